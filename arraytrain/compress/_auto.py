r"""``compressor="auto"``: dense or a compressor, whichever makes the step fastest on the link it runs on.

Compression pays where the link is slow against the step's compute and loses where it is fast (a
study of 200+ data-centre setups, Agarwal et al., MLSys 2022, found it faster than a tuned DDP in only
6). :class:`Auto` measures instead of guessing:

1. **Probe.** The first ``probe`` calls exchange the gradient dense, timed; the first is left out
   (connections and caches). In an engine a dense call is the engine's own dense exchange (the one
   it makes without a compressor, through :meth:`Auto.dense_call`), so a dense choice costs nothing
   per step. Between calls, the step's compute: the time from the end
   of one exchange to the start of the next.
2. **Estimate.** Each candidate compresses and decodes a copy of the current gradient on a
   throwaway twin at its target setting, timed (the second of two rounds: the first may compile),
   and its payload's bytes give its wire bytes: an all-reduce of them for a method whose payloads
   add up, every process's payload to every other for one whose payloads are gathered (top-k); a
   sparsifier's bytes are the mean over its next ``reprobe`` calls, its ramp included. With the
   link's rate from the dense probe, a candidate's exchange is its encode and decodes plus its
   bytes at that rate.
3. **Choose.** The candidate with the fastest estimated step, if it beats the dense step by at least
   ``gain`` (default 1.25x); else dense. Rank 0 decides on its own timings and broadcasts the
   choice, so every process compresses alike.
4. **Re-decide.** Every ``reprobe`` calls one exchange is dense again, timed (all of a compressor's
   error-feedback residual travels in it and is cleared, as in a warm restart); when the dense
   exchange time moved by more than a factor ``drift`` since the choice (the link's rate changed),
   the choice is made again at the new rate.

The **accuracy guard** is the candidate list: by default only PowerSGD rank 4 with error feedback
(its algorithm includes it), the one setting measured to keep accuracy on every task tried
(``docs/cluster.md``). Top-k 1% was a candidate and was left out: with AdamW no one setting of it
held on both digits MLPs — without error feedback it kept the widened MLP's accuracy and lost 2.9
points on the 17K-parameter one (1% of it is 170 weights), with error feedback the reverse (-0.84
and -0.28). Pass ``candidates=`` (a name -> factory mapping) to choose among others; each factory
returns a new compressor or ErrorFeedback.

What it chose and why is :attr:`decisions` (one entry per choice, with the timings behind it), the
step report's ``compression`` (``"auto:<name>:<phase>"``) and the checkpoint's state. The choice
depends on timings, so two runs may choose differently: a run is reproducible bit for bit only
from a checkpoint (it holds the choice) or with the candidate passed directly.

Every time is read from ``clock`` (default :func:`time.perf_counter`): a program, a simulation or a
test that knows its times (a modelled link, a replayed trace) passes its own clock, and the decision
is then a function of those times alone, not of how busy the machine happens to be.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

import numpy as np

from .._checks import check_count, check_int, check_number, shown
from ..backend import array_module
from ..errors import ArgumentTypeError, LayoutError, StateDictError
from ..parallel.communicator import check_comm
from ._base import Compressor, ErrorFeedback, Payload
from ._powersgd import PowerSGD
from ._summed import Summed

DENSE = "dense"


class _Call:
    """What :meth:`Auto.dense_call` yields: its ``payload`` once the block has ended."""

    payload: Payload | None = None


def default_candidates() -> dict:
    """The candidate measured to keep accuracy across the tasks tried: PowerSGD rank 4 with error feedback
    (see the module docstring for top-k)."""
    return {"powersgd": lambda: ErrorFeedback(PowerSGD(rank=4))}


def _inner(c):
    return c.compressor if isinstance(c, ErrorFeedback) else c


class Auto:
    """Dense or one of ``candidates``, chosen from measured timings and re-chosen when the link changes.

    Parameters
    ----------
    candidates : mapping of name -> callable, optional
        Factories of the compressors to choose from (default :func:`default_candidates`).
    probe : int
        Dense calls before the first choice (at least 2: the first is not timed).
    gain : float
        How much faster (estimated step time) a compressor must be than dense to be chosen.
    reprobe : int
        Calls between the dense exchanges that check the link (0: never re-check).
    drift : float
        The factor by which the dense exchange time must move for the choice to be made again.
    clock : callable, optional
        A function of no arguments returning seconds, read around every timed call (default
        :func:`time.perf_counter`).
    """

    method = "auto"

    def __init__(self, candidates: Mapping | None = None, *, probe: int = 4, gain: float = 1.25,
                 reprobe: int = 200, drift: float = 2.0, clock=None):
        candidates = default_candidates() if candidates is None else candidates
        if not isinstance(candidates, Mapping) or not candidates or any(
                not isinstance(k, str) or k == DENSE or not callable(f) for k, f in candidates.items()):
            raise ArgumentTypeError(f"candidates: expected a non-empty mapping of names (not {DENSE!r}) to "
                                    f"factories, got {candidates!r:.120}")
        made = {}
        for name, make in candidates.items():
            c = make()
            if not isinstance(c, (Compressor, ErrorFeedback)):
                raise ArgumentTypeError(f"candidates[{name!r}]: the factory returned {type(c).__name__}, "
                                        "not a Compressor or ErrorFeedback")
            made[name] = c
        self.factories = dict(candidates)
        self.candidates = made
        self.probe = check_int("probe", probe, 2)
        self.gain = check_number("gain", gain, 1.0)
        self.reprobe = check_int("reprobe", reprobe, 0)
        self.drift = check_number("drift", drift, 1.0, lo_open=True)
        if clock is not None and not callable(clock):
            raise ArgumentTypeError(f"clock: expected a function of no arguments returning seconds, "
                                    f"got {type(clock).__name__}")
        self.clock = time.perf_counter if clock is None else clock
        self.choice = DENSE
        self.step = 0
        self.decisions: list[dict] = []
        self.layout = None
        self.comm = check_comm(None)
        self._dense_times: list[float] = []
        self._compute_times: list[float] = []
        self._t_dense_chosen: float | None = None
        self._last_end: float | None = None

    # -- set-up -----------------------------------------------------------------------------------
    def bind(self, layout, dtype=np.float32, comm=None) -> Auto:
        """Bind every candidate (the engine calls it)."""
        comm = check_comm(comm)
        if self.layout is not None:
            if self.layout == layout and (comm is self.comm or comm.is_local and self.comm.is_local):
                return self
            raise LayoutError(f"{self!r} is already bound to {self.layout!r}; use a new Auto")
        for c in self.candidates.values():
            c.bind(layout, dtype, comm)
        self.layout, self.comm, self._dtype = layout, comm, np.dtype(dtype)
        self._dense_nbytes = sum(int(np.prod(s, dtype=np.int64)) for s in layout.shapes) * self._dtype.itemsize
        return self

    def _need_bound(self) -> None:
        if self.layout is None:
            raise LayoutError(f"{self!r} is not bound to a layout: call bind(layout, dtype) first")

    # -- the exchange ------------------------------------------------------------------------------
    @property
    def dense_next(self) -> bool:
        """Whether the next call is a plain dense exchange (no residual to send with it): the engine then
        makes it with its own dense reduce inside :meth:`dense_call`, as without a compressor."""
        return self.layout is not None and (self.comm.is_local or self.step < self.probe or self.choice == DENSE)

    @contextlib.contextmanager
    def dense_call(self, x):
        """Count and time a dense exchange of ``x`` that the caller makes itself (the engine's own
        all-reduce and norm pass) when :attr:`dense_next`; ``.payload`` of the yielded object is the
        call's payload once the block ends."""
        self._need_bound()
        step, call = self._begin(), _Call()
        t = self.clock()
        yield call
        call.payload = self._after_dense(x, step, self.clock() - t)
        self._end(step)

    def exchange(self, x) -> Payload:
        """Exchange ``x`` (it becomes the decoded sum over processes) dense or with the chosen compressor."""
        self._need_bound()
        step = self._begin()
        if self.dense_next or self._reprobe_due(step):
            self._flush(x)  # a compressor's residual travels with the dense check
            t = self.clock()
            self.comm.allreduce(x)
            payload = self._after_dense(x, step, self.clock() - t)
        else:
            payload = self.candidates[self.choice].exchange(x)
            payload.meta = dict(payload.meta, phase=f"auto:{self.choice}:{payload.meta.get('phase')}")
        self._end(step)
        return payload

    def _begin(self) -> int:
        """A call starts: the compute since the last one ended is recorded; the call's number."""
        if self._last_end is not None:
            self._compute_times.append(self.clock() - self._last_end)
            del self._compute_times[:-16]
        return self.step

    def _end(self, step: int) -> None:
        self.step = step + 1
        self._last_end = self.clock()

    def _reprobe_due(self, step: int) -> bool:
        return bool(self.reprobe) and step >= self.probe and (step - self.probe + 1) % self.reprobe == 0

    def _after_dense(self, x, step: int, seconds: float) -> Payload:
        """A dense call's bookkeeping: its time, the first choice at the probe's end, the check of the link."""
        if self.comm.is_local:
            if not self.decisions:
                self.decisions.append({"step": step, "choice": DENSE, "why": "one process: nothing travels",
                                       "said": "one process: nothing travels, no compression"})
        elif step > 0:
            self._dense_times.append(seconds)
            del self._dense_times[:-8]
            if step == self.probe - 1:
                self._decide(x, step, why="first choice")
            elif self._reprobe_due(step):
                moved = None if not self._t_dense_chosen else seconds / self._t_dense_chosen
                if moved is None or not 1 / self.drift <= moved <= self.drift:
                    why = ("no dense time was kept (a resumed run)" if moved is None else
                           f"the dense exchange took {moved:.2f}x its time at the last choice")
                    del self._dense_times[:-1]  # the link of before is gone: only this time counts
                    self._decide(x, step, why=why)
                else:
                    self._share_choice(x)
        return Payload(self.method, meta={"step": step, "phase": f"auto:{DENSE}"}, dense_nbytes=self._dense_nbytes,
                       sent_nbytes=self._dense_nbytes)

    def _flush(self, x) -> None:
        """Every candidate's error-feedback residual into ``x`` (sent dense now), then cleared."""
        for c in self.candidates.values():
            if isinstance(c, ErrorFeedback) and c.residual is not None and c.step:
                x += c.residual.flat
                c.reset()

    def _share_choice(self, like) -> None:
        """Rank 0's choice to every process (every process calls it at the same calls), in an array on
        ``like``'s backend (NCCL moves device arrays only)."""
        names = [DENSE, *self.candidates]
        pick = array_module(like).asarray([names.index(self.choice)], dtype=np.int64)
        self.comm.broadcast(pick)
        self.choice = names[int(pick[0])]

    # -- the choice ----------------------------------------------------------------------------------
    def _decide(self, x, step: int, why: str) -> None:
        """Rank 0 estimates and chooses; every process takes its choice. ``x``: the gradient just
        exchanged dense (the candidates' encodes are timed on a copy)."""
        t_dense = float(np.median(self._dense_times[-3:]))
        entry = {"step": step, "why": why}
        if self.comm.rank == 0:
            compute = float(np.median(self._compute_times)) if self._compute_times else 0.0
            k = self.comm.size
            # a ring all-reduce's bytes per process (a clock that saw no time pass: an unbounded link)
            rate = 2 * (k - 1) / k * self._dense_nbytes / t_dense if t_dense > 0 else float("inf")
            estimates = {DENSE: t_dense}
            for name, make in self.factories.items():
                estimates[name] = self._estimate(make(), x, rate, k, self.candidates[name])
            best = min(self.factories, key=lambda n: estimates[n])
            faster = (compute + t_dense) / (compute + estimates[best])
            self.choice = best if faster >= self.gain else DENSE
            entry.update(rate_gbit_s=rate * 8 / 1e9, compute_s=compute, exchange_s=estimates, said=(
                f"a dense exchange took {1e3 * t_dense:.1f} ms ({rate * 8 / 1e9:.2g} Gbit/s per process) "
                f"against {1e3 * compute:.1f} ms of compute; estimated: "
                + ", ".join(f"{n} {1e3 * t:.1f} ms" for n, t in estimates.items())
                + f"; {best} would make the step {faster:.2f}x as fast (a compressor needs {self.gain:g}x); {why}"))
        self._share_choice(x)
        self._t_dense_chosen = t_dense
        entry["choice"] = self.choice
        self.decisions.append(entry)

    def _estimate(self, twin, x, rate: float, k: int, real) -> float:
        """A candidate's exchange in seconds at ``rate`` bytes/s: its encode and decode on a throwaway
        twin at its target setting, timed on a copy of ``x``, plus its payload's bytes on the wire — for
        a sparsifier, the mean of its next ``reprobe`` calls' (``real``'s ramp from its own call count)."""
        inner = _inner(twin)
        inner.warmup = 0
        if hasattr(inner, "ramp"):
            inner.ramp = 0
        twin.bind(self.layout, self._dtype)
        y = x.copy()
        for _ in range(2):  # the second timed: the first may compile or load the kernels
            t0 = self.clock()
            payload = twin.compress(y)
            t1 = self.clock()
            twin.decompress(payload, y)
            t2 = self.clock()
        summed = isinstance(inner, Summed)
        wire = (2 * (k - 1) / k if summed else k - 1) * payload.nbytes
        ramp = _inner(real)
        if hasattr(ramp, "k_at") and ramp.k_selected:
            calls = range(ramp.step, ramp.step + (self.reprobe or 200))
            wire *= sum(ramp.k_at(c) for c in calls) / len(calls) / ramp.k_selected
        decodes = 1 if summed else k
        return (t1 - t0) + decodes * (t2 - t1) + wire / rate

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The call count, the choice, the dense time it was made at, and every candidate's state."""
        self._need_bound()
        return {"type": self.describe(), "step": self.step, "choice": self.choice,
                "dense_seconds": float(self._t_dense_chosen or 0.0),
                "candidates": {n: c.state_dict() for n, c in self.candidates.items()}}

    def check_state(self, state: Mapping) -> dict:
        """Validate a :meth:`state_dict`; raise StateDictError; change nothing."""
        self._need_bound()
        try:
            kind, step, choice, dense, cands = (state["type"], state["step"], state["choice"],
                                                state["dense_seconds"], state["candidates"])
        except (KeyError, TypeError) as exc:
            raise StateDictError(f"auto compression state lacks {exc}") from None
        if kind != self.describe():
            raise StateDictError(f"compression: the state is for {kind!r:.200}, the engine has {self.describe()!r:.200}")
        check_count("compression step", step, 0, error=StateDictError)
        if choice not in (DENSE, *self.candidates):
            raise StateDictError(f"compression choice: expected one of {[DENSE, *self.candidates]}, got {choice!r:.80}")
        if isinstance(dense, bool) or not isinstance(dense, (int, float)) or not 0 <= dense < float("inf"):
            raise StateDictError(f"compression dense_seconds: expected a finite time >= 0, got {dense!r:.80}")
        if not isinstance(cands, Mapping) or set(cands) != set(self.candidates):
            raise StateDictError(f"compression candidates: expected states for {sorted(self.candidates)}")
        checked = {n: c.check_state(cands[n]) for n, c in self.candidates.items()}
        return {"step": int(step), "choice": choice, "dense": float(dense), "candidates": checked}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a :meth:`state_dict`, validated first: a refused state changes nothing."""
        self.apply_state(self.check_state(state))

    def apply_state(self, checked: dict) -> None:
        """Restore what :meth:`check_state` returned (assignments only)."""
        for n, c in self.candidates.items():
            c.apply_state(checked["candidates"][n])
        self.step, self.choice = checked["step"], checked["choice"]
        self._t_dense_chosen = checked["dense"] or None

    def describe(self) -> str:
        """The settings and the candidates (saved with the state)."""
        return repr(self)

    def __repr__(self) -> str:
        cands = ", ".join(f"{n}={c!r}" for n, c in self.candidates.items())
        return (f"Auto({{{cands}}}, probe={self.probe}, gain={self.gain!r}, reprobe={self.reprobe}, "
                f"drift={self.drift!r})")


def check_compressor(c, name: str = "compressor"):
    """A Compressor, an ErrorFeedback or an Auto (``"auto"``: a new :class:`Auto`); a clear error otherwise."""
    if isinstance(c, str) and c == "auto":
        return Auto()
    if not isinstance(c, (Compressor, ErrorFeedback, Auto)):
        raise ArgumentTypeError(f"{name}: expected an arraytrain Compressor, ErrorFeedback, Auto or 'auto', "
                                f"got {shown(c) if isinstance(c, str) else type(c).__name__}")
    return c

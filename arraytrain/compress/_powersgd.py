r"""PowerSGD: rank-``r`` gradient compression by one step of subspace iteration.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019 (Algorithm 1); the
behaviour follows ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``.
Each parameter of the domain with ``ndim >= 2`` is viewed as the matrix
:math:`M` of shape ``(n, m) = (shape[0], prod(shape[1:]))``, and with the
``(m, r)`` factor :math:`Q` of the previous call (warm start)

.. math::
    P = M Q, \qquad P \leftarrow \mathrm{orth}(P), \qquad Q = M^\top P,
    \qquad \hat M = P Q^\top = P P^\top M,

so :math:`\hat M` is the orthogonal projection of :math:`M`'s columns onto the
``r``-dimensional subspace that one power-iteration step from the last
subspace found. Repeated calls on slowly changing gradients converge to the
top-``r`` singular subspace (subspace iteration); a matrix of rank ``<= r`` is
reproduced exactly from the first call on. :math:`Q` is kept between calls
(``warm_start=True``, the paper's and torch's default) and is named state
(``state_dict()["arrays"]["Q:<name>"]``), saved in checkpoints; the first
:math:`Q` is standard normal from ``numpy.random.default_rng([seed, i])``
(``i``: the parameter's index in the domain), so every rank draws the same.
With ``warm_start=False`` a fresh :math:`Q` is drawn from
``default_rng([seed, call, i])`` at every call. A :math:`Q` with a zero or
non-finite column (an all-zero gradient, say) is not kept: the previous one
stays, so the iteration never collapses to zero.

Payload: ``"P:<name>"`` (``n x r``, orthonormal columns) and ``"Q:<name>"``
(``m x r``) per compressed matrix, in the gradient's dtype:
``(n + m) * r * itemsize`` bytes. A domain parameter with ``ndim < 2``, or
whose factors would not be smaller than it (``(n + m) * r >= n * m``, which
includes every ``r >= min(n, m)``; torch's ``min_compression_rate=1``),
travels uncompressed as ``"M:<name>"``.

**In a group of processes** (``bind(..., comm=...)``), as torch's DDP hook:
every process starts from the same :math:`Q` (the shared seed; after that the
group's), computes :math:`P_r = M_r Q`, and :meth:`compress` all-reduces the
``P`` of every matrix (one collective, inside the encode — every process must
call it) before orthogonalising, so :math:`P` spans :math:`(\sum_r M_r) Q`
and is the same everywhere. Each process's ``Q`` is then
:math:`Q_r = M_r^\top P`, and :meth:`aggregate` all-reduces the ``Q`` s (and
the ``M`` s) and decodes once, :math:`P (\sum_r Q_r)^\top = P P^\top \sum_r M_r`.
The warm start keeps the group's :math:`\sum_r Q_r`, identical on every
process, as torch does. What a process *sent* (what its error feedback
subtracts) is :math:`P Q_r^\top = P P^\top M_r`, its own part of the sum —
torch's hook subtracts the group's mean instead; here each residual holds
exactly what its own process failed to send. The bytes on the wire are the
payload's, ``(n + m) * r * itemsize`` per matrix, however many processes.

**Bias.** :math:`\hat M` is a projection of :math:`M`, not an unbiased
estimate: without error feedback whatever lies outside the subspace is lost
at every step, and the paper always runs PowerSGD with error feedback
(torch's hook does too, ``use_error_feedback=True``). Wrap it:
``ErrorFeedback(PowerSGD(rank=4))``.

Kernels: both twins do the GEMMs with NumPy's BLAS (the well-kept library for
them; a numba GEMM would be slower). ``kernels="numba"`` computes in the
gradient's dtype and orthogonalises with LAPACK's Householder QR
(``numpy.linalg.qr``), columns signed so that ``diag(R) >= 0`` — the same
basis Gram-Schmidt gives in exact arithmetic, and stable when ``P``'s columns
are nearly parallel (after warm start they scale as :math:`\sigma_i^2`).
``kernels="reference"`` computes in float64 with a plain Gram-Schmidt,
column by column with the projections removed twice, a zero column left zero
(torch's behaviour);
both store factors and state in the gradient's dtype. They agree to the
project's tolerance on matrices of full column rank ``r``; on rank-deficient
``P`` the QR completes the basis where Gram-Schmidt leaves zeros (the decoded
``\hat M`` is then the same, ``Q`` need not be).

On CuPy gradients (``kernels="numba"``) the same steps run on the device: cuBLAS
GEMMs and ``cupy.linalg.qr`` (cuSOLVER's Householder QR), the factors and ``Q`` on
the device; the first ``Q`` is drawn on the host as above (every rank and device
draws the same) and moved once. The check that a new ``Q`` is usable reads one
flag per matrix back to the host.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .._checks import check_bool, check_int
from ..backend import array_module
from ..errors import StateDictError
from ._base import Compressor, Domain, array_backend, check_wire
from ._summed import Summed, allreduce_arrays


def orthonormalize_qr(p):
    """Orthonormal columns spanning ``p``'s (Householder QR), signed so that ``diag(R) >= 0``.

    NumPy (LAPACK) or CuPy (cuSOLVER) as ``p`` is.
    """
    xp = array_module(p)
    q, r = xp.linalg.qr(p)
    sign = xp.where(xp.diagonal(r) < 0, -1, 1).astype(q.dtype)
    return q * sign


def orthonormalize_gram_schmidt(p: np.ndarray) -> np.ndarray:
    """Gram-Schmidt in float64, column by column: each column minus its projections on the earlier ones.

    The projections are removed twice ("twice is enough": Giraud, Langou and
    Rozložník 2005): one pass leaves a column that was nearly dependent on the
    earlier ones far from orthogonal to them once normalised, which breaks
    ``P P^T M = M`` for a matrix of rank below ``r``. A column that is exactly
    zero after the projections stays zero.
    """
    p = np.array(p, dtype=np.float64)
    for i in range(p.shape[1]):
        col = p[:, i]
        for _ in range(2):
            for j in range(i):
                col -= (p[:, j] @ col) * p[:, j]
        norm = np.sqrt(col @ col)
        if norm > 0:
            col /= norm
        else:
            col[:] = 0.0
    return p


class PowerSGD(Summed, Compressor):
    """Rank-``rank`` PowerSGD with warm start, per matrix of the domain.

    Parameters
    ----------
    rank : int >= 1
        Columns of the factors ``P`` and ``Q``.
    warm_start : bool
        Keep ``Q`` between calls (named, checkpointed state) or draw it afresh.
    min_size, warmup, seed, kernels
        As in :class:`~arraytrain.compress.Compressor`; torch's
        ``start_powerSGD_iter`` is ``warmup``.
    """

    method = "powersgd"
    family = None  # GEMMs and QR from NumPy / CuPy, no kernels of its own

    def __init__(self, rank: int = 2, *, warm_start: bool = True, min_size: int = 0, warmup: int | None = None,
                 seed: int = 0, kernels: str = "numba"):
        super().__init__(min_size=min_size, warmup=warmup, seed=seed, kernels=kernels)
        self.rank = check_int("rank", rank, 1)
        self.warm_start = check_bool("warm_start", warm_start)

    # -- set-up ---------------------------------------------------------------------------
    def _bind(self, domain: Domain) -> None:
        r = self.rank
        mats, raw = [], []
        for i, seg in enumerate(domain.segments):
            if seg.size == 0:
                continue
            if len(seg.shape) >= 2:
                n, m = int(seg.shape[0]), seg.size // int(seg.shape[0])
                if (n + m) * r < n * m:
                    mats.append((i, seg.name, seg.start, n, m))
                    continue
            raw.append((seg.name, seg.start, seg.size))
        self._mats, self._raw = tuple(mats), tuple(raw)
        self._dt = domain.dtype
        self._q = {name: self._draw_q(i, m) for i, name, _, _, m in mats} if self.warm_start else {}

    def _draw_q(self, index: int, m: int, step: int | None = None) -> np.ndarray:
        """Drawn on the host (the same numbers for every rank and device)."""
        key = [self.seed, index] if step is None else [self.seed, step, index]
        return np.random.default_rng(key).standard_normal((m, self.rank)).astype(self._dt)

    def _move(self, xp) -> None:
        self._q = {name: xp.asarray(q) for name, q in self._q.items()}

    # -- the work ---------------------------------------------------------------------------
    def _encode(self, x: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        ref = self.kernels == "reference"
        xp = self._xp()
        local = self.comm.is_local
        mats, ps = [], []
        for i, name, start, n, m in self._mats:
            mat = x[start:start + n * m].reshape(n, m)
            q = self._q[name] if self.warm_start else xp.asarray(self._draw_q(i, m, meta["step"]))
            if ref:
                mat = mat.astype(np.float64)
                q = q.astype(np.float64)
            mats.append(mat)
            ps.append(mat @ q)
        if not local:
            allreduce_arrays(self.comm, ps)  # sum_r M_r Q: the same Q everywhere, so the group's P
        arrays = {}
        for (_, name, _, _, _), mat, p in zip(self._mats, mats, ps):
            p = orthonormalize_gram_schmidt(p) if ref else orthonormalize_qr(p)
            q_new = mat.T @ p
            arrays[f"P:{name}"] = xp.ascontiguousarray(p, dtype=self._dt)
            arrays[f"Q:{name}"] = q_new = xp.ascontiguousarray(q_new, dtype=self._dt)
            if local:
                self._keep(name, q_new)
        for name, start, size in self._raw:
            arrays[f"M:{name}"] = x[start:start + size].copy()
        return arrays

    def _keep(self, name: str, q_new) -> None:
        """Warm start: keep ``q_new`` unless it has a zero or non-finite column."""
        xp = self._xp()
        if self.warm_start and bool(xp.all(xp.isfinite(q_new)) & xp.all(xp.any(q_new != 0, axis=0))):
            self._q[name] = q_new.copy()

    def _summed(self, payload) -> list[str]:
        return [f"Q:{name}" for _, name, _, _, _ in self._mats] + [f"M:{name}" for name, _, _ in self._raw]

    def _summed_hook(self, payload) -> None:
        if not payload.meta.get("warmup"):  # the group's Q, the same on every process
            for _, name, _, _, _ in self._mats:
                self._keep(name, payload.arrays[f"Q:{name}"])

    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        ref = self.kernels == "reference"
        for _, name, start, n, m in self._mats:
            p = check_wire(arrays, f"P:{name}", (n, self.rank), out.dtype, out)
            q = check_wire(arrays, f"Q:{name}", (m, self.rank), out.dtype, out)
            dst = out[start:start + n * m].reshape(n, m)
            if ref:
                dst[...] = p.astype(np.float64) @ q.astype(np.float64).T
            elif isinstance(out, np.ndarray):
                np.matmul(p, q.T, out=dst)
            else:
                dst[...] = p @ q.T
        for name, start, size in self._raw:
            out[start:start + size] = check_wire(arrays, f"M:{name}", (size,), out.dtype, out)

    # -- state ------------------------------------------------------------------------------
    def _state(self) -> dict[str, np.ndarray]:
        return {f"Q:{name}": q.copy() for name, q in self._q.items()}

    def _check_state(self, arrays: Mapping) -> dict:
        want = {f"Q:{name}": (m, self.rank) for _, name, _, _, m in self._mats} if self.warm_start else {}
        if set(arrays) != set(want):
            missing, extra = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
            raise StateDictError(f"{self.method}: state arrays differ from the layout's matrices "
                                 f"(missing {missing}, unexpected {extra})")
        checked = {}
        for key, shape in want.items():
            a = arrays[key]
            if array_backend(a) is None or a.shape != shape or a.dtype != self._dt:
                got = (getattr(a, "shape", type(a).__name__), getattr(a, "dtype", None))
                raise StateDictError(f"{key!r}: expected shape {shape} of {self._dt}, got {got}")
            checked[key[2:]] = a.copy()
        return checked

    def _load_state(self, checked: dict) -> None:
        self._q = checked

    def hyperparameters(self) -> dict:
        return {"rank": self.rank, "warm_start": self.warm_start, **super().hyperparameters()}

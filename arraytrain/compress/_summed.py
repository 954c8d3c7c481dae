"""Payloads that add up: all-reduced, then decoded once.

A method whose decode is linear in some of its payload arrays, with the rest
equal on every process — random-k (the indices from the shared seed), VSA
(the key and selection from the shared seed), int8 with a scale shared by the
group, PowerSGD's ``Q`` once ``P`` is shared — decodes the sum of the
processes' arrays to the sum of their decodes. So instead of gathering every
payload (:meth:`Compressor.aggregate`'s default) it all-reduces those arrays
in place and decodes once: the bytes on the wire do not grow with the number
of processes. The ``raw`` elements (small parameters, warm-up) add up too.
"""

from __future__ import annotations

from ..backend import array_module
from ..errors import ArgumentTypeError
from ._base import Payload


def allreduce_arrays(comm, arrays) -> None:
    """Sum every array over ``comm``, in place: one all-reduce per dtype.

    Arrays of one dtype are packed into one buffer, all-reduced, and copied back
    (one collective instead of one per array; the copies are the size of the
    payload, not of the gradient). Every process passes the same list.
    """
    groups: dict = {}
    for a in arrays:
        groups.setdefault(a.dtype, []).append(a)
    for group in groups.values():
        if len(group) == 1:
            comm.allreduce(group[0])
            continue
        buf = array_module(group[0]).concatenate([a.reshape(-1) for a in group])
        comm.allreduce(buf)
        k = 0
        for a in group:
            a[...] = buf[k:k + a.size].reshape(a.shape)
            k += a.size


class Summed:
    """Mixin for a :class:`~arraytrain.compress.Compressor` whose payloads add up.

    :meth:`aggregate` all-reduces the arrays :meth:`_summed` names, and ``raw``,
    **in place in the payload** (afterwards it holds the group's sums), then
    decodes once into ``out``. :meth:`Compressor.sent` — this process's own
    decode, which error feedback keeps — must be taken before, as
    :meth:`ErrorFeedback.exchange` does.
    """

    def _summed(self, payload: Payload) -> list[str]:
        """The names of the payload's arrays whose sum decodes to the sum of the decodes."""
        raise NotImplementedError

    def aggregate(self, payload: Payload, out):
        if self.comm.is_local:
            return self.decompress(payload, out)
        self._need_bound()
        if not isinstance(payload, Payload) or payload.method != self.method:
            raise ArgumentTypeError(f"payload: expected a {self.method} Payload, got {payload!r:.80}")
        self._check_flat(out, "out")
        names = [] if payload.meta.get("warmup") else self._summed(payload)
        arrays = [payload.arrays[k] for k in names]
        if payload.raw is not None:
            arrays.append(payload.raw)
        allreduce_arrays(self.comm, arrays)
        self._summed_hook(payload)
        return self.decompress(payload, out)

    def _summed_hook(self, payload: Payload) -> None:
        """After the all-reduce, before the decode (default: nothing)."""

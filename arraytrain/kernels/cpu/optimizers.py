"""CPU optimizer kernels: one fused pass (or a few, for LAMB and Adafactor) over the flat buffer.

Loop shape: each piece works on slices (``pb = p[lo:hi]``) indexed from 0, so numba drops
its negative-index check and LLVM vectorises the inner loop (sqrt and division included).
Scalars arrive cast to the storage dtype, so float32 buffers get float32 math.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import newton_schulz
from ...ops import clip_factor
from ..interface import LP_NONE
from ._jit import EXACT_DIVISION, JIT, pick, twins
from .codecs import (QBLOCK, clear_grad, grad_fill, grad_slice, load_state, piece_mask, state_close, state_open,
                     state_scratch, state_step, store_masked, store_state, store_working)
from .reductions import SUMSQ_TWINS, piece_totals

# -- optimizers -------------------------------------------------------------------------
#
# Convention shared by every optimizer kernel (and by its reference twin; the public
# wrappers' arguments are those of arraytrain.kernels.interface: arrays, then keywords, every
# derived value formed by the optimizer; a wrapper casts to the storage dtype and forms the
# complements ``1 - x`` and squares its jitted twin reads):
#   * the loop runs over ``pieces`` (rows ``[start, stop, segment]`` of the Layout), so a
#     piece belongs to one parameter and per-parameter hyperparameters arrive as arrays
#     indexed by segment (``lr[seg]``, ``wd[seg]`` ...): name-pattern overrides cost one
#     load per piece, not a launch per group. Padding is never touched.
#   * ``gscale`` multiplies the gradient (clip factor, accumulation mean, loss-scale unscale).
#   * ``working``/``kind`` (``w``/``wkind`` in the jitted twins): a low-precision working copy
#     (uint16 bits, ``kind`` LP_BF16 or LP_F16) of the new weights, written per piece while it
#     is in cache; ``working=None`` when there is none, which numba prunes at compile time (an always-false runtime flag
#     measured 1.5x slower: the dead conversion code spoiled the update loop).
#   * ``zero_grad`` zeroes the gradient in the same pass; the jitted twins receive
#     ``grad_fill(zero_grad)`` (0 or None) and store through ``clear_grad``, so the choice is
#     made when the kernel is typed and neither loop holds a flag-guarded store (see codecs).
#   * ``mask`` (last argument, default None): a uint8 array of the params' flat size, 1 = keep,
#     0 = pruned. Pruned weights are written as exactly 0 by the update itself
#     (``store_masked(pb, i, new, kb)``, so ``store_working`` sees them), and stay 0 whatever
#     momentum or weight decay say: each step is projected onto the pruned pattern; moments,
#     norms and trust ratios are formed as without a mask. ``piece_mask``/``store_masked`` are
#     resolved at typing time, so ``mask=None`` compiles to the unmasked loop. The select sits
#     in the update loop rather than in a second loop over the piece after it: measured on
#     AdamW at 1e7 float32, the second loop cost 1.5-2x the step (the piece is re-read from
#     L2 after p, g, m, v went through), the select ~1.05x.
#   * a runtime flag that guards a store to a state slot (SGD's momentum buffer, AMSGrad's
#     maximum, RMSprop's centered average and momentum) is hoisted out of the element loop: the
#     loop is an inline function (``_<name>_piece``) called once per value of the flag, so each
#     copy of the loop has it as a constant. Inside the loop the store would be a masked store,
#     and AVX2 has none for 16-bit lanes: with bfloat16 state LLVM then left the whole loop
#     scalar (AdamW with bfloat16 moments 4x slower than with float32 moments on an AVX2 CPU;
#     AVX-512BW has the masked 16-bit store, so AVX-512 machines never saw it).


@njit(inline="always", **JIT)
def _sgd_piece(pb, gb, bb, kb, gscale, lr_j, wd_j, momentum, damp_c, nesterov, first, zero_grad, has_buf):
    for i in range(pb.size):
        pi = pb[i]
        d = gscale * gb[i] + wd_j * pi
        if has_buf:
            bi = store_state(bb, i, d if first else momentum * load_state(bb, i) + damp_c * d)
            d = d + momentum * bi if nesterov else bi
        store_masked(pb, i, pi - lr_j * d, kb)
        clear_grad(gb, i, zero_grad)


def _sgd(p, g, buf, pieces, gp, gscale, lr, wd, momentum, damp_c, nesterov, first, w, wkind, zero_grad, mask):
    has_buf = momentum != 0
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, wd_j = lr[seg], wd[seg]
        # 8-bit state: the piece in blocks, each decoded, updated, encoded (see codecs)
        step = state_step(buf, seg, hi - lo) if has_buf else hi - lo
        tb = state_scratch(buf)
        for a in range(lo, hi, max(step, 1)):
            b = min(a + step, hi)
            pb, gb = p[a:b], grad_slice(g, gp, j, lo, a, b)
            kb = piece_mask(mask, a, b)
            # the flag that guards a state store is a constant in each copy of the loop (see above);
            # so is ``first``, which guards the buffer's load: under a runtime flag that load is a
            # branch LLVM does not speculate in the parallel twin, and that loop stayed scalar
            if has_buf:
                bb = state_open(buf, seg, a, b, tb)
                if first:
                    _sgd_piece(pb, gb, bb, kb, gscale, lr_j, wd_j, momentum, damp_c, nesterov, True, zero_grad, True)
                else:
                    _sgd_piece(pb, gb, bb, kb, gscale, lr_j, wd_j, momentum, damp_c, nesterov, False, zero_grad, True)
                state_close(buf, seg, a, b, bb)
            else:
                _sgd_piece(pb, gb, pb, kb, gscale, lr_j, wd_j, momentum, damp_c, nesterov, first, zero_grad, False)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_SGD = twins(_sgd)


def seg_array(a, dtype):
    """A per-segment hyperparameter as a contiguous, writable array of the storage dtype (a
    read-only one is copied: numba would compile a second signature for it)."""
    out = np.ascontiguousarray(a, dtype=dtype)
    return out if out.flags.writeable else out.copy()


def sgd_step(p, g, buf, pieces, *, gscale, lr, l2, momentum, dampening, nesterov, first, working=None, kind=LP_NONE,
             zero_grad=False, grad_ptrs=None, mask=None):
    """Fused SGD update; see :func:`arraytrain.kernels.reference.sgd_step`."""
    t = p.dtype.type
    pick(_SGD, p.size, buf)(
        p, g, buf, pieces, grad_ptrs, t(gscale), seg_array(lr, p.dtype), seg_array(l2, p.dtype), t(momentum),
        t(1.0 - dampening), bool(nesterov), bool(first), working, int(kind), grad_fill(zero_grad), mask,
    )


@njit(inline="always", **JIT)
def _adam_piece(pb, gb, mb, vb, xb, kb, gscale, ss, beta1c, beta2, beta2c, eps, inv_bc2_sqrt, l2_j, dec, zero_grad,
                amsgrad):
    for i in range(pb.size):
        pi = pb[i]
        d = gscale * gb[i] + l2_j * pi
        mi = load_state(mb, i)
        mi = mi + beta1c * (d - mi)
        vi = beta2 * load_state(vb, i) + beta2c * d * d
        # continue from the stored values, so a low-precision state is what the update sees
        mi = store_state(mb, i, mi)
        vi = store_state(vb, i, vi)
        if amsgrad:
            vi = store_state(xb, i, max(load_state(xb, i), vi))
        store_masked(pb, i, pi * dec - ss * mi / (np.sqrt(vi) * inv_bc2_sqrt + eps), kb)
        clear_grad(gb, i, zero_grad)


def _adam(p, g, m, v, vmax, pieces, gp, gscale, step_size, beta1c, beta2, beta2c, eps, inv_bc2_sqrt, l2, decay,
          amsgrad, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        ss, l2_j, dec = step_size[seg], l2[seg], decay[seg]
        step = state_step(m, seg, hi - lo)
        tm, tv = state_scratch(m), state_scratch(v)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            pb, gb = p[a:b], grad_slice(g, gp, j, lo, a, b)
            mb, vb = state_open(m, seg, a, b, tm), state_open(v, seg, a, b, tv)
            kb = piece_mask(mask, a, b)
            if amsgrad:
                tx = state_scratch(vmax)
                xb = state_open(vmax, seg, a, b, tx)
                _adam_piece(pb, gb, mb, vb, xb, kb, gscale, ss, beta1c, beta2, beta2c, eps, inv_bc2_sqrt, l2_j, dec,
                            zero_grad, True)
                state_close(vmax, seg, a, b, xb)
            else:
                _adam_piece(pb, gb, mb, vb, vb, kb, gscale, ss, beta1c, beta2, beta2c, eps, inv_bc2_sqrt, l2_j, dec,
                            zero_grad, False)
            state_close(m, seg, a, b, mb)
            state_close(v, seg, a, b, vb)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_ADAM = twins(_adam)


def adam_step(p, g, m, v, vmax, pieces, *, gscale, step_size, beta1, beta2, eps, inv_bc2_sqrt, l2, decay, amsgrad,
              working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Fused Adam/AdamW update; see :func:`arraytrain.kernels.reference.adam_step`."""
    t = p.dtype.type
    pick(_ADAM, p.size, m, v, vmax)(
        p, g, m, v, vmax, pieces, grad_ptrs, t(gscale), seg_array(step_size, p.dtype), t(1.0 - beta1), t(beta2),
        t(1.0 - beta2), t(eps), t(inv_bc2_sqrt), seg_array(l2, p.dtype), seg_array(decay, p.dtype),
        bool(amsgrad), working, int(kind), grad_fill(zero_grad), mask,
    )


@njit(inline="always", error_model="numpy")  # (no fast-math: the NumPy expressions' bits, see optim._rates)
def rates_into(hp_lr, hp_wd, lr, weight_decay, lr_div, decoupled, step_size, l2, decay):
    """The kernels' per-parameter rates (:func:`arraytrain.optim._rates.step_rates`) into ``step_size``, ``l2``
    and ``decay``: per parameter the override (``hp_lr``/``hp_wd``, NaN: none) or ``lr``/``weight_decay``;
    ``step_size = lr / lr_div``; decoupled ``l2 = 0``, ``decay = 1 - lr * weight_decay``; else ``l2 =
    weight_decay``, ``decay = 1`` (jitted code)."""
    for i in range(hp_lr.size):
        a = hp_lr[i]
        if np.isnan(a):
            a = lr
        w = hp_wd[i]
        if np.isnan(w):
            w = weight_decay
        step_size[i] = a / lr_div
        if decoupled:
            l2[i] = 0.0
            decay[i] = 1.0 - a * w
        else:
            l2[i] = w
            decay[i] = 1.0


def _adam_checked(p, g, m, v, vmax, pieces, upieces, bounds, bases, offsets, itemsize, hp_lr, hp_wd, rates, lr_divs,
                  inv_bc2_sqrts, decoupled, unscale, max_norm, clip_eps, check, sign, beta1, beta2, eps, amsgrad):
    nseg = offsets.size
    gp = _piece_addresses(pieces, bases, offsets, itemsize)
    if check or max_norm >= 0.0:
        total, per_seg = _sumsq_twin(g, pieces, gp, nseg)
    else:  # nothing needs the norm pass
        total, per_seg = np.nan, np.full(nseg, np.nan)
    finite = np.isfinite(total)
    if check and not finite:
        return total, per_seg, False
    norm = np.sqrt(total) / unscale if finite else np.nan
    coef = _clip_factor(norm, max_norm, clip_eps) if max_norm >= 0.0 else 1.0
    gscale = np.float32(sign * (coef / unscale))
    for i in range(nseg):
        hp_lr[i], hp_wd[i] = rates[i, 0], rates[i, 1]
    step_size = np.empty(nseg, np.float32)
    l2 = np.empty(nseg, np.float32)
    decay = np.empty(nseg, np.float32)
    ugp = _piece_addresses(upieces, bases, offsets, itemsize)
    for k in range(lr_divs.size):  # (one launch per step count among the parameters, as run_groups makes them)
        rates_into(hp_lr, hp_wd, 0.0, 0.0, lr_divs[k], decoupled, step_size, l2, decay)
        a, b = bounds[k], bounds[k + 1]
        _adam_twin(p, g, m, v, vmax, upieces[a:b], ugp[a:b], gscale, step_size, np.float32(1.0 - beta1),
                   np.float32(beta2), np.float32(1.0 - beta2), np.float32(eps), np.float32(inv_bc2_sqrts[k]), l2, decay,
                   amsgrad, None, LP_NONE, None, None)
    return total, per_seg, True


@njit(**JIT)
def _piece_addresses(pieces, bases, offsets, itemsize):
    """Where each piece's gradient starts: parameter ``s``'s gradient lies at ``bases[s]``."""
    gp = np.empty(pieces.shape[0], np.int64)
    for j in range(pieces.shape[0]):
        s = pieces[j, 2]
        gp[j] = bases[s] + (pieces[j, 0] - offsets[s]) * itemsize
    return gp


def _calling(fn, suffix: str, **kernels):
    """``fn`` compiled (no fast-math: every scalar rounds as the staged step's Python does) with the
    dispatchers ``kernels`` as its globals of those names, under a qualname of its own (its cache)."""
    body = type(fn)(fn.__code__, {**fn.__globals__, **kernels}, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    body.__qualname__ = fn.__qualname__ + suffix
    return njit(error_model="numpy", cache=True)(body)


# A whole Adam/AdamW step in one compiled call, ``(parallel, serial)`` as the twins it calls:
# ``(total, per_segment, applied)``.
#
# The staged step (:meth:`arraytrain.Engine.step`) makes a dozen calls around its two kernels (the
# norm pass, the clip factor, the per-parameter rates, the update); inside a training loop each kind
# of call pays for its first use, a numba dispatch some 40 µs (docs/performance.md, the torch loop).
# This is their composition for the torch drop-ins' common step, calling the same compiled twins
# (:data:`~arraytrain.kernels.cpu.reductions.SUMSQ_TWINS`' and Adam's) with the arguments the staged
# step forms, each by the same float64 operations: the gradient of parameter ``s`` lies at
# ``bases[s]`` (``offsets``: the parameters' first elements, ``itemsize`` bytes each); the sum of
# squares over ``pieces`` (the present parameters' rows of the layout's table) gives the norm
# ``sqrt(total) / unscale`` and the clip factor of ``max_norm`` (< 0: none) and ``clip_eps``
# (:func:`arraytrain.ops.clip_factor`, compiled; without ``check`` and ``max_norm`` no norm pass, and a non-finite
# gradient is applied, its norm NaN, as ``nonfinite="apply"`` takes it); ``rates`` (a row per
# parameter: lr, weight decay) is written into ``hp_lr``/``hp_wd`` (``OptState.hp``); then one update
# per step count among the present parameters (:func:`arraytrain.param_steps.groups`): rows
# ``bounds[k]:bounds[k + 1]`` of ``upieces`` with Adam's bias corrections ``lr_divs[k]`` and
# ``inv_bc2_sqrts[k]``, the rates :func:`arraytrain.optim._rates.step_rates` would give, and ``gscale =
# sign * coef / unscale``. Not finite with ``check``: ``applied`` False, nothing written.
# The gradient is read, not zeroed (it is the caller's). float32 parameters and state only.
_clip_factor = njit(error_model="numpy", cache=True)(clip_factor)  # (the judge's rule, compiled: arraytrain.ops)
_ADAM_CHECKED = (_calling(_adam_checked, "_parallel", _sumsq_twin=SUMSQ_TWINS[0], _adam_twin=_ADAM[0]),
                _calling(_adam_checked, "_serial", _sumsq_twin=SUMSQ_TWINS[1], _adam_twin=_ADAM[1]))


def adam_checked(p, g, m, v, vmax, hp_lr, hp_wd, rates, bases, offsets, upieces, bounds, pieces, *, unscale, max_norm,
                 clip_eps, check, maximize, decoupled, beta1, beta2, eps, amsgrad, lr_div, inv_bc2_sqrt):
    """A whole Adam/AdamW step in one call (the twin for ``p.size`` of the composition above): ``(total,
    per_segment, applied)``. ``lr_div`` and ``inv_bc2_sqrt``: per step-count group (rows
    ``bounds[k]:bounds[k + 1]`` of ``upieces``), ``1 - beta1**t`` and ``1 / sqrt(1 - beta2**t)``;
    ``max_norm`` None: no clipping. ``vmax``: an empty array without ``amsgrad``."""
    return pick(_ADAM_CHECKED, p.size)(
        p, g, m, v, vmax, pieces, upieces, bounds, bases, offsets, p.itemsize, hp_lr, hp_wd, rates,
        np.asarray(lr_div, np.float64), np.asarray(inv_bc2_sqrt, np.float64), bool(decoupled), float(unscale),
        -1.0 if max_norm is None else float(max_norm), float(clip_eps), bool(check), -1.0 if maximize else 1.0,
        float(beta1), float(beta2), float(eps), bool(amsgrad))  # (floats: one compiled signature)


# -- adagrad, rmsprop, lion, lamb ---------------------------------------------------------


def _adagrad(p, g, s, pieces, gp, gscale, lr, wd, eps, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, wd_j = lr[seg], wd[seg]
        step = state_step(s, seg, hi - lo)
        ts = state_scratch(s)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            pb, gb, sb = p[a:b], grad_slice(g, gp, j, lo, a, b), state_open(s, seg, a, b, ts)
            kb = piece_mask(mask, a, b)
            for i in range(pb.size):
                pi = pb[i]
                d = gscale * gb[i] + wd_j * pi
                si = store_state(sb, i, load_state(sb, i) + d * d)
                store_masked(pb, i, pi - lr_j * (d / (np.sqrt(si) + eps)), kb)
                clear_grad(gb, i, zero_grad)
            state_close(s, seg, a, b, sb)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_ADAGRAD = twins(_adagrad)


def adagrad_step(p, g, sum_sq, pieces, *, gscale, lr, l2, eps, working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None,
                 mask=None):
    """Fused Adagrad update; see :func:`arraytrain.kernels.reference.adagrad_step`."""
    t = p.dtype.type
    pick(_ADAGRAD, p.size, sum_sq)(
        p, g, sum_sq, pieces, grad_ptrs, t(gscale), seg_array(lr, p.dtype), seg_array(l2, p.dtype), t(eps),
        working, int(kind), grad_fill(zero_grad), mask,
    )


@njit(inline="always", **JIT)
def _rmsprop_piece(pb, gb, qb, ab, bb, kb, gscale, lr_j, wd_j, alpha, alpha_c, eps, momentum, zero_grad, centered,
                   use_momentum):
    for i in range(pb.size):
        pi = pb[i]
        d = gscale * gb[i] + wd_j * pi
        qi = store_state(qb, i, alpha * load_state(qb, i) + alpha_c * d * d)
        if centered:
            ai = load_state(ab, i)
            ai = store_state(ab, i, ai + alpha_c * (d - ai))
            qi = qi - ai * ai
        step = d / (np.sqrt(qi) + eps)
        if use_momentum:
            step = store_state(bb, i, momentum * load_state(bb, i) + step)
        store_masked(pb, i, pi - lr_j * step, kb)
        clear_grad(gb, i, zero_grad)


def _rmsprop(p, g, sq, gavg, buf, pieces, gp, gscale, lr, wd, alpha, alpha_c, eps, momentum, centered, use_momentum,
             w, wkind, zero_grad, mask):
    # one template: ``centered`` and ``use_momentum`` select the variant (the unused
    # slots arrive as empty arrays and are never indexed), each a constant in its copy of the loop
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, wd_j = lr[seg], wd[seg]
        step = state_step(sq, seg, hi - lo)
        tq, ta, tb = state_scratch(sq), state_scratch(gavg), state_scratch(buf)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            pb, gb, qb = p[a:b], grad_slice(g, gp, j, lo, a, b), state_open(sq, seg, a, b, tq)
            kb = piece_mask(mask, a, b)
            if centered and use_momentum:
                ab, bb = state_open(gavg, seg, a, b, ta), state_open(buf, seg, a, b, tb)
                _rmsprop_piece(pb, gb, qb, ab, bb, kb, gscale, lr_j, wd_j, alpha, alpha_c, eps, momentum, zero_grad,
                               True, True)
                state_close(gavg, seg, a, b, ab)
                state_close(buf, seg, a, b, bb)
            elif centered:
                ab = state_open(gavg, seg, a, b, ta)
                _rmsprop_piece(pb, gb, qb, ab, qb, kb, gscale, lr_j, wd_j, alpha, alpha_c, eps, momentum, zero_grad,
                               True, False)
                state_close(gavg, seg, a, b, ab)
            elif use_momentum:
                bb = state_open(buf, seg, a, b, tb)
                _rmsprop_piece(pb, gb, qb, qb, bb, kb, gscale, lr_j, wd_j, alpha, alpha_c, eps, momentum, zero_grad,
                               False, True)
                state_close(buf, seg, a, b, bb)
            else:
                _rmsprop_piece(pb, gb, qb, qb, qb, kb, gscale, lr_j, wd_j, alpha, alpha_c, eps, momentum, zero_grad,
                               False, False)
            state_close(sq, seg, a, b, qb)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_RMSPROP = twins(_rmsprop)


def rmsprop_step(p, g, square_avg, grad_avg, momentum_buffer, pieces, *, gscale, lr, l2, alpha, eps, momentum,
                 centered, working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Fused RMSprop update; see :func:`arraytrain.kernels.reference.rmsprop_step`."""
    t = p.dtype.type
    pick(_RMSPROP, p.size, square_avg, grad_avg, momentum_buffer)(
        p, g, square_avg, grad_avg, momentum_buffer, pieces, grad_ptrs, t(gscale), seg_array(lr, p.dtype),
        seg_array(l2, p.dtype), t(alpha), t(1.0 - alpha), t(eps), t(momentum), bool(centered),
        bool(momentum > 0), working, int(kind), grad_fill(zero_grad), mask,
    )


def _lion(p, g, m, pieces, gp, gscale, lr, decay, beta1, beta1c, beta2, beta2c, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, dec = lr[seg], decay[seg]
        step = state_step(m, seg, hi - lo)
        tm = state_scratch(m)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            pb, gb, mb = p[a:b], grad_slice(g, gp, j, lo, a, b), state_open(m, seg, a, b, tm)
            kb = piece_mask(mask, a, b)
            for i in range(pb.size):
                d = gscale * gb[i]
                mi = load_state(mb, i)
                # np.sign keeps NaN (a NaN gradient is not silently turned into a zero step)
                c = np.sign(beta1 * mi + beta1c * d)
                store_state(mb, i, beta2 * mi + beta2c * d)
                store_masked(pb, i, pb[i] * dec - lr_j * c, kb)
                clear_grad(gb, i, zero_grad)
            state_close(m, seg, a, b, mb)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_LION = twins(_lion)


def lion_step(p, g, m, pieces, *, gscale, lr, decay, beta1, beta2, working=None, kind=LP_NONE, zero_grad=False,
              grad_ptrs=None, mask=None):
    """Fused Lion update; see :func:`arraytrain.kernels.reference.lion_step`."""
    t = p.dtype.type
    pick(_LION, p.size, m)(
        p, g, m, pieces, grad_ptrs, t(gscale), seg_array(lr, p.dtype), seg_array(decay, p.dtype), t(beta1), t(1.0 - beta1),
        t(beta2), t(1.0 - beta2), working, int(kind), grad_fill(zero_grad), mask,
    )


#: LAMB's sums of squares (its trust ratios) run in this many float64 lanes: element ``i`` of a piece
#: is added to lane ``i % SUM_LANES`` in element order, then the lanes in lane order. The lanes are
#: the source's, not the target's vector width, so the bits are the same on AVX2 and AVX-512 (and
#: for any thread count: pieces are the layout's); one running sum carried the whole piece before,
#: a chain of dependent float64 additions that kept the loop scalar on every target.
SUM_LANES = 8
_EXACT = dict(JIT, fastmath=False)  # (each lane's sum in element order, each product and sum rounded once)


@intrinsic
def _add_squares(typingctx, x, full, lanes):
    """``lanes[k] += float64(x[r + k]) ** 2`` for ``r`` in ``range(0, full, SUM_LANES)`` and every lane ``k``, in
    that order (jitted code only; ``x`` contiguous float32 or float64, ``lanes`` float64): one packed product
    and one packed addition of ``SUM_LANES`` doubles a step, in a register, without fast-math flags, so each
    lane rounds the same on every target (no contraction into an FMA, no reordering)."""
    if not (isinstance(x, types.Array) and x.dtype in (types.float32, types.float64) and x.layout == "C"):
        return None
    wide = x.dtype == types.float64
    f64v = ir.VectorType(ir.DoubleType(), SUM_LANES)
    xv = f64v if wide else ir.VectorType(ir.FloatType(), SUM_LANES)

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        la = context.make_array(signature.args[2])(context, builder, args[2])
        dst = builder.bitcast(la.data, f64v.as_pointer())
        acc = cgutils.alloca_once(builder, f64v)
        builder.store(builder.load(dst, align=8), acc)
        i64 = ir.IntType(64)
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), args[1], ir.Constant(i64, SUM_LANES)) as (r, _):
            v = builder.load(builder.bitcast(builder.gep(xa.data, [r]), xv.as_pointer()), align=8 if wide else 4)
            if not wide:
                v = builder.fpext(v, f64v)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(v, v)), acc)
        builder.store(builder.load(acc), dst, align=8)
        return context.get_dummy_value()

    return types.void(x, types.int64, lanes), codegen


@njit(**_EXACT)
def _lanes_sumsq(x, lanes):
    """``lanes[k] += float64(x[i]) ** 2`` for every ``i`` with ``i % SUM_LANES == k``, in element order."""
    n = x.size
    full = n - n % SUM_LANES
    _add_squares(x, full, lanes)
    for k in range(n - full):
        xi = np.float64(x[full + k])
        lanes[k] += xi * xi


@njit(**_EXACT)
def _lanes_total(lanes):
    total = 0.0
    for k in range(SUM_LANES):
        total += lanes[k]
    return total


def _lamb_moments(p, g, m, v, pieces, gp, gscale, wd, b1c, b2, b2c, inv_bc1, inv_bc2, eps, eps_root, zero_grad,
                  nseg):
    npieces = pieces.shape[0]
    psq = np.empty(npieces, dtype=np.float64)
    usq = np.empty(npieces, dtype=np.float64)
    # pass 1: moments, and float64 sums of squares of p and of the update u per piece (in SUM_LANES lanes)
    for j in prange(npieces):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        wd_j = wd[seg]
        lp = np.zeros(SUM_LANES)
        lu = np.zeros(SUM_LANES)
        tu = np.empty(QBLOCK, p.dtype)  # the u of a run of QBLOCK elements, whose squares are then summed
        step = state_step(m, seg, hi - lo)
        tm, tv = state_scratch(m), state_scratch(v)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            pb, gb = p[a:b], grad_slice(g, gp, j, lo, a, b)
            mb, vb = state_open(m, seg, a, b, tm), state_open(v, seg, a, b, tv)
            # runs of QBLOCK elements (a multiple of SUM_LANES, as a block's start is): each starts at lane 0
            for s in range(0, b - a, QBLOCK):
                e = min(s + QBLOCK, b - a)
                ps, gs, ms, vs, us = pb[s:e], gb[s:e], mb[s:e], vb[s:e], tu[: e - s]
                for i in range(ps.size):  # no reduction here: a packed loop
                    pi = ps[i]
                    d = gscale * gs[i]
                    mi = load_state(ms, i)
                    mi = store_state(ms, i, mi + b1c * (d - mi))
                    vi = store_state(vs, i, b2 * load_state(vs, i) + b2c * d * d)
                    us[i] = (mi * inv_bc1) / (np.sqrt(vi * inv_bc2 + eps_root) + eps) + wd_j * pi
                    clear_grad(gs, i, zero_grad)
                _lanes_sumsq(ps, lp)
                _lanes_sumsq(us, lu)
            state_close(m, seg, a, b, mb)
            state_close(v, seg, a, b, vb)
        psq[j] = _lanes_total(lp)
        usq[j] = _lanes_total(lu)
    # per parameter, added in piece order: [||p_s||^2..., ||u_s||^2...]
    sums = np.empty(2 * nseg, dtype=np.float64)
    sums[:nseg] = piece_totals(psq, pieces, nseg)[1]
    sums[nseg:] = piece_totals(usq, pieces, nseg)[1]
    return sums


_LAMB_MOMENTS = twins(_lamb_moments)


def _lamb_apply(p, m, v, pieces, wd, step, inv_bc1, inv_bc2, eps, eps_root, w, wkind, mask):
    # pass 2: recompute u from the stored moments (p is unchanged so far) and apply it
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        wd_j, st = wd[seg], step[seg]
        # 8-bit moments are read back decoded (the codes, not the float values pass 1 formed)
        n = state_step(m, seg, hi - lo)
        tm, tv = state_scratch(m), state_scratch(v)
        for a in range(lo, hi, n):
            b = min(a + n, hi)
            pb, mb, vb = p[a:b], state_open(m, seg, a, b, tm), state_open(v, seg, a, b, tv)
            kb = piece_mask(mask, a, b)
            for i in range(pb.size):
                pi = pb[i]
                u = (load_state(mb, i) * inv_bc1) / (np.sqrt(load_state(vb, i) * inv_bc2 + eps_root) + eps) + wd_j * pi
                store_masked(pb, i, pi - st * u, kb)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_LAMB_APPLY = twins(_lamb_apply)


def lamb_step(p, g, m, v, pieces, *, gscale, lr, weight_decay, beta1, beta2, eps, eps_root, inv_bc1, inv_bc2,
              working=None, kind=LP_NONE, zero_grad=False, reduce_sums=None, grad_ptrs=None, mask=None):
    """Fused LAMB update, returns the per-parameter trust ratios (float64).

    Two parallel loops; between them the per-parameter sums of squares (completed by
    ``reduce_sums`` where given) become the trust ratios. See
    :func:`arraytrain.kernels.reference.lamb_step`.
    """
    t = p.dtype.type
    lr, wd = seg_array(lr, p.dtype), seg_array(weight_decay, p.dtype)
    nseg = lr.size
    inv_bc1, inv_bc2, eps, eps_root = t(inv_bc1), t(inv_bc2), t(eps), t(eps_root)
    sums = pick(_LAMB_MOMENTS, p.size, m, v)(
        p, g, m, v, pieces, grad_ptrs, t(gscale), wd, t(1.0 - beta1), t(beta2), t(1.0 - beta2), inv_bc1, inv_bc2, eps, eps_root,
        grad_fill(zero_grad), nseg,
    )
    if reduce_sums is not None:
        reduce_sums(sums)
    pn, un = np.sqrt(sums[:nseg]), np.sqrt(sums[nseg:])
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where((pn == 0.0) | (un == 0.0), 1.0, pn / un)
    step = (lr.astype(np.float64) * ratio).astype(p.dtype)  # lr * ratio rounded to the storage dtype
    pick(_LAMB_APPLY, p.size, m, v)(
        p, m, v, pieces, wd, step, inv_bc1, inv_bc2, eps, eps_root, working, int(kind), mask,
    )
    return ratio


# -- adafactor, sophia, sam -------------------------------------------------------------
#
# Adafactor (torch.optim.Adafactor's form). A parameter with >= 2 dims is factored over its
# last two dims (B leading "batch" matrices of R x C); others keep a full second moment.
# Geometry tables (built once per layout by arraytrain.optim._adafactor, int64):
#   segs    (nseg, 9): [p_off, numel, factored, B, R, C, row_off, col_off, var_off]
#   rows    (K, 4):    [p_start, C, row_index, seg]          one per matrix row (B*R per segment)
#   cols    (Q, 5):    [p_start, R, C, width, col_index]      one per block of <= _AF_COLS columns
#   batches (NB, 2):   [row_index, R]                         one per matrix, first row and rows
# Passes over the flat buffers per step (g: the gradient, p: the parameters):
#   1. rows   (factored): g and p read once; float64 row sums of g^2 -> row_var EMA, and the
#                         float64 row sums of p^2 for the parameter RMS.
#   2. cols   (factored): g read once by column blocks (rows in order, so the float64 column
#                         sums do not depend on the thread count) -> col_var EMA.
#   3. rscale (tiny, per matrix): row_var / max(mean(row_var), eps1).
#   4. stats  (every piece): factored pieces read g for the float64 sum of U^2; unfactored
#                         pieces read p, g, variance, write the variance EMA and sum p^2, U^2.
#   host:     alpha = max(eps2, RMS(p)) * rel_step, step = alpha / max(1, RMS(U) / d).
#   5. apply  (every piece): p = p * (1 - lr*wd) - step * U, U recomputed from the statistics.
# The clipping denominator needs all of U before any element moves, so U is formed twice
# (passes 4 and 5); the column sums could share pass 1 only through per-thread partial
# column buffers, traded here for one more read of g and sums that need no merge.

_AF_COLS = 256


def _af_rows(p, g, row, rows, gscale, beta2c, psq_rows):
    for k in prange(rows.shape[0]):
        a, c, ri = rows[k, 0], rows[k, 1], rows[k, 2]
        pb, gb = p[a : a + c], g[a : a + c]
        sg = 0.0
        sp = 0.0
        for i in range(c):
            gi = np.float64(gscale * gb[i])
            pi = np.float64(pb[i])
            sg += gi * gi
            sp += pi * pi
        r = row[ri]
        row[ri] = r + beta2c * (sg / c - r)
        psq_rows[k] = sp


_AF_ROWS = twins(_af_rows)


def _af_cols(g, col, cols, gscale, beta2c):
    for q in prange(cols.shape[0]):
        a, nr, c, width, ci = cols[q, 0], cols[q, 1], cols[q, 2], cols[q, 3], cols[q, 4]
        acc = np.zeros(width, dtype=np.float64)
        for r in range(nr):
            gb = g[a + r * c : a + r * c + width]
            for i in range(width):
                gi = np.float64(gscale * gb[i])
                acc[i] += gi * gi
        cb = col[ci : ci + width]
        for i in range(width):
            x = cb[i]
            cb[i] = x + beta2c * (acc[i] / nr - x)


_AF_COLS_PAIR = twins(_af_cols)


def _af_rscale(row, batches, eps1, rscale):
    for b in prange(batches.shape[0]):
        r0, nr = batches[b, 0], batches[b, 1]
        rb = row[r0 : r0 + nr]
        s = 0.0
        for i in range(nr):
            s += np.float64(rb[i])
        m = s / nr
        m = eps1 if m < eps1 else m  # NaN-propagating clamp (torch's clamp_(min=eps1))
        sb = rscale[r0 : r0 + nr]
        for i in range(nr):
            sb[i] = rb[i] / m


_AF_RSCALE = twins(_af_rscale)


def _af_stats(p, g, col, var, rscale, pieces, segs, gscale, beta2c, eps1sq, psq_part, usq_part):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        off = segs[seg, 0]
        su = 0.0
        sp = 0.0
        if segs[seg, 2]:
            nr, c, ro, co = segs[seg, 4], segs[seg, 5], segs[seg, 6], segs[seg, 7]
            e, end = lo - off, hi - off
            while e < end:
                k = e // c
                c0 = e - k * c
                c1 = min(c, c0 + end - e)
                rs = rscale[ro + k]
                gb = g[off + k * c + c0 : off + k * c + c1]
                cb = col[co + (k // nr) * c + c0 : co + (k // nr) * c + c1]
                for i in range(c1 - c0):
                    v = rs * cb[i]
                    v = eps1sq if v < eps1sq else v
                    u = np.float64(gscale * gb[i] / np.sqrt(v))
                    su += u * u
                e += c1 - c0
        else:
            vo = segs[seg, 8] + lo - off
            pb, gb, vb = p[lo:hi], g[lo:hi], var[vo : vo + hi - lo]
            for i in range(pb.size):
                gi = gscale * gb[i]
                x = vb[i]
                v = x + beta2c * (gi * gi - x)
                vb[i] = v
                v = eps1sq if v < eps1sq else v
                u = np.float64(gi / np.sqrt(v))
                pi = np.float64(pb[i])
                su += u * u
                sp += pi * pi
        usq_part[j] = su
        psq_part[j] = sp


_AF_STATS = twins(_af_stats)


def _af_apply(p, g, col, var, rscale, pieces, segs, gscale, eps1sq, step, decay, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        off = segs[seg, 0]
        ss, dec = step[seg], decay[seg]
        if segs[seg, 2]:
            nr, c, ro, co = segs[seg, 4], segs[seg, 5], segs[seg, 6], segs[seg, 7]
            e, end = lo - off, hi - off
            while e < end:
                k = e // c
                c0 = e - k * c
                c1 = min(c, c0 + end - e)
                rs = rscale[ro + k]
                a = off + k * c
                pb, gb = p[a + c0 : a + c1], g[a + c0 : a + c1]
                kb = piece_mask(mask, a + c0, a + c1)
                cb = col[co + (k // nr) * c + c0 : co + (k // nr) * c + c1]
                for i in range(c1 - c0):
                    v = rs * cb[i]
                    v = eps1sq if v < eps1sq else v
                    store_masked(pb, i, pb[i] * dec - ss * (gscale * gb[i] / np.sqrt(v)), kb)
                    clear_grad(gb, i, zero_grad)
                e += c1 - c0
        else:
            vo = segs[seg, 8] + lo - off
            pb, gb, vb = p[lo:hi], g[lo:hi], var[vo : vo + hi - lo]
            kb = piece_mask(mask, lo, hi)
            for i in range(pb.size):
                v = vb[i]
                v = eps1sq if v < eps1sq else v
                store_masked(pb, i, pb[i] * dec - ss * (gscale * gb[i] / np.sqrt(v)), kb)
                clear_grad(gb, i, zero_grad)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)


_AF_APPLY = twins(_af_apply)


def _seg_totals(part, pieces, nseg, extra, extra_seg):
    """Per-segment float64 totals of per-piece (and per-row) partial sums, in a fixed order."""
    out = np.zeros(nseg, dtype=np.float64)
    np.add.at(out, pieces[:, 2], part)  # unbuffered, in index order: thread-count independent
    if extra is not None:
        np.add.at(out, extra_seg, extra)
    return out


def adafactor_step(p, g, row, col, var, pieces, segs, rows, cols, batches, *, gscale, rel_step, decay,
                   one_minus_beta2, eps1, eps2, d, working=None, kind=LP_NONE, zero_grad=False, mask=None):
    """Fused Adafactor update (five passes, see above); see :func:`arraytrain.kernels.reference.adafactor_step`."""
    t = p.dtype.type
    n = p.size
    gs, b2c = t(gscale), t(one_minus_beta2)
    nseg = segs.shape[0]
    psq_rows = np.empty(rows.shape[0], dtype=np.float64)
    rscale = np.empty(row.size, dtype=p.dtype)
    if rows.shape[0]:
        pick(_AF_ROWS, n)(p, g, row, rows, gs, b2c, psq_rows)
        pick(_AF_COLS_PAIR, n)(g, col, cols, gs, b2c)
        pick(_AF_RSCALE, row.size)(row, batches, float(eps1), rscale)
    psq_part = np.empty(pieces.shape[0], dtype=np.float64)
    usq_part = np.empty(pieces.shape[0], dtype=np.float64)
    eps1sq = t(eps1 * eps1)
    pick(_AF_STATS, n)(p, g, col, var, rscale, pieces, segs, gs, b2c, eps1sq, psq_part, usq_part)
    psq = _seg_totals(psq_part, pieces, nseg, psq_rows, rows[:, 3])
    usq = _seg_totals(usq_part, pieces, nseg, None, None)
    step = adafactor_step_size(psq, usq, segs[:, 1], rel_step, eps2, d)
    pick(_AF_APPLY, n)(p, g, col, var, rscale, pieces, segs, gs, eps1sq, seg_array(step, p.dtype),
                        seg_array(decay, p.dtype), working, int(kind), grad_fill(zero_grad), mask)


def adafactor_step_size(psq, usq, numel, rel_step, eps2, d):
    """``max(eps2, RMS(p)) * rel_step / max(1, RMS(U) / d)`` per segment, in float64.

    ``max`` as torch's Python ``max(constant, x)``: a NaN ``x`` gives the constant
    (``np.fmax``); the NaN still reaches the parameters through ``U``.
    """
    size = np.maximum(np.asarray(numel, np.float64), 1.0)
    alpha = np.fmax(eps2, np.sqrt(psq / size)) * np.asarray(rel_step, np.float64)
    return alpha / np.fmax(1.0, np.sqrt(usq / size) / d)


# Sophia ------------------------------------------------------------------------------------


def _sophia(p, g, m, h, pieces, gscale, lr, decay, beta1, beta1c, rho_bs, eps, one, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, dec = lr[seg], decay[seg]
        pb, gb, mb, hb = p[lo:hi], g[lo:hi], m[lo:hi], h[lo:hi]
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            mi = beta1 * mb[i] + beta1c * (gscale * gb[i])
            mb[i] = mi
            den = rho_bs * hb[i]
            den = eps if den < eps else den  # NaN-propagating max(rho_bs*h, eps) > 0
            # sign(m) * min(|m| / den, 1) == clip(m / den, -1, 1) for den > 0; NaN stays NaN
            r = mi / den
            r = one if r > one else r
            r = -one if r < -one else r
            store_masked(pb, i, pb[i] * dec - lr_j * r, kb)
            clear_grad(gb, i, zero_grad)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_SOPHIA = twins(_sophia)


def sophia_step(p, g, m, h, pieces, *, gscale, lr, decay, beta1, rho_bs, eps, working=None, kind=LP_NONE,
                zero_grad=False, mask=None):
    """Fused SophiaG update; see :func:`arraytrain.kernels.reference.sophia_step`."""
    t = p.dtype.type
    pick(_SOPHIA, p.size)(
        p, g, m, h, pieces, t(gscale), seg_array(lr, p.dtype), seg_array(decay, p.dtype), t(beta1),
        t(1.0 - beta1), t(rho_bs), t(eps), t(1.0), working, int(kind), grad_fill(zero_grad), mask,
    )


# SAM -----------------------------------------------------------------------------------------


def _sam_perturb(p, g, backup, pieces, scale, adaptive, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi = pieces[j, 0], pieces[j, 1]
        pb, gb, bb = p[lo:hi], g[lo:hi], backup[lo:hi]
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            pi = pb[i]
            bb[i] = pi
            e = scale * gb[i]
            if adaptive:
                e = e * (pi * pi)
            store_masked(pb, i, pi + e, kb)
            clear_grad(gb, i, zero_grad)


_SAM_PERTURB = twins(_sam_perturb)


def sam_perturb(p, g, backup, pieces, *, scale, adaptive, zero_grad=False, mask=None):
    """``backup = p; p += scale * (p^2 if adaptive) * g``, pruned weights 0.

    See :func:`arraytrain.kernels.reference.sam_perturb`.
    """
    pick(_SAM_PERTURB, p.size)(p, g, backup, pieces, p.dtype.type(scale), bool(adaptive), grad_fill(zero_grad), mask)


# NAdam, RAdam, Adamax, Adadelta -------------------------------------------------------------
#
# NAdam and RAdam share one template: Adam's moments, then, per element,
#   adaptive:  p = p*decay - (a*d + b*m) * rect / (sqrt(v)*inv_bc2_sqrt + eps)
#   otherwise: p = p*decay - b*m                     (RAdam while rho_t <= 5)
# NAdam: a, b = grad_step, moment_step, rect = 1. RAdam: a = 0, b = step_size, inv_bc2_sqrt = 1
# (torch adds eps to sqrt(v) before RAdam's bias correction, which rect carries); a*d = +-0
# exactly for a finite d, and a non-finite d makes m and v non-finite too.


def _nadam_radam(p, g, m, v, pieces, gp, gscale, a, b, beta1c, beta2, beta2c, eps, inv_bc2_sqrt, rect, l2, decay,
                 adaptive, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        a_j, b_j, l2_j, dec = a[seg], b[seg], l2[seg], decay[seg]
        n = state_step(m, seg, hi - lo)
        tm, tv = state_scratch(m), state_scratch(v)
        for e0 in range(lo, hi, n):
            e1 = min(e0 + n, hi)
            pb, gb = p[e0:e1], grad_slice(g, gp, j, lo, e0, e1)
            mb, vb = state_open(m, seg, e0, e1, tm), state_open(v, seg, e0, e1, tv)
            kb = piece_mask(mask, e0, e1)
            for i in range(pb.size):
                pi = pb[i]
                d = gscale * gb[i] + l2_j * pi
                mi = load_state(mb, i)
                mi = store_state(mb, i, mi + beta1c * (d - mi))
                vi = store_state(vb, i, beta2 * load_state(vb, i) + beta2c * d * d)
                if adaptive:
                    step = (a_j * d + b_j * mi) * rect / (np.sqrt(vi) * inv_bc2_sqrt + eps)
                else:
                    step = b_j * mi
                store_masked(pb, i, pi * dec - step, kb)
                clear_grad(gb, i, zero_grad)
            state_close(m, seg, e0, e1, mb)
            state_close(v, seg, e0, e1, vb)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_NADAM_RADAM = twins(_nadam_radam)


def _run_nadam_radam(p, g, m, v, pieces, grad_ptrs, gscale, a, b, beta1, beta2, eps, inv_bc2_sqrt, rect, l2, decay, adaptive,
                     w, wkind, zero_grad, mask):
    t = p.dtype.type
    pick(_NADAM_RADAM, p.size, m, v)(
        p, g, m, v, pieces, grad_ptrs, t(gscale), seg_array(a, p.dtype), seg_array(b, p.dtype), t(1.0 - beta1), t(beta2),
        t(1.0 - beta2), t(eps), t(inv_bc2_sqrt), t(rect), seg_array(l2, p.dtype), seg_array(decay, p.dtype),
        bool(adaptive), w, int(wkind), grad_fill(zero_grad), mask,
    )


def nadam_step(p, g, m, v, pieces, *, gscale, grad_step, moment_step, beta1, beta2, eps, inv_bc2_sqrt, l2, decay,
               working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Fused NAdam update; see :func:`arraytrain.kernels.reference.nadam_step`."""
    _run_nadam_radam(p, g, m, v, pieces, grad_ptrs, gscale, grad_step, moment_step, beta1, beta2, eps, inv_bc2_sqrt, 1.0, l2,
                     decay, True, working, kind, zero_grad, mask)


def radam_step(p, g, m, v, pieces, *, gscale, step_size, beta1, beta2, eps, rect, rectified, l2, decay, working=None,
               kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Fused RAdam update; see :func:`arraytrain.kernels.reference.radam_step`."""
    _run_nadam_radam(p, g, m, v, pieces, grad_ptrs, gscale, np.zeros(np.shape(step_size)), step_size, beta1, beta2,
                     eps, 1.0, rect, l2, decay, rectified, working, kind, zero_grad, mask)


def _adamax(p, g, m, u, pieces, gp, gscale, step_size, beta1c, beta2, eps, l2, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        ss, l2_j = step_size[seg], l2[seg]
        step = state_step(m, seg, hi - lo)
        tm, tu = state_scratch(m), state_scratch(u)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            pb, gb = p[a:b], grad_slice(g, gp, j, lo, a, b)
            mb, ub = state_open(m, seg, a, b, tm), state_open(u, seg, a, b, tu)
            kb = piece_mask(mask, a, b)
            for i in range(pb.size):
                pi = pb[i]
                d = gscale * gb[i] + l2_j * pi
                mi = load_state(mb, i)
                mi = store_state(mb, i, mi + beta1c * (d - mi))
                x, y = beta2 * load_state(ub, i), np.abs(d) + eps
                ui = store_state(ub, i, y if y > x or y != y else x)  # torch.maximum: NaN if either is NaN
                store_masked(pb, i, pi - ss * (mi / ui), kb)
                clear_grad(gb, i, zero_grad)
            state_close(m, seg, a, b, mb)
            state_close(u, seg, a, b, ub)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_ADAMAX = twins(_adamax)


def adamax_step(p, g, m, u, pieces, *, gscale, step_size, beta1, beta2, eps, l2, working=None, kind=LP_NONE,
                zero_grad=False, grad_ptrs=None, mask=None):
    """Fused Adamax update; see :func:`arraytrain.kernels.reference.adamax_step`."""
    t = p.dtype.type
    pick(_ADAMAX, p.size, m, u)(
        p, g, m, u, pieces, grad_ptrs, t(gscale), seg_array(step_size, p.dtype), t(1.0 - beta1), t(beta2), t(eps),
        seg_array(l2, p.dtype), working, int(kind), grad_fill(zero_grad), mask,
    )


def _adadelta(p, g, sq, acc, pieces, gp, gscale, lr, wd, rho, rho_c, eps, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, wd_j = lr[seg], wd[seg]
        step = state_step(sq, seg, hi - lo)
        tq, ta = state_scratch(sq), state_scratch(acc)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            pb, gb = p[a:b], grad_slice(g, gp, j, lo, a, b)
            qb, ab = state_open(sq, seg, a, b, tq), state_open(acc, seg, a, b, ta)
            kb = piece_mask(mask, a, b)
            for i in range(pb.size):
                pi = pb[i]
                d = gscale * gb[i] + wd_j * pi
                qi = store_state(qb, i, rho * load_state(qb, i) + rho_c * d * d)
                ai = load_state(ab, i)
                delta = np.sqrt(ai + eps) / np.sqrt(qi + eps) * d
                store_state(ab, i, rho * ai + rho_c * delta * delta)
                store_masked(pb, i, pi - lr_j * delta, kb)
                clear_grad(gb, i, zero_grad)
            state_close(sq, seg, a, b, qb)
            state_close(acc, seg, a, b, ab)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_ADADELTA = twins(_adadelta, fastmath=EXACT_DIVISION)  # the ratio of two roots, exactly (see _jit)


def adadelta_step(p, g, square_avg, acc_delta, pieces, *, gscale, lr, l2, rho, eps, working=None, kind=LP_NONE,
                  zero_grad=False, grad_ptrs=None, mask=None):
    """Fused Adadelta update; see :func:`arraytrain.kernels.reference.adadelta_step`."""
    t = p.dtype.type
    pick(_ADADELTA, p.size, square_avg, acc_delta)(
        p, g, square_avg, acc_delta, pieces, grad_ptrs, t(gscale), seg_array(lr, p.dtype), seg_array(l2, p.dtype), t(rho),
        t(1.0 - rho), t(eps), working, int(kind), grad_fill(zero_grad), mask,
    )


# Muon ---------------------------------------------------------------------------------------
#
# Per matrix of the ``mats`` table (one Muon parameter): the momentum kernel writes the update
# to orthogonalise into the work buffer (``u[i - offset]``) and sums its squares in float64 per
# piece (added in piece order: thread-count independent); the Newton-Schulz iteration runs its
# GEMMs on NumPy's BLAS in the storage dtype, in the rest of the work buffer; the apply kernel
# writes the parameters (mask, working copy). Per-matrix calls keep the scratch at the largest
# matrix instead of a copy of every Muon parameter. The element-wise kernels are compiled in
# their serial form only: between two GEMMs BLAS's threads own the cores (OpenBLAS's spin
# after each call, see arraytrain.threads), and the O(rows*cols) passes are small next to the
# O(rows^2*cols) GEMMs.


def _muon_momentum(g, buf, u, pieces, off, gscale, mc, nesterov, zero_grad, part):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        s = 0.0
        n = state_step(buf, seg, hi - lo)
        tb = state_scratch(buf)
        for e0 in range(lo, hi, n):
            e1 = min(e0 + n, hi)
            gb, bb, ub = g[e0:e1], state_open(buf, seg, e0, e1, tb), u[e0 - off : e1 - off]
            for i in range(gb.size):
                d = gscale * gb[i]
                b = load_state(bb, i)
                b = store_state(bb, i, b + mc * (d - b))
                x = b + mc * (d - b) if nesterov else b
                ub[i] = x
                x64 = np.float64(ub[i])
                s += x64 * x64
                clear_grad(gb, i, zero_grad)
            state_close(buf, seg, e0, e1, bb)
        part[j] = s
    total = 0.0
    for j in range(pieces.shape[0]):
        total += part[j]
    return total


_MUON_MOMENTUM = njit(**JIT)(_muon_momentum)  # serial: see above


def _muon_apply(p, o, pieces, off, alr, decay, w, wkind, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        a, dec = alr[seg], decay[seg]
        pb, ob = p[lo:hi], o[lo - off : hi - off]
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            store_masked(pb, i, pb[i] * dec - a * ob[i], kb)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_MUON_APPLY = njit(**JIT)(_muon_apply)  # serial: see above


def muon_step(p, g, buf, work, mats, pieces, *, gscale, momentum, nesterov, adjusted_lr, decay, eps_norm,
              ns_coefficients, ns_steps, working=None, kind=LP_NONE, zero_grad=False, mask=None):
    """Muon, one matrix at a time (see above); see :func:`arraytrain.kernels.reference.muon_step`."""
    t = p.dtype.type
    gs, mc = t(gscale), t(1.0 - momentum)
    alr, dec = seg_array(adjusted_lr, p.dtype), seg_array(decay, p.dtype)
    part = np.empty(pieces.shape[0], np.float64)
    for _, off, rows, cols, lo, hi in np.asarray(mats).tolist():
        if lo == hi:
            continue
        n = rows * cols
        pc, u = pieces[lo:hi], work[:n]
        sumsq = _MUON_MOMENTUM(g, buf, u, pc, off, gs, mc, bool(nesterov), grad_fill(zero_grad), part[lo:hi])
        u *= t(1.0 / max(float(np.sqrt(sumsq)), eps_norm))  # X / max(||X||, eps), torch's normalisation
        o = newton_schulz.iterate(u.reshape(rows, cols), work[n:], ns_coefficients, ns_steps)
        _MUON_APPLY(p, o.reshape(-1), pc, off, alr, dec, working, int(kind), mask)


# Schedule-free AdamW ------------------------------------------------------------------------


@njit(**JIT)
def _sf_weights(max_lr, weight_sum, weight_lr, power, ck):
    # optax's schedule_free: max_lr = max(max_lr, lr) (NaN-propagating), w = max_lr**power,
    # weight_sum += w, ck = w / weight_sum with 0/0 -> 0 and NaN kept
    for s in range(max_lr.size):
        m, x = max_lr[s], weight_lr[s]
        if np.isnan(m) or np.isnan(x):
            m = np.nan
        elif x > m:
            m = x
        max_lr[s] = m
        w = m**power
        total = weight_sum[s] + w
        weight_sum[s] = total
        r = w / total
        ck[s] = 0.0 if (np.isnan(r) and not (np.isnan(w) or np.isnan(total))) else r


def _sf_adamw(p, g, z, v, pieces, gscale, lr, wd, ck, b1, b1c, beta2, beta2c, eps, inv_bc2_sqrt, w, wkind,
              zero_grad, mask):
    one = p.dtype.type(1.0)
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, wd_j, c = lr[seg], wd[seg], ck[seg]
        # y' = b1 x' + (1 - b1) z' with x' = (1 - c) x + c z' and x = (y - (1 - b1) z) / b1:
        # y' = (1 - c)(y - (1 - b1) z) + (b1 c + 1 - b1) z', no division by b1
        keep, take = one - c, b1 * c + b1c
        step = state_step(v, seg, hi - lo)
        tv = state_scratch(v)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            pb, gb, zb, vb = p[a:b], g[a:b], z[a:b], state_open(v, seg, a, b, tv)
            kb = piece_mask(mask, a, b)
            for i in range(pb.size):
                y = pb[i]
                d = gscale * gb[i]
                vi = store_state(vb, i, beta2 * load_state(vb, i) + beta2c * d * d)
                u = d / (np.sqrt(vi) * inv_bc2_sqrt + eps) + wd_j * y
                zo = zb[i]
                zn = zo - lr_j * u
                store_masked(zb, i, zn, kb)
                store_masked(pb, i, keep * (y - b1c * zo) + take * zn, kb)
                clear_grad(gb, i, zero_grad)
            state_close(v, seg, a, b, vb)
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)  # the whole piece (8-bit state walks it in blocks)


_SF_ADAMW = twins(_sf_adamw)


def schedule_free_adamw_step(p, g, z, v, max_lr, weight_sum, pieces, *, gscale, lr, weight_lr, weight_lr_power,
                             weight_decay, beta1, beta2, eps, inv_bc2_sqrt, working=None, kind=LP_NONE, zero_grad=False,
                             mask=None):
    """Fused Schedule-Free AdamW step; see :func:`arraytrain.kernels.reference.schedule_free_adamw_step`."""
    ck = np.empty(max_lr.size, np.float64)
    _sf_weights(max_lr, weight_sum, seg_array(weight_lr, np.float64), float(weight_lr_power), ck)
    t = p.dtype.type
    pick(_SF_ADAMW, p.size, v)(
        p, g, z, v, pieces, t(gscale), seg_array(lr, p.dtype), seg_array(weight_decay, p.dtype), seg_array(ck, p.dtype),
        t(beta1), t(1.0 - beta1), t(beta2), t(1.0 - beta2), t(eps), t(inv_bc2_sqrt), working, int(kind),
        grad_fill(zero_grad), mask,
    )

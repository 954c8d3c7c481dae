"""Reference kernels: slow, obviously correct NumPy, the oracle of the tests.

Same names and signatures as :mod:`arraytrain.kernels.cpu`. Every function
works on 1-D arrays and trusts its inputs (the public layer validates). The
math is done in float64 and rounded once to the storage dtype, so the fast
kernels are compared against the most accurate value of the same formula.
"""

from __future__ import annotations

import numpy as np


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def accumulate(acc, g, w, overwrite):
    """``acc = w * g`` if ``overwrite`` else ``acc += w * g``."""
    new = w * _f64(g) if overwrite else _f64(acc) + w * _f64(g)
    acc[...] = new


def scale(x, s):
    """``x *= s``."""
    x[...] = _f64(x) * s


def all_finite(x):
    """True when no element is NaN or +-Inf."""
    return bool(np.isfinite(x).all())


def sumsq(x, pieces, nseg):
    """``(total, per_segment)`` sums of squares over the pieces, in float64.

    Padding outside the pieces is not read. A NaN/Inf element makes the
    total non-finite; so may an overflow of huge float64 values.
    """
    per_seg = np.zeros(nseg, dtype=np.float64)
    for start, stop, seg in pieces:
        part = _f64(x[start:stop])
        per_seg[seg] += float(np.dot(part, part))
    return float(per_seg.sum()), per_seg


def max_abs(x, pieces):
    """Largest |element| over the pieces, for finite input (rescales a norm that overflowed)."""
    best = 0.0
    for start, stop, _ in pieces:
        if stop > start:
            best = max(best, float(np.max(np.abs(_f64(x[start:stop])))))
    return best


def sumsq_scaled(x, pieces, nseg, inv):
    """Like :func:`sumsq` but of ``x * inv``: an overflow-safe second pass."""
    per_seg = np.zeros(nseg, dtype=np.float64)
    for start, stop, seg in pieces:
        part = _f64(x[start:stop]) * inv
        per_seg[seg] += float(np.dot(part, part))
    return float(per_seg.sum()), per_seg


def sgd_step(p, g, buf, gscale, lr, weight_decay, momentum, dampening, nesterov, first, zero_grad):
    """SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD).

    ``d = gscale*g + weight_decay*p``; with momentum ``b = d`` on the first step,
    else ``b = momentum*b + (1 - dampening)*d``; ``d = d + momentum*b`` (Nesterov)
    or ``d = b``; then ``p -= lr*d``. ``buf`` is ignored when momentum is 0.
    """
    pp = _f64(p)
    d = gscale * _f64(g) + weight_decay * pp
    if momentum != 0.0:
        b = d if first else momentum * _f64(buf) + (1.0 - dampening) * d
        d = d + momentum * b if nesterov else b
        buf[...] = b
    p[...] = pp - lr * d
    if zero_grad:
        g[...] = 0


def adam_step(p, g, m, v, vmax, gscale, step_size, beta1, beta2, eps, bc2_sqrt, l2, decay, amsgrad, zero_grad):
    """Adam / AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019), torch's form.

    ``d = gscale*g + l2*p``; ``p *= decay`` (decoupled: ``1 - lr*wd``);
    ``m += (1 - beta1)*(d - m)``; ``v = beta2*v + (1 - beta2)*d^2``;
    AMSGrad: ``vmax = max(vmax, v)`` replaces ``v`` below;
    ``p -= step_size * m / (sqrt(v)/bc2_sqrt + eps)`` with
    ``step_size = lr/(1 - beta1^t)`` and ``bc2_sqrt = sqrt(1 - beta2^t)``.
    """
    pp = _f64(p)
    d = gscale * _f64(g) + l2 * pp
    mm = _f64(m) + (1.0 - beta1) * (d - _f64(m))
    vv = beta2 * _f64(v) + (1.0 - beta2) * d * d
    m[...] = mm
    v[...] = vv
    vv = _f64(v)  # continue from the stored (rounded) values, as the fast kernels do
    if amsgrad:
        vmax[...] = np.maximum(_f64(vmax), vv)
        vv = _f64(vmax)
    denom = np.sqrt(vv) / bc2_sqrt + eps
    p[...] = pp * decay - step_size * _f64(m) / denom
    if zero_grad:
        g[...] = 0

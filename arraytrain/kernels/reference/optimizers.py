"""Reference optimizer updates: each written from its paper / torch's or optax's form, in float64."""

from __future__ import annotations

import numpy as np

from ..interface import LP_NONE
from ._common import apply_mask, f64, gathered, q8_commit, q8_expand, segments, store, store_at, with_q8
from .reductions import cast_working

# Arrays first, then every scalar and per-parameter value keyword-only: the argument
# conventions of arraytrain.kernels.interface.


@with_q8
def sgd_step(p, g, buf, pieces, *, gscale, lr, l2, momentum, dampening, nesterov, first, working=None, kind=LP_NONE,
             zero_grad=False, grad_ptrs=None, mask=None):
    """SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD).

    Per element of segment ``s``: ``d = gscale*g + l2[s]*p``; with momentum
    ``b = d`` on the first step, else ``b = momentum*b + (1 - dampening)*d``;
    ``d = d + momentum*b`` (Nesterov) or ``d = b``; then ``p -= lr[s]*d``. ``buf`` is
    ignored when momentum is 0. Only the elements covered by ``pieces`` are touched.
    ``working`` (uint16, or None): low-precision working copy of the new ``p`` (``kind``).
    ``mask`` (uint8, or None; every kernel): the new ``p`` is 0 where ``mask == 0``
    (:func:`apply_mask`), before the working copy is written.
    """
    g = gathered(g, pieces, grad_ptrs)
    i, s = segments(pieces, p.size)
    lr, wd = np.asarray(lr, np.float64)[s], np.asarray(l2, np.float64)[s]
    pp = f64(p[i])
    d = gscale * f64(g[i]) + wd * pp
    if momentum != 0.0:
        b = store_at(buf, i, d if first else momentum * f64(buf[i]) + (1.0 - dampening) * d)
        d = d + momentum * b if nesterov else b
    p[i] = pp - lr * d
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


def _finish(p, g, w, wkind, pieces, i, zero_grad, mask=None):
    """Mask, working copy and gradient zeroing after an update (see :func:`apply_mask`)."""
    if mask is not None:
        apply_mask(p, mask, i)
    if w is not None:
        cast_working(w, p, pieces, kind=wkind)
    if zero_grad:
        g[i] = 0


def _adam_moments(p, g, m, v, pieces, gscale, l2, beta1, beta2):
    """Adam's moments: ``d = gscale*g + l2[s]*p``, then ``m`` and ``v`` updated and stored.

    Returns the covered positions and their segments, ``p`` and ``d`` there, and the new
    ``m`` and ``v`` as stored (float64 values of what the storage holds).
    """
    i, s = segments(pieces, p.size)
    pp = f64(p[i])
    d = gscale * f64(g[i]) + np.asarray(l2, np.float64)[s] * pp
    mm = f64(m[i])
    mm = store_at(m, i, mm + (1.0 - beta1) * (d - mm))
    vv = store_at(v, i, beta2 * f64(v[i]) + (1.0 - beta2) * d * d)
    return i, s, pp, d, mm, vv


@with_q8
def adam_step(p, g, m, v, vmax, pieces, *, gscale, step_size, beta1, beta2, eps, inv_bc2_sqrt, l2, decay, amsgrad,
              working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Adam / AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019), torch's form.

    Per element of segment ``s``: ``d = gscale*g + l2[s]*p``; ``p *= decay[s]``
    (decoupled: ``1 - lr*wd``); ``m += (1 - beta1)*(d - m)``; ``v = beta2*v + (1 - beta2)*d^2``;
    AMSGrad: ``vmax = max(vmax, v)`` replaces ``v`` below;
    ``p -= step_size[s] * m / (sqrt(v)*inv_bc2_sqrt + eps)`` with ``step_size = lr/(1 - beta1^t)``
    and ``inv_bc2_sqrt = 1/sqrt(1 - beta2^t)``. ``m``, ``v``, ``vmax`` may be uint16 arrays of
    bfloat16 bits (low-precision state): the update then continues from the rounded values.
    """
    g = gathered(g, pieces, grad_ptrs)
    i, s, pp, d, mm, vv = _adam_moments(p, g, m, v, pieces, gscale, l2, beta1, beta2)
    if amsgrad:
        vv = store_at(vmax, i, np.maximum(f64(vmax[i]), vv))
    denom = np.sqrt(vv) * inv_bc2_sqrt + eps
    p[i] = pp * np.asarray(decay, np.float64)[s] - np.asarray(step_size, np.float64)[s] * mm / denom
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


# -- adagrad, rmsprop, lion, lamb ---------------------------------------------------------


@with_q8
def adagrad_step(p, g, sum_sq, pieces, *, gscale, lr, l2, eps, working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Adagrad (Duchi, Hazan & Singer 2011), torch.optim.Adagrad's form.

    Per element of segment ``s``: ``d = gscale*g + l2[s]*p``;
    ``sum_sq += d^2``; ``p -= lr[s] * d / (sqrt(sum_sq) + eps)`` with ``lr`` the
    decayed rate ``lr / (1 + (t - 1)*lr_decay)`` (torch's ``clr``) formed by the optimizer.
    """
    g = gathered(g, pieces, grad_ptrs)
    i, s = segments(pieces, p.size)
    pp = f64(p[i])
    d = gscale * f64(g[i]) + np.asarray(l2, np.float64)[s] * pp
    ss = store_at(sum_sq, i, f64(sum_sq[i]) + d * d)
    p[i] = pp - np.asarray(lr, np.float64)[s] * (d / (np.sqrt(ss) + eps))
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


@with_q8
def rmsprop_step(p, g, square_avg, grad_avg, momentum_buffer, pieces, *, gscale, lr, l2, alpha, eps, momentum,
                 centered, working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """RMSprop (Hinton, Coursera lecture 6e, 2012; centered: Graves 2013), torch.optim.RMSprop's form.

    Per element of segment ``s``: ``d = gscale*g + l2[s]*p``;
    ``square_avg = alpha*square_avg + (1 - alpha)*d^2``; centered:
    ``grad_avg += (1 - alpha)*(d - grad_avg)`` and ``q = square_avg - grad_avg^2``, else
    ``q = square_avg``; ``u = d / (sqrt(q) + eps)``; with ``momentum > 0``:
    ``buf = momentum*buf + u``, ``u = buf``; then ``p -= lr[s]*u``. ``grad_avg``
    (not centered) and ``momentum_buffer`` (momentum 0) are ignored.
    """
    g = gathered(g, pieces, grad_ptrs)
    i, s = segments(pieces, p.size)
    pp = f64(p[i])
    d = gscale * f64(g[i]) + np.asarray(l2, np.float64)[s] * pp
    q = store_at(square_avg, i, alpha * f64(square_avg[i]) + (1.0 - alpha) * d * d)
    if centered:
        a = f64(grad_avg[i])
        a = store_at(grad_avg, i, a + (1.0 - alpha) * (d - a))
        q = q - a * a
    u = d / (np.sqrt(q) + eps)
    if momentum > 0:
        u = store_at(momentum_buffer, i, momentum * f64(momentum_buffer[i]) + u)
    p[i] = pp - np.asarray(lr, np.float64)[s] * u
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


@with_q8
def lion_step(p, g, m, pieces, *, gscale, lr, decay, beta1, beta2, working=None, kind=LP_NONE, zero_grad=False,
              grad_ptrs=None, mask=None):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), optax.lion's form.

    Per element of segment ``s``: ``d = gscale*g``; ``c = sign(beta1*m + (1 - beta1)*d)``;
    ``p = p*decay[s] - lr[s]*c`` with ``decay = 1 - lr*weight_decay`` (decoupled, scaled by
    the lr: optax's ``p - lr*(c + wd*p)``); ``m = beta2*m + (1 - beta2)*d``. ``sign`` keeps NaN.
    """
    g = gathered(g, pieces, grad_ptrs)
    i, s = segments(pieces, p.size)
    pp, mm, d = f64(p[i]), f64(m[i]), gscale * f64(g[i])
    c = np.sign(beta1 * mm + (1.0 - beta1) * d)
    store_at(m, i, beta2 * mm + (1.0 - beta2) * d)
    p[i] = pp * np.asarray(decay, np.float64)[s] - np.asarray(lr, np.float64)[s] * c
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


def lamb_step(p, g, m, v, pieces, *, gscale, lr, weight_decay, beta1, beta2, eps, eps_root, inv_bc1, inv_bc2,
              working=None, kind=LP_NONE, zero_grad=False, reduce_sums=None, grad_ptrs=None, mask=None):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"), optax.lamb's form.

    Per element of segment ``s``: ``d = gscale*g``; ``m += (1 - beta1)*(d - m)``;
    ``v = beta2*v + (1 - beta2)*d^2``;
    ``u = (m*inv_bc1) / (sqrt(v*inv_bc2 + eps_root) + eps) + weight_decay[s]*p`` with
    ``inv_bc1 = 1/(1 - beta1^t)``, ``inv_bc2 = 1/(1 - beta2^t)`` (the decay is added to the
    update, before the trust ratio, as optax does); per parameter the trust ratio
    ``r[s] = ||p_s|| / ||u_s||``, or 1 when either norm is 0; then
    ``p -= lr[s]*r[s]*u``. Returns ``r`` (float64, one per parameter).

    ``reduce_sums``: None, or a callable given the float64 array ``[||p_s||^2..., ||u_s||^2...]``
    (``2 * nseg`` sums over these pieces) that completes it in place before the ratios are
    formed (with sharded state: the sums over every rank's partition).
    """
    g = gathered(g, pieces, grad_ptrs)
    nseg = len(np.asarray(lr))
    q8 = not isinstance(m, np.ndarray)  # 8-bit moments (arraytrain.kernels.interface.Q8)
    m8, v8 = m, v
    if q8:
        m, v = q8_expand(m8), q8_expand(v8)
    i, s = segments(pieces, p.size)
    pp, d = f64(p[i]), gscale * f64(g[i])
    mm = f64(m[i])
    mm = store_at(m, i, mm + (1.0 - beta1) * (d - mm))
    vv = store_at(v, i, beta2 * f64(v[i]) + (1.0 - beta2) * d * d)
    wdecay = np.asarray(weight_decay, np.float64)[s]
    u = (mm * inv_bc1) / (np.sqrt(vv * inv_bc2 + eps_root) + eps) + wdecay * pp
    if q8:
        # the norms see the step's float values; the update reads the moments back decoded
        q8_commit(m8, m, pieces)
        q8_commit(v8, v, pieces)
        mq, vq = f64(q8_expand(m8)[i]), f64(q8_expand(v8)[i])
        u_apply = (mq * inv_bc1) / (np.sqrt(vq * inv_bc2 + eps_root) + eps) + wdecay * pp
    else:
        u_apply = u
    sums = np.zeros(2 * nseg)
    if len(s):
        sums[:nseg] = np.bincount(s, weights=pp * pp, minlength=nseg)
        sums[nseg:] = np.bincount(s, weights=u * u, minlength=nseg)
    if reduce_sums is not None:
        reduce_sums(sums)
    pn, un = np.sqrt(sums[:nseg]), np.sqrt(sums[nseg:])
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where((pn == 0.0) | (un == 0.0), 1.0, pn / un)
    p[i] = pp - (np.asarray(lr, np.float64) * ratio)[s] * u_apply
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)
    return ratio


# -- adafactor, sophia, sam -------------------------------------------------------------


def _nanmax(x, floor):
    """``max(x, floor)`` that keeps NaN (torch's ``clamp(min=floor)``)."""
    return np.where(np.isnan(x), x, np.maximum(x, floor))


def adafactor_step(p, g, row, col, var, pieces, segs, rows, cols, batches, *, gscale, rel_step, decay,
                   one_minus_beta2, eps1, eps2, d, working=None, kind=LP_NONE, zero_grad=False, mask=None):
    """Adafactor (Shazeer & Stern 2018) in torch.optim.Adafactor's form, one parameter at a time.

    For segment ``s`` (``segs[s] = [p_off, numel, factored, B, R, C, row_off, col_off,
    var_off]``) with ``G = gscale * g`` and ``k = one_minus_beta2``: a factored parameter
    (B matrices R x C) updates ``row += k * (mean_c G^2 - row)``, ``col += k * (mean_r G^2 - col)``
    and estimates ``V = row (x) col / max(mean_r row, eps1)``; otherwise
    ``V = var += k * (G^2 - var)``. Then ``U = G / sqrt(max(V, eps1^2))``,
    ``p = p * decay[s] - step * U`` with ``step = max(eps2, RMS(p)) * rel_step[s] / max(1, RMS(U) / d)``
    (``max(c, NaN) = c``, as torch's Python ``max``). ``one_minus_beta2 = t**beta2_decay``,
    ``rel_step = min(lr, 1/sqrt(t))`` (the paper's relative step size, torch's ``rho_t``),
    ``decay = 1 - lr * weight_decay``. ``rows``, ``cols``,
    ``batches`` (the fast kernel's work tables) are not needed here. Zero-size parameters
    are skipped: their statistics stay as they are.
    """
    rel_step, decay, k = np.asarray(rel_step, np.float64), np.asarray(decay, np.float64), one_minus_beta2
    for s, (off, n, factored, nb, nr, nc, ro, co, vo) in enumerate(np.asarray(segs).tolist()):
        if n == 0:
            continue
        pp = f64(p[off : off + n])
        gg = gscale * f64(g[off : off + n])
        if factored:
            G2 = (gg * gg).reshape(nb, nr, nc)
            r_old = f64(row[ro : ro + nb * nr]).reshape(nb, nr)
            c_old = f64(col[co : co + nb * nc]).reshape(nb, nc)
            r_new = store(row[ro : ro + nb * nr], (r_old + k * (G2.mean(axis=2) - r_old)).ravel()).reshape(nb, nr)
            c_new = store(col[co : co + nb * nc], (c_old + k * (G2.mean(axis=1) - c_old)).ravel()).reshape(nb, nc)
            rmean = _nanmax(r_new.mean(axis=1), eps1)
            V = ((r_new / rmean[:, None])[:, :, None] * c_new[:, None, :]).ravel()
        else:
            v_old = f64(var[vo : vo + n])
            V = store(var[vo : vo + n], v_old + k * (gg * gg - v_old))
        U = gg / np.sqrt(_nanmax(V, eps1 * eps1))
        step = np.fmax(eps2, np.sqrt(np.dot(pp, pp) / n)) * rel_step[s] / np.fmax(1.0, np.sqrt(np.dot(U, U) / n) / d)
        p[off : off + n] = pp * decay[s] - step * U
    i, _ = segments(pieces, p.size)
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


def sophia_step(p, g, m, h, pieces, *, gscale, lr, decay, beta1, rho_bs, eps, working=None, kind=LP_NONE,
                zero_grad=False, mask=None):
    """SophiaG (Liu et al. 2023, the authors' reference implementation's update).

    Per element of segment ``s``: ``m = beta1*m + (1 - beta1)*gscale*g``;
    ``p = p*decay[s] - lr[s] * sign(m) * min(|m| / max(rho_bs*h, eps), 1)`` with
    ``decay = 1 - lr*weight_decay`` (decoupled) and ``rho_bs = rho * bs`` (the optimizer's
    ``rho`` times the batch-size factor). ``h`` is read only (fed by the Hessian EMA). NaN propagates.
    """
    i, s = segments(pieces, p.size)
    mm = beta1 * f64(m[i]) + (1.0 - beta1) * gscale * f64(g[i])
    m[i] = mm
    den = _nanmax(rho_bs * f64(h[i]), eps)
    ratio = np.abs(mm) / den
    ratio = np.where(ratio > 1.0, 1.0, ratio)
    p[i] = f64(p[i]) * np.asarray(decay, np.float64)[s] - np.asarray(lr, np.float64)[s] * np.sign(mm) * ratio
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


def sam_perturb(p, g, backup, pieces, *, scale, adaptive, zero_grad=False, mask=None):
    """SAM's ascent (Foret et al. 2021; ASAM, Kwon et al. 2021): ``backup = p``, then
    ``p += scale * g`` or, adaptive, ``p += scale * p^2 * g`` (``scale = rho * gscale / (norm + 1e-12)``);
    pruned weights (``mask == 0``) are 0 at the ascent point."""
    i, _ = segments(pieces, p.size)
    pp = f64(p[i])
    backup[i] = p[i]
    e = scale * f64(g[i])
    p[i] = pp + (e * pp * pp if adaptive else e)
    if mask is not None:
        apply_mask(p, mask, i)
    if zero_grad:
        g[i] = 0


# -- nadam, radam, adamax, adadelta ---------------------------------------------------------


@with_q8
def nadam_step(p, g, m, v, pieces, *, gscale, grad_step, moment_step, beta1, beta2, eps, inv_bc2_sqrt, l2, decay,
               working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """NAdam (Dozat 2016), torch.optim.NAdam's form (momentum schedule, NAdamW's decoupled decay).

    Per element of segment ``s``: ``d = gscale*g + l2[s]*p``; ``p *= decay[s]``;
    ``m += (1 - beta1)*(d - m)``; ``v = beta2*v + (1 - beta2)*d^2``;
    ``p -= (grad_step[s]*d + moment_step[s]*m) / (sqrt(v)*inv_bc2_sqrt + eps)`` with
    ``grad_step = lr*(1 - mu_t)/(1 - mu_1...mu_t)``, ``moment_step = lr*mu_{t+1}/(1 - mu_1...mu_{t+1})``
    and ``inv_bc2_sqrt = 1/sqrt(1 - beta2^t)``, all formed by the optimizer.
    """
    g = gathered(g, pieces, grad_ptrs)
    i, s, pp, d, mm, vv = _adam_moments(p, g, m, v, pieces, gscale, l2, beta1, beta2)
    step = np.asarray(grad_step, np.float64)[s] * d + np.asarray(moment_step, np.float64)[s] * mm
    p[i] = pp * np.asarray(decay, np.float64)[s] - step / (np.sqrt(vv) * inv_bc2_sqrt + eps)
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


@with_q8
def radam_step(p, g, m, v, pieces, *, gscale, step_size, beta1, beta2, eps, rect, rectified, l2, decay, working=None,
               kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """RAdam (Liu et al. 2020), torch.optim.RAdam's form.

    Per element of segment ``s``: ``d = gscale*g + l2[s]*p``; ``p *= decay[s]``;
    ``m += (1 - beta1)*(d - m)``; ``v = beta2*v + (1 - beta2)*d^2``; then
    ``p -= step_size[s] * m * rect / (sqrt(v) + eps)`` when ``rectified`` (rho_t > 5; ``rect``
    is r_t*sqrt(1 - beta2^t)), else ``p -= step_size[s] * m``; ``step_size = lr/(1 - beta1^t)``.
    """
    g = gathered(g, pieces, grad_ptrs)
    i, s, pp, d, mm, vv = _adam_moments(p, g, m, v, pieces, gscale, l2, beta1, beta2)
    u = mm * rect / (np.sqrt(vv) + eps) if rectified else mm
    p[i] = pp * np.asarray(decay, np.float64)[s] - np.asarray(step_size, np.float64)[s] * u
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


@with_q8
def adamax_step(p, g, m, u, pieces, *, gscale, step_size, beta1, beta2, eps, l2, working=None, kind=LP_NONE,
                zero_grad=False, grad_ptrs=None, mask=None):
    """Adamax (Kingma & Ba 2015, section 7.1), torch.optim.Adamax's form.

    Per element of segment ``s``: ``d = gscale*g + l2[s]*p``; ``m += (1 - beta1)*(d - m)``;
    ``u = max(beta2*u, |d| + eps)`` (NaN propagates, as torch.maximum);
    ``p -= step_size[s] * m / u`` with ``step_size = lr/(1 - beta1^t)``.
    """
    g = gathered(g, pieces, grad_ptrs)
    i, s = segments(pieces, p.size)
    pp = f64(p[i])
    d = gscale * f64(g[i]) + np.asarray(l2, np.float64)[s] * pp
    mm = f64(m[i])
    mm = store_at(m, i, mm + (1.0 - beta1) * (d - mm))
    uu = store_at(u, i, np.maximum(beta2 * f64(u[i]), np.abs(d) + eps))
    p[i] = pp - np.asarray(step_size, np.float64)[s] * (mm / uu)
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


@with_q8
def adadelta_step(p, g, square_avg, acc_delta, pieces, *, gscale, lr, l2, rho, eps, working=None, kind=LP_NONE,
                  zero_grad=False, grad_ptrs=None, mask=None):
    """Adadelta (Zeiler 2012), torch.optim.Adadelta's form.

    Per element of segment ``s``: ``d = gscale*g + l2[s]*p``;
    ``square_avg = rho*square_avg + (1 - rho)*d^2``;
    ``delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * d`` (the old ``acc_delta``);
    ``acc_delta = rho*acc_delta + (1 - rho)*delta^2``; ``p -= lr[s]*delta``.
    """
    g = gathered(g, pieces, grad_ptrs)
    i, s = segments(pieces, p.size)
    pp = f64(p[i])
    d = gscale * f64(g[i]) + np.asarray(l2, np.float64)[s] * pp
    q = store_at(square_avg, i, rho * f64(square_avg[i]) + (1.0 - rho) * d * d)
    a = f64(acc_delta[i])
    delta = np.sqrt(a + eps) / np.sqrt(q + eps) * d
    store_at(acc_delta, i, rho * a + (1.0 - rho) * delta * delta)
    p[i] = pp - np.asarray(lr, np.float64)[s] * delta
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)


# -- Muon, schedule-free AdamW -------------------------------------------------------------


@with_q8
def muon_step(p, g, buf, work, mats, pieces, *, gscale, momentum, nesterov, adjusted_lr, decay, eps_norm,
              ns_coefficients, ns_steps, working=None, kind=LP_NONE, zero_grad=False, mask=None):
    """Muon (Jordan et al. 2024), torch.optim.Muon's form, one matrix at a time in float64.

    ``mats`` rows ``[seg, offset, rows, cols, piece_lo, piece_hi]``: a parameter of segment
    ``seg`` seen as a ``rows x cols`` matrix (row-major from ``offset``), its elements the
    pieces ``pieces[piece_lo:piece_hi]``. Per element, ``d = gscale*g``:
    ``buf = buf + (1 - momentum)*(d - buf)`` (torch's ``buf.lerp_(grad, 1 - momentum)``);
    the update ``U = buf + (1 - momentum)*(d - buf)`` with Nesterov (torch's
    ``grad.lerp(buf, momentum)`` written from ``buf``'s side, as torch's lerp does for a
    weight >= 0.5), else ``U = buf``. Per matrix, with ``X = U^T`` for a tall one (more rows
    than columns), else ``U``: ``X /= max(||X||_F, eps_norm)``, then ``ns_steps`` times
    ``A = X X^T``, ``X = a X + (b A + c A^2) X`` with ``(a, b, c) = ns_coefficients``; ``O``
    is ``X`` (transposed back). Then ``p = p*decay[s] - adjusted_lr[s]*O`` with
    ``decay = 1 - lr*weight_decay`` (the unadjusted lr, as torch) and ``adjusted_lr`` the lr
    times the matrix's shape factor. ``work`` (the fast kernels' scratch) is not needed here.
    """
    a, b, c = ns_coefficients
    alr, dec = np.asarray(adjusted_lr, np.float64), np.asarray(decay, np.float64)
    for seg, _, rows, cols, lo, hi in np.asarray(mats).tolist():
        if lo == hi:
            continue
        i, _ = segments(pieces[lo:hi], p.size)
        d = gscale * f64(g[i])
        bb = f64(buf[i])
        bb = store_at(buf, i, bb + (1.0 - momentum) * (d - bb))
        X = (bb + (1.0 - momentum) * (d - bb) if nesterov else bb).reshape(rows, cols)
        tall = rows > cols
        if tall:
            X = X.T
        X = X / max(float(np.linalg.norm(X)), eps_norm)
        for _ in range(ns_steps):
            A = X @ X.T
            X = a * X + (b * A + c * (A @ A)) @ X
        p[i] = f64(p[i]) * dec[seg] - alr[seg] * (X.T if tall else X).reshape(-1)
        if zero_grad:
            g[i] = 0
    i, _ = segments(pieces, p.size)
    _finish(p, g, working, kind, pieces, i, False, mask)


def _schedule_free_weights(max_lr, weight_sum, weight_lr, weight_lr_power):
    """Schedule-free's averaging weight per parameter, updating ``max_lr`` and ``weight_sum`` (float64).

    optax's ``schedule_free``: ``max_lr = max(max_lr, weight_lr)``, ``w = max_lr**power``,
    ``weight_sum += w``, ``ck = w / weight_sum`` (0 for 0/0, NaN when ``w`` or the sum is NaN).
    """
    max_lr[...] = np.maximum(max_lr, np.asarray(weight_lr, np.float64))
    weight = max_lr**weight_lr_power
    weight_sum += weight
    with np.errstate(invalid="ignore", divide="ignore"):
        ck = np.where(np.isnan(weight) | np.isnan(weight_sum), np.nan,
                      np.nan_to_num(weight / weight_sum, nan=0.0, posinf=np.inf))
    return ck


@with_q8
def schedule_free_adamw_step(p, g, z, v, max_lr, weight_sum, pieces, *, gscale, lr, weight_lr, weight_lr_power,
                             weight_decay, beta1, beta2, eps, inv_bc2_sqrt, working=None, kind=LP_NONE, zero_grad=False,
                             mask=None):
    """Schedule-Free AdamW (Defazio et al. 2024), optax.contrib.schedule_free_adamw's form.

    ``p`` holds y, where the gradient is taken; ``z`` the base sequence; x is not stored
    (``x = (y - (1 - beta1) z) / beta1``). First the averaging weight per parameter
    (:func:`_schedule_free_weights`: ``max_lr``, ``weight_sum`` updated, ``ck``), then per
    element of segment ``s``, ``d = gscale*g``: ``v = beta2*v + (1 - beta2)*d^2``;
    ``u = d / (sqrt(v)*inv_bc2_sqrt + eps) + weight_decay[s]*y``; ``z' = z - lr[s]*u``;
    ``x = (y - (1 - beta1) z) / beta1``, ``x' = (1 - ck) x + ck z'``, ``y' = beta1 x' + (1 - beta1) z'``.
    With a mask, pruned elements of both y and z are written as 0 (so x is 0 there too).
    """
    ck = _schedule_free_weights(max_lr, weight_sum, weight_lr, weight_lr_power)
    i, s = segments(pieces, p.size)
    y, d = f64(p[i]), gscale * f64(g[i])
    vv = store_at(v, i, beta2 * f64(v[i]) + (1.0 - beta2) * d * d)
    u = d / (np.sqrt(vv) * inv_bc2_sqrt + eps) + np.asarray(weight_decay, np.float64)[s] * y
    z_old = f64(z[i])
    z_new = z_old - np.asarray(lr, np.float64)[s] * u
    c = ck[s]
    x_new = (1.0 - c) * ((y - (1.0 - beta1) * z_old) / beta1) + c * z_new
    z[i] = z_new
    if mask is not None:
        apply_mask(z, mask, i)
    p[i] = beta1 * x_new + (1.0 - beta1) * z_new
    _finish(p, g, working, kind, pieces, i, zero_grad, mask)

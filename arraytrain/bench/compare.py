"""``python -m arraytrain.bench compare``: one clipped optimizer step, side by side.

Per optimizer and parameter count, in one run. The default optimizers are
AdamW, Adam and SGD with momentum; ``--optimizers`` adds Adagrad, RMSprop
(momentum 0.9, centered), Adafactor (2-D parameters, so its second moments are
factored), Lion, LAMB, NAdam, RAdam, Adamax, Adadelta, Muon (2-D parameters: its cost is the
Newton-Schulz GEMMs) and Schedule-Free AdamW. Contestants:

* ``arraytrain``: ``engine.step()`` on the zero-copy path: one read-only norm
  pass, then the optimizer's fused kernel (LAMB and Adafactor take more passes,
  see :data:`arraytrain.bench.common.OPTIMIZERS`); ``arraytrain-bf16`` (not in the
  default set): the same with ``state_dtype="bfloat16"``; ``arraytrain-8bit`` (not in the default
  set): with ``state_dtype="8bit"``; ``arraytrain-float8`` (not in the default set): with
  ``state_dtype="float8"``; ``arraytrain-working-bf16`` /
  ``arraytrain-working-f16``: float32 state and a bfloat16 / float16 working copy of the
  weights written by the step (``time / arraytrain`` is then the copy's cost);
* ``torch-foreach`` / ``torch-fused``: ``clip_grad_norm_(foreach=True)`` then
  the optimizer with ``foreach=True`` / ``fused=True`` (torch 2.x's fast paths;
  torch has fused kernels for AdamW, Adam, SGD and Adagrad only, and no Lion or
  LAMB); ``torch-forloop`` (not in the default set): ``foreach=False``, torch's
  per-tensor path;
* ``deepspeed`` (not in the default set): DeepSpeed's fused CPU optimizers (``DeepSpeedCPUAdam``
  for AdamW and Adam, ``DeepSpeedCPULion``, ``DeepSpeedCPUAdagrad``: ZeRO-Offload's step) after
  ``clip_grad_norm_``; ``deepspeed-working-bf16`` / ``-f16``: that step, then the float32 weights
  copied into a bfloat16 / float16 copy (``torch._foreach_copy_``), ZeRO-Offload's form, beside
  ``arraytrain-working-*``, whose step writes the copy. A benchmark-only dependency
  (``DS_BUILD_OPS=0 pip install deepspeed ninja``; each op builds with g++ on first use, minutes;
  skipped with the reason where it cannot). Threads: DeepSpeed's OpenMP loops take
  ``OMP_NUM_THREADS``, arraytrain's ``NUMBA_NUM_THREADS`` (set both to 1 for one thread);
* ``bnb-8bit`` (not in the default set): bitsandbytes' 8-bit optimizers (AdamW8bit, Adam8bit,
  SGD8bit, Adagrad8bit, Lion8bit) on CPU tensors after ``clip_grad_norm_``;
  bitsandbytes is a benchmark-only dependency;
* ``numpy``: the same math written by hand with in-place NumPy per tensor
  (not for Adafactor: factored statistics and two RMS reductions per tensor are
  no simple in-place loop);
* ``optax``: ``clip_by_global_norm`` chained with the optimizer, ``jax.jit``
  with donated buffers, on the CPU (AdamW, Adam, SGD, Lion, LAMB, RAdam, Adamax,
  Adadelta: optax's Adagrad, RMSprop, Adafactor and NAdam are other variants of
  those methods, see :data:`arraytrain.bench.common.NOT_AVAILABLE`);
* the machine's streaming bandwidth: a numba triad ``a = b + s*c`` and a numba
  in-place update ``a += s*b`` over 5e7 float32 elements (12 B/element each),
  timed in every round beside the others.

Each contestant's parameters are split into 100 tensors (``--tensors``; arraytrain: 100
named views of one buffer), with identical hyperparameters. A contestant whose
library is missing is skipped and said so. Contestants are timed in
alternating blocks (A A A B B B ... A A A), each block after one untimed call,
so nobody pays for another's thread pool winding down; warm-up and JIT
compilation are excluded; min and median are reported. "GB/s" counts the bytes
a fused clipped step cannot avoid (a read of the gradients for the norm, then
read p, g and every state slot, write p and every slot; per optimizer in
:data:`arraytrain.bench.common.OPTIMIZERS`), the same for every contestant, so it
is proportional to speed; "% triad" compares that to the triad's best over the
run, "% in-place" to the in-place update's best in the same row's rounds (this
VM's bandwidth drifts within a run, and a burst would otherwise set every row's
reference). A contestant without an implementation of an optimizer is listed
under the table with the reason. ``--json`` writes every figure; ``--baseline OLD.json`` flags
arraytrain slowdowns against an earlier run (see :func:`regressions`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

import numpy as np

from . import common
from .common import (
    ADADELTA,
    ADAGRAD,
    ADAMAX,
    BETAS,
    EPS,
    LAMB,
    LION,
    LR,
    MAX_NORM,
    MOMENTUM,
    MUON,
    NADAM,
    NOT_AVAILABLE,
    OPTIMIZERS,
    RADAM,
    RMSPROP,
    SCHEDULE_FREE,
    WD,
    bnb_optimizer,
    first_step_seconds,
    make_engine,
    make_inplace,
    make_triad,
    shapes,
    step_bytes,
    timeit,
    torch_optimizer,
)

BLOCK = 3  # timed calls per contestant per round
# steps each contestant takes before it is timed (default 1, the warm-up): RAdam's steps before
# rho_t > 5 skip the second moment's square root and division, so its timed steps start after them
WARM_STEPS = {"radam": 6}
DEFAULT_OPTIMIZERS = ("adamw", "adam", "sgd")


class NotAvailable(Exception):
    """A contestant has no implementation of this optimizer (see :data:`arraytrain.bench.common.NOT_AVAILABLE`)."""


def _check_available(name: str, opt: str) -> None:
    why = NOT_AVAILABLE.get((name, opt))
    if why is not None:
        raise NotAvailable(why)


def make_data(n: int, seed: int = 0, opt: str = ""):
    """100 parameters and gradients of ``n`` elements in all, NumPy float32; matrices for
    :data:`~arraytrain.bench.common.MATRIX_OPTIMIZERS`."""
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s, dtype=np.float32) for s in shapes(n, opt)]
    grads = [rng.standard_normal(s, dtype=np.float32) for s in shapes(n, opt)]
    return params, grads


# -- contestants: each returns a zero-argument step function, already warm (one step taken, -----
# -- or WARM_STEPS), whose ``.params()`` lists the parameters after the steps taken so far -----


def _warm(step, opt: str):
    for _ in range(WARM_STEPS.get(opt, 1)):
        step()
    return step


def make_arraytrain(opt: str, n: int, zero_grad: bool = False, state_dtype: str | None = None,
                    working_dtype: str | None = None):
    params, grads = make_data(n, opt=opt)
    engine = make_engine(opt, params, grads, zero_grad, state_dtype, working_dtype)

    def step():
        engine.step()

    step.params = lambda: [engine.params[f"p{i}"] for i in range(len(params))]
    step.engine = engine
    return _warm(step, opt)


def _torch_step(opt: str, n: int, make_optimizer, zero_grad: bool = False, then=None):
    """A torch optimizer's clipped step on CPU parameters sharing the data's memory:
    ``make_optimizer(params)`` builds the optimizer, torch's ``clip_grad_norm_`` clips;
    ``then(params)``, if given, returns what runs after each step."""
    import torch

    params, grads = make_data(n, opt=opt)
    ps = [torch.nn.Parameter(torch.from_numpy(p)) for p in params]
    for p, g in zip(ps, grads):
        p.grad = torch.from_numpy(g)
    optimizer = make_optimizer(ps)
    after = then(ps) if then is not None else None

    def step():
        torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True)
        optimizer.step()
        if after is not None:
            after()
        if zero_grad:
            optimizer.zero_grad(set_to_none=False)

    step.params = lambda: [p.detach().numpy() for p in ps]
    return _warm(step, opt)


def _make_torch(opt: str, n: int, mode: str, zero_grad: bool = False):
    _check_available(f"torch-{mode}", opt)
    flag = {"foreach": False} if mode == "forloop" else {mode: True}
    return _torch_step(opt, n, lambda ps: torch_optimizer(opt, ps, flag), zero_grad)


def make_torch_foreach(opt, n, zero_grad=False):
    return _make_torch(opt, n, "foreach", zero_grad)


def make_torch_fused(opt, n, zero_grad=False):
    return _make_torch(opt, n, "fused", zero_grad)


def make_torch_forloop(opt, n, zero_grad=False):
    return _make_torch(opt, n, "forloop", zero_grad)


def make_numpy(opt: str, n: int, zero_grad: bool = False):
    """The same clipped step written by hand: in-place NumPy per tensor, one scratch buffer."""
    _check_available("numpy", opt)
    if opt in _NUMPY_STEPS:
        return _make_numpy_other(opt, n, zero_grad)
    params, grads = make_data(n)
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params] if opt != "sgd" else None
    scratch = np.empty(max(p.size for p in params), np.float32)
    t = [0]
    b1, b2 = BETAS

    def step():
        norm = np.sqrt(sum(float(np.dot(g, g)) for g in grads))
        coef = min(1.0, MAX_NORM / (norm + 1e-6))
        t[0] += 1
        step_size = LR / (1 - b1 ** t[0])
        bc2_sqrt = np.sqrt(1 - b2 ** t[0])
        for i, (p, g) in enumerate(zip(params, grads)):
            g *= coef
            tmp = scratch[: p.size]
            if opt == "sgd":
                if t[0] == 1:
                    m[i][...] = g
                else:
                    m[i] *= MOMENTUM
                    m[i] += g
                p -= LR * m[i]
            else:
                if opt == "adamw":
                    p *= 1 - LR * WD
                m[i] *= b1
                m[i] += (1 - b1) * g
                np.multiply(g, g, out=tmp)
                tmp *= 1 - b2
                v[i] *= b2
                v[i] += tmp
                np.sqrt(v[i], out=tmp)
                tmp /= bc2_sqrt
                tmp += EPS
                np.divide(m[i], tmp, out=tmp)
                tmp *= -step_size
                p += tmp
            if zero_grad:
                g[...] = 0

    step.params = lambda: params
    return _warm(step, opt)


def _np_adagrad(p, g, slots, t, d, tmp):
    # d = g + wd p;  sum += d^2;  p -= lr d / (sqrt(sum) + eps)   (lr_decay 0)
    (acc,) = slots
    np.multiply(p, ADAGRAD["weight_decay"], out=d)
    d += g
    np.multiply(d, d, out=tmp)
    acc += tmp
    np.sqrt(acc, out=tmp)
    tmp += ADAGRAD["eps"]
    np.divide(d, tmp, out=d)
    d *= -ADAGRAD["lr"]
    p += d


def _np_rmsprop(p, g, slots, t, d, tmp):
    # centered, with momentum, no weight decay:
    # v = a v + (1-a) g^2;  gbar = a gbar + (1-a) g;  b = mu b + g / (sqrt(v - gbar^2) + eps);  p -= lr b
    v, gbar, buf = slots
    a = RMSPROP["alpha"]
    np.multiply(g, g, out=tmp)
    tmp *= 1 - a
    v *= a
    v += tmp
    np.multiply(g, 1 - a, out=tmp)
    gbar *= a
    gbar += tmp
    np.multiply(gbar, gbar, out=tmp)
    np.subtract(v, tmp, out=tmp)
    np.sqrt(tmp, out=tmp)
    tmp += RMSPROP["eps"]
    np.divide(g, tmp, out=tmp)
    buf *= RMSPROP["momentum"]
    buf += tmp
    np.multiply(buf, RMSPROP["lr"], out=tmp)
    p -= tmp


def _np_lion(p, g, slots, t, d, tmp):
    # c = sign(b1 m + (1-b1) g);  m = b2 m + (1-b2) g;  p = p (1 - lr wd) - lr c
    (m,) = slots
    (b1, b2), lr = LION["betas"], LION["lr"]
    np.multiply(m, b1, out=d)
    np.multiply(g, 1 - b1, out=tmp)
    d += tmp
    np.sign(d, out=d)
    m *= b2
    np.multiply(g, 1 - b2, out=tmp)
    m += tmp
    p *= 1 - lr * LION["weight_decay"]
    d *= lr
    p -= d


def _np_moments(g, m, v, b1, b2, tmp):
    """Adam's moments in place: m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2 (unless v is None)."""
    np.multiply(g, 1 - b1, out=tmp)
    m *= b1
    m += tmp
    if v is not None:
        np.multiply(g, g, out=tmp)
        tmp *= 1 - b2
        v *= b2
        v += tmp


def _np_lamb(p, g, slots, t, d, tmp):
    # u = m_hat / (sqrt(v_hat + eps_root) + eps) + wd p;  p -= lr (||p|| / ||u||) u  (ratio 1 if a norm is 0)
    m, v = slots
    b1, b2 = LAMB["betas"]
    _np_moments(g, m, v, b1, b2, tmp)
    np.multiply(v, 1 / (1 - b2**t), out=tmp)
    tmp += LAMB["eps_root"]
    np.sqrt(tmp, out=tmp)
    tmp += LAMB["eps"]
    np.divide(m, tmp, out=d)
    d *= 1 / (1 - b1**t)
    np.multiply(p, LAMB["weight_decay"], out=tmp)
    d += tmp
    pn, un = np.sqrt(float(np.dot(p, p))), np.sqrt(float(np.dot(d, d)))
    ratio = 1.0 if pn == 0 or un == 0 else pn / un
    d *= -LAMB["lr"] * ratio
    p += d


def _nadam_mu(t):
    b1, psi = NADAM["betas"][0], NADAM["momentum_decay"]
    return b1 * (1.0 - 0.5 * 0.96 ** (t * psi))


def _np_nadam(p, g, slots, t, d, tmp):
    # m, v as Adam;  p -= lr ((1-mu_t)/(1-P_t) g + mu_{t+1}/(1-P_t mu_{t+1}) m) / (sqrt(v / bc2) + eps)
    m, v = slots
    (b1, b2), lr = NADAM["betas"], NADAM["lr"]
    prod = float(np.prod([_nadam_mu(k) for k in range(1, t + 1)]))  # torch's mu_product after step t
    mu, mu_next = _nadam_mu(t), _nadam_mu(t + 1)
    _np_moments(g, m, v, b1, b2, tmp)
    np.multiply(v, 1 / (1 - b2**t), out=d)
    np.sqrt(d, out=d)
    d += NADAM["eps"]
    np.multiply(m, lr * mu_next / (1 - prod * mu_next), out=tmp)
    tmp += lr * (1 - mu) / (1 - prod) * g
    tmp /= d
    p -= tmp


def _np_radam(p, g, slots, t, d, tmp):
    # m, v as Adam;  rho_t > 5: p -= lr/bc1 r_t sqrt(bc2) m / (sqrt(v) + eps);  else p -= lr/bc1 m
    m, v = slots
    (b1, b2), lr = RADAM["betas"], RADAM["lr"]
    _np_moments(g, m, v, b1, b2, tmp)
    rho_inf = 2 / (1 - b2) - 1
    rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
    step = lr / (1 - b1**t)
    if rho > 5:
        r = np.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
        np.sqrt(v, out=d)
        d += RADAM["eps"]
        np.divide(m, d, out=tmp)
        tmp *= step * r * np.sqrt(1 - b2**t)
    else:
        np.multiply(m, step, out=tmp)
    p -= tmp


def _np_adamax(p, g, slots, t, d, tmp):
    # m as Adam;  u = max(b2 u, |g| + eps);  p -= lr/bc1 m / u
    m, u = slots
    (b1, b2), lr = ADAMAX["betas"], ADAMAX["lr"]
    _np_moments(g, m, None, b1, b2, tmp)
    np.abs(g, out=tmp)
    tmp += ADAMAX["eps"]
    u *= b2
    np.maximum(u, tmp, out=u)
    np.divide(m, u, out=tmp)
    tmp *= lr / (1 - b1**t)
    p -= tmp


def _np_adadelta(p, g, slots, t, d, tmp):
    # s = rho s + (1-rho) g^2;  delta = sqrt(a + eps) / sqrt(s + eps) g;  a = rho a + (1-rho) delta^2;  p -= lr delta
    sq, acc = slots
    rho, eps = ADADELTA["rho"], ADADELTA["eps"]
    np.multiply(g, g, out=tmp)
    tmp *= 1 - rho
    sq *= rho
    sq += tmp
    np.add(sq, eps, out=tmp)
    np.sqrt(tmp, out=tmp)
    np.add(acc, eps, out=d)
    np.sqrt(d, out=d)
    d /= tmp
    d *= g
    np.multiply(d, d, out=tmp)
    tmp *= 1 - rho
    acc *= rho
    acc += tmp
    d *= ADADELTA["lr"]
    p -= d


def _np_muon(p, g, slots, t, d, tmp):
    # torch.optim.Muon on one matrix: buf += (1-mu)(g - buf); u = buf + (1-mu)(g - buf) (Nesterov);
    # X = u / ||u|| (transposed when tall); 5 x: A = X X^T, X = a X + (b A + c A^2) X; decay, step
    (buf,) = slots
    mu, lr = MUON["momentum"], MUON["lr"]
    a, b, c = 3.4445, -4.7750, 2.0315
    u, t2 = d.reshape(p.shape), tmp.reshape(p.shape)
    np.subtract(g, buf, out=t2)
    t2 *= 1 - mu
    buf += t2
    np.subtract(g, buf, out=u)
    u *= 1 - mu
    u += buf
    tall = p.shape[0] > p.shape[1]
    x = u.T if tall else u
    x /= max(float(np.linalg.norm(x)), 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    p *= 1 - lr * MUON["weight_decay"]
    p -= (lr * np.sqrt(max(1.0, p.shape[0] / p.shape[1]))) * (x.T if tall else x)


def _np_schedule_free(p, g, slots, t, d, tmp):
    # optax's schedule_free_adamw at a constant lr (c = 1/t): v = b2 v + (1-b2) g^2;
    # z' = z - lr (g / (sqrt(v / (1-b2^t)) + eps) + wd y); y' = (1-c)(y - (1-b1) z) + (b1 c + 1 - b1) z'
    z, v = slots
    (b1, b2), lr, ck = SCHEDULE_FREE["betas"], SCHEDULE_FREE["lr"], 1.0 / t
    np.multiply(g, g, out=tmp)
    tmp *= 1 - b2
    v *= b2
    v += tmp
    np.multiply(v, 1 / (1 - b2**t), out=tmp)
    np.sqrt(tmp, out=tmp)
    tmp += SCHEDULE_FREE["eps"]
    np.divide(g, tmp, out=d)
    np.multiply(p, SCHEDULE_FREE["weight_decay"], out=tmp)
    d += tmp
    np.multiply(z, 1 - b1, out=tmp)
    p -= tmp
    p *= 1 - ck
    d *= lr
    z -= d
    np.multiply(z, b1 * ck + 1 - b1, out=tmp)
    p += tmp


# optimizer -> (per-tensor in-place step, number of state slots)
_NUMPY_STEPS = {"adagrad": (_np_adagrad, 1), "rmsprop": (_np_rmsprop, 3), "lion": (_np_lion, 1),
                "lamb": (_np_lamb, 2), "nadam": (_np_nadam, 2), "radam": (_np_radam, 2), "adamax": (_np_adamax, 2),
                "adadelta": (_np_adadelta, 2), "muon": (_np_muon, 1),
                "schedule_free_adamw": (_np_schedule_free, 2)}


def _make_numpy_other(opt: str, n: int, zero_grad: bool):
    """The other optimizers by hand: clip in place, then one in-place update per tensor."""
    params, grads = make_data(n, opt=opt)
    update, nslots = _NUMPY_STEPS[opt]
    slots = [[np.zeros_like(p) for _ in range(nslots)] for p in params]
    if opt == "schedule_free_adamw":  # z starts at the parameters
        for s, p in zip(slots, params):
            s[0][...] = p
    big = max(p.size for p in params)
    d, tmp = np.empty(big, np.float32), np.empty(big, np.float32)
    t = [0]

    def step():
        norm = np.sqrt(sum(float(np.vdot(g, g)) for g in grads))
        coef = min(1.0, MAX_NORM / (norm + 1e-6))
        t[0] += 1
        for p, g, s in zip(params, grads, slots):
            g *= coef
            update(p, g, s, t[0], d[: p.size], tmp[: p.size])
            if zero_grad:
                g[...] = 0

    step.params = lambda: params
    return _warm(step, opt)


def make_optax(opt: str, n: int, zero_grad: bool = False):
    _check_available("optax", opt)
    import jax
    import jax.numpy as jnp
    import optax

    params, grads = make_data(n, opt=opt)
    inner = {"adamw": lambda: optax.adamw(LR, *BETAS, EPS, weight_decay=WD),
             "adam": lambda: optax.adam(LR, *BETAS, EPS),
             "sgd": lambda: optax.sgd(LR, momentum=MOMENTUM),
             "lion": lambda: optax.lion(LION["lr"], *LION["betas"], weight_decay=LION["weight_decay"]),
             "lamb": lambda: optax.lamb(LAMB["lr"], *LAMB["betas"], LAMB["eps"], LAMB["eps_root"],
                                        LAMB["weight_decay"]),
             # optax.radam adds eps after the bias correction of sqrt(v) (torch: before); at eps = 1e-8
             # the two steps agree far within the benchmark's checks
             "radam": lambda: optax.radam(RADAM["lr"], *RADAM["betas"], RADAM["eps"]),
             "adamax": lambda: optax.adamax(ADAMAX["lr"], *ADAMAX["betas"], ADAMAX["eps"]),
             "adadelta": lambda: optax.adadelta(ADADELTA["lr"], ADADELTA["rho"], ADADELTA["eps"]),
             "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(
                 SCHEDULE_FREE["lr"], None, *SCHEDULE_FREE["betas"], SCHEDULE_FREE["eps"],
                 SCHEDULE_FREE["weight_decay"])}[opt]()
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), inner)
    p = [jnp.asarray(x) for x in params]
    g = [jnp.asarray(x) for x in grads]
    box = {"p": p, "s": tx.init(p)}

    @jax.jit
    def update(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    update = jax.jit(update, donate_argnums=(0, 1))

    def step():
        box["p"], box["s"] = update(box["p"], box["s"], g)
        jax.block_until_ready(box["p"])

    step.params = lambda: [np.asarray(x) for x in box["p"]]
    return _warm(step, opt)


def make_arraytrain_bf16(opt: str, n: int, zero_grad: bool = False):
    """arraytrain with ``state_dtype="bfloat16"``: the optimizer state at 2 bytes per element."""
    _check_available("arraytrain-bf16", opt)
    return make_arraytrain(opt, n, zero_grad, "bfloat16")


def make_arraytrain_working_bf16(opt: str, n: int, zero_grad: bool = False):
    """arraytrain with ``working_dtype="bfloat16"``: float32 state, and the step also writes a bfloat16
    copy of the weights (2 more bytes per element)."""
    return make_arraytrain(opt, n, zero_grad, working_dtype="bfloat16")


def make_arraytrain_working_f16(opt: str, n: int, zero_grad: bool = False):
    """arraytrain with ``working_dtype="float16"`` (see :func:`make_arraytrain_working_bf16`)."""
    return make_arraytrain(opt, n, zero_grad, working_dtype="float16")


def make_arraytrain_8bit(opt: str, n: int, zero_grad: bool = False):
    """arraytrain with ``state_dtype="8bit"``: one byte per element and slot, a float32 scale per
    256 elements (tensors under 4096 elements keep float32 state)."""
    _check_available("arraytrain-8bit", opt)
    return make_arraytrain(opt, n, zero_grad, "8bit")


def make_arraytrain_float8(opt: str, n: int, zero_grad: bool = False):
    """arraytrain with ``state_dtype="float8"``: one byte per element and slot (e4m3 codes), a
    float32 scale per 256 elements (tensors under 4096 elements keep float32 state)."""
    _check_available("arraytrain-float8", opt)
    return make_arraytrain(opt, n, zero_grad, "float8")


def make_bnb_8bit(opt: str, n: int, zero_grad: bool = False):
    """bitsandbytes' 8-bit optimizers (blockwise, 256) on CPU torch tensors, after torch's
    ``clip_grad_norm_``: the reference implementation of 8-bit state (a benchmark-only dependency)."""
    _check_available("bnb-8bit", opt)
    return _torch_step(opt, n, lambda ps: bnb_optimizer(opt, ps), zero_grad)


def _deepspeed_step(name: str, opt: str, n: int, zero_grad: bool, working: str | None):
    """DeepSpeed's fused CPU step after torch's ``clip_grad_norm_``; with ``working`` ("bfloat16" or
    "float16") then ZeRO-Offload's copy of the float32 weights into a low-precision copy of them, a
    separate pass (arraytrain-working-* writes it in the step)."""
    _check_available(name, opt)
    from .common import deepspeed_optimizer

    def copy_after(ps):
        import torch

        fp32 = [p.data for p in ps]
        copies = [torch.empty_like(p, dtype=getattr(torch, working)) for p in fp32]
        return lambda: torch._foreach_copy_(copies, fp32)

    return _torch_step(opt, n, lambda ps: deepspeed_optimizer(opt, ps), zero_grad, copy_after if working else None)


def make_deepspeed(opt, n, zero_grad=False):
    """DeepSpeed's fused CPU optimizer (DeepSpeedCPUAdam / CPULion / CPUAdagrad): a benchmark-only dependency."""
    return _deepspeed_step("deepspeed", opt, n, zero_grad, None)


def make_deepspeed_working_bf16(opt, n, zero_grad=False):
    """DeepSpeed's step, then its float32 weights copied into a bfloat16 copy (ZeRO-Offload's form)."""
    return _deepspeed_step("deepspeed-working-bf16", opt, n, zero_grad, "bfloat16")


def make_deepspeed_working_f16(opt, n, zero_grad=False):
    """DeepSpeed's step, then its float32 weights copied into a float16 copy."""
    return _deepspeed_step("deepspeed-working-f16", opt, n, zero_grad, "float16")


CONTESTANTS = {
    "arraytrain": make_arraytrain,
    "arraytrain-bf16": make_arraytrain_bf16,
    "arraytrain-8bit": make_arraytrain_8bit,
    "arraytrain-float8": make_arraytrain_float8,
    "bnb-8bit": make_bnb_8bit,
    "arraytrain-working-bf16": make_arraytrain_working_bf16,
    "arraytrain-working-f16": make_arraytrain_working_f16,
    "torch-foreach": make_torch_foreach,
    "torch-fused": make_torch_fused,
    "numpy": make_numpy,
    "optax": make_optax,
    "torch-forloop": make_torch_forloop,
    "deepspeed": make_deepspeed,
    "deepspeed-working-bf16": make_deepspeed_working_bf16,
    "deepspeed-working-f16": make_deepspeed_working_f16,
}
DEFAULT_CONTESTANTS = ("arraytrain", "torch-foreach", "torch-fused", "numpy", "optax")


# -- running and reporting --------------------------------------------------------------


def run(optimizers, sizes, reps, names=DEFAULT_CONTESTANTS, zero_grad=False, log=print):
    """Time every contestant per (optimizer, size).

    Returns the rows, the best triad GB/s, the contestants whose library is
    missing (name -> error), the pairs without an implementation
    (``"contestant/optimizer"`` -> reason) and the best in-place GB/s.
    """
    triad, triad_bytes = make_triad()
    inplace, inplace_bytes = make_inplace()
    triad_times, inplace_times, rows, missing, unavailable = [], [], [], {}, {}
    for opt in optimizers:
        for n in sizes:
            contestants = {}
            for name in names:
                try:
                    contestants[name] = CONTESTANTS[name](opt, n, zero_grad)
                except ImportError as exc:
                    missing[name] = str(exc)
                except NotAvailable as exc:
                    unavailable[f"{name}/{opt}"] = str(exc)
            contestants["triad"], contestants["in-place"] = triad, inplace
            times = {k: [] for k in contestants}
            rounds = max(3, (reps if n < 50_000_000 else max(3, reps // 3)) // BLOCK)
            for _ in range(rounds):
                for name, fn in contestants.items():
                    fn()  # untimed: absorbs the previous contestant's idle threads winding down
                    times[name] += timeit(fn, BLOCK)
            triad_times += times.pop("triad")
            row_inplace = times.pop("in-place")
            inplace_times += row_inplace
            # the VM's bandwidth drifts within a run: each row keeps the in-place figure of its own rounds
            rows.append({"optimizer": opt, "n": n, "times": times,
                         "inplace_gbs": inplace_bytes / min(row_inplace) / 1e9})
            log(f"  timed {opt} n={n:.0e}: " + ", ".join(f"{k} {min(v) * 1e3:.2f} ms" for k, v in times.items()))
            contestants.clear()
    for name, why in missing.items():
        log(f"  skipped {name}: {why}")
    return (rows, triad_bytes / min(triad_times) / 1e9, missing, unavailable,
            inplace_bytes / min(inplace_times) / 1e9)


def table(rows, triad_gbs, inplace_gbs=None) -> str:
    """The Markdown table; with ``inplace_gbs``, a last column: GB/s as a share of the in-place update's,
    timed in the same row's rounds where the row has it (``row["inplace_gbs"]``), else ``inplace_gbs``."""
    extra = ("", "") if inplace_gbs is None else (" % in-place |", "---:|")
    out = ["| optimizer | params | contestant | min ms | median ms | GB/s | % triad | time / arraytrain |" + extra[0],
           "|---|---:|---|---:|---:|---:|---:|---:|" + extra[1]]
    for row in rows:
        opt, n, times = row["optimizer"], row["n"], row["times"]
        ours = min(times["arraytrain"]) if "arraytrain" in times else None
        inplace = row.get("inplace_gbs", inplace_gbs)
        for name, ts in times.items():
            best = min(ts)
            gbs = step_bytes(opt) * n / best / 1e9
            ratio = f"{best / ours:.2f}" if ours else "-"
            out.append(f"| {opt} | {n:.0e} | {name} | {best * 1e3:.2f} | {statistics.median(ts) * 1e3:.2f} | "
                       f"{gbs:.1f} | {gbs / triad_gbs:.0%} | {ratio} |"
                       + ("" if inplace_gbs is None else f" {gbs / inplace:.0%} |"))
    return "\n".join(out)


def regressions(new: dict, old: dict, threshold: float = 1.10) -> list[str]:
    """arraytrain rows whose share of the triad fell by more than ``threshold`` since ``old``.

    Each run's times are divided by its own triad, so a slower or busier
    machine does not read as a regression; what is left is the code.
    """
    def shares(doc):
        return {(r["optimizer"], r["n"]): min(r["times"]["arraytrain"]) * doc["triad_gbs"]
                for r in doc["rows"] if "arraytrain" in r["times"]}

    before, after = shares(old), shares(new)
    found = []
    for key in sorted(before.keys() & after.keys()):
        ratio = after[key] / before[key]
        if ratio > threshold:
            found.append(f"{key[0]} n={key[1]:.0e}: {ratio:.2f}x slower relative to the triad")
    return found


def _device(argv) -> str:
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return "cpu"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _device(argv) == "cuda":  # the GPU comparison: arraytrain.bench.cuda
        from .cuda import main as cuda_main

        return cuda_main(argv)
    ap = argparse.ArgumentParser(prog="python -m arraytrain.bench compare", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: see arraytrain.bench.cuda")
    ap.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS),
                    help="comma-separated, from: " + ", ".join(OPTIMIZERS))
    ap.add_argument("--sizes", default="1e6,1e7", help="comma-separated parameter counts (1e8 needs ~4 GB)")
    ap.add_argument("--contestants", default=",".join(DEFAULT_CONTESTANTS),
                    help="comma-separated, from: " + ", ".join(CONTESTANTS))
    ap.add_argument("--reps", type=int, default=15, help="timed calls per contestant (in blocks of 3)")
    ap.add_argument("--tensors", type=int, default=common.N_TENSORS,
                    help=f"tensors each contestant's parameters are split into (default {common.N_TENSORS})")
    ap.add_argument("--zero-grad", action="store_true", help="also zero the gradients every step")
    ap.add_argument("--startup", action="store_true", help="also time the first step with a cold/warm cache")
    ap.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    ap.add_argument("--baseline", metavar="OLD.json", help="flag arraytrain slowdowns against an earlier --json")
    ap.add_argument("--threshold", type=float, default=1.10, help="slowdown factor that counts (default 1.10)")
    args = ap.parse_args(argv)

    optimizers = [o.strip() for o in args.optimizers.split(",")]
    names = [c.strip() for c in args.contestants.split(",")]
    for o in optimizers:
        if o not in OPTIMIZERS:
            ap.error(f"--optimizers: unknown {o!r}; choose from {list(OPTIMIZERS)}")
    for c in names:
        if c not in CONTESTANTS:
            ap.error(f"--contestants: unknown {c!r}; choose from {list(CONTESTANTS)}")
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    if args.tensors < 1:
        ap.error(f"--tensors: expected at least 1, got {args.tensors}")
    common.N_TENSORS = args.tensors  # every contestant's split (common.split, common.shapes)

    from arraytrain import threads

    policy = threads.describe()
    rows, tri, missing, unavailable, inp = run(optimizers, sizes, args.reps, names, args.zero_grad,
                                               log=lambda s: print(s, file=sys.stderr))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}, "
          f"numpy {np.__version__}; {policy}")
    print(f"numba triad bandwidth (best over the run, timed in the same rotation): {tri:.1f} GB/s")
    print(f"numba in-place a += s*b bandwidth (likewise): {inp:.1f} GB/s; '% in-place' compares each row with "
          f"the in-place update timed in that row's own rounds\n")
    print(table(rows, tri, inp))
    if unavailable:
        print("\nnot available: " + "; ".join(f"{k}: {v}" for k, v in unavailable.items()))
    doc = {"triad_gbs": tri, "inplace_gbs": inp, "threads": policy, "rows": rows, "missing": missing, "unavailable": unavailable,
           "zero_grad": args.zero_grad, "machine": platform.machine(), "cpus": os.cpu_count()}
    if args.startup:
        with tempfile.TemporaryDirectory() as cache:
            doc["startup"] = {"cold_s": first_step_seconds(cache), "warm_s": first_step_seconds(cache)}
        print(f"\nfirst engine.step in a fresh process (import + compile/load + step): "
              f"cold cache {doc['startup']['cold_s']:.2f} s, warm cache {doc['startup']['warm_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.baseline:
        with open(args.baseline) as f:
            found = regressions(doc, json.load(f), args.threshold)
        print("\nregressions against the baseline: " + ("; ".join(found) if found else "none"))
        return 1 if found else 0
    return 0

"""The torch and JAX bindings over TorchComm on every rank (run by ``checks.py bindings``).

Each rank trains on its half of every global batch; the result must be what one process
gives with the whole batch (float64: params to 1e-10, gradient norms to 1e-12, as the MPI
engine checks), with sharded state too; a checkpoint of a bound model saved under torchrun
resumes bitwise. ``ARRAYTRAIN_TORCHRUN_DIR``: where the checkpoint of a sharded engine is
left for the test to resume in one process.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import torch
from comm_checks import same_everywhere

import arraytrain as at
from arraytrain.interop import torch as at_torch

IN, HIDDEN, OUT, BATCH, STEPS = 9, 16, 3, 12, 5  # BATCH: shared evenly by 1, 2, 3 or 4 ranks


def model(seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                                   torch.nn.Linear(HIDDEN, OUT)).double()


def batch(t: int):
    rng = np.random.default_rng([t, 3])
    return torch.from_numpy(rng.standard_normal((BATCH, IN))), torch.from_numpy(rng.integers(0, OUT, BATCH))


def half(x, comm):
    n = x.shape[0] // comm.size
    return x[comm.rank * n : (comm.rank + 1) * n]


def flat_params(m: torch.nn.Module) -> np.ndarray:
    return np.concatenate([p.detach().numpy().ravel() for p in m.parameters()])


def torch_run(comm, shard: bool, steps: int = STEPS, engine_kwargs=None):
    """Each rank's half of every batch, bound over ``comm`` (rank 0's initial weights are broadcast)."""
    m = model(comm.rank)
    kw = dict(max_grad_norm=0.5, schedule=at.schedules.CosineAnnealingLR(10), **(engine_kwargs or {}))
    eng = at_torch.bind(m, at.optim.AdamW(lr=1e-2, weight_decay=0.01), comm=comm, shard_state=shard, **kw)
    norms = []
    for t in range(steps):
        x, y = batch(t)
        torch.nn.functional.cross_entropy(m(half(x, comm)), half(y, comm)).backward()
        norms.append(eng.step().grad_norm)
    return m, eng, norms


def torch_one_process(steps: int = STEPS):
    m = model(0)
    eng = at_torch.bind(m, at.optim.AdamW(lr=1e-2, weight_decay=0.01), max_grad_norm=0.5,
                        schedule=at.schedules.CosineAnnealingLR(10))
    norms = []
    for t in range(steps):
        x, y = batch(t)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        norms.append(eng.step().grad_norm)
    return m, norms


def check_torch_binding_equals_one_process_with_the_global_batch(comm) -> int:
    want, want_norms = torch_one_process()
    cases = 0
    for shard in (False, True):
        m, eng, norms = torch_run(comm, shard)
        got = flat_params(m)
        assert same_everywhere(comm, got), f"shard={shard}"
        np.testing.assert_allclose(norms, want_norms, rtol=1e-12, err_msg=f"shard={shard}")
        np.testing.assert_allclose(got, flat_params(want), rtol=1e-10, atol=1e-12, err_msg=f"shard={shard}")
        assert np.shares_memory(next(m.parameters()).detach().numpy(), eng.params.flat)
        cases += 1
    return cases


def check_weights_gathered_in_the_next_forward_pass_equal_the_publish_at_the_step(comm) -> int:
    m, _, norms = torch_run(comm, True)
    g, eng, gnorms = torch_run(comm, True, engine_kwargs={"gather_in_forward": True})
    assert eng._placement.in_flight > 0  # the last update's all-gather, left in flight
    eng.wait_weights()  # the tensors are read directly below, not through the model's forward pass
    assert eng._placement.in_flight == 0
    np.testing.assert_array_equal(flat_params(g), flat_params(m))
    np.testing.assert_array_equal(gnorms, norms)
    return 1


def check_a_bound_models_checkpoint_resumes_bitwise_under_torchrun(comm) -> int:
    folder = comm.gather_objects(tempfile.mkdtemp(prefix="arraytrain-torchrun-") if comm.rank == 0 else None)[0]
    cases = 0
    try:
        for shard in (False, True):
            path = os.path.join(folder, f"bound-{shard}.safetensors")
            full, full_eng, _ = torch_run(comm, shard, steps=2)
            at.save(path, full_eng)
            for t in range(2, STEPS):
                x, y = batch(t)
                torch.nn.functional.cross_entropy(full(half(x, comm)), half(y, comm)).backward()
                full_eng.step()
            m = model(comm.rank + 7)
            eng = at_torch.bind(m, at.optim.AdamW(lr=1e-2, weight_decay=0.01), comm=comm, shard_state=shard,
                                max_grad_norm=0.5, schedule=at.schedules.CosineAnnealingLR(10))
            at.load(path, eng)
            for t in range(2, STEPS):
                x, y = batch(t)
                torch.nn.functional.cross_entropy(m(half(x, comm)), half(y, comm)).backward()
                eng.step()
            np.testing.assert_array_equal(flat_params(m), flat_params(full), err_msg=f"shard={shard}")
            assert eng.state.step == full_eng.state.step == STEPS
            cases += 1
        keep = os.environ.get("ARRAYTRAIN_TORCHRUN_DIR")
        if keep and comm.rank == 0:  # for the test: one process resumes what 2 sharded ranks wrote
            shutil.copy(os.path.join(folder, "bound-True.safetensors"), os.path.join(keep, "sharded.safetensors"))
    finally:
        comm.gather_objects(None)  # every rank is done with the files
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return cases


def check_jax_binding_equals_one_process_with_the_global_batch(comm) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)  # float64, as the other equality checks
    import jax.numpy as jnp

    from arraytrain.interop import jax as at_jax

    rng = np.random.default_rng(comm.rank)  # each rank its own start: rank 0's is broadcast
    params = {"w1": rng.standard_normal((IN, HIDDEN)) * 0.3, "b1": np.zeros(HIDDEN),
              "out": {"w": rng.standard_normal((HIDDEN, OUT)) * 0.3, "b": np.zeros(OUT)}}

    def loss(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        logits = h @ p["out"]["w"] + p["out"]["b"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y])

    grad = jax.jit(jax.grad(loss))

    def run(c, shard):
        start = params if c is not None else jax.tree.map(np.copy, comm.gather_objects(params)[0])
        eng = at_jax.bind(start, at.optim.Adam(lr=1e-2), comm=c, shard_state=shard, max_grad_norm=0.5)
        norms = []
        for t in range(STEPS):
            x, y = (a.numpy() for a in batch(t))
            if c is not None:
                x, y = half(x, c), half(y, c)
            norms.append(eng.step(grad(eng.tree(), x, y)).grad_norm)
        return np.array(eng.params.flat), norms

    want, want_norms = run(None, False)
    for shard in (False, True):
        got, norms = run(comm, shard)
        assert same_everywhere(comm, got)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-12, err_msg=f"shard={shard}")
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"shard={shard}")
    return 2


def check_dropin_with_comm_equals_ddp(comm) -> int:
    """``at_torch.AdamW(..., comm=comm)`` (blocking and overlapped, set_to_none zero_grad) against
    DDP + torch.optim.AdamW + clip_grad_norm_, each rank on its half of every batch: the same
    losses and weights (float64, to 1e-10)."""
    from torch.nn.parallel import DistributedDataParallel

    cases = 0
    for overlap in (False, True):
        ref = model(0)
        ddp = DistributedDataParallel(ref)
        topt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
        m = model(comm.rank)  # rank 0's weights reach every rank at construction
        opt = at_torch.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.5, comm=comm,
                             overlap=overlap, bucket_bytes=256)
        assert opt._cohorts[0].engine.overlapped is overlap
        losses = []
        for t in range(STEPS):
            x, y = batch(t)
            pair = []
            for net, o in ((ddp, topt), (m, opt)):
                o.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(half(x, comm)), half(y, comm))
                loss.backward()
                if o is topt:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                o.step()
                pair.append(loss.item())
            losses.append(pair)
        losses = np.array(losses)
        np.testing.assert_allclose(losses[:, 1], losses[:, 0], rtol=1e-10, err_msg=f"overlap={overlap}")
        got = flat_params(m)
        assert same_everywhere(comm, got), f"overlap={overlap}"
        np.testing.assert_allclose(got, flat_params(ref), rtol=1e-10, atol=1e-12, err_msg=f"overlap={overlap}")
        cases += 1
    return cases


def check_dropin_with_sharded_state_equals_ddp_and_resumes(comm) -> int:
    """``at_torch.AdamW(..., comm=comm, shard_state=True)`` against DDP + torch.optim.AdamW (float64, to
    1e-10); its state_dict (a collective) holds torch's slots; a fresh sharded drop-in that loads the
    state saved after 2 steps continues as the uninterrupted run."""
    from torch.nn.parallel import DistributedDataParallel

    ref = model(0)
    ddp = DistributedDataParallel(ref)
    topt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    m = model(comm.rank)
    kw = {"lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 0.5, "comm": comm, "shard_state": True}
    opt = at_torch.AdamW(m.parameters(), **kw)
    saved = None
    for t in range(STEPS):
        x, y = batch(t)
        for net, o in ((ddp, topt), (m, opt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(net(half(x, comm)), half(y, comm)).backward()
            if o is topt:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            o.step()
        if t == 1:
            saved = (opt.state_dict(), [p.detach().clone() for p in m.parameters()])
    np.testing.assert_allclose(flat_params(m), flat_params(ref), rtol=1e-10, atol=1e-12)
    ours, theirs = opt.state_dict()["state"], topt.state_dict()["state"]
    for i, entry in theirs.items():
        assert float(ours[i]["step"]) == float(entry["step"])
        for slot in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(ours[i][slot].numpy(), entry[slot].numpy(), rtol=1e-9, atol=1e-14)
    again = model(comm.rank)
    with torch.no_grad():
        for p, v in zip(again.parameters(), saved[1]):
            p.copy_(v)
    opt2 = at_torch.AdamW(again.parameters(), **kw)
    opt2.load_state_dict(saved[0])
    for t in range(2, STEPS):
        x, y = batch(t)
        opt2.zero_grad()
        torch.nn.functional.cross_entropy(again(half(x, comm)), half(y, comm)).backward()
        opt2.step()
    np.testing.assert_allclose(flat_params(again), flat_params(m), rtol=1e-12, atol=1e-14)
    return 2


def _branched(seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.ModuleDict({"trunk": torch.nn.Linear(IN, HIDDEN), "branch": torch.nn.Linear(HIDDEN, OUT),
                                    "head": torch.nn.Linear(HIDDEN, OUT)}).double()


def _branch_used(t: int, rank: int) -> bool:
    """The branch: used by every rank, then by rank 1 only (present: a rank had a gradient), then by none
    (absent: torch skips it), then by every rank again."""
    return t < 2 or (t < 4 and rank == 1) or t >= 7


def _branched_loss(m, x, y, used: bool):
    h = torch.tanh(m["trunk"](x))
    out = m["head"](h)
    if used:
        out = out + m["branch"](h)
    return torch.nn.functional.cross_entropy(out, y)


def check_unused_branch_across_ranks_as_torch(comm) -> int:
    """A branch without gradients on some ranks or on all: the drop-in (replicated, sharded) and bind over
    ``comm`` against one process's torch.optim.AdamW(foreach=False) on the mean of the ranks' losses,
    which DDP computes (a parameter with a gradient on any rank is stepped, one with none anywhere is
    not, and keeps its own step count); float64, to 1e-10."""
    steps = 9
    ref = _branched(0)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for t in range(steps):
        x, y = batch(t)
        topt.zero_grad()
        n = x.shape[0] // comm.size
        sum(_branched_loss(ref, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n], _branch_used(t, r))
            for r in range(comm.size)).div(comm.size).backward()
        topt.step()
    want = flat_params(ref)
    cases = 0
    for how in ("dropin", "dropin-sharded", "bind"):
        m = _branched(comm.rank)
        if how == "bind":
            eng = at_torch.bind(m, at.optim.AdamW(lr=1e-2, weight_decay=0.01), comm=comm)
            step, zero = eng.step, m.zero_grad
        else:
            opt = at_torch.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01, comm=comm,
                                 shard_state=how == "dropin-sharded")
            step, zero = opt.step, opt.zero_grad
        for t in range(steps):
            x, y = batch(t)
            zero()
            _branched_loss(m, half(x, comm), half(y, comm), _branch_used(t, comm.rank)).backward()
            step()
        np.testing.assert_allclose(flat_params(m), want, rtol=1e-10, atol=1e-12, err_msg=how)
        if how == "dropin":
            steps_of = [float(s["step"]) for s in opt.state_dict()["state"].values()]
            assert steps_of == [float(s["step"]) for s in topt.state_dict()["state"].values()], steps_of
        cases += 1
    return cases

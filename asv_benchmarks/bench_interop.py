"""The drop-in torch optimizers (``arraytrain.interop.torch``): one ``optimizer.step()`` on CPU
torch parameters, float32, bfloat16 and 8-bit state, beside ``torch.optim.AdamW(fused=True)``.

Skipped where torch is not installed (asv's environment installs arraytrain alone; ``python -m
asv_benchmarks.direct bench_interop`` runs it in an environment with torch).
"""

from __future__ import annotations

from .common import QUICK, SIZES, split

# every parameter is a process of its own that imports torch (about 3 s): the quick run keeps one group count
GROUPS = [10] if QUICK else [1, 10, 100]


class DropInAdamWStep:
    """A clipped AdamW step over 100 tensors of ``n`` elements in all, gradients already in ``.grad``;
    ``-frozen``: every other tensor's ``.grad`` None (left out of the step, as torch leaves it)."""

    params = [["arraytrain-float32", "arraytrain-bfloat16", "arraytrain-8bit", "torch-fused",
               "arraytrain-float32-frozen", "torch-fused-frozen"], SIZES]
    param_names = ["optimizer", "n"]

    def setup(self, optimizer, n):
        try:
            import torch
        except ImportError:
            raise NotImplementedError("needs torch") from None
        from arraytrain.interop import torch as att

        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(k, generator=gen)) for k in split(n)]
        frozen = optimizer.endswith("-frozen")
        for i, p in enumerate(ps):
            p.grad = None if frozen and i % 2 else torch.randn(p.shape, generator=gen) * 0.01
        if optimizer.startswith("torch-fused"):
            self.opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
            self.clip = lambda: torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
        else:
            state = optimizer.split("-")[1]
            self.opt = att.AdamW(ps, lr=1e-3, max_grad_norm=1.0, state_dtype=None if state == "float32" else state)
            self.clip = lambda: None
        for _ in range(2):  # JIT compilation and the state's allocation: outside the timed method
            self.time_step(optimizer, n)

    def time_step(self, optimizer, n):
        self.clip()
        self.opt.step()


class ReadParamGroups:
    """``read_param_groups()`` (every step's first call) over ``groups`` groups of 100 one-element tensors:
    nothing changed, ``lr`` set anew (a scheduler), ``lr`` and beta1 set anew (OneCycleLR's
    ``cycle_momentum``, set on the optimizer without building one), or ``lr`` a 0-d tensor written in
    place (``fill_``: read through a view of its memory). The writes are in the timing."""

    params = [GROUPS, ["unchanged", "lr", "lr+betas", "tensor lr"]]
    param_names = ["groups", "change"]

    def setup(self, groups, change):
        try:
            import torch
        except ImportError:
            raise NotImplementedError("needs torch") from None
        from arraytrain.interop import torch as att

        ps = [torch.nn.Parameter(torch.zeros(1)) for _ in range(100)]
        per = 100 // groups
        tensor = change == "tensor lr"
        self.opt = att.AdamW([{"params": ps[i * per:(i + 1) * per], **({"lr": torch.tensor(1e-3)} if tensor else {})}
                              for i in range(groups)], lr=1e-3)
        self.i = 0
        self.opt.read_param_groups()

    def time_read(self, groups, change):
        self.i += 1
        if change == "tensor lr":
            for g in self.opt.param_groups:
                g["lr"].fill_(1e-3 * (1.0 + 1e-6 * self.i))
        elif change != "unchanged":
            for g in self.opt.param_groups:
                g["lr"] = 1e-3 * (1.0 + 1e-6 * self.i)
                if change == "lr+betas":
                    g["betas"] = (0.9 - 1e-9 * self.i, 0.999)
        self.opt.read_param_groups()

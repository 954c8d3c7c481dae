"""A Lightning ``Trainer`` stepping an arraytrain optimizer returned by ``configure_optimizers``.

Lightning calls ``optimizer.step(closure=...)`` (its closure runs the training step and the
backward pass), ``zero_grad``, gradient clipping (``gradient_clip_val``) and the scheduler
of ``configure_optimizers``, and checkpoints ``optimizer.state_dict()``: all of it works with
``arraytrain.interop.torch.AdamW`` as with ``torch.optim.AdamW``.

``python examples/torch_lightning.py`` trains a small MLP regressor on synthetic data with
both and prints the two loss curves (a few seconds); the tests check that they agree.
"""

from __future__ import annotations

import lightning
import torch

from arraytrain.interop import torch as at_torch


class Regressor(lightning.LightningModule):
    """An MLP on ``(x, y)`` batches; ``optimizer_class`` is the torch-style optimizer to train with."""

    def __init__(self, optimizer_class, lr: float = 1e-2, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                           torch.nn.Linear(64, 1))
        self.optimizer_class, self.lr = optimizer_class, lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.net.named_parameters() if n.endswith("weight") and p.dim() > 1]
        rest = [p for n, p in self.net.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
        optimizer = self.optimizer_class([{"params": decay, "weight_decay": 0.05},
                                          {"params": rest, "weight_decay": 0.0}], lr=self.lr)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_loader(n: int = 512, batch: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = torch.sin(x[:, :1] * 2) + x[:, 1:2] * x[:, 2:3]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=False)


def train(optimizer_class, *, steps: int = 40, seed: int = 0) -> list[float]:
    """Train a fresh regressor for ``steps`` steps; the loss of every step."""
    model = Regressor(optimizer_class, seed=seed)
    trainer = lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    trainer.fit(model, make_loader())
    return model.losses


def main() -> None:
    ours = train(at_torch.AdamW)
    theirs = train(torch.optim.AdamW)
    print("step  arraytrain AdamW  torch AdamW")
    for i, (a, b) in enumerate(zip(ours, theirs), 1):
        print(f"{i:4d}  {a:16.6f}  {b:11.6f}")


if __name__ == "__main__":
    main()

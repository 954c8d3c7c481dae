"""A Hugging Face ``Trainer`` stepping an arraytrain optimizer: ``Trainer(optimizers=(AdamW, scheduler))``.

``arraytrain.interop.torch.AdamW`` is a ``torch.optim.Optimizer``: the Trainer, its
``accelerate`` wrapper, its gradient clipping (``clip_grad_norm_``, ``max_grad_norm=1.0``)
and a transformers scheduler use it as they use torch's. Its step runs on flat buffers
that the model's parameters and gradients are views of; the param groups (weight decay for
the weights, none for biases and norms, as the Trainer builds them) become per-parameter
values of one fused kernel.

The model is a small GPT-2 built from a config (random weights, nothing downloaded),
trained on synthetic token sequences. ``python examples/torch_hf_trainer.py`` trains it
with the arraytrain AdamW and with torch's, and prints both loss curves (about 15 s on 2 cores);
the tests check that they agree. ``train(functools.partial(at_torch.AdamW, state_dtype="8bit"))``
trains it with 8-bit optimizer state, as ``bnb.optim.AdamW8bit`` keeps it (the MLP weights,
4096 elements each, reach its ``min_8bit_size``); the tests check that too.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from arraytrain.interop import torch as at_torch

VOCAB, LENGTH = 64, 16


def make_model(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (tied input and output embeddings) with weights drawn from ``seed``."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def make_dataset(n: int = 256, seed: int = 1) -> list[dict]:
    """Sequences that count upward from a random start (mod VOCAB): learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    ids = (start + torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def param_groups(model, weight_decay: float = 0.01) -> list[dict]:
    """The Trainer's own split: weight decay for weights, none for biases and LayerNorms; named."""
    no_decay = ("bias", "ln_", "wpe")
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if not any(k in n for k in no_decay)], "weight_decay": weight_decay},
            {"params": [(n, p) for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0}]


def train(optimizer_class, *, steps: int = 20, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Train a fresh model for ``steps`` steps with ``optimizer_class``; the loss of every step."""
    model = make_model(seed)
    optimizer = optimizer_class(param_groups(model), lr=lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=steps)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=16, logging_steps=1,
                                 max_grad_norm=1.0, report_to=[], save_strategy="no", use_cpu=True, seed=seed,
                                 data_seed=seed, disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=make_dataset(), optimizers=(optimizer, scheduler))
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main() -> None:
    ours = train(at_torch.AdamW)
    theirs = train(torch.optim.AdamW)
    print("step  arraytrain AdamW  torch AdamW")
    for i, (a, b) in enumerate(zip(ours, theirs), 1):
        print(f"{i:4d}  {a:16.6f}  {b:11.6f}")


if __name__ == "__main__":
    main()

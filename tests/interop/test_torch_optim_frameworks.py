"""The drop-in optimizers inside the training frameworks, as their users run them.

``examples/torch_hf_trainer.py`` (a Hugging Face ``Trainer`` given ``optimizers=(AdamW,
scheduler)``, a small GPT-2 built from a config) and ``examples/torch_lightning.py`` (a
Lightning ``Trainer`` whose ``configure_optimizers`` returns the optimizer and a
scheduler): each trains once with ``arraytrain.interop.torch.AdamW`` and once with
``torch.optim.AdamW``, and the losses of every step agree to float32 tolerance. With 8-bit state
(``state_dtype="8bit"``) the same runs agree with torch's float32 AdamW to the tolerance 8-bit
state costs over these few steps (measured: 8e-6 relative for the Trainer's 12 steps, 5e-4 for
Lightning's 24), and the Trainer's checkpoint holds the 8-bit slots as they are. transformers
(with accelerate) and lightning are test dependencies only; the tests skip without them.
"""

from __future__ import annotations

import functools
import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from arraytrain.interop import torch as at_torch

# the slow tier: Hugging Face's and Lightning's Trainers (each run imports and starts a framework)
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# state_dtype: the drop-in's keywords, the relative tolerance to torch's float32 AdamW (Trainer, Lightning)
STATE = {"float32": ({}, 1e-5, 1e-5),
         # the example GPT-2's MLP weights (4096 elements) reach bitsandbytes' default min_8bit_size;
         # the Lightning MLP's first weight (512) reaches 256
         "8bit": ({"state_dtype": "8bit"}, 1e-4, 5e-3)}


@pytest.mark.parametrize("state", list(STATE))
def test_hugging_face_trainer_matches_torch_adamw(state):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ex = _example("torch_hf_trainer")
    kwargs, rtol, _ = STATE[state]
    ours = ex.train(functools.partial(at_torch.AdamW, **kwargs), steps=12)
    theirs = ex.train(torch.optim.AdamW, steps=12)
    assert len(ours) == len(theirs) == 12
    np.testing.assert_allclose(ours, theirs, rtol=rtol)
    assert ours[-1] < ours[0] - 0.3  # it learns


@pytest.mark.parametrize("state", list(STATE))
def test_hugging_face_trainer_checkpoint_holds_the_state(state):
    """The Trainer saves ``optimizer.state_dict()`` with torch.save; it loads back by name."""
    pytest.importorskip("transformers")
    ex = _example("torch_hf_trainer")
    model = ex.make_model()
    opt = at_torch.AdamW(ex.param_groups(model), lr=1e-3, **STATE[state][0])
    batch = torch.stack([d["input_ids"] for d in ex.make_dataset(8)])
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    other = at_torch.AdamW(ex.param_groups(model), lr=1e-3, **STATE[state][0])
    other.load_state_dict(torch.load(buf, weights_only=True))
    names = opt.state_dict()["param_groups"][0]["param_names"]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # tied: held once
    for p in model.parameters():
        mine, loaded = opt.state[p]["exp_avg_sq"], other.state[p]["exp_avg_sq"]
        if isinstance(mine, dict):  # an 8-bit slot: its codes and block scales, as they were
            assert torch.equal(loaded["codes"], mine["codes"]) and torch.equal(loaded["absmax"], mine["absmax"])
        else:
            assert torch.equal(loaded, mine)
        assert int(other.state[p]["step"]) == 2
    fc = model.transformer.h[0].mlp.c_fc.weight
    assert isinstance(opt.state[fc]["exp_avg"], dict) == (state == "8bit")


# lightning 2.6's own use of torch's pytree (a LeafSpec check torch 2.13 deprecates)
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.parametrize("state", list(STATE))
def test_lightning_trainer_matches_torch_adamw(state):
    pytest.importorskip("lightning")
    ex = _example("torch_lightning")
    kwargs, _, rtol = STATE[state]
    if kwargs:
        kwargs = {**kwargs, "min_8bit_size": 256}
    ours = ex.train(functools.partial(at_torch.AdamW, **kwargs), steps=24)
    theirs = ex.train(torch.optim.AdamW, steps=24)
    assert len(ours) == len(theirs) == 24
    np.testing.assert_allclose(ours, theirs, rtol=rtol)

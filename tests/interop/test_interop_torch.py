"""arraytrain.interop.torch.bind: real torch models trained through the engine against torch.optim."""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import arraytrain as at  # noqa: E402
from arraytrain.errors import (  # noqa: E402
    ArgumentTypeError,
    ArrayTrainError,
    BackendError,
    CheckpointError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    MissingDependencyError,
    NoGradientsError,
    StateDictError,
)
from arraytrain.interop import torch as att  # noqa: E402
from conftest import engine_snapshot  # noqa: E402
from cuda_family import require_cuda  # noqa: E402

LR, WD, MAX_NORM, STEPS = 3e-3, 1e-2, 0.5, 50


# -- models -------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    """Conv (no bias: BatchNorm follows) + BatchNorm + ReLU + pooling + a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(nn.functional.max_pool2d(h, 2).flatten(1))


class TiedTransformer(nn.Module):
    """Embedding, one TransformerEncoder layer, and an output projection tied to the embedding."""

    def __init__(self, vocab=24, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok):
        return self.head(self.enc(self.emb(tok))).flatten(0, 1)


class FrozenMLP(nn.Module):
    """A frozen first layer (a pretrained feature extractor), two trainable layers."""

    def __init__(self):
        super().__init__()
        self.features = nn.Linear(10, 24)
        self.hidden = nn.Linear(24, 24)
        self.out = nn.Linear(24, 3)
        for p in self.features.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(torch.tanh(self.features(x)))))


def _data(kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        return torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    if kind == "transformer":
        tok = torch.randint(0, 24, (8, 6), generator=g)
        return tok, torch.randint(0, 24, (8 * 6,), generator=g)
    return torch.randn(64, 10, generator=g), torch.randint(0, 3, (64,), generator=g)


MODELS = {"cnn": SmallCNN, "transformer": TiedTransformer, "frozen": FrozenMLP}


def make(kind, dtype=torch.float32, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MODELS[kind]()
    return model.to(dtype)


def _input(x, dtype):
    return x.to(dtype) if x.is_floating_point() else x


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


# -- the torch reference: torch.optim.AdamW + clip_grad_norm_ (+ fp32 masters and GradScaler) ----
class Reference:
    def __init__(self, kind, dtype):
        self.model = make(kind, dtype)
        self.dtype = dtype
        self.lowp = dtype in (torch.bfloat16, torch.float16)
        params = _trainable(self.model)
        self.master = [p.detach().float().clone() for p in params] if self.lowp else params
        self.opt = torch.optim.AdamW(self.master, lr=LR, weight_decay=WD, foreach=False)
        self.scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None

    def step(self, x, y, set_to_none):
        self.model.zero_grad(set_to_none=set_to_none)
        loss = nn.functional.cross_entropy(self.model(_input(x, self.dtype)).float(), y)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if self.lowp:
            for m, p in zip(self.master, _trainable(self.model)):
                m.grad = p.grad.float()
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.master, MAX_NORM)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        if self.lowp:
            with torch.no_grad():
                for m, p in zip(self.master, _trainable(self.model)):
                    p.copy_(m)
        return loss.item()


def bound_step(model, engine, x, y, dtype, set_to_none):
    if set_to_none is not None:
        model.zero_grad(set_to_none=set_to_none)
    loss = nn.functional.cross_entropy(model(_input(x, dtype)).float(), y)
    (loss * engine.loss_scale).backward()
    report = engine.step()
    return loss.item(), report


def _bind(kind, dtype, **kw):
    model = make(kind, dtype)
    return model, att.bind(model, at.optim.AdamW(lr=LR, weight_decay=WD), max_grad_norm=MAX_NORM, **kw)


# Parameters whose exact gradient is zero, so that each side's gradient is rounding noise: the
# attention's key bias (softmax does not change when the same q.b_k is added to every logit of
# a query).
NOISE_ONLY = {"enc.layers.0.self_attn.in_proj_bias": slice(16, 32)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# float32: the fused kernel and torch's for-loop AdamW differ in rounding only; bf16/fp16: the
# models run in low precision, so a rounding difference in a weight shows at that precision
TOL = {"float32": dict(rtol=2e-4, atol=2e-5), "bfloat16": dict(rtol=2e-2, atol=5e-3),
       "float16": dict(rtol=5e-3, atol=5e-3)}


def _close_weights(got, want, dtype, name):
    """float32: every element at TOL. bf16/fp16: a forward pass in low precision can round one
    activation to the neighbouring value on one side only (seen with another torch build's CPU
    kernels: 1 of 512 weights 5% apart after 50 steps), so 99% of the elements at TOL and all
    within 5x TOL."""
    t = TOL[dtype]
    if dtype == "float32":
        np.testing.assert_allclose(got, want, **t, err_msg=name)
        return
    off = np.abs(got - want) > t["atol"] + t["rtol"] * np.abs(want)
    assert off.sum() <= 0.01 * off.size, f"{name}: {off.sum()} of {off.size} weights beyond the tolerance"
    np.testing.assert_allclose(got, want, rtol=5 * t["rtol"], atol=5 * t["atol"], err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow),
                                   pytest.param("float16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", list(MODELS))
def test_bound_model_trains_like_torch_optim(kind, dtype):
    tdtype = DTYPES[dtype]
    model, engine = _bind(kind, tdtype)
    ref = Reference(kind, tdtype)
    x, y = _data(kind)
    losses, ref_losses = [], []
    for i in range(STEPS):
        set_to_none = (True, False, None)[i % 3]  # zero_grad() both ways, and not at all
        loss, report = bound_step(model, engine, x, y, tdtype, set_to_none)
        losses.append(loss)
        ref_losses.append(ref.step(x, y, set_to_none=bool(set_to_none)))
        assert report.applied or (dtype == "float16" and report.skipped)
    np.testing.assert_allclose(losses, ref_losses, **TOL[dtype])
    assert losses[-1] < losses[0]
    masters = ref.master
    for (name, p), m in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], masters):
        got, want = engine.params[name].copy(), m.detach().numpy().copy()
        if name in NOISE_ONLY:  # Adam turns rounding noise into steps of size lr: compare loosely
            part = NOISE_ONLY[name]
            np.testing.assert_allclose(got[part], want[part], atol=STEPS * LR, err_msg=name)
            got[part] = want[part] = 0
        _close_weights(got, want, dtype, name)
        # the model's tensors are the engine's memory (the working copy for bf16/fp16)
        view = engine.working[name] if engine.working is not None else engine.params[name]
        assert p.data_ptr() == view.__array_interface__["data"][0], name
        assert p.dtype == tdtype
    for name, b in model.named_buffers():
        np.testing.assert_allclose(b.float().numpy(), dict(ref.model.named_buffers())[name].float().numpy(),
                                   **TOL[dtype], err_msg=name)


def test_zero_grad_either_way_or_not_at_all_gives_the_same_bits():
    flats = []
    for set_to_none in (True, False, None):
        model, engine = _bind("cnn", torch.float32)
        x, y = _data("cnn")
        for _ in range(10):
            bound_step(model, engine, x, y, torch.float32, set_to_none)
        flats.append(engine.params.flat.copy())
        # after set_to_none the step reconnected .grad to the engine's buffer
        for name, p in model.named_parameters():
            assert p.grad.data_ptr() == engine.grads[name].__array_interface__["data"][0]
    np.testing.assert_array_equal(flats[0], flats[1])
    np.testing.assert_array_equal(flats[0], flats[2])


def test_tied_parameters_are_bound_once_and_stay_tied():
    model, engine = _bind("transformer", torch.float32)
    assert "emb.weight" in engine.layout and "head.weight" not in engine.layout
    assert model.head.weight is model.emb.weight
    x, y = _data("transformer")
    bound_step(model, engine, x, y, torch.float32, None)
    assert model.head.weight.data_ptr() == engine.params["emb.weight"].__array_interface__["data"][0]


def test_frozen_parameters_are_neither_updated_nor_decayed():
    model, engine = _bind("frozen", torch.float32)
    before = {n: p.detach().clone() for n, p in model.features.named_parameters()}
    assert set(engine.frozen) == {"features.weight", "features.bias"}
    assert not any(n.startswith("features") for n in engine.layout.names)
    x, y = _data("frozen")
    for _ in range(5):
        bound_step(model, engine, x, y, torch.float32, True)
    for n, p in model.features.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_save_load_restores_parameters_buffers_and_state_bitwise(tmp_path, dtype):
    tdtype = DTYPES[dtype]
    kind = "cnn"
    model, engine = _bind(kind, tdtype)
    model.conv.weight.requires_grad_(False)  # a frozen parameter too: bind again
    engine = att.bind(model, at.optim.AdamW(lr=LR, weight_decay=WD), max_grad_norm=MAX_NORM)
    x, y = _data(kind)
    for _ in range(5):
        bound_step(model, engine, x, y, tdtype, True)
    with torch.no_grad():
        model.conv.weight.mul_(1.5)  # the frozen one differs from a fresh model's
    at.save(tmp_path / "run.safetensors", engine)
    for _ in range(5):
        bound_step(model, engine, x, y, tdtype, True)
    want = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = make(kind, tdtype, seed=1)
    fresh.conv.weight.requires_grad_(False)
    resumed = att.bind(fresh, at.optim.AdamW(lr=LR, weight_decay=WD), max_grad_norm=MAX_NORM)
    at.load(tmp_path / "run.safetensors", resumed)
    for _ in range(5):
        bound_step(fresh, resumed, x, y, tdtype, True)
    got = fresh.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    a, b = engine.state_dict(), resumed.state_dict()
    for slot in a["optimizer"]["slots"]:
        for n in a["optimizer"]["slots"][slot]:
            np.testing.assert_array_equal(a["optimizer"]["slots"][slot][n], b["optimizer"]["slots"][slot][n])
    assert a["optimizer"]["step"] == b["optimizer"]["step"] == 10


def test_module_state_is_checked_before_anything_is_written(tmp_path):
    model, engine = _bind("cnn", torch.float32)
    x, y = _data("cnn")
    bound_step(model, engine, x, y, torch.float32, None)
    state = engine.state_dict()
    bad = dict(state, module={"buffers": dict(state["module"]["buffers"]), "frozen": {}})
    bad["module"]["buffers"]["bn.running_mean"] = np.zeros(5, np.float32)
    snap, buffers = engine_snapshot(engine), {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictError, match="running_mean"):
        engine.load_state_dict(bad)
    no_module = {k: v for k, v in state.items() if k != "module"}
    with pytest.raises(StateDictError, match="module"):
        engine.load_state_dict(no_module)
    assert snap == engine_snapshot(engine)
    assert all(torch.equal(v, buffers[k]) for k, v in model.state_dict().items())
    plain = at.Engine({"w": np.zeros(3, np.float32)}, at.optim.SGD(lr=0.1))
    at.save(tmp_path / "plain.safetensors", plain)
    with pytest.raises(CheckpointError):
        at.load(tmp_path / "plain.safetensors", engine)
    assert snap == engine_snapshot(engine)


def test_replaced_data_is_taken_into_the_engine():
    model, engine = _bind("frozen", torch.float32)
    new = torch.full_like(model.out.bias, 0.25)
    model.out.bias.data = new  # a tensor outside the engine, of the same kind
    x, y = _data("frozen")
    bound_step(model, engine, x, y, torch.float32, None)
    assert model.out.bias.data_ptr() == engine.params["out.bias"].__array_interface__["data"][0]
    assert abs(float(engine.params["out.bias"].mean()) - 0.25) < 0.05  # one small step from 0.25


def _refusals(model, engine):
    """(what, setup, error): each leaves a module the engine must refuse to step."""
    def all_none():
        model.zero_grad(set_to_none=True)

    def to_double():
        model.double()

    def unfreeze():
        model.features.weight.requires_grad_(True)

    def freeze():
        model.out.weight.requires_grad_(False)

    return [("no gradients", all_none, NoGradientsError), ("converted after bind", to_double, DTypeError),
            ("unfrozen after bind", unfreeze, LayoutError), ("frozen after bind", freeze, LayoutError)]


@pytest.mark.parametrize("case", range(4))
def test_what_cannot_be_repaired_is_refused_and_changes_nothing(case):
    model, engine = _bind("frozen", torch.float32)
    x, y = _data("frozen")
    bound_step(model, engine, x, y, torch.float32, None)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    what, setup, error = _refusals(model, engine)[case]
    setup()
    snap = engine_snapshot(engine)
    grads = {n: p.grad for n, p in model.named_parameters()}
    with pytest.raises(error) as info:
        engine.step()
    assert isinstance(info.value, ArrayTrainError), what
    assert snap == engine_snapshot(engine), what
    assert grads == {n: p.grad for n, p in model.named_parameters()}, what


def test_bad_arguments_get_typed_errors():
    opt = at.optim.AdamW()
    cases = [(lambda: att.bind(object(), opt), ArgumentTypeError),
             (lambda: att.bind(nn.Linear(2, 2), opt, working_dtype="bfloat16"), HyperparameterError),
             (lambda: att.bind(nn.Linear(2, 2), opt, dtype=np.float64), HyperparameterError),
             (lambda: att.bind(nn.Linear(2, 2).requires_grad_(False), opt), LayoutError),
             (lambda: att.bind(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), opt), DTypeError),
             (lambda: att.bind(nn.Linear(2, 2).double().to(torch.float8_e4m3fn).requires_grad_(True), opt),
              DTypeError)]
    for make_it, error in cases:
        with pytest.raises(error):
            make_it()
    print(f"{len(cases)} bad bind calls, each a typed error")


@pytest.mark.parametrize("make", [lambda m: torch.optim.AdamW(m.parameters()), lambda m: att.AdamW(m.parameters())],
                         ids=["torch.optim", "drop-in"])
def test_bind_given_a_torch_optimizer_says_what_it_takes_and_changes_nothing(make):
    model = nn.Linear(3, 2)
    opt = make(model)  # the drop-in points the parameters into its own buffers: the state bind must keep
    before = [(p.data_ptr(), p.grad) for p in model.parameters()]
    with pytest.raises(ArgumentTypeError, match=r"optimizer: got .*AdamW, a torch.optim.Optimizer.*"
                                                r"arraytrain\.optim\.AdamW\(lr=\.\.\.\)"):
        att.bind(model, opt)
    assert [(p.data_ptr(), p.grad) for p in model.parameters()] == before


def test_an_arraytrain_optimizer_given_torch_parameters_points_to_the_drop_in():
    model = nn.Linear(3, 2)
    for name, cls in at.optim.by_name().items():
        for params in (model.parameters(), list(model.parameters()), [{"params": list(model.parameters())}]):
            with pytest.raises(ArgumentTypeError, match=f"lr: .*use arraytrain.interop.torch.{cls.__name__}$"):
                cls(params)
    with pytest.raises(HyperparameterError, match="lr: expected a finite real number"):
        at.optim.AdamW("fast")  # not parameters: the usual error


def test_torch_missing_is_a_typed_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingDependencyError, match="PyTorch"):
        att.bind(None, at.optim.SGD(lr=0.1))


def test_dict_path_still_works_on_a_bound_engine():
    model, engine = _bind("frozen", torch.float32, missing="zero")
    g = {n: np.full(p.shape, 0.1, np.float32) for n, p in model.named_parameters() if p.requires_grad}
    report = engine.step(g)
    assert report.applied


def test_fp16_model_gets_a_loss_scaler_and_skips_overflow():
    model, engine = _bind("frozen", torch.float16)
    assert engine.loss_scaler is not None and engine.working.dtype == np.float16
    x, y = _data("frozen")
    before = engine.params.flat.copy()
    loss = nn.functional.cross_entropy(model(x.half()).float(), y)
    (loss * 1e30).backward()  # inf in float16
    report = engine.step()
    assert report.skipped and engine.loss_scale == 2.0**15
    np.testing.assert_array_equal(engine.params.flat, before)
    assert model.out.weight.grad.abs().max() == 0  # the low-precision buffer was handed over and cleared
    _, off = _bind("frozen", torch.float16, loss_scaler=None)
    assert off.loss_scaler is None


# -- CUDA: a CUDA module bound to a CuPy engine through DLPack (skips without a GPU) -------------
@pytest.fixture
def cupy(monkeypatch):
    require_cuda()
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA support here")
    # the reference runs on the CPU: keep cuDNN and cuBLAS in full float32 (no TF32)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    import cupy

    return cupy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_module_is_bound_without_copies(cupy, dtype):
    tdtype = DTYPES[dtype]
    model = make("cnn", tdtype).cuda()
    engine = att.bind(model, at.optim.AdamW(lr=LR, weight_decay=WD), max_grad_norm=MAX_NORM)
    assert isinstance(engine.params.flat, cupy.ndarray)
    weights = engine.working if engine.working is not None else engine.params
    for name, p in model.named_parameters():
        assert p.is_cuda and p.dtype == tdtype
        assert p.data_ptr() == weights[name].data.ptr, name
        if dtype == "float32":
            assert p.grad.data_ptr() == engine.grads[name].data.ptr, name
    ref = Reference("cnn", tdtype)
    x, y = _data("cnn")
    for i in range(20):
        loss, report = bound_step(model, engine, x.cuda(), y.cuda(), tdtype, (True, False)[i % 2])
        ref.step(x, y, set_to_none=(True, False)[i % 2])
        assert report.applied
    torch.cuda.synchronize()
    for (name, p), m in zip([(n, p) for n, p in model.named_parameters()], ref.master):
        np.testing.assert_allclose(cupy.asnumpy(engine.params[name]), m.detach().numpy(), **TOL[dtype],
                                   err_msg=name)
        assert p.data_ptr() == weights[name].data.ptr, name  # still the engine's memory after steps


def test_cuda_save_load_round_trip(cupy, tmp_path):
    model = make("cnn").cuda()
    engine = att.bind(model, at.optim.AdamW(lr=LR), max_grad_norm=MAX_NORM)
    x, y = _data("cnn")
    for _ in range(3):
        bound_step(model, engine, x.cuda(), y.cuda(), torch.float32, True)
    at.save(tmp_path / "cuda.safetensors", engine)
    fresh = make("cnn", seed=3).cuda()
    resumed = att.bind(fresh, at.optim.AdamW(lr=LR), max_grad_norm=MAX_NORM)
    at.load(tmp_path / "cuda.safetensors", resumed)
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), k


def test_a_cuda_gradient_for_a_cpu_bound_engine_is_refused():
    model = nn.Linear(2, 2)
    engine = att.bind(model, at.optim.SGD(lr=0.1))
    cuda_like = type("CudaGrad", (), {"__dlpack_device__": lambda self: (2, 0),
                                      "__dlpack__": lambda self, **k: None})()
    snap = engine_snapshot(engine)
    with pytest.raises((BackendError, at.errors.BackendUnavailableError)):
        engine.step({"weight": np.ones((2, 2), np.float32), "bias": cuda_like})
    assert snap == engine_snapshot(engine)

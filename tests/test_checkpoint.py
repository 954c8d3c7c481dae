"""Checkpoints: bitwise resume, the tree encoding, refused files, crash safety, no pickle."""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import arraytrain
from arraytrain import ArgumentTypeError, Engine, StateDictError, checkpoint
from arraytrain.checkpoint import FORMAT, FORMAT_VERSION, CheckpointError, load, save
from arraytrain.optim import SGD, Adam, AdamW
from arraytrain.optim import Adadelta, Adamax, NAdam, RAdam
from builders import random_params
from conftest import engine_snapshot

# Names that a separator-joined key would confuse: dots, slashes, spaces, unicode, a tag
# look-alike, and a zero-size parameter.
SHAPES = {"fc.weight": (3, 5), "fc/bias": (3,), "emb table": (4, 2), "ünï/çødé.w": (2, 2, 2),
          "$tensor": (1,), "empty": (0, 3)}

# One row per optimizer configuration: (factory, parameter dtypes to resume with). A new
# optimizer gets the round trip by adding a row.
OPTIMIZERS = {
    "sgd-momentum": (lambda: SGD(lr=0.05, momentum=0.9, weight_decay=0.01), (np.float64, np.float32)),
    "adam-amsgrad": (lambda: Adam(lr=0.02, betas=(0.9, 0.95), amsgrad=True, weight_decay=0.01),
                     (np.float64, np.float32)),
    "adamw": (lambda: AdamW(lr=0.02, weight_decay=0.1), (np.float64, np.float32)),
    # bfloat16 moments: slot leaves of another dtype than the parameters
    "adamw-bf16-state": (lambda: AdamW(lr=0.02, weight_decay=0.1, state_dtype="bfloat16"), (np.float32,)),
    # NAdam: a scalar of the optimizer's state (mu_product) next to the slots
    "nadam": (lambda: NAdam(lr=0.02, weight_decay=0.1, decoupled_weight_decay=True), (np.float64, np.float32)),
    "radam-bf16-state": (lambda: RAdam(lr=0.02, betas=(0.9, 0.9), state_dtype="bfloat16"), (np.float32,)),
    "adamax": (lambda: Adamax(lr=0.02, weight_decay=0.01), (np.float64,)),
    "adadelta": (lambda: Adadelta(lr=1.0, weight_decay=0.01), (np.float32,)),
}
RESUME = [pytest.param(opt, dtype, id=f"{opt}-{np.dtype(dtype).name}")
          for opt, (_, dtypes) in OPTIMIZERS.items() for dtype in dtypes]
TOTAL = 11  # micro-batch calls of a full run


def _table_engine(opt="adam-amsgrad", shapes=SHAPES, dtype=np.float64, zeros=False, optimizer=None, **kw):
    """An Engine in ``dtype`` of a row of OPTIMIZERS (or ``optimizer``) over random float64 parameters of
    ``shapes`` (seed 1), or zeros (a resume's target), accumulating 3 micro-batches and clipping at 2 by default."""
    kw.setdefault("accumulation_steps", 3)
    kw.setdefault("max_grad_norm", 2.0)
    params = {n: np.zeros(s) for n, s in shapes.items()} if zeros else random_params(shapes, seed=1)
    return Engine(params, optimizer or OPTIMIZERS[opt][0](), dtype=dtype, **kw)


def _run(e: Engine, calls) -> None:
    """Call i: gradients that depend on the parameters plus noise seeded by i, weight 1 + i % 3."""
    for i in calls:
        rng = np.random.default_rng(100 + i)
        e.step({n: 0.3 * np.asarray(p, np.float64) + rng.standard_normal(p.shape) for n, p in e.params.items()},
               weight=1 + i % 3)


@pytest.fixture
def ck(tmp_path):
    return tmp_path / "ck.safetensors"


# -- resume ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [4, 6, 8], ids=lambda k: f"after-{k}-micro")
@pytest.mark.parametrize("opt, dtype", RESUME)
def test_resume_from_file_is_bitwise(ck, opt, split, dtype):
    full = _table_engine(opt, dtype=dtype)
    _run(full, range(TOTAL))
    first = _table_engine(opt, dtype=dtype)
    _run(first, range(split))
    assert first.micro_batches == split % 3
    save(ck, first, extra={"epoch": split})
    resumed = _table_engine(opt, dtype=dtype, zeros=True)
    assert load(ck, resumed) == {"epoch": split}
    assert engine_snapshot(resumed) == engine_snapshot(first)
    for e in (first, resumed):
        _run(e, range(split, TOTAL))
        assert engine_snapshot(e) == engine_snapshot(full)
    assert resumed.state.step == TOTAL // 3


def test_load_keeps_the_engines_hyperparameters(ck):
    src = _table_engine("adamw")
    _run(src, range(4))
    save(ck, src)
    dst = _table_engine(optimizer=AdamW(lr=0.5, betas=(0.8, 0.9), weight_decay=0.0))
    load(ck, dst)
    assert dst.optimizer.lr == 0.5 and dst.optimizer.betas == (0.8, 0.9)
    assert engine_snapshot(dst)["params"] == engine_snapshot(src)["params"]


def test_other_hyperparameter_values_and_overrides_are_accepted(ck):
    """Array-free subtrees are values: a resumed run may change lr or its per-parameter overrides."""
    src = _table_engine(optimizer=SGD(lr=0.05, momentum=0.9,
                                      overrides={"fc*": {"lr": 0.1}, "emb*": {"weight_decay": 0.0}}))
    _run(src, range(5))
    save(ck, src)
    dst = _table_engine(zeros=True, optimizer=SGD(lr=0.01, momentum=0.9, overrides={"*.w": {"lr": 0.2}}))
    load(ck, dst)
    assert dst.optimizer.overrides == {"*.w": {"lr": 0.2}}
    assert engine_snapshot(dst) == engine_snapshot(src)


def test_betas_as_a_json_list_are_accepted(ck, tmp_path):
    """Another writer may store a tuple as a plain JSON list; the engine's template has a tuple."""
    src = _table_engine()
    _run(src, range(5))
    save(ck, src)

    def listify(tree):
        hp = tree["optimizer"]["hyperparameters"]
        hp["betas"] = hp["betas"]["$tuple"]

    path = _rewrite(ck, tmp_path / "list.safetensors", tree=listify)
    dst = _table_engine(zeros=True)
    load(path, dst)
    assert engine_snapshot(dst) == engine_snapshot(src)


def test_metadata_format_version_and_summary(ck):
    e = _table_engine("adam-amsgrad")
    _run(e, range(7))
    save(ck, e)
    with safe_open(str(ck), framework="numpy") as f:
        meta = f.metadata()
        keys = list(f.keys())
    assert meta["format"] == FORMAT == "arraytrain.checkpoint"
    assert meta["format_version"] == str(FORMAT_VERSION) == "1"
    assert meta["arraytrain_version"] == arraytrain.__version__
    summary = meta["summary"]
    assert summary.startswith("Adam(lr=0.02, betas=(0.9, 0.95), eps=1e-08, weight_decay=0.01, amsgrad=True")
    assert "), step 2; " in summary
    assert "6 parameters, 35 elements, float64" in summary
    # params, grads and three slots: 5 flat buffers of 6 parameters
    assert f"{len(keys)} tensors" in summary and len(keys) == 30
    assert json.loads(meta["extra"]) == {}


def test_overwrite_leaves_no_stray_files_and_new_files_follow_the_umask(ck, tmp_path):
    e = _table_engine()
    save(ck, e)
    _run(e, range(3))
    save(ck, e, extra={"n": 2})
    assert os.listdir(tmp_path) == [ck.name]
    assert load(ck, _table_engine(zeros=True)) == {"n": 2}
    umask = os.umask(0)
    os.umask(umask)
    assert ck.stat().st_mode & 0o777 == 0o666 & ~umask


# -- the tree encoding -----------------------------------------------------------------------------------


def _f16(*bits):
    return np.array(bits, dtype=np.uint16).view(np.float16)


def _bf16(*bits):
    return np.array(bits, dtype=np.uint16).view(ml_dtypes.bfloat16)


def _bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _nan(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _assert_identical(got, want, path="tree"):
    """Same types (tuple is not list), same keys in the same order, arrays and floats bit for bit."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            _assert_identical(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_identical(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert _bits(got) == _bits(want), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, path


def _hand_made_tree():
    return {
        "format": 1,
        "params": {
            # inf, -inf, NaN with a payload, -0, the smallest subnormal, 1
            "f16.w": _f16(0x7C00, 0xFC00, 0x7E01, 0x8000, 0x0001, 0x3C00),
            "bf16/w": _bf16(0x7F80, 0xFF80, 0x7FC1, 0x8000, 0x0001, 0x3F80).reshape(2, 3),
            "u16 counts": np.array([0, 1, 65535, 40000], dtype=np.uint16),
            "ünï/çødé.w": np.arange(6, dtype=np.float32).reshape(3, 2, 1),
            "$tensor": np.array([1.5, -0.0, np.inf]),
            "$$": np.array([True, False]),
            "": np.array(7, dtype=np.int64),
            "empty": np.zeros((0, 3), np.float32),
        },
        "floats": {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "-nan": -math.nan,
                   "payload": _nan(0x7FF8000000000123), "signalling": _nan(0x7FF0000000000001),
                   "-0": -0.0, "subnormal": 5e-324, "third": 1 / 3, "max": sys.float_info.max, "1e16": 1e16},
        "sequences": [(), [], (1, 2.5, None), ((True, "x"), [math.inf, (math.nan,)]),
                      [np.arange(3, dtype=np.float16), (_bf16(0x3F80), {"k": np.zeros(1, np.uint16)})]],
        "scalars": {"none": None, "true": True, "false": False, "big": 2**70, "neg": -3, "str": "ü/.$ x\n\"'"},
        "empty": {},
    }


def test_hand_made_tree_round_trips_bitwise(ck):
    tree = _hand_made_tree()
    extra = {"epoch": 7, "best": math.inf, "history": (1.5, math.nan), "$tuple": {"$$x": [None, -0.0]}}
    checkpoint._save_tree(str(ck), tree, extra)
    got, got_extra = checkpoint._read(str(ck), tree)
    _assert_identical(got, tree)
    _assert_identical(got_extra, extra)


def test_encoding_of_special_values_is_documented_json(ck):
    tree = {"a": {"$t": math.inf, "b": (1, -math.inf), "n": math.nan, "p": _nan(0xFFF8000000000001)}}
    checkpoint._save_tree(str(ck), tree, None)
    with safe_open(str(ck), framework="numpy") as f:
        encoded = json.loads(f.metadata()["tree"])
    assert encoded == {"a": {"$$t": {"$float": "inf"}, "b": {"$tuple": [1, {"$float": "-inf"}]},
                             "n": {"$float": "nan"}, "p": {"$float": "nan:0xfff8000000000001"}}}


def test_numpy_scalars_are_stored_as_python_scalars(ck):
    tree = {"f32": np.float32(0.1), "i": np.int64(-5), "b": np.bool_(True), "f16": np.float16(np.inf)}
    checkpoint._save_tree(str(ck), tree, None)
    got, _ = checkpoint._read(str(ck), tree)
    _assert_identical(got, {"f32": float(np.float32(0.1)), "i": -5, "b": True, "f16": math.inf})


def test_non_contiguous_array_is_stored_by_value(ck):
    a = np.arange(12.0).reshape(3, 4)[:, ::2]
    checkpoint._save_tree(str(ck), {"a": a}, None)
    got, _ = checkpoint._read(str(ck), {"a": a})
    np.testing.assert_array_equal(got["a"], a)


UNSTORABLE_STATE = {
    "object-array": {"a": np.array([None, 1], dtype=object)},
    "complex128": {"a": np.zeros(2, np.complex128)},
    "int-key": {"a": {1: 2.0}},
    "set": {"a": {1, 2}},
    "bytes": {"a": b"x"},
}


@pytest.mark.parametrize("case", list(UNSTORABLE_STATE))
def test_unstorable_state_is_refused_before_writing(ck, case):
    with pytest.raises(CheckpointError, match=r"^a: "):
        checkpoint._save_tree(str(ck), UNSTORABLE_STATE[case], None)
    assert not ck.exists() and os.listdir(ck.parent) == []


@pytest.mark.parametrize("extra", [{"w": np.zeros(2)}, {"s": {1}}, {2: "x"}, [1, 2], "epoch"],
                         ids=["array", "set", "int-key", "list", "str"])
def test_bad_extra_is_refused_before_writing(ck, extra):
    e = _table_engine()
    save(ck, e)
    old = ck.read_bytes()
    with pytest.raises(ArgumentTypeError, match="extra"):
        save(ck, e, extra=extra)
    assert ck.read_bytes() == old and os.listdir(ck.parent) == [ck.name]


def test_bad_arguments():
    e = _table_engine()
    with pytest.raises(ArgumentTypeError, match="path"):
        save(3, e)
    with pytest.raises(ArgumentTypeError, match="engine"):
        save("x.safetensors", object())
    with pytest.raises(ArgumentTypeError, match="engine"):
        load("x.safetensors", {"params": {}})


# -- refused files: a typed error naming the file, and the engine unchanged ------------------------------


def _rewrite(src, dst, *, meta=None, tree=None, tensors=None):
    """Copy a checkpoint with its metadata, its decoded tree JSON or its tensors mutated in place."""
    with safe_open(str(src), framework="numpy") as f:
        m = dict(f.metadata())
        t = {k: f.get_tensor(k) for k in f.keys()}
    if tree is not None:
        obj = json.loads(m["tree"])
        tree(obj)
        m["tree"] = json.dumps(obj)
    if meta is not None:
        meta(m)
    if tensors is not None:
        tensors(t)
    save_file(t, str(dst), metadata=m)
    return dst


def _saved(tmp_path, name="src", calls=7, **engine_kw):
    e = _table_engine(**engine_kw)
    _run(e, range(calls))
    path = tmp_path / f"{name}.safetensors"
    save(path, e)
    return path


def _header_len(path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def _cut(at):
    def make(tmp_path, good):
        data = good.read_bytes()
        n = _header_len(good)
        pos = {"1": 1, "7": 7, "8": 8, "header-mid": 8 + n // 2, "header-end": 8 + n, "data-1": 9 + n,
               "data-mid": (8 + n + len(data)) // 2, "last-byte": len(data) - 1}[at]
        path = tmp_path / f"cut{pos}.safetensors"
        path.write_bytes(data[:pos])
        return path
    return make


def _bytes(make_data):
    def make(tmp_path, good):
        path = tmp_path / "bytes.safetensors"
        path.write_bytes(make_data(good))
        return path
    return make


def _meta(mutate):
    return lambda tmp_path, good: _rewrite(good, tmp_path / "meta.safetensors", meta=mutate)


def _tree(mutate):
    return lambda tmp_path, good: _rewrite(good, tmp_path / "tree.safetensors", tree=mutate)


def _tensors(mutate):
    return lambda tmp_path, good: _rewrite(good, tmp_path / "tensors.safetensors", tensors=mutate)


def _from(**engine_kw):
    return lambda tmp_path, good: _saved(tmp_path, "other", **engine_kw)


def _foreign(metadata):
    def make(tmp_path, good):
        path = tmp_path / "foreign.safetensors"
        save_file({"weight": np.zeros((2, 2), np.float32)}, str(path), metadata=metadata)
        return path
    return make


def _set_step(value):
    def mutate(tree):
        tree["optimizer"]["step"] = value
    return mutate


def _drop_first(t):
    t.pop(next(iter(t)))


def _rename_tensor(t):
    t["renamed"] = t.pop(next(iter(t)))


def _reference_twice(tree):
    tree["params"]["fc/bias"] = tree["params"]["fc.weight"]


def _array_for_lr(tmp_path, good):
    return _rewrite(good, tmp_path / "hp.safetensors",
                    tree=lambda t: t["optimizer"]["hyperparameters"].update(lr={"$tensor": "lr"}),
                    tensors=lambda t: t.update(lr=np.zeros(1)))


RENAMED = {("fc.bias" if n == "fc/bias" else n): s for n, s in SHAPES.items()}
RESHAPED = {**SHAPES, "emb table": (2, 4)}

# case -> (make the file from the good checkpoint, what the message says)
FAULTS = {
    **{f"truncated-{at}": (_cut(at), "not a valid safetensors file")
       for at in ("1", "7", "8", "header-mid", "header-end", "data-1", "data-mid", "last-byte")},
    "trailing-bytes": (_bytes(lambda good: good.read_bytes() + b"\0\0\0"), "not a valid safetensors file"),
    "empty-file": (_bytes(lambda good: b""), "empty file"),
    "pickle-file": (_bytes(lambda good: pickle.dumps(_table_engine().state_dict())), "pickle"),
    "random-bytes": (_bytes(lambda good: np.random.default_rng(3).bytes(4096)), "not a valid safetensors file"),
    "random-header": (_bytes(lambda good: struct.pack("<Q", 200) + np.random.default_rng(4).bytes(300)),
                      "not a valid safetensors file"),
    "plain-safetensors": (_foreign(None), "not an arraytrain checkpoint"),
    "torch-safetensors": (_foreign({"format": "pt"}), "not an arraytrain checkpoint"),
    "newer-version": (_meta(lambda m: m.update(format_version="2")), "newer than this arraytrain reads"),
    "bad-version": (_meta(lambda m: m.update(format_version="one")), "format_version 'one'"),
    "no-tree": (_meta(lambda m: m.pop("tree")), "metadata lacks 'tree'"),
    "tree-not-json": (_meta(lambda m: m.update(tree="{'params': ")), "'tree' is not valid JSON"),
    "tree-nan-literal": (_meta(lambda m: m.update(tree='{"a": NaN}')), "'tree' is not valid JSON"),
    "tree-duplicate-key": (_meta(lambda m: m.update(tree='{"a": 1, "a": 2}')), "'tree' is not valid JSON"),
    "extra-not-mapping": (_meta(lambda m: m.update(extra="[1]")), "'extra' is a list"),
    "extra-with-tensor": (_meta(lambda m: m.update(extra='{"a": {"$tensor": "x"}}')), "tensor reference"),
    "unknown-tag": (_tree(lambda t: t.update(params={"$array": [1]})), "malformed tagged value"),
    "bad-float-tag": (_tree(_set_step({"$float": "1.5"})), r"optimizer\['step'\]: malformed"),
    "tensor-missing": (_tensors(_drop_first), "which the file lacks"),
    "tensor-unreferenced": (_tensors(lambda t: t.update(stray=np.zeros(1))), "does not reference"),
    "tensor-renamed": (_tensors(_rename_tensor), "which the file lacks"),
    "tensor-referenced-twice": (_tree(_reference_twice), "referenced twice"),
    "wrong-parameter-names": (_from(shapes=RENAMED), r"params: the checkpoint lacks \['fc/bias'\]; "
                                                     r"the checkpoint has unexpected \['fc.bias'\]"),
    "wrong-shape": (_from(shapes=RESHAPED), r"params\['emb table'\]: shape \(2, 4\) != engine shape \(4, 2\)"),
    "wrong-dtype": (_from(dtype=np.float32), r"params\['fc.weight'\]: dtype float32 != engine dtype float64"),
    "missing-slot": (_from(optimizer=Adam(lr=0.02)),
                     r"optimizer\['slots'\]: the checkpoint lacks \['max_exp_avg_sq'\]"),
    "other-optimizer": (_from(opt="sgd-momentum"), "the checkpoint is for 'SGD', the engine has 'Adam'"),
    "array-for-hyperparameter": (_array_for_lr,
                                 r"optimizer\['hyperparameters'\]: the checkpoint holds arrays where the engine "
                                 "holds a mapping"),
    "list-for-mapping": (_tree(lambda t: t.update(params=[t["params"]])),
                         "params: the engine holds a mapping, the checkpoint a list of 1"),
    # the engine's own checks, reported with the file name
    "step-not-int": (_tree(_set_step({"$float": "inf"})), "optimizer step: expected an int"),
    "step-negative": (_tree(_set_step(-1)), "optimizer step: expected an int"),
    "window-too-long": (_from(accumulation_steps=4, calls=3), "micro_batches: expected an int in"),
}


@pytest.mark.parametrize("case", list(FAULTS))
def test_refused_file_changes_nothing(tmp_path, case):
    make, message = FAULTS[case]
    good = _saved(tmp_path)
    path = make(tmp_path, good)
    target = _table_engine()
    _run(target, range(4))  # a state unlike the file's in every buffer
    before = engine_snapshot(target)
    with pytest.raises(CheckpointError, match=message) as info:
        load(path, target)
    assert isinstance(info.value, StateDictError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"{path}: ")
    assert engine_snapshot(target) == before


def test_fault_table_covers_every_kind_of_refusal():
    """The table holds every kind of bad file the module promises to refuse; the count is printed."""
    kinds = ("truncated-", "empty-file", "pickle-file", "random-bytes", "plain-safetensors", "newer-version",
             "wrong-parameter-names", "wrong-shape", "wrong-dtype", "missing-slot", "other-optimizer")
    assert all(any(case.startswith(k) for case in FAULTS) for k in kinds)
    print(f"\nrefused-file table: {len(FAULTS)} cases")


def test_cuts_across_the_header_are_refused(tmp_path):
    small = {"w.0": (2,)}
    good = _saved(tmp_path, opt="sgd-momentum", shapes=small)
    data = good.read_bytes()
    target = _table_engine("sgd-momentum", shapes=small)
    before = engine_snapshot(target)
    path = tmp_path / "cut.safetensors"
    end = 8 + _header_len(good)
    for pos in sorted({*range(1, 17), *range(17, end, 11), end - 1, end}):
        path.write_bytes(data[:pos])
        with pytest.raises(CheckpointError):
            load(path, target)
    assert engine_snapshot(target) == before


def test_missing_file_and_directory(tmp_path):
    e = _table_engine()
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "absent.safetensors", e)
    with pytest.raises(CheckpointError, match="not a regular file"):
        load(tmp_path, e)


# -- crash safety -----------------------------------------------------------------------------------------

BUILD = textwrap.dedent("""
    import numpy as np
    from arraytrain import Engine
    from arraytrain.optim import Adam

    def build():
        rng = np.random.default_rng(5)
        return Engine({"w": rng.standard_normal((4, 3)), "b": np.zeros(3)}, Adam(lr=0.1, amsgrad=True),
                      accumulation_steps=2)

    def train(e, n):
        for i in range(n):
            rng = np.random.default_rng(i)
            e.step({k: rng.standard_normal(v.shape) for k, v in e.params.items()})
""")

KILLED_BETWEEN_WRITE_AND_RENAME = BUILD + textwrap.dedent("""
    import os, sys
    from arraytrain.checkpoint import save
    e = build()
    train(e, 3)
    save(sys.argv[1], e, extra={"which": "A"})
    train(e, 2)
    os.replace = lambda *args, **kwargs: os._exit(1)  # the process dies right before the rename
    save(sys.argv[1], e, extra={"which": "B"})
    print("not reached")
""")


def test_kill_before_rename_keeps_the_old_checkpoint(ck, tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_WRITE_AND_RENAME, str(ck)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr
    assert "not reached" not in proc.stdout
    leftovers = sorted(os.listdir(tmp_path))
    assert ck.name in leftovers and len(leftovers) == 2  # checkpoint A and B's orphaned temporary file
    assert [n for n in leftovers if n != ck.name][0].startswith(f".{ck.name}.")
    ns: dict = {}
    exec(BUILD, ns)
    expected = ns["build"]()
    ns["train"](expected, 3)
    resumed = ns["build"]()
    assert load(ck, resumed) == {"which": "A"}
    assert engine_snapshot(resumed) == engine_snapshot(expected)


def _write_partial_then_fail(tensors, filename, metadata=None):
    with open(filename, "wb") as fh:
        fh.write(b"partial")
    raise OSError(28, "No space left on device")


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _fail(*args, **kwargs):
    raise OSError(5, "Input/output error")


WRITE_FAILURES = {
    "save_file-partial": (checkpoint._st_numpy, "save_file", _write_partial_then_fail, OSError),
    "save_file-interrupted": (checkpoint._st_numpy, "save_file", _interrupt, KeyboardInterrupt),
    "fsync": (os, "fsync", _fail, OSError),
    "replace": (os, "replace", _fail, OSError),
}


@pytest.mark.parametrize("case", list(WRITE_FAILURES))
@pytest.mark.parametrize("existing", [True, False], ids=["over-old", "new"])
def test_exception_while_writing_leaves_no_temp_file(ck, tmp_path, monkeypatch, case, existing):
    e = _table_engine()
    _run(e, range(2))
    if existing:
        save(ck, e, extra={"which": "old"})
        old = ck.read_bytes()
    _run(e, range(2, 5))
    obj, attr, replacement, error = WRITE_FAILURES[case]
    with monkeypatch.context() as m:
        m.setattr(obj, attr, replacement)
        with pytest.raises(error):
            save(ck, e, extra={"which": "new"})
    if existing:
        assert os.listdir(tmp_path) == [ck.name]
        assert ck.read_bytes() == old
        assert load(ck, _table_engine(zeros=True)) == {"which": "old"}
    else:
        assert os.listdir(tmp_path) == []


def test_short_write_is_caught_before_the_rename(ck, tmp_path, monkeypatch):
    e = _table_engine()
    save(ck, e)
    old = ck.read_bytes()
    real = checkpoint._st_numpy.save_file

    def short(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as fh:
            fh.truncate(os.path.getsize(filename) - 1)

    monkeypatch.setattr(checkpoint._st_numpy, "save_file", short)
    with pytest.raises(CheckpointError, match="does not read back"):
        save(ck, e)
    assert os.listdir(tmp_path) == [ck.name] and ck.read_bytes() == old


def test_missing_directory_leaves_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        save(tmp_path / "absent" / "ck.safetensors", _table_engine())
    assert os.listdir(tmp_path) == []


# -- no pickle ----------------------------------------------------------------------------------------


def _no_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    for name in ("load", "loads", "dump", "dumps", "Unpickler", "Pickler"):
        monkeypatch.setattr(pickle, name, refuse)


def test_no_pickle_written_or_read(ck, monkeypatch):
    e = _table_engine()
    _run(e, range(5))
    with monkeypatch.context() as m:
        _no_pickle(m)
        save(ck, e, extra={"epoch": 1})
    data = ck.read_bytes()
    assert not data.startswith(b"\x80") and data[:2] != b"\x80\x04"
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])  # safetensors: u64 length, then a JSON header
    assert header["__metadata__"]["format"] == FORMAT
    assert len(data) == 8 + n + sum(v["data_offsets"][1] - v["data_offsets"][0]
                                    for k, v in header.items() if k != "__metadata__")
    resumed = _table_engine(zeros=True)
    with monkeypatch.context() as m:
        _no_pickle(m)
        assert load(ck, resumed) == {"epoch": 1}
    assert engine_snapshot(resumed) == engine_snapshot(e)

"""``arraytrain compile`` (arraytrain.precompile): the jobs it plans, its refusals, the notice of a
step that compiles, and (slow tier) a cold cache filled ahead so that a new process's first step
compiles nothing."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import arraytrain as at
from arraytrain import _compile_notice, precompile
from arraytrain.cli import main
from arraytrain.errors import HyperparameterError
from arraytrain.precompile import Job, jobs


def test_jobs_are_the_combinations_that_exist():
    assert jobs("adamw") == [Job("adamw")]
    got = jobs("adamw,sophia", "float32,float64", "all")
    # sophia keeps no state in another dtype; low-precision state needs float32 parameters
    assert set(got) == {Job("adamw"), Job("adamw", "float64"), Job("adamw", state_dtype="bfloat16"),
                        Job("adamw", state_dtype="8bit"), Job("adamw", state_dtype="float8"), Job("sophia"),
                        Job("sophia", "float64")}
    assert set(got[:2]) == {Job("adamw", state_dtype="8bit"), Job("adamw", state_dtype="float8")}  # the slowest first
    # one working-copy signature serves bfloat16 and float16 copies
    assert jobs("sgd", working_dtypes="bfloat16,float16") == [Job("sgd", working_dtype="bfloat16")]
    assert len(jobs()) == len(precompile.optimizer_names())  # default: every optimizer, float32


@pytest.mark.parametrize("kwargs, flag", [
    ({"optimizers": "adamw,adamx"}, "--optimizers"),
    ({"optimizers": ""}, "--optimizers"),
    ({"dtypes": "float16"}, "--dtype"),
    ({"state_dtypes": "int8"}, "--state-dtype"),
    ({"working_dtypes": "bf16"}, "--working-dtype"),
    ({"device": "tpu"}, "--device"),
])
def test_unknown_names_are_refused_naming_the_flag(kwargs, flag):
    with pytest.raises(HyperparameterError, match=flag):
        jobs(**kwargs)


def test_no_combination_is_refused():
    with pytest.raises(HyperparameterError, match="no combination"):
        jobs("adamw", "float64", "bfloat16")


def test_cli_refusals_are_one_line_and_status_2(capsys):
    for argv in (["compile", "--optimizers", "adamx"], ["compile", "--processes", "0"],
                 ["compile", "--dtype", "float64", "--state-dtype", "8bit"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("arraytrain compile: error:") and err.count("\n") == 1, err


def test_cuda_without_a_gpu_is_refused(capsys):
    from cuda_family import cuda_usable

    if cuda_usable():
        pytest.skip("a GPU is usable here")
    assert main(["compile", "--optimizers", "sgd", "--device", "cuda"]) == 2
    err = capsys.readouterr().err  # CuPy's install hint, or no usable device
    assert err.startswith("arraytrain compile: error:") and ("CuPy" in err or "--device cuda" in err)
    assert err.count("\n") == 1


def test_command_names_the_engines_configuration():
    assert _compile_notice.command_for(at.optim.AdamW(), np.float32, None) == "arraytrain compile --optimizers adamw"
    assert _compile_notice.command_for(at.optim.Lion(state_dtype="8bit"), np.float32, "bfloat16") == (
        "arraytrain compile --optimizers lion --state-dtype 8bit --working-dtype bfloat16")
    assert _compile_notice.command_for(at.optim.SGD(), np.float64, None) == (
        "arraytrain compile --optimizers sgd --dtype float64")
    # SAM is not one of arraytrain train's optimizers: every optimizer then
    sam = at.optim.SAM(at.optim.SGD())
    assert _compile_notice.command_for(sam, np.float32, None) == "arraytrain compile"


class _Clock:
    seconds = 0.0


@pytest.mark.parametrize("took, shown", [(2.5, True), (0.4, False)])
def test_every_step_that_compiles_says_so(took, shown, monkeypatch, capsys):
    """Each step whose compiles took over a second prints a line; the first names the command."""
    monkeypatch.setattr(_compile_notice, "_shown", False)
    params = {"w": np.zeros((3, 4), np.float32)}
    engine = at.Engine(params, at.optim.AdamW(), max_grad_norm=1.0)
    clock = engine._compile_clock = _Clock()
    step = engine._step
    compiles = iter([took, 0.0, took])  # the third step meets a new signature

    def compiling(*args):
        clock.seconds += next(compiles)
        return step(*args)

    monkeypatch.setattr(engine, "_step", compiling)
    for _ in range(3):
        engine.step({"w": np.ones((3, 4), np.float32)})
    lines = capsys.readouterr().err.splitlines()
    if shown:
        assert len(lines) == 2 and all(f"compiled kernels for {took:.1f} s" in line for line in lines)
        assert lines[0].endswith("To compile them ahead: arraytrain compile --optimizers adamw")
        assert "did not use" in lines[1]
    else:
        assert lines == []


def test_the_reference_kernels_never_notice():
    engine = at.Engine({"w": np.zeros(3)}, at.optim.SGD(lr=0.1), kernels="reference")
    assert engine._compile_clock is None


def test_run_in_process_counts_what_it_compiled():
    """A job's second run finds everything in this process: nothing compiled (the suite's warm-up
    compiled the first one ahead)."""
    job = Job("sgd")
    precompile.run(job)
    assert precompile.run(job) == (0.0, 0)


# A new process: the first two SGD steps of an Engine's defaults (the second reads the gradients where
# they lie), what they compiled (names) and how long the first took.
FIRST_STEP = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import arraytrain as at
    from arraytrain.kernels.cpu._jit import COMPILE_CLOCK
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((300, 300)).astype(np.float32), "b": np.zeros(300, np.float32)}
    engine = at.Engine(params, at.optim.SGD(lr=0.1, momentum=0.9), max_grad_norm=1.0)
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    start = time.perf_counter()
    engine.step(grads)
    seconds = time.perf_counter() - start
    engine.step(grads)
    print(json.dumps({"seconds": seconds, "compiled": COMPILE_CLOCK.compiled}))
""")


def _run(args, cache, code=False):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    cmd = [sys.executable, "-c", args] if code else [sys.executable, "-m", "arraytrain", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.slow  # the slow tier: fresh processes on cold caches
def test_compiled_ahead_the_first_step_compiles_nothing(tmp_path):
    cold = _run(FIRST_STEP, tmp_path / "cold", code=True)
    report = json.loads(cold.stdout)
    assert report["compiled"]  # a cold cache: the step compiled ...
    assert "arraytrain compile --optimizers sgd" in cold.stderr  # ... and said how to avoid it
    ahead = _run(["compile", "--optimizers", "sgd", "--processes", "2"], tmp_path / "ahead")
    line = ahead.stdout.strip().splitlines()[-1]
    assert line.startswith("compiled ") and " 0 kernel signatures" not in line, ahead.stdout
    report = json.loads(_run(FIRST_STEP, tmp_path / "ahead", code=True).stdout)
    assert report["compiled"] == []
    again = _run(["compile", "--optimizers", "sgd", "--quiet"], tmp_path / "ahead")
    assert again.stdout.startswith("compiled 0 kernel signatures for 1 configuration")
    assert again.stderr == ""


# A new process: two steps of the torch drop-in AdamW in the tutorials' loop (fresh .grad tensors, read where
# they lie, each step one compiled call), and what they compiled.
DROP_IN_STEPS = textwrap.dedent("""
    import json
    import torch
    from arraytrain.interop import torch as att
    from arraytrain.kernels.cpu._jit import COMPILE_CLOCK
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = att.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
    print(json.dumps({"compiled": COMPILE_CLOCK.compiled}))
""")


@pytest.mark.slow  # the slow tier: fresh processes on cold caches
def test_compiled_ahead_the_drop_in_steps_compile_nothing(tmp_path):
    pytest.importorskip("torch")
    _run(["compile", "--optimizers", "adamw", "--processes", "2", "--quiet"], tmp_path)
    report = json.loads(_run(DROP_IN_STEPS, tmp_path, code=True).stdout.strip().splitlines()[-1])
    assert report["compiled"] == []


def test_progress_lines_without_a_terminal():
    out = io.StringIO()
    summary = precompile.compile_ahead([Job("sgd")], processes=1, file=out)
    assert summary["jobs"] == 1 and summary["processes"] == 1
    assert out.getvalue().startswith("[1/1] sgd float32: ")

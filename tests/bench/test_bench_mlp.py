"""The MLP throughput benchmark compares like with like, and its report has the promised structure."""

from __future__ import annotations

import json

import numpy as np
import pytest

from arraytrain.bench import mlp
from arraytrain.bench.__main__ import main as bench_main

pytestmark = pytest.mark.slow  # the slow tier: the benchmarks' smoke runs (tiny settings, real subprocesses)

SIZES = [12, 16, 8, 5]
TORCH = [name for name in mlp.CONTESTANTS if name.startswith("torch")]


@pytest.mark.parametrize("opt", mlp.OPTIMIZERS)
@pytest.mark.parametrize("name", TORCH)
def test_torch_contestant_trains_the_same_model(opt, name):
    pytest.importorskip("torch")
    params = mlp.init_params(SIZES, seed=0)
    data = mlp.make_data(SIZES, 6, seed=0)
    ours = mlp.make_arraytrain(SIZES, 6, opt, params, data)
    theirs = mlp.CONTESTANTS[name](SIZES, 6, opt, params, data)
    assert ours.params().keys() == theirs.params().keys() == params.keys()
    for _ in range(4):  # the factories took one step already; cycles through every batch
        ours()
        theirs()
        np.testing.assert_allclose(theirs.loss(), ours.loss(), rtol=1e-5)
    moved = 0
    for key, a in ours.params().items():
        b = theirs.params()[key]
        assert a.shape == b.shape, key  # torch's (out, in) weights come back as (in, out)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=key)
        moved += not np.allclose(a, params[key], rtol=0, atol=1e-7)
    assert moved == len(params)  # every parameter trained, so the comparison is not vacuous


def test_flop_accounting():
    sizes = [4, 3, 2]
    assert mlp.num_params(sizes) == 4 * 3 + 3 + 3 * 2 + 2
    # forward and weight gradient of both layers, input gradient of the second only
    assert mlp.matmul_flops(sizes, 5) == 5 * (2 * 2 * 4 * 3 + 3 * 2 * 3 * 2)
    assert mlp.matmul_share([784, 1024, 256, 10]) == pytest.approx(0.749, abs=1e-3)
    assert mlp.num_params(mlp.parse_shape(mlp.SHAPES[0])) == 1_068_810
    assert 9.5e6 < mlp.num_params(mlp.parse_shape(mlp.SHAPES[1])) < 10.5e6


def test_gemm_roof_runs_the_step_matmuls():
    call, flops = mlp.make_gemm([6, 5, 3], 4)
    call()
    assert flops == mlp.matmul_flops([6, 5, 3], 4)


def test_cli_tiny_run(tmp_path, capsys):
    out = tmp_path / "mlp.json"
    names = ["arraytrain"] + TORCH
    rc = bench_main(["mlp", "--shapes", "12-16-5,10-8-3", "--batches", "4,8", "--optimizers", "sgd,adamw",
                     "--contestants", ",".join(names), "--steps", "2", "--rounds", "2", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    ran = [n for n in names if n not in doc["missing"]]
    assert "arraytrain" in ran
    assert len(doc["rows"]) == 2 * 2 * 2
    for row in doc["rows"]:
        assert set(row["samples_per_second"]) == set(ran)
        assert all(len(v) == 2 and min(v) > 0 for v in row["samples_per_second"].values())
        assert row["gemm_gflops"] > 0
    assert len(doc["records"]) == len(doc["rows"]) * len(ran)
    for rec in doc["records"]:
        assert rec["samples_per_second"] > 0 and rec["fraction_of_gemm_roof"] > 0
        if any(n.startswith("torch") for n in ran):
            assert rec["vs_torch"] > 0
    assert doc["matmul_share"]["12-16-5"] == pytest.approx(mlp.matmul_share([12, 16, 5]))
    text = capsys.readouterr().out
    assert "| 12-16-5 | 0.00M | 4 | sgd | arraytrain |" in text
    assert "% roof (6P)" in text


@pytest.mark.parametrize("args", [["--optimizers", "lion"], ["--shapes", "784-x-10"], ["--shapes", "784"],
                                  ["--batches", "0"], ["--contestants", "jax"], ["--steps", "0"]])
def test_cli_rejects_bad_arguments(args):
    with pytest.raises(SystemExit):
        mlp.main(args)

"""The distributed benchmark runs end to end on tiny settings (it launches mpiexec itself)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from arraytrain import cli
from arraytrain.bench import compression
from arraytrain.bench import distributed as bench
from arraytrain.distributed import find_mpiexec

pytestmark = pytest.mark.slow  # the slow tier: the benchmarks' smoke runs (tiny settings, real subprocesses)

def _need_mpi():
    if importlib.util.find_spec("mpi4py") is None or find_mpiexec() is None:
        pytest.skip('needs mpi4py and mpiexec: pip install "arraytrain[mpi]"')


def test_wire_bytes_of_the_ring_algorithms():
    assert bench.wire_bytes(1000, 1, True) == 0
    assert bench.wire_bytes(1000, 4, True) == 1500  # all-reduce: 2 (K-1)/K
    assert bench.wire_bytes(1000, 4, False) == 3000  # all-gather: (K-1)
    assert bench.wire_bytes(1000, 2, True) == bench.wire_bytes(1000, 2, False)


@pytest.mark.parametrize("key", sorted(compression.METHODS))
@pytest.mark.parametrize("ef", [False, True])
def test_the_cli_spec_builds_the_same_compressor(key, ef):
    comp = compression.METHODS[key][1](3, ef)
    method, kwargs = cli.arguments.compress_spec(bench.cli_spec(comp))
    again = getattr(__import__("arraytrain").compress, cli.COMPRESSORS[method])(**kwargs)
    assert again.describe() == comp.describe()


@pytest.mark.parametrize("ef", [False, True])
def test_the_gathered_methods_are_those_whose_payloads_do_not_add_up(ef):
    gathered = {key for key, (_, make) in compression.METHODS.items() if bench._gathered(make(0, ef))}
    assert gathered == {"topk", "sign", "ternary"}


def test_allreduce_scaling_and_projection_on_tiny_settings(tmp_path, capsys):
    _need_mpi()
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "d.json", tmp_path / "d.png"
    rc = bench.main(["--parts", "allreduce,scaling,projection", "--sizes", "1e3", "--rounds", "1", "--reps", "3",
                     "--scaling-ranks", "1,2", "--scaling-size", "1e4", "--compress-size", "2e4",
                     "--methods", "topk,int8", "--steps", "2", "--timeout", "240",
                     "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "% of mpi4py |" in text and "| 2 |" in text and "| top-k 1% + EF | all-gather |" in text
    data = json.loads(out_json.read_text())
    rows = {r["method"]: r for r in data["projection"]["rows"]}
    assert set(rows) == {"dense", "topk", "int8"}
    assert rows["topk"]["summed"] is False and rows["int8"]["summed"] is True and rows["dense"]["summed"]
    n = rows["int8"]["dense_bytes"] // 4
    assert rows["int8"]["payload_bytes"] == 2 * n + 4 * -(-n // 256)  # int16 sums of codes in a group
    assert rows["dense"]["payload_bytes"] == 4 * n
    assert data["allreduce"]["rows"][0]["fraction"] > 0
    assert [r["ranks"] for r in data["scaling"]["rows"]] == [1, 2]
    assert out_png.stat().st_size > 10_000


def test_accuracy_on_tiny_settings(tmp_path, capsys):
    _need_mpi()
    pytest.importorskip("sklearn")
    out_json = tmp_path / "a.json"
    rc = bench.main(["--parts", "accuracy", "--methods", "topk", "--accuracy-ranks", "2", "--epochs", "1",
                     "--timeout", "240", "--json", str(out_json)])
    assert rc == 0
    assert "| top-k 1% | yes |" in capsys.readouterr().out
    data = json.loads(out_json.read_text())
    runs = {(r["method"], r["ef"]): r for r in data["accuracy"]["runs"]}
    assert set(runs) == {("none", False), ("topk", False), ("topk", True)}
    assert all(0 <= r["accuracy"] <= 1 and r["processes"] == 2 for r in runs.values())
    assert runs[("topk", True)]["bytes_per_step"] * 16 < runs[("none", False)]["bytes_per_step"]


def test_bad_arguments(capsys):
    assert bench.main(["--parts", "nope"]) == 2
    assert "unknown ['nope']" in capsys.readouterr().err


def test_sharding_on_tiny_settings(tmp_path, capsys):
    _need_mpi()
    out_json = tmp_path / "s.json"
    rc = bench.main(["--parts", "sharding", "--shard-ranks", "2", "--shard-size", "1e5", "--steps", "2",
                     "--timeout", "240", "--json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| 2 | fp32 | sharded |" in text and "sharded / replicated speed" in text
    rows = json.loads(out_json.read_text())["sharding"]["rows"]
    assert [r["ranks"] for r in rows] == [1, 2]
    one, two = rows[0]["memory"], rows[1]["memory"]
    chunk = 16384 * 4 * 2  # one reduction chunk of padding per slot
    assert two["fp32/sharded"]["state"] <= one["fp32/replicated"]["state"] / 2 + chunk
    assert two["bf16/sharded"]["params"] == 0 and two["bf16/sharded"]["master"] > 0
    # 8-bit state lays the 100 tensors of 1000 elements (all under the 4096-element threshold: float32)
    # on 256-element blocks, 7 chunks of which rank 0 owns 4: per slot a code per element of its 65,536
    # and the float32 values of its 64 tensors
    assert two["8bit/sharded"]["state"] == 2 * (65536 + 4 * 64 * 1000)
    assert rows[1]["same_weights"]["fp32"] or rows[1]["max_rel_diff"]["fp32"] < 1e-5
    assert set(rows[1]["step_s"]) == {"fp32/replicated", "fp32/sharded", "8bit/replicated", "8bit/sharded"}


def test_overlap_on_tiny_settings(tmp_path, capsys):
    _need_mpi()
    out_json = tmp_path / "o.json"
    rc = bench.main(["--parts", "overlap", "--overlap-widths", "20,64,32,10", "--overlap-batch", "8",
                     "--overlap-bucket-mib", "0.005", "--steps", "2", "--timeout", "240", "--json", str(out_json)])
    assert rc == 0
    assert "| MPIComm's progress thread and the marks' tests |" in capsys.readouterr().out
    runs = json.loads(out_json.read_text())["overlap"]["runs"]
    assert len(runs) == 3 and all(r["same_weights"] and r["buckets"] > 1 for r in runs.values())


def test_vs_ddp_on_tiny_settings(tmp_path, capsys):
    _need_mpi()
    pytest.importorskip("torch")
    out_json, out_png = tmp_path / "v.json", tmp_path / "v.png"
    rc = bench.main(["--vs-ddp", "--ddp-models", "MLP 4x1024 (4.2M)", "--ddp-batch", "2", "--steps", "1",
                     "--timeout", "240", "--json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| torch DDP |" in text and "| arraytrain, TorchComm, overlapped |" in text
    assert "| torch DDP + PowerSGD |" in text and "| arraytrain, MPIComm, sharded + overlapped |" in text
    assert "losses agree with DDP's to 1e-4: True" in text
    res = json.loads(out_json.read_text())["vs_ddp"]["MLP 4x1024 (4.2M)"]
    assert len(res["step_s"]) == 13 and res["params"] == 4 * (1024 * 1024 + 1024)
    assert "| arraytrain, MPIComm, sharded + overlapped, gathered in forward |" in text

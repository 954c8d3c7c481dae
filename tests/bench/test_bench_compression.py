"""The compression benchmarks run end to end on tiny settings and report measured bytes."""

from __future__ import annotations

import json
import math

import pytest

from arraytrain.bench import compression
from arraytrain.bench.__main__ import main as bench_main

pytestmark = pytest.mark.slow  # the slow tier: the benchmarks' smoke runs (tiny settings, real subprocesses)

def test_compression_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    rc = compression.main(["--methods", "topk,int8", "--seeds", "1", "--epochs", "1",
                           "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| top-k 1% | yes |" in text and "| uncompressed | — |" in text
    data = json.loads(out_json.read_text())
    runs = {(r["method"], r["ef"]): r for r in data["runs"]}
    assert set(runs) == {("none", False), ("topk", False), ("topk", True), ("int8", False), ("int8", True)}
    n = runs[("none", False)]["dense_bytes"] // 4  # float32 parameters of the digits MLP
    assert n == 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    assert runs[("none", False)]["bytes_per_step"] == 4 * n
    assert runs[("topk", True)]["bytes_per_step"] == math.ceil(0.01 * n) * 8  # uint32 index + float32 value
    blocks = math.ceil(n / 256)
    assert runs[("int8", False)]["bytes_per_step"] == n + 4 * blocks  # int8 codes + a float32 scale per block
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["steps"] > 0 for r in data["runs"])
    assert out_png.stat().st_size > 10_000


def test_compression_bad_method(capsys):
    assert compression.main(["--methods", "zip"]) == 2
    assert "unknown ['zip']" in capsys.readouterr().err


def test_throughput_table(capsys):
    rc = bench_main(["compress", "--sizes", "2e4", "--rounds", "1", "--reps", "1",
                     "--methods", "topk-1%,int8-256,powersgd-r4"])
    assert rc == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "method" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == ["topk-1%", "int8-256", "powersgd-r4", "np.argpartition 1%"]


def test_throughput_bad_method(capsys):
    assert compression.throughput_main(["--methods", "zip"]) == 2
    assert "unknown ['zip']" in capsys.readouterr().err

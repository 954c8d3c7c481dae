"""The simulated cluster (``python -m arraytrain.bench cluster``): namespaces joined by shaped links, MPI
across them on TCP, bytes read off the links, and nothing left behind, also after an error or a kill.
Needs root and iproute2 (skipped otherwise: the command then says why in one line)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from arraytrain.bench import cluster as bc
from arraytrain.distributed import find_mpiexec

pytestmark = pytest.mark.slow  # the slow tier: real namespaces, links and subprocesses


def _namespaces() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _ours(pid: int) -> set:
    return {n for n in _namespaces() if n.startswith(f"at{pid}-")}


@pytest.fixture
def need_root():
    why = bc.available()
    if why is not None:
        pytest.skip(why)


@pytest.fixture
def need_mpi(need_root):
    if importlib.util.find_spec("mpi4py") is None or find_mpiexec() is None:
        pytest.skip('needs mpi4py and mpiexec: pip install "arraytrain[mpi]"')


def test_without_root_the_command_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(bc, "available", lambda: "the simulated cluster needs root (CAP_NET_ADMIN) to ...")
    assert bc.main(["--models", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "root" in err


def test_bad_arguments_are_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="nodes"):
        bc.Cluster(1)
    with pytest.raises(ValueError, match="link_gbit"):
        bc.Cluster(2, 0.0)
    assert bc.main(["--models", "no such model"]) == 2


def test_a_shaped_link_carries_its_rate_and_the_cluster_leaves_nothing(need_root):
    with bc.Cluster(2, 1.0) as c:
        assert _ours(os.getpid()) == {*c.names, c.switch}
        rate = c.probe(megabytes=60)
        assert 0.7 < rate < 1.05, rate  # the token bucket's rate, less TCP's overhead
        # how busy each node's cores were while the bytes moved: a share, or None where the nodes share cores
        assert len(c.probe_busy) == 2
        assert all(b is None for b in c.probe_busy) if c.cpus is None else all(0 < b <= 1 for b in c.probe_busy)
        c.shape(0.5)  # mid-run
        assert 0.35 < c.probe(megabytes=30) < 0.53
        before = c.tx_bytes()
        assert c.run(1, ["true"]).returncode == 0
        assert len(before) == 2
    assert _ours(os.getpid()) == set()


def test_an_error_inside_the_block_removes_the_cluster_and_its_processes(need_root):
    with pytest.raises(RuntimeError, match="boom"):
        with bc.Cluster(2, 1.0) as c:
            p = c.popen(0, ["sleep", "60"])
            raise RuntimeError("boom")
    assert p.poll() is not None
    assert _ours(os.getpid()) == set()


def test_a_killed_run_is_cleaned_by_the_next_and_sigterm_cleans_its_own(need_root, tmp_path):
    code = ("import sys, time\nsys.path.insert(0, %r)\nfrom arraytrain.bench import cluster as bc\n"
            "with bc.Cluster(2, 1.0):\n    print('up', flush=True)\n    time.sleep(60)\n") % os.getcwd()
    for sig in (signal.SIGKILL, signal.SIGTERM):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "up"
        p.send_signal(sig)
        p.wait(timeout=30)
        if sig == signal.SIGTERM:
            assert _ours(p.pid) == set()  # removed on the way out
        else:  # killed outright: left behind until the next cluster starts (or another test's, meanwhile)
            bc.remove_stale()
            assert _ours(p.pid) == set()


def test_mpi_crosses_the_links_on_tcp(need_mpi):
    code = ("from mpi4py import MPI\nimport numpy as np\nc = MPI.COMM_WORLD\na = np.ones(2**20, np.float32)\n"
            "c.Allreduce(MPI.IN_PLACE, a)\nassert a[0] == c.size\nprint(f'rank{c.rank}ok', flush=True)\n")
    with bc.Cluster(2, 2.0) as c:
        before = c.tx_bytes()
        t = time.perf_counter()
        proc = c.run(0, c.mpiexec([sys.executable, "-c", code]), env=bc.MPI_ENV, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.count('ok') == 2 and 'rank0ok' in proc.stdout and 'rank1ok' in proc.stdout
        sent = [b - a for a, b in zip(before, c.tx_bytes())]
        # a 4 MiB all-reduce over 2 ranks: each node sends its half and the other's reduced half back
        assert all(sent_i > 4 * 2**20 for sent_i in sent), sent
        assert time.perf_counter() - t < 60


def test_torchrun_across_the_nodes_meets_at_node_0(need_root, tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "reduce.py"
    script.write_text("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "t = torch.ones(4) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
                      "print(f'rank{dist.get_rank()}of{dist.get_world_size()}sum{int(t[0])}', flush=True)\n"
                      "dist.destroy_process_group()\n")
    with bc.Cluster(2, 1.0) as c:
        env = {**bc.MPI_ENV, "OMP_NUM_THREADS": "1"}
        procs = [c.popen(i, c.torchrun(i, [script]), env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert "rank0of2sum3" in outs[0] and "rank1of2sum3" in outs[1]


def test_arraytrain_train_runs_across_the_nodes(need_mpi, tmp_path):
    summary = tmp_path / "s.json"
    env = {**bc.MPI_ENV, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    with bc.Cluster(2, 1.0) as c:
        proc = c.run(0, c.mpiexec([sys.executable, "-m", "arraytrain", "train", "--epochs", "1", "--no-progress",
                                   "--json", summary]), env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 processes" in proc.stdout and json.loads(summary.read_text())["processes"] == 2


def test_arraytrain_train_runs_across_the_nodes_under_torchrun(need_root, tmp_path):
    pytest.importorskip("torch")
    summary = tmp_path / "s.json"
    env = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "GLOO_SOCKET_IFNAME": "eth0"}
    with bc.Cluster(2, 1.0) as c:
        procs = [c.popen(node, c.torchrun(node, ["-m", "arraytrain", "train", "--epochs", "1", "--no-progress",
                                                 "--json", summary]), env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True) for node in (0, 1)]
        outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert "2 processes" in outs[0][0] and json.loads(summary.read_text())["processes"] == 2


def test_ranks_that_mpi_started_in_other_nodes_end_with_the_cluster(need_mpi):
    """Hydra's proxies put the ranks in sessions of their own: closing the cluster kills what runs in its
    namespaces too, also with a node's link down (a rank there would wait on the network forever)."""
    with bc.Cluster(2, 1.0) as c:
        c.popen(0, c.mpiexec([sys.executable, "-c", "import time; time.sleep(120)"]), bc.MPI_ENV)
        deadline = time.monotonic() + 30
        while not (inside := subprocess.run(["ip", "netns", "pids", c.names[1]], capture_output=True,
                                            text=True).stdout.split()):
            assert time.monotonic() < deadline, "no rank started in node 1"
            time.sleep(0.2)
        c.set_link(1, False)
    time.sleep(0.5)
    assert not [pid for pid in inside if _running(pid)]


def _running(pid: str) -> bool:
    """A process that exists and is not a zombie (killed, waiting for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_delay_needs_netem_and_says_so_where_the_kernel_lacks_it(need_root):
    try:
        with bc.Cluster(2, 1.0, delay_us=100) as c:
            assert c.probe(megabytes=10) > 0.5  # netem there: the link still carries its rate
    except bc.ClusterUnavailable as exc:
        assert "netem" in str(exc)
    assert _ours(os.getpid()) == set()


def _train_in_cluster(c, tmp_path, *flags):
    """``arraytrain train`` on every node under mpiexec; each rank's stderr in ``tmp_path/rank-R.err`` (a rank
    cut off from node 0 cannot send its output there). Returns the running mpiexec, its stdout a pipe."""
    env = {**bc.MPI_ENV, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(),
           "PYTHONUNBUFFERED": "1"}
    argv = ["sh", "-c", f'exec "$0" "$@" 2>{tmp_path}/rank-$PMI_RANK.err', sys.executable, "-m", "arraytrain",
            "train", "--no-progress", *flags]
    return c.popen(0, c.mpiexec(argv), env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ranks_left(c) -> list:
    """The ranks still running in the nodes (not Hydra's launcher and proxies)."""
    def rank(pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                return f.read().split("\0")[:4] == [sys.executable, "-m", "arraytrain", "train"] and _running(pid)
        except FileNotFoundError:
            return False

    return [pid for n in c.names for pid in subprocess.run(["ip", "netns", "pids", n], capture_output=True,
                                                           text=True).stdout.split() if rank(pid)]


def test_a_link_taken_down_mid_run_ends_every_rank_at_its_deadline(need_mpi, tmp_path):
    """Node 1's link goes down in the middle of an epoch: each rank writes one CommTimeoutError line and ends
    within its 5 s limit (and a tick); the checkpoints written before are whole. mpiexec itself waits for node
    1's launcher until the link is back (Hydra's, not a rank's), then ends non-zero."""
    import safetensors

    with bc.Cluster(2, 1.0) as c:
        p = _train_in_cluster(c, tmp_path, "--epochs", "100", "--hidden", "1024,1024", "--comm-timeout", "5",
                              "--save", tmp_path / "ck-{epoch}.safetensors", "--checkpoint-every", "2")
        for line in p.stdout:
            if line.startswith("epoch 3/"):
                break
        else:
            pytest.fail(f"the run ended before its third epoch: {p.stderr.read()[-2000:]}")
        time.sleep(0.3)  # into the fourth epoch: no checkpoint is being written
        c.set_link(1, False)
        down = time.monotonic()
        while _ranks_left(c):
            assert time.monotonic() - down < 30, "a rank outlived its deadline by far"
            time.sleep(0.2)
        took = time.monotonic() - down
        assert 4.5 < took < 20, took
        for r in (0, 1):
            lines = [ln for ln in (tmp_path / f"rank-{r}.err").read_text().splitlines() if "CommTimeoutError" in ln]
            assert len(lines) == 1 and lines[0].startswith(f"arraytrain: CommTimeoutError: rank {r} of 2: "), lines
            assert "over its limit of 5 s" in lines[0]
        c.set_link(1, True)
        assert p.wait(timeout=30) != 0
    left = sorted(f.name for f in tmp_path.iterdir())
    assert left == ["ck-2.safetensors", "rank-0.err", "rank-1.err"], left  # no half-written file, no work folder
    with safetensors.safe_open(tmp_path / "ck-2.safetensors", framework="numpy") as f:
        assert len(list(f.keys())) > 0


def test_a_link_slowed_to_a_tenth_mid_run_slows_the_run_without_errors(need_mpi, tmp_path):
    with bc.Cluster(2, 1.0) as c:
        p = _train_in_cluster(c, tmp_path, "--epochs", "4", "--hidden", "512,512", "--comm-timeout", "5")
        seconds = []
        for line in p.stdout:
            if line.startswith("epoch "):
                seconds.append(float(line.rsplit("(", 1)[1].split()[0]))
                if len(seconds) == 2:
                    c.shape(0.1)
        assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]
    errs = "".join((tmp_path / f"rank-{r}.err").read_text() for r in (0, 1))
    assert "CommTimeoutError" not in errs and "Traceback" not in errs, errs
    assert len(seconds) == 4 and seconds[3] > 2 * seconds[1], seconds


EXAMPLE = os.path.join(os.getcwd(), "examples", "torchrun_train.py")


def _losses_after(text: str, step: int) -> list:
    return [(int(k), v) for k, v in re.findall(r"step (\d+): loss (\S+)", text) if int(k) > step]


def test_a_node_lost_under_elastic_torchrun_leaves_the_survivor_resuming_on_fewer_ranks(need_root, tmp_path):
    """``torchrun --nnodes 1:2 --max-restarts 3`` on both nodes, the example saving every 20 steps; node 1 is
    lost (link down, its processes killed) after step 60 is saved. Node 0's rank ends at its deadline (one
    line), torchrun restarts it alone, it resumes from the last checkpoint on one rank and finishes; its
    losses and final weights equal a fresh one-process run from that checkpoint."""
    pytest.importorskip("torch")
    from safetensors.numpy import load_file

    run, fresh = tmp_path / "run", tmp_path / "fresh"
    run.mkdir(), fresh.mkdir()
    env = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "PYTHONUNBUFFERED": "1",
           "GLOO_SOCKET_IFNAME": "eth0", "ARRAYTRAIN_COMM_TIMEOUT": "5"}
    script = [EXAMPLE, "--steps", "200", "--every", "20", "--print-every", "1"]
    with bc.Cluster(2, 1.0) as c:
        procs = [c.popen(node, c.torchrun(node, [*script, "--checkpoint-dir", run], nnodes="1:2",
                                          rdzv_conf={"last_call_timeout": 3},
                                          extra=["--max-restarts=3", "--monitor-interval=1"]),
                         env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
        deadline = time.monotonic() + 240
        while not (run / "step-60.safetensors").exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, "no step 60 from the two nodes"
            time.sleep(0.1)
        c.kill_node(1)
        lost = time.monotonic()
        out, _ = procs[0].communicate(timeout=240)
        took = time.monotonic() - lost
    assert procs[0].returncode == 0, out[-3000:]
    assert out.count("CommTimeoutError") == 1 and "arraytrain: CommTimeoutError: rank 0 of 2: " in out, out[-3000:]
    resumed = re.findall(r"resumed from (\S+) at step (\d+) on 1 rank\(s\)", out)
    assert len(resumed) == 1 and int(resumed[0][1]) >= 60, out[-3000:]
    assert "200 AdamW steps on 1 rank(s) over gloo" in out and took < 200, took
    step = int(resumed[0][1])
    shutil.copy(run / f"step-{step}.safetensors", fresh)
    alone = subprocess.run([sys.executable, EXAMPLE, *script[1:], "--checkpoint-dir", str(fresh)], capture_output=True,
                           text=True, timeout=180, env={**os.environ, **env})
    assert alone.returncode == 0, alone.stderr[-2000:]
    got, want = _losses_after(out[out.rindex("resumed from"):], step), _losses_after(alone.stdout, step)
    assert len(got) == 200 - step and got == want
    a, b = load_file(run / "step-200.safetensors"), load_file(fresh / "step-200.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_compression_end_to_end_on_a_slow_link(need_mpi, tmp_path, capsys):
    """``bench tta`` at 0.5 Gbit/s: the dense run and ``--compress auto`` across the nodes; auto measures
    the link, chooses a compressor on both ranks, and sends far fewer bytes than dense."""
    from arraytrain.bench import tta

    out = tmp_path / "tta.json"
    assert tta.main(["--link", "0.5", "--compress", "dense;auto", "--seeds", "0", "--json", str(out),
                     "--train", "--hidden 512,512 --batch-size 64 --epochs 2"]) == 0
    runs = {r["spec"]: r for r in json.loads(out.read_text())["results"][0]["runs"]}
    assert runs["dense"]["decisions"] == [] and runs["dense"]["accuracy"] > 0.8
    chose = runs["auto"]["decisions"]
    assert len(chose) == 1 and chose[0]["choice"] in ("powersgd", "topk") and chose[0]["rate_gbit_s"] < 0.6
    assert runs["auto"]["node_bytes"] < runs["dense"]["node_bytes"] / 3
    shown = capsys.readouterr().out
    assert "| auto |" in shown and "| dense |" in shown


def test_the_language_model_reaches_its_target_under_ddp_and_bind(need_mpi, tmp_path, capsys):
    """``bench tta --task lm`` in small: torch DDP + PowerSGD's hook and bind with auto train the character
    model on the standard library's sources to a (loose) validation loss, the clock and bytes counted."""
    pytest.importorskip("torch")
    from arraytrain.bench import tta

    out = tmp_path / "lm.json"
    lm = {"d_model": 32, "layers": 1, "seq": 16, "batch": 8, "target": 3.5, "eval_every": 10, "max_steps": 200,
          "megabytes": 0.2, "contestants": ["torch DDP + PowerSGD", "arraytrain auto"]}
    assert tta.main(["--task", "lm", "--link", "0.5", "--json", str(out), "--lm", json.dumps(lm)]) == 0
    res = json.loads(out.read_text())["results"][0]
    for label in lm["contestants"]:
        r = res["results"][label]
        assert r["reached"] and r["val_loss"] <= 3.5 and r["seconds"] > 0 and r["node_bytes"] > 0
        assert r["curve"][-1][0] == r["steps"] and r["steps"] % 10 == 0
    assert [d["choice"] for d in res["results"]["arraytrain auto"]["decisions"]] != []
    assert "| arraytrain auto | yes |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, said", [
    (["--link", "0"], "--link, --seeds"), (["--link", "fast"], "--link, --seeds"), (["--seeds", "a"], "--seeds"),
    (["--task", "lm", "--lm", "{bad json"], "--lm: expected a JSON object"),
    (["--task", "lm", "--lm", '{"d_modle": 64}'], "--lm: expected a JSON object"),
])
def test_tta_refuses_bad_settings_in_one_line_before_any_cluster(argv, said, capsys):
    from arraytrain.bench import tta

    assert tta.main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1

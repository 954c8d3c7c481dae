"""``python -m arraytrain.bench cluster``: a small cluster on this machine, and the exchange measured on it.

Every other distributed figure comes from processes of one machine that talk through shared
memory. Here each node is a Linux network namespace with one interface, ``eth0`` (address
``10.77.0.<i+1>``), joined to the others by a veth pair into a bridge that lives in a namespace of
its own (the machine's own network is not touched). Each link is shaped in both directions by a
token bucket (``tc qdisc ... tbf``) to ``--link`` Gbit/s, so a node sends and receives at most that;
``--delay-us`` adds a one-way delay with ``netem`` where the kernel has it. The link is probed
(one TCP stream from node 1 to node 0) before anything is timed, and the probed rate is printed,
with how busy each node's cores were while the bytes moved (the links are software: their work
runs on the nodes' own cores).

Ranks run inside the nodes: ``mpiexec`` across the nodes through Hydra's ``ssh`` launcher, whose
command is a script that enters the node's namespace instead of logging in (see
:meth:`Cluster.mpiexec`), with MPI kept off shared memory (``MPIR_CVAR_NOLOCAL=1``: the nodes share
the machine's hostname, and MPICH would otherwise move their bytes through shared memory, around
the shaped links) and on TCP; ``torchrun`` per node with a c10d rendezvous on node 0's address
(:meth:`Cluster.torchrun`). Each node gets cores of its own where the machine has enough: its
processes run under ``taskset`` on an equal share, with the thread counts of OpenMP, OpenBLAS, MKL
and numba set to that share (``pin=False``: every core shared). Bytes on the wire are each node's
own ``eth0`` counters.

Every namespace, link and process is removed when the cluster closes, also after an error,
Ctrl-C or SIGTERM; namespaces left by a cluster whose process was killed outright are removed by
the next one. Needs root (CAP_NET_ADMIN); without it the command says so in one line.

The measurement (``--models``): ``python -m arraytrain.bench distributed --vs-ddp``'s contestants
(torch DDP over gloo, arraytrain's ``bind`` over MPIComm and TorchComm, blocking and overlapped,
and each implementation's step without any exchange), one rank per node, each step's bytes on
the wire beside what a ring all-reduce sends, ``2 (K - 1) / K`` times the gradient's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBNET = "10.77.0"
PORT = 29500  # torchrun's rendezvous and the probe's port, on node 0
#: One node's interface counters (read inside its namespace: sysfs is the namespace's own there).
TX_BYTES = "/sys/class/net/eth0/statistics/tx_bytes"
#: MPICH on TCP between the nodes: libfabric's tcp provider on eth0, and no shared memory between
#: ranks that share a hostname (every node here does).
MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0", "MPIR_CVAR_NOLOCAL": "1",
           "GLOO_SOCKET_IFNAME": "eth0"}


class ClusterUnavailable(RuntimeError):
    """The machine cannot make the cluster (not root, no ``ip``/``tc``, no network namespaces)."""


def _run(*argv, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=timeout)


def available() -> str | None:
    """None when this process can make a cluster, else why not (one line)."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "the simulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the simulated cluster needs root (CAP_NET_ADMIN) to make network namespaces and shape links"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"the simulated cluster needs {' and '.join(missing)} (iproute2)"
    return None


def _split_cpus(nodes: int) -> list[list[int]] | None:
    """This process's cores in ``nodes`` equal, disjoint sets (the rest unused); None when there are fewer
    cores than nodes (or no ``taskset``): then the nodes share every core."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per = len(cores) // nodes
    if per == 0 or shutil.which("taskset") is None:
        return None
    return [cores[i * per:(i + 1) * per] for i in range(nodes)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(name: str) -> None:
    """SIGKILL every process in namespace ``name`` (ranks that MPI's proxies started in a session of their
    own are not in the group of the process that launched them)."""
    for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove(names) -> None:
    """Kill what runs in the namespaces ``names``, then delete them (their veths go with them)."""
    for name in names:
        _kill_inside(name)
    for name in names:
        _run("ip", "netns", "del", name, check=False)


def remove_stale() -> list[str]:
    """Remove the namespaces of clusters whose process is gone (killed outright), and whatever still runs
    in them; returns their names."""
    out = _run("ip", "netns", "list", check=False).stdout
    gone = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(r"at(\d+)-(sw|n\d+)", name)
        if m and not _alive(int(m.group(1))):
            gone.append(name)
    _remove(gone)
    return gone


class Cluster:
    """``nodes`` network namespaces on one bridge, each link shaped to ``link_gbit`` both ways.

    A context manager: ``with Cluster(2, 10.0) as c: ...``; on leaving it (however) every process
    started through it is killed and every namespace and link removed.
    """

    def __init__(self, nodes: int = 2, link_gbit: float = 10.0, delay_us: float | None = None, pin: bool = True):
        if int(nodes) != nodes or nodes < 2 or nodes > 64:
            raise ValueError(f"nodes: expected an integer in [2, 64], got {nodes!r}")
        if not link_gbit > 0:
            raise ValueError(f"link_gbit: expected a rate > 0, got {link_gbit!r}")
        self.nodes, self.link_gbit, self.delay_us = int(nodes), float(link_gbit), delay_us
        self.prefix = f"at{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-n{i}" for i in range(self.nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(self.nodes)]
        self.cpus = _split_cpus(self.nodes) if pin else None
        self.probe_busy: list = [None] * self.nodes  # set by probe()
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._dir = None
        self._old_term = None

    # -- making and removing -----------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        why = available()
        if why is not None:
            raise ClusterUnavailable(why)
        remove_stale()
        if threading_main():  # SIGTERM ends the block like Ctrl-C: the cluster is removed on the way out
            self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns(self, name: str, *argv) -> None:
        _run("ip", "-n", name, *argv)

    def _build(self) -> None:
        try:
            _run("ip", "netns", "add", self.switch)
        except subprocess.CalledProcessError as exc:
            raise ClusterUnavailable(f"ip netns add failed: {exc.stderr.strip()}") from None
        self._made.append(self.switch)
        self._ns(self.switch, "link", "add", "br0", "type", "bridge")
        self._ns(self.switch, "link", "set", "br0", "up")
        for i, (name, addr) in enumerate(zip(self.names, self.addresses)):
            _run("ip", "netns", "add", name)
            self._made.append(name)
            host, port = f"{self.prefix}e{i}", f"{self.prefix}p{i}"
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", port)
            _run("ip", "link", "set", host, "netns", name)
            _run("ip", "link", "set", port, "netns", self.switch)
            self._ns(name, "link", "set", host, "name", "eth0")
            self._ns(name, "addr", "add", f"{addr}/24", "dev", "eth0")
            self._ns(name, "link", "set", "eth0", "up")
            self._ns(name, "link", "set", "lo", "up")
            self._ns(self.switch, "link", "set", port, "master", "br0")
            self._ns(self.switch, "link", "set", port, "up")
        self.shape(self.link_gbit)
        self._dir = tempfile.mkdtemp(prefix="arraytrain-cluster-")
        self.launcher = str(Path(self._dir) / "nsexec")
        cases = "\n".join(f"  {a}) set -- {' '.join(self.argv(i, []))} sh -c \"$*\";;"
                           for i, a in enumerate(self.addresses))
        Path(self.launcher).write_text(
            "#!/bin/sh\n# Hydra's ssh launcher, into a node's namespace (and onto its cores): [options] host command...\n"
            'while [ "${1#-}" != "$1" ]; do shift; done\nhost=$1; shift\n'
            f'case $host in\n{cases}\n  *) echo "no node $host" >&2; exit 255;;\nesac\n'
            'exec "$@"\n')
        os.chmod(self.launcher, 0o755)

    def shape(self, link_gbit: float) -> None:
        """Every link's rate (both ways) set to ``link_gbit`` Gbit/s now (also mid-run)."""
        rate = f"{int(link_gbit * 1000)}mbit"
        # a bucket of 1 ms at the rate (at least 256 KB): bursts no larger than the link could carry
        burst = f"{max(256 * 1024, int(link_gbit * 1e9 / 8 / 1000))}b"
        qdisc = ["handle", "1:", "tbf", "rate", rate, "burst", burst, "latency", "200ms"]
        for i, name in enumerate(self.names):
            for ns, dev in ((name, "eth0"), (self.switch, f"{self.prefix}p{i}")):
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc)
                if self.delay_us:
                    try:
                        _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "parent", "1:1",
                             "handle", "10:", "netem", "delay", f"{self.delay_us}us")
                    except subprocess.CalledProcessError as exc:
                        raise ClusterUnavailable(f"--delay-us needs netem, which this kernel refused: "
                                                 f"{exc.stderr.strip()}") from None
        self.link_gbit = float(link_gbit)

    def set_link(self, node: int, up: bool) -> None:
        """Take node ``node``'s link down (or up again): its interface in the bridge."""
        _run("ip", "-n", self.switch, "link", "set", f"{self.prefix}p{node}", "up" if up else "down")

    def kill_node(self, node: int) -> None:
        """Node ``node`` lost, as a machine that vanishes: its link down first (its peers get no word: no
        reset, no closed socket), then every process in it killed."""
        self.set_link(node, False)
        _kill_inside(self.names[node])

    def close(self) -> None:
        """Kill every process started through the cluster and every process in its namespaces, then remove
        the namespaces and files."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []
        _remove(list(reversed(self._made)))
        self._made = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    # -- running in the nodes ----------------------------------------------------------------------
    def argv(self, node: int, argv) -> list:
        """``argv`` run inside node ``node`` (and on its cores, when the nodes are pinned)."""
        pin = [] if self.cpus is None else ["taskset", "-c", ",".join(map(str, self.cpus[node]))]
        return ["ip", "netns", "exec", self.names[node], *pin, *map(str, argv)]

    def thread_env(self) -> dict:
        """Thread counts for a node's processes: its cores (nothing when the nodes are not pinned)."""
        if self.cpus is None:
            return {}
        k = str(len(self.cpus[0]))
        return {v: k for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}

    def popen(self, node: int, argv, env=None, **kw) -> subprocess.Popen:
        """Start ``argv`` in node ``node`` (its own process group, killed when the cluster closes); the node's
        :meth:`thread_env` under ``env``."""
        env = {**os.environ, **self.thread_env(), **(env or {})}
        p = subprocess.Popen(self.argv(node, argv), env=env, start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def run(self, node: int, argv, *, env=None, timeout: float = 600) -> subprocess.CompletedProcess:
        """Run ``argv`` in node ``node`` to completion (output captured as text); killed at ``timeout``."""
        p = self.popen(node, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def mpiexec(self, argv, *, per_node: int = 1, mpiexec: str | None = None) -> list:
        """The command that runs ``argv`` as ``per_node`` ranks on every node (run it in node 0 with
        :meth:`run`, and with :data:`MPI_ENV`): Hydra starts its proxies through :attr:`launcher`."""
        from ..distributed import find_mpiexec

        exe = mpiexec or find_mpiexec()
        if exe is None:
            raise ClusterUnavailable('no mpiexec: pip install "arraytrain[mpi]"')
        return [exe, "-launcher", "ssh", "-launcher-exec", self.launcher, "-hosts", ",".join(self.addresses),
                "-iface", "eth0", "-n", str(per_node * self.nodes), "-ppn", str(per_node), *map(str, argv)]

    def torchrun(self, node: int, argv, *, per_node: int = 1, run_id: str = "arraytrain", nnodes: str | None = None,
                 rdzv_conf: dict | None = None, extra=()) -> list:
        """torchrun's command for node ``node``: ``per_node`` processes, a c10d rendezvous on node 0; ``nnodes``
        (default: every node) and ``rdzv_conf`` (more of the rendezvous' settings, e.g. ``last_call_timeout``)
        as torchrun takes them."""
        exe = Path(sys.executable).parent / "torchrun"
        # is_host: node 0 holds the rendezvous store (torch finds the host by the machine's hostname, which
        # every node shares here and which does not resolve to a node's address)
        conf = ",".join(f"{k}={v}" for k, v in {"is_host": int(node == 0), **(rdzv_conf or {})}.items())
        return [str(exe) if exe.exists() else "torchrun", f"--nnodes={nnodes or self.nodes}",
                f"--nproc-per-node={per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.addresses[0]}:{PORT}",
                f"--rdzv-id={run_id}", f"--rdzv-conf={conf}", f"--local-addr={self.addresses[node]}", *extra,
                *map(str, argv)]

    def tx_bytes(self) -> list[int]:
        """Bytes each node has sent on its link so far (its ``eth0`` counter)."""
        return [int(_run("ip", "netns", "exec", n, "cat", TX_BYTES).stdout) for n in self.names]

    def probe(self, megabytes: int = 200, timeout: float = 60) -> float:
        """One TCP stream of ``megabytes`` MB from node 1 to node 0; the rate it reached, Gbit/s.

        Also sets :attr:`probe_busy`: how busy each node's cores were while the bytes moved (0-1,
        from ``/proc/stat`` between the first and the last byte received; None for a node when the
        nodes share every core). The links are software — the veth pairs, the bridge, the token
        buckets and both ends' TCP run on the nodes' own cores — so moving bytes takes CPU time that
        a network adapter would take off them."""
        code = ("import json,socket,sys,time\n"
                "def busy():\n"
                "  with open('/proc/stat') as f:\n"
                "    rows=[l.split() for l in f if l.startswith('cpu') and l[3].isdigit()]\n"
                "  return {int(r[0][3:]):(sum(map(int,r[1:8]))-int(r[4])-int(r[5]),sum(map(int,r[1:8]))) for r in rows}\n"
                "mode,host,port,n=sys.argv[1],sys.argv[2],int(sys.argv[3]),int(sys.argv[4])*2**20\n"
                "if mode=='recv':\n"
                "  s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind((host,port));s.listen(1)\n"
                "  print('ready',flush=True);c,_=s.accept();buf=bytearray(1<<20);got=0;t0=None\n"
                "  while got<n:\n"
                "    k=c.recv_into(buf)\n"
                "    if not k: break\n"
                "    if t0 is None: t0,b0=time.perf_counter(),busy()\n"
                "    got+=k\n"
                "  t1,b1=time.perf_counter(),busy()\n"
                "  print(json.dumps({'gbit':got*8/(t1-t0)/1e9,'busy':{c:[b1[c][0]-b0[c][0],b1[c][1]-b0[c][1]] for c in b1}}),"
                "flush=True)\n"
                "else:\n"
                "  c=socket.create_connection((host,port));d=b'x'*(1<<20)\n"
                "  for _ in range(n>>20): c.sendall(d)\n"
                "  c.close()\n")
        args = [sys.executable, "-c", code]
        recv = self.popen(0, [*args, "recv", self.addresses[0], PORT + 1, megabytes], stdout=subprocess.PIPE, text=True)
        if recv.stdout.readline().strip() != "ready":
            raise ClusterUnavailable("the probe's receiver did not start")
        self.run(1, [*args, "send", self.addresses[0], PORT + 1, megabytes], timeout=timeout)
        out, _ = recv.communicate(timeout=timeout)
        res = json.loads(out.strip().splitlines()[-1])
        ticks = {int(c): v for c, v in res["busy"].items()}
        self.probe_busy = [None if self.cpus is None else
                           sum(ticks[c][0] for c in cpus) / max(1, sum(ticks[c][1] for c in cpus))
                           for cpus in (self.cpus or [()] * self.nodes)]
        return float(res["gbit"])


def on_cluster(nodes: int, link_gbit: float, body, delay_us: float | None = None) -> int | None:
    """``body(cluster)`` on a new :class:`Cluster`; None when it ran, else the command's exit status with
    a line said: 2 when no cluster can be made here, 130 on Ctrl-C or SIGTERM (the cluster removed)."""
    try:
        with Cluster(nodes, link_gbit, delay_us) as cluster:
            body(cluster)
    except ClusterUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the cluster was removed", file=sys.stderr)
        return 130
    return None


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# -- the measurement ---------------------------------------------------------------------------------


def measure(cluster: Cluster, models: list, steps: int, batch: int, threads: int, timeout: float,
            bucket_mib: float | None = None) -> dict:
    """The DDP comparison's contestants with one rank per node; each step's bytes on the wire too."""
    from .distributed import RESULT, worker_env

    cfg = {"models": models, "batch": batch, "steps": steps, "port": PORT + 2, "addr": cluster.addresses[0],
           "wire": TX_BYTES, "bucket_mib": bucket_mib}
    argv = cluster.mpiexec([sys.executable, "-m", "arraytrain.bench", "distributed", "--worker", "ddp",
                            "--config", json.dumps(cfg)])
    proc = cluster.run(0, argv, env={**worker_env(threads), **MPI_ENV}, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the job across the nodes failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def report(res: dict, cluster: Cluster, probed: float, args) -> None:
    from . import ddp

    k = cluster.nodes
    ddp.report(res, args, f"{k} nodes of one rank, links shaped to {cluster.link_gbit:g} Gbit/s a node each way "
                          f"(probed: {probed:.2f} Gbit/s), MPI and gloo on TCP"
                          + ("" if args.bucket_mib is None else f", arraytrain's buckets {args.bucket_mib:g} MiB"))
    print("\nBytes each node sent per step (its eth0 counter), against a ring all-reduce's 2(K-1)/K x the gradient:")
    for name, r in res.items():
        expected = 2 * (k - 1) / k * 4 * r["params"]
        print(f"  {name}: expected {expected / 1e6:.1f} MB | " + " | ".join(
            f"{key}: {b / 1e6:.1f} MB ({b / expected:.2f}x)" for key, b in r["wire_bytes"].items()))


def plot(path: str, sweep: list) -> None:
    """Step time against link rate, a line per contestant, a panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(sweep[0]["results"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        rates = [run["link_gbit"] for run in sweep]
        for i, key in enumerate(sweep[0]["results"][name]["step_s"]):  # more contestants than the default colours
            ax.plot(rates, [1e3 * run["results"][name]["step_s"][key] for run in sweep], marker="o",
                    color=plt.cm.tab20(i % 20), linestyle="--" if key.endswith("no exchange") else "-", label=key)
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("link, Gbit/s a node each way")
        ax.set_ylabel("ms per step (best, slowest rank)")
        ax.set_title(f"{name}, {sweep[0]['nodes']} nodes", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    from . import ddp

    p = argparse.ArgumentParser(prog="python -m arraytrain.bench cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--link", default="10", help="Gbit/s a node, each way (default 10); several, comma-separated: "
                                                "a sweep on one cluster, reshaped between runs")
    p.add_argument("--delay-us", type=float, default=None, help="one-way delay per link (needs netem)")
    p.add_argument("--models", default="MLP 4x2048 (16.8M)",
                   help=f"comma-separated, of {list(ddp.MODELS)}; 'all'; 'none': only probe the link")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="samples per rank")
    p.add_argument("--threads", type=int, default=1, help="numba threads per rank")
    p.add_argument("--bucket-mib", type=float, default=None,
                   help="arraytrain's bucket size in MiB (default: bind's own); DDP keeps its 25 MB")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the job")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png", help="step time against link rate (with several --link)")
    return p


def main(argv=None) -> int:
    from . import ddp

    args = build_parser().parse_args(argv)
    names = [] if args.models == "none" else list(ddp.MODELS) if args.models == "all" else \
        [s for s in args.models.split(",") if s]
    unknown = [n for n in names if n not in ddp.MODELS]
    if unknown:
        print(f"--models: unknown {unknown}; models {list(ddp.MODELS)}", file=sys.stderr)
        return 2
    try:
        links = [float(x) for x in args.link.split(",") if x]
    except ValueError:
        links = []
    if not links or min(links) <= 0:
        print(f"--link: expected rates > 0 in Gbit/s, comma-separated, got {args.link!r}", file=sys.stderr)
        return 2
    why = available()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    args.ddp_batch = args.batch
    sweep = []

    def body(cluster):
        for rate in links:
            cluster.shape(rate)
            t = time.perf_counter()
            probed = cluster.probe(megabytes=max(200, int(rate * 62.5)))  # half a second of the link or more
            print(f"{args.nodes} nodes up; link probed at {probed:.2f} Gbit/s (shaped to {rate:g}) "
                  f"in {time.perf_counter() - t:.1f} s", flush=True)
            if None not in cluster.probe_busy:
                print(f"while the probe's bytes moved, node 1's cores (sending) were busy {cluster.probe_busy[1]:.0%}, "
                      f"node 0's (receiving) {cluster.probe_busy[0]:.0%}: the links' work runs on the nodes' cores",
                      flush=True)
            res = measure(cluster, names, args.steps, args.batch, args.threads, args.timeout,
                                                 args.bucket_mib) if names else {}
            if res:
                report(res, cluster, probed, args)
                print(f"\nlosses agree with DDP's to 1e-4: {ddp.losses_agree(res)}", flush=True)
            sweep.append({"nodes": args.nodes, "link_gbit": rate, "probed_gbit": probed,
                          "probe_busy": cluster.probe_busy, "results": res})

    status = on_cluster(args.nodes, links[0], body, args.delay_us)
    if status is not None:
        return status
    if args.json:
        with open(args.json, "w") as f:
            json.dump(sweep, f, indent=2)
    if args.plot and names:
        plot(args.plot, sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())

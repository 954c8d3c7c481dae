"""Where a test run's cold minutes go: every numba compile, its own time (nested compiles of the
functions it calls taken out) and the test that triggered it, one JSON line each.

Load it as a pytest plugin (xdist passes it to every worker)::

    PYTHONPATH=tools python -m pytest -p compile_log -n auto          # writes compile-log/*.jsonl
    python tools/compile_log.py compile-log                           # the summary

``COMPILE_LOG`` names the folder (default ``compile-log``). The summary lists the seconds by
kernel (the outermost compile's function: what a test asked for), by function compiled (a
kernel's helpers included) and by test file, and the signatures compiled more than once (by two
workers, or by a test that compiles in a subprocess).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

_CURRENT = {"test": "(collection or session)"}


def _name(dispatcher) -> str:
    func = getattr(dispatcher, "py_func", None)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(dispatcher))}"


def _recorder(path):
    import numba.core.event as ev

    class Recorder(ev.Listener):
        def __init__(self):
            self.path, self.stack = path, []

        def on_start(self, event):
            self.stack.append([time.perf_counter(), 0.0])

        def on_end(self, event):
            start, inner = self.stack.pop()
            total = time.perf_counter() - start
            if self.stack:
                self.stack[-1][1] += total
            data = event.data or {}
            record = {"test": _CURRENT["test"], "function": _name(data.get("dispatcher")),
                      "args": str(data.get("args")), "self_s": round(total - inner, 4),
                      "total_s": round(total, 4), "depth": len(self.stack)}
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    return Recorder()


def pytest_configure(config):
    import numba.core.event as ev

    folder = os.environ.get("COMPILE_LOG", "compile-log")
    os.makedirs(folder, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    ev.register("numba:compile", _recorder(os.path.join(folder, f"{worker}-{os.getpid()}.jsonl")))


def used_signatures() -> list:
    """(function, signature) of every arraytrain kernel this process ran (compiled or loaded from
    the cache): numba adds a signature to a dispatcher only when a call needs it."""
    import gc

    from numba.core.dispatcher import Dispatcher

    found = set()
    for d in gc.get_objects():
        try:
            if isinstance(d, Dispatcher) and _name(d).startswith("arraytrain."):
                found.update((_name(d), str(sig)) for sig in d.signatures)
        except Exception:  # (an object half torn down at exit)
            continue
    return sorted(found)


def pytest_sessionfinish(session):
    folder = os.environ.get("COMPILE_LOG", "compile-log")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    used = used_signatures()
    with open(os.path.join(folder, f"used-{worker}-{os.getpid()}.json"), "w") as f:
        json.dump(used, f)


def pytest_runtest_protocol(item, nextitem):
    _CURRENT["test"] = item.nodeid


def summary(folder: str, top: int = 30) -> None:
    records = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(folder, name)) as f:
            records += [json.loads(line) for line in f]
    kernels, functions, files = (collections.Counter() for _ in range(3))
    seen = collections.Counter()
    for r in records:
        functions[r["function"]] += r["self_s"]
        files[r["test"].split("::")[0]] += r["self_s"]
        if r["depth"] == 0:
            kernels[r["function"]] += r["total_s"]
            seen[(r["function"], r["args"])] += 1
    total = sum(r["self_s"] for r in records)
    print(f"{len(records)} compiles, {total:.0f} s of compile in all (summed over workers)")
    for title, counter in (("by kernel (outermost compile)", kernels), ("by function (own time)", functions),
                           ("by test file", files)):
        print(f"\n{title}:")
        for key, s in counter.most_common(top):
            print(f"  {s:8.1f} s  {key}")
    twice = [(k, n) for k, n in seen.items() if n > 1]
    print(f"\nsignatures compiled more than once: {len(twice)}")
    for (func, args), n in sorted(twice, key=lambda kn: -kn[1])[:top]:
        print(f"  {n}x {func} {args[:120]}")


if __name__ == "__main__":
    summary(sys.argv[1] if len(sys.argv) > 1 else "compile-log")

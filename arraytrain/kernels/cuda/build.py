"""Compile-check the CUDA sources with nvcc, with no GPU and no CuPy: ``python -m arraytrain.kernels.cuda.build``.

Every declared template instance of every source is instantiated (its address is
taken) and compiled to a cubin for each architecture in :data:`ARCHS`, with
``-Xptxas -v`` so the resource report (registers, spills) comes back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from .core import OPTIONS

ARCHS = ("sm_80", "sm_90")


def sources() -> dict:
    from . import compression, optimizers, projection, reductions, trend

    return {"reductions": reductions.SOURCE, "optimizers": optimizers.SOURCE, "compression": compression.SOURCE,
            "projection": projection.SOURCE, "trend": trend.SOURCE,
            "optimizers-muon-sf": optimizers.MUON_SF_SOURCE}


def compile_source(name: str, arch: str, workdir) -> subprocess.CompletedProcess:
    src = sources()[name]
    inst = "\n".join(f"static void* const arraytrain_inst_{i} = (void*)&{e};" for i, e in enumerate(src.instances))
    path = os.path.join(workdir, f"{name}.cu")
    with open(path, "w") as f:
        f.write(src.code + "\n" + inst + "\n")
    cmd = ["nvcc", f"-arch={arch}", "-cubin", *OPTIONS, "-Xptxas", "-v", "-o", os.path.join(workdir, f"{name}.cubin"),
           path]
    return subprocess.run(cmd, capture_output=True, text=True)


def main() -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for name, src in sources().items():
            for arch in ARCHS:
                r = compile_source(name, arch, d)
                print(f"{name} {arch}: {len(src.instances)} instances, {'ok' if r.returncode == 0 else 'FAILED'}")
                if r.returncode:
                    print(r.stderr, file=sys.stderr)
                    bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Gradient compressors on a GPU: compress, decompress and the error-feedback round trip on CuPy buffers.

The same methods and layouts as :mod:`.bench_compress` (``arraytrain.bench.compression``), with
the gradient, the payload and the state on the device. Skipped (``NotImplementedError`` in
``setup``, asv's way) where no CUDA device runs a probe kernel. ``setup`` runs each call once,
so NVRTC compilation never lands in a timed method; every timed call synchronises the device
before it returns, so asv's wall-clock timer sees device time. ``track_gbs`` counts the
float32 gradient bytes handled per second (4 per element, as in :mod:`.bench_compress`) and
``track_fraction_of_copy`` puts that against the device's copy bandwidth
(:func:`.bench_cuda.copy_gbs`).
"""

from __future__ import annotations

import numpy as np

from arraytrain.bench.compression import THROUGHPUT_METHODS, throughput_compressor, throughput_layout

from .bench_cuda import _require, copy_gbs
from .common import QUICK

SIZES = [100_000] if QUICK else [1_000_000, 10_000_000]


class _CudaCompress:
    params = [list(THROUGHPUT_METHODS), SIZES]
    param_names = ["method", "size"]
    timeout = 300

    def setup(self, method, n):
        cp = self.cp = _require()
        self.layout = throughput_layout(method, n)
        rs = cp.random.RandomState(0)
        self.g = rs.standard_normal(self.layout.size, dtype=cp.float32)
        self.c = self._make(method).bind(self.layout, np.float32)
        self.out = cp.zeros_like(self.g)
        self.payload = self.c.compress(self.g)
        self._bytes = 4 * self.layout.num_elements
        self._call()  # compiles every kernel the call uses outside the timed region
        cp.cuda.Device().synchronize()

    def _make(self, method):
        return throughput_compressor(method)

    def _timed(self):
        self._call()
        self.cp.cuda.Device().synchronize()

    def time_it(self, method, n):
        self._timed()

    def track_gbs(self, method, n):
        """Gradient bytes per second, best of 7 synchronised calls timed with CUDA events."""
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        best = float("inf")
        for _ in range(7):
            start.record()
            self._call()
            end.record()
            end.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
        return self._bytes / best / 1e9

    track_gbs.unit = "GB/s"

    def track_fraction_of_copy(self, method, n):
        return self.track_gbs(method, n) / copy_gbs()

    track_fraction_of_copy.unit = "fraction"


class CudaCompress(_CudaCompress):
    """``payload = c.compress(g)`` on a CuPy gradient."""

    def _call(self):
        self.c.compress(self.g)

    def track_payload_ratio(self, method, n):
        return self.payload.ratio

    track_payload_ratio.unit = "x"


class CudaDecompress(_CudaCompress):
    """``c.decompress(payload, out)`` into a CuPy buffer."""

    def _call(self):
        self.c.decompress(self.payload, self.out)


class CudaErrorFeedbackRoundtrip(_CudaCompress):
    """``ErrorFeedback(c).roundtrip(g)`` on the device: residual added, compressed, decoded into g, residual updated."""

    def _make(self, method):
        return throughput_compressor(method, error_feedback=True)

    def _call(self):
        self.c.roundtrip(self.g)

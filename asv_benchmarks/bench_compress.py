"""Gradient compressors: compress, decompress and the error-feedback round trip.

GB/s counts the float32 gradient bytes handled per second (4 bytes per
element, whatever the method reads or writes besides), so the figure reads as
"how fast can a gradient of this size go through", comparable across methods;
``track_fraction_of_triad`` puts it against the machine's streaming bandwidth.
``track_payload_ratio`` is the measured dense bytes over payload bytes.
"""

from __future__ import annotations

import numpy as np

from arraytrain.bench.compression import THROUGHPUT_METHODS, throughput_compressor, throughput_layout

from .common import QUICK, SIZES, _Bandwidth

SIZES_C = [s for s in SIZES if s <= 10_000_000]


class _Compress(_Bandwidth):
    params = [list(THROUGHPUT_METHODS), SIZES_C]
    param_names = ["method", "size"]
    timeout = 240

    def setup(self, method, n):
        self.layout = throughput_layout(method, n)
        rng = np.random.default_rng(0)
        self.g = np.zeros(self.layout.size, np.float32)
        self.g[:] = rng.standard_normal(self.layout.size)
        self.c = self._make(method).bind(self.layout, np.float32)
        self.out = np.zeros_like(self.g)
        self.payload = self.c.compress(self.g)
        self._bytes = 4 * self.layout.num_elements
        self._call()  # compile outside the timed region

    def _make(self, method):
        return throughput_compressor(method)

    def time_it(self, method, n):
        self._call()


class Compress(_Compress):
    """``payload = c.compress(g)``."""

    def _call(self):
        self.c.compress(self.g)

    def track_payload_ratio(self, method, n):
        return self.payload.ratio

    track_payload_ratio.unit = "x"


class Decompress(_Compress):
    """``c.decompress(payload, out)``."""

    def _call(self):
        self.c.decompress(self.payload, self.out)


class ErrorFeedbackRoundtrip(_Compress):
    """``ErrorFeedback(c).roundtrip(g)``: add the residual, compress, decode into g, update the residual."""

    params = [["topk-1%", "int8-256", "sign"] if QUICK else list(THROUGHPUT_METHODS), SIZES_C]

    def _make(self, method):
        return throughput_compressor(method, error_feedback=True)

    def _call(self):
        self.c.roundtrip(self.g)

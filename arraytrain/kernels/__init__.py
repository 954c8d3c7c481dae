"""Kernel families: ``reference`` (NumPy oracle), ``cpu`` (numba) and ``cuda`` (CuPy).

They mirror each other domain by domain; :mod:`arraytrain.kernels.interface` declares the
kernels and picks a family for a buffer. ``counter_rng`` is the random-number generator
all three share.
"""

"""Threading policy (placeholder, replaced below)."""
def describe():
    import numba
    return f"numba {numba.config.THREADING_LAYER} x{numba.get_num_threads()}"

"""The compressors' multi-rank exchange (run by ``checks.py compress``)."""

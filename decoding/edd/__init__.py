"""The EDD draft model (save, load, its draft vocabulary) and its training loop.

It imports `decoding.base`, `decoding.runtime`, `decoding.speculation` and `decoding.trees`.
"""

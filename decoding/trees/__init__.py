"""Draft tree shapes and the policies that grow them: static shapes (shipped as JSON), k_config,
Sequoia's dynamic program, PCT.

It imports `decoding.base`, `decoding.runtime` and `decoding.speculation`.
"""

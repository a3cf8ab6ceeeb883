"""The schedules: the one speculative loop (continuous batching in SEED's rounds; `ar` is it with empty
trees), its step on one screen (`step.py`), the goodput planner, and `hf` (transformers' generate).

They import every folder of `decoding` below them (base to drafters), never the engine's API
(decoding/api/) that drives them.
"""

"""The schedules: the one speculative loop (continuous batching in SEED's rounds; `ar` is it with empty
trees), its step on one screen (`step.py`), the goodput planner, and `hf` (transformers' generate).

They sit above every other folder of `decoding`: the engine (decoding/engine.py) drives them.
"""

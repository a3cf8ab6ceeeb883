"""The `Drafter` protocol and every drafter, each a plug-in module (`PLUGIN = DrafterPlugin(...)`):
STAND's N-gram pools, PLD, recycling, suffix, ADED, a draft model or EDD, the union of two.

It imports the layers below it (`decoding.base`, `runtime`, `speculation`, `trees`, `edd`), never the
schedules or the engine above.
"""

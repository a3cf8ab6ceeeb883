"""Tuning tools: commands that run searches to tune the decoding backend's internals (a static draft
tree's calibration, `calibrate_tree.py`; the EDD draft decoder's training, `train_edd.py`). They sit on
top of both `tot` and `decoding` and may import decoding's modules, which `tot` may not.
"""

"""The engine's API, on top of every other folder of `decoding`: the decoder tables (`kinds.py`: each
decoder's schedule and drafter; `decoders.py`: the builders), a decoder's configuration read from the
options (`config.py`), the engine that admits requests and drives a schedule (`engine.py`), and the
same engine protocol over a server's OpenAI-compatible API (`server.py`). decoding/__init__.py
exports what users need of it; it may import any folder of decoding, never the commands beside it.
"""

"""What every layer of `decoding` shares: errors the user can fix, typed option parsing, the plug-in
mechanism, the values a request and its result are (GenRequest, GenResult, DecodeStats), chat
prompts (`prompts.py`) and the command framework every command shares (`cli.py`).

It imports nothing else of `decoding`.
"""

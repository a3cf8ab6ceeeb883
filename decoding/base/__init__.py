"""What every layer of `decoding` shares: errors the user can fix, typed option parsing, the plug-in
mechanism, and the values a request and its result are (GenRequest, GenResult, DecodeStats).

It imports nothing else of `decoding`.
"""

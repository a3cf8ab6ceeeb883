"""Tree-of-thoughts search over the `decoding` engine: the search library (search/), run folders
(runs/), and the commands (the modules here: `python -m tot.solve`, `tot.bench`, `tot.collect`,
`tot.show`, ...), which sit on top of both. Each folder imports only those below it (the search
library: `tasks` and `decoding`'s public face; run folders: the search library too), never a command.
"""

"""`python tests/packaged_cli.py SITE MODEL.json [ARGS...]`: `python -m decoding.install ARGS` with one
more packaged model, a test's fake one (its parts installed in SITE, its pin in MODEL.json), so that the
command itself (its one-line errors, its signals, its exit status) runs on small files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    site, spec = sys.argv[1:3]
    sys.path.insert(0, site)
    from decoding.install import main
    from decoding.runtime.packaged import PACKAGED, PackagedModel

    fields = json.loads(Path(spec).read_text())
    model = PackagedModel(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    PACKAGED[model.name] = model
    main(sys.argv[3:])

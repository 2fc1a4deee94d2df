#!/usr/bin/env python
"""``python scripts/bench.py SUITE [options]`` from a checkout, without installing: ``python -m jaxgrad.bench``."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxgrad.bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

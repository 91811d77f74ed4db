"""Alias: `python -m serve_app.check`, the documented command, runs `serve_app.tools.check` (it
checks a model before it is deployed). Kept so that the commands users know keep working; the
code lives there."""

import sys

from serve_app.tools.check import main

if __name__ == "__main__":
    sys.exit(main())

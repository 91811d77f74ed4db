"""Alias: `python -m serve_app.train_tiny`, the documented command, runs `serve_app.shapes.train`
(it trains builtin:shapes). Kept so that the commands users know keep working; the code lives
there."""

import sys

from serve_app.shapes.train import main

if __name__ == "__main__":
    sys.exit(main())

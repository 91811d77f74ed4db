"""Alias: `python -m serve_app.single_file`, the documented command, runs
`serve_app.tools.single_file` (it writes a pipeline as one checkpoint file). Kept so that the
commands users know keep working; the code lives there."""

import sys

from serve_app.tools.single_file import main

if __name__ == "__main__":
    sys.exit(main())

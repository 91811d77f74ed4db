"""Alias: `python -m serve_app.lora`, the documented command, runs `serve_app.tools.lora` (it
writes adapters to try the server with). Kept so that the commands users know keep working; the
code lives there."""

import sys

from serve_app.tools.lora import main

if __name__ == "__main__":
    sys.exit(main())

"""Alias: `python -m serve_app.kube`, the documented command, runs `serve_app.tools.kube` (it
writes the KubeRay manifest's Serve config). Kept so that the commands users know keep working;
the code lives there."""

import sys

from serve_app.tools.kube import main

if __name__ == "__main__":
    sys.exit(main())

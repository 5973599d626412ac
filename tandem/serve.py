"""``python -m tandem.serve [MODEL] [flags]``: the same as ``tandem serve`` (see tandem.server.cli)."""

from __future__ import annotations

import sys

from tandem.server.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tandem.serve"))

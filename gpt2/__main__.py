"""``python -m gpt2 <command> ...``: the command line (see :mod:`gpt2.cli`)."""

from __future__ import annotations

import sys

from gpt2.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

"""``python -m gpt2 <command> ...``: the command line (see :mod:`gpt2.cli`)."""

import sys

from gpt2.cli import main

if __name__ == "__main__":
    sys.exit(main())

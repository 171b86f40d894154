#!/usr/bin/env bash
# The main job: install, pretrain a GPT-2 on Tiny Shakespeare, print validation loss and samples.
# CPU: a small model for a few minutes. CUDA GPU: the 124M reference settings (bf16, compile).
# Extra arguments go to examples/pretrain_shakespeare.py (see --help).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh ""  # no extras (without an argument it would see this script's)
# Run again with no arguments, it continues the run in runs/shakespeare (or, finished, reports it
# again); with arguments, a run already there is refused unless --resume auto / --overwrite says how.
[ $# -eq 0 ] && set -- --resume auto
status=0
"$PYTHON" examples/pretrain_shakespeare.py "$@" || status=$?
# The commands printed above need the environment setup.sh made: say how to get it in a new shell.
if [ "$PYTHON" = .venv/bin/python ]; then
    echo
    echo "The project is installed in .venv: in a new shell, run  source .venv/bin/activate  first"
    echo "(or call its programs directly: .venv/bin/gpt2 --help, .venv/bin/python examples/sample.py --help)."
fi
exit "$status"

#!/usr/bin/env bash
# The main job: install, pretrain a GPT-2 on Tiny Shakespeare, print validation loss and samples.
# CPU: a small model for a few minutes. CUDA GPU: the 124M reference settings (bf16, compile).
# Extra arguments go to examples/pretrain_shakespeare.py (see --help).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$PYTHON" examples/pretrain_shakespeare.py "$@"

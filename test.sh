#!/usr/bin/env bash
# Install the project with its dev extras and run the whole test suite (CPU, no network).
# Extra arguments go to pytest, e.g. `bash test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh dev
exec "$PYTHON" -m pytest -q --durations=15 "$@"

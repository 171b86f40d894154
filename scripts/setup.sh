# Sourced by run.sh and test.sh: install the project (torch first) and point at offline data.
# Usage: source scripts/setup.sh [extras]   e.g. "dev"
set -euo pipefail
extras=${1:-}

# A project-local virtual environment (.venv, created on first use and reused after), so the
# install never lands in whatever python3 happens to be active. PYTHON=/path/to/python uses that
# interpreter instead (e.g. one with your own CUDA build of torch).
if [ -z "${PYTHON:-}" ]; then
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
    fi
    PYTHON=.venv/bin/python
fi

# Install torch on its own first: with no torch present, a plain `torch` requirement resolved by
# pip pulls the newest CUDA build (several GB). An installed torch (any build, e.g. your CUDA one)
# is kept; TORCH_VERSION picks another version for a fresh machine.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
if [ -n "$extras" ]; then
    "$PYTHON" -m pip install --quiet -e ".[$extras]"
else
    "$PYTHON" -m pip install --quiet -e .
fi

# Offline copies of the GPT-2 BPE files and Tiny Shakespeare, when a ../shared/data folder sits
# beside the checkout (CI and the project's own machines): copy them (sha256-checked) into the
# cache folder the library reads by itself (~/.cache/gpt2), so the commands that
# run.sh suggests at the end also work in a new shell. Elsewhere the library downloads and caches
# them on first use.
shared_data="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/shared/data"
if [ -d "$shared_data" ]; then
    "$PYTHON" scripts/seed_cache.py "$shared_data"
    export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
fi

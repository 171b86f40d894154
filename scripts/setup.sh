# Sourced by run.sh and test.sh: install the project (torch first) and point at offline data.
# Usage: source scripts/setup.sh [extras]   e.g. "dev"
# Each phase prints one line starting with "setup:", so a quiet minute is never a mystery.
set -euo pipefail
extras=${1:-}

say() { printf 'setup: %s\n' "$*"; }

# A project-local virtual environment (.venv, created on first use and reused after), so the
# install never lands in whatever python3 happens to be active. PYTHON=/path/to/python uses that
# interpreter instead (e.g. one with your own CUDA build of torch).
if [ -z "${PYTHON:-}" ]; then
    if [ ! -x .venv/bin/python ]; then
        say "creating the virtual environment .venv (python3 -m venv)"
        python3 -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
    fi
    PYTHON=.venv/bin/python
fi

# Install torch on its own first: with no torch present, a plain `torch` requirement resolved by
# pip pulls the newest CUDA build (several GB). An installed torch (any build, e.g. your CUDA one)
# is kept; TORCH_VERSION picks another version for a fresh machine. pip shows its own progress here:
# this is the long download.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    say "installing torch ${TORCH_VERSION:-2.13.0} (the long step: pip shows its progress)"
    "$PYTHON" -m pip install "torch==${TORCH_VERSION:-2.13.0}"
fi

# The project itself, editable, with its extras. Skipped when nothing it depends on changed since the
# last install: the stamp records pyproject.toml's hash and the extras asked for.
target="."
if [ -n "$extras" ]; then
    target=".[$extras]"
fi
stamp_dir="$("$PYTHON" -c 'import sys; print(sys.prefix)')"
stamp="$stamp_dir/.gpt2-minlora-install"
want="$(cat pyproject.toml <(echo "extras=$extras") | "$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PYTHON" -c "import gpt2, minlora" >/dev/null 2>&1; then
    say "gpt2-minlora${extras:+[$extras]} is installed and pyproject.toml is unchanged: nothing to install"
else
    say "installing gpt2-minlora${extras:+[$extras]} (pip install -e \"$target\", about a minute the first time)"
    # PYTHONWARNINGS: setuptools' build backend prints a boxed warning about editable installs
    # (folders named like the package) on every install; it concerns no one running from the checkout.
    PYTHONWARNINGS=ignore "$PYTHON" -m pip install --quiet -e "$target"
    printf '%s\n' "$want" > "$stamp"
fi

# Offline copies of the GPT-2 BPE files and Tiny Shakespeare, when a ../shared/data folder sits
# beside the checkout (CI and the project's own machines): copy them (sha256-checked) into the
# cache folder the library reads by itself (~/.cache/gpt2), so the commands that
# run.sh suggests at the end also work in a new shell. Elsewhere the library downloads and caches
# them on first use.
shared_data="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/shared/data"
if [ -d "$shared_data" ]; then
    say "offline data: seeding ~/.cache/gpt2 from $shared_data"
    "$PYTHON" scripts/seed_cache.py "$shared_data"
    export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
fi

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
    torch_spec="torch==${TORCH_VERSION:-2.13.0}"
    torch_args=()
    cpu_index="${GPT2_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
    if [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi >/dev/null 2>&1; then
        say "installing $torch_spec, the CUDA build for this NVIDIA GPU (the long step: pip shows its progress)"
    elif [ -n "${PIP_INDEX_URL:-}${PIP_EXTRA_INDEX_URL:-}${PIP_FIND_LINKS:-}" ] \
        || "$PYTHON" -m pip config list 2>/dev/null | grep -qE '(index-url|find-links)='; then
        # A wheel source set up for this machine (a mirror, a wheel folder) knows best: it is used as it is.
        say "installing $torch_spec from pip's configured sources (the long step: pip shows its progress)"
    elif "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" \
        "$cpu_index/torch/" >/dev/null 2>&1; then
        # No NVIDIA GPU: PyTorch's CPU wheels (~200 MB) instead of the CUDA build and its nvidia-* wheels.
        # Its +cpu version sorts above PyPI's, so pip takes it; everything else still comes from PyPI.
        say "installing $torch_spec, the CPU build from $cpu_index (no NVIDIA GPU here; pip shows its progress)"
        torch_args=(--extra-index-url "$cpu_index")
    else
        say "installing $torch_spec from PyPI: PyTorch's CPU wheel index ($cpu_index) did not answer, so on"
        say "Linux this is the CUDA build with its nvidia-* wheels (about 3 GB) although there is no NVIDIA GPU;"
        say "for the CPU build (~200 MB) stop here and run  $PYTHON -m pip install $torch_spec --index-url $cpu_index"
    fi
    "$PYTHON" -m pip install "$torch_spec" ${torch_args[@]+"${torch_args[@]}"}
fi

# The project itself, editable, with its extras. Skipped when nothing it depends on changed since the
# last install: the stamp records pyproject.toml's hash (first line) and the extras installed with it
# (second line); an install with more extras (test.sh's dev) serves one asking for fewer (run.sh's none).
target="."
if [ -n "$extras" ]; then
    target=".[$extras]"
fi
stamp_dir="$("$PYTHON" -c 'import sys; print(sys.prefix)')"
stamp="$stamp_dir/.gpt2-minlora-install"
want="$("$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
have_hash="" have_extras=""
if [ -f "$stamp" ]; then
    { read -r have_hash || true; read -r have_extras || true; } < "$stamp"
fi
covered=yes
for extra in ${extras//,/ }; do
    case ",$have_extras," in *",$extra,"*) ;; *) covered=no ;; esac
done
if [ "$have_hash" = "$want" ] && [ "$covered" = yes ] && "$PYTHON" -c "import gpt2, minlora" >/dev/null 2>&1; then
    say "gpt2-minlora${extras:+[$extras]} is installed and pyproject.toml is unchanged: nothing to install"
else
    say "installing gpt2-minlora${extras:+[$extras]} (pip install -e \"$target\", about a minute the first time)"
    # PYTHONWARNINGS: setuptools' build backend prints a boxed warning about editable installs
    # (folders named like the package) on every install; it concerns no one running from the checkout.
    PYTHONWARNINGS=ignore "$PYTHON" -m pip install --quiet -e "$target"
    # The extras installed now, with those of an install of the same pyproject.toml before (pip keeps them).
    if [ "$have_hash" = "$want" ] && [ -n "$have_extras" ]; then
        extras="$have_extras${extras:+,$extras}"
    fi
    printf '%s\n%s\n' "$want" "$extras" > "$stamp"
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

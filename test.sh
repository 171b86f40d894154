#!/usr/bin/env bash
# Install the project with its dev extras and run the whole test suite (CPU, no network).
# Extra arguments go to pytest, e.g. `bash test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh dev
# Lint, formatting and the import layers first: each fails fast and names the file.
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check --quiet gpt2 minlora tests examples benchmarks scripts
lint_imports=("$PYTHON" -c "from importlinter.cli import lint_imports_command as c; c()" --no-cache)
"${lint_imports[@]}" >/dev/null || "${lint_imports[@]}"  # the contracts: pyproject.toml [tool.importlinter]
# The readability budget beyond ruff (statement ternaries, ternary and walrus density, radon
# complexity, private torch names outside *compat* modules), where the shared hooks sit beside the checkout.
readability=../shared/hooks/readability.py
if [ -f "$readability" ]; then
    "$PYTHON" "$readability" >/dev/null 2>&1 || "$PYTHON" "$readability"
fi
# The tests in parallel (pytest-xdist): a worker per core, at most 8 (each holds torch and a few
# models); each test file runs whole in one worker, so a module's fixtures are built once, the
# longest files first (tests/conftest.py orders them). `bash test.sh -n 0 ...` runs them all in
# this process (e.g. for --pdb).
"$PYTHON" -m pytest -q --durations=15 -n auto --maxprocesses 8 --dist loadfile --no-loadscope-reorder "$@"
# What gpt2 decides from the CPU's features (the tests marked cpu_features) once more under each answer forced,
# native bf16 and emulated, whatever this machine has: the suite then holds on AMX and on AVX2 CPUs alike.
for native in 1 0; do
    status=0
    GPT2_CPU_NATIVE_BF16=$native "$PYTHON" -m pytest -q -n auto --maxprocesses 8 "$@" -m cpu_features || status=$?
    # 5: none of the tests asked for is marked cpu_features
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
        exit "$status"
    fi
done

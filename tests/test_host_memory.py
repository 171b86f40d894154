"""A CPU Trainer keeps freed memory in the process while it is open (gpt2.train.host_memory): a block freed and
allocated again is not faulted in again. Read from the page faults (``ru_minflt``) of a 64 MB block allocated twice.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2.train import host_memory

REPO = Path(__file__).resolve().parents[1]

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

# In a fresh process (no Trainer of another test holds the memory): the faults of a 64 MB block allocated again after
# a first one was freed, with no Trainer, two CPU Trainers, one of them closed, and both gone.
SCRIPT = """
import gc, resource, sys, torch
sys.path.insert(0, "tests")
from _tiny_run import tiny_config, tiny_model, tiny_tokens
from gpt2 import Trainer

def refill():
    torch.ones(16 * 2**20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2**20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def trainer():
    return Trainer(tiny_model(), tiny_config(None, device="cpu", max_steps=1), tiny_tokens(), sinks=[])

faults = [refill()]
first, second = trainer(), trainer()
first.train_step()
faults.append(refill())
first.close()
faults.append(refill())
del second
gc.collect()
faults.append(refill())
print(*faults)
"""


@glibc
def test_freed_memory_is_kept_while_a_cpu_trainer_is_open():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in host_memory.USER_SETTINGS:
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    alone, open_, one_closed, none_open = map(int, result.stdout.split())
    # 16,384 pages of 4 KiB: glibc maps a block over 32 MB afresh and unmaps it when it is freed
    assert alone > 10_000 and none_open > 10_000, result.stdout
    # the heap keeps it: the second block takes the first one's pages
    assert open_ < 1_000 and one_closed < 1_000, result.stdout


@pytest.mark.parametrize(
    "name, value",
    [
        ("MALLOC_TRIM_THRESHOLD_", "131072"),
        ("MALLOC_MMAP_MAX_", "0"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1"),
    ],
)
def test_users_own_malloc_settings_are_left_alone(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(host_memory, "_holders", 0)
    assert not host_memory.hold() and not host_memory.set_kept(False)
    assert host_memory._holders == 0

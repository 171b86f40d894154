"""Shared test set-up: offline data from ../shared/data, no network, tiny configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("GPT2_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))

# Never touch the network from tests: the Hugging Face hub and tiktoken read local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if (SHARED_DATA / "tiktoken-cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED_DATA / "tiktoken-cache"))
if (SHARED_DATA / "tinyshakespeare.txt").is_file():
    os.environ.setdefault("GPT2_TINY_SHAKESPEARE", str(SHARED_DATA / "tinyshakespeare.txt"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def tiny_config():
    """A 2-layer, 32-wide GPT over a 128-token vocabulary: fast on a 2-core CPU."""
    from gpt2 import GPTConfig

    return GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(autouse=True)
def _one_thread(request):
    """Tiny models: a second intra-op thread costs more in synchronisation than it saves (and far
    more when other processes share the cores); tests marked slow (124M shapes) keep them all."""
    threads = torch.get_num_threads()
    if request.node.get_closest_marker("slow") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

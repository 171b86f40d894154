"""GPU code paths checked on a CPU by faking the parts: the process group a failed Trainer set-up
leaves behind, and each rank's CUDA RNG state in checkpoints.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpt2 import GPT
from gpt2.train import checkpoint as ckpt
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer


@pytest.fixture
def one_process_group(monkeypatch, tmp_path):
    """The Trainer believes it is rank 0 of 2 (so it joins a group), but the group it creates is a
    one-process gloo group on a FileStore: nothing waits for a second rank.
    """
    real_init = dist.init_process_group
    joined = []

    def init(backend, rank, world_size):
        real_init("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
        joined.append(dist.is_initialized())

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "init_process_group", init)
    yield joined
    if dist.is_initialized():
        dist.destroy_process_group()


def test_failed_trainer_setup_leaves_the_process_group(one_process_group, tiny_config):
    # 32 tokens per step cannot be split into micro-batches of 2 x 16 on each of 2 processes:
    # the Trainer fails after it joined the group.
    config = TrainConfig(micro_batch_size=2, seq_len=16, total_batch_size=32, out_dir=None, device="cpu")
    with pytest.raises(ValueError, match="total_batch_size=32"):
        Trainer(GPT(tiny_config), config, torch.zeros(1000, dtype=torch.long), sinks=[])
    assert one_process_group == [True] and not dist.is_initialized()


class FakeCuda:
    """torch.cuda's RNG functions for a process on GPU ``device``; every GPU's state differs.
    get/set_rng_state_all fail: they would touch (create a context on) every visible GPU.
    """

    def __init__(self, monkeypatch, device: int):
        self.device, self.set_calls = device, []
        for name, fn in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "current_device": lambda: self.device,
            "device_count": lambda: 8,
            "get_rng_state": lambda device="cuda": torch.full((16,), 10 + int(device), dtype=torch.uint8),
            "set_rng_state": lambda state, device="cuda": self.set_calls.append((int(device), state.clone())),
            "get_rng_state_all": self._touches_every_gpu,
            "set_rng_state_all": self._touches_every_gpu,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    @staticmethod
    def _touches_every_gpu(*args):
        raise AssertionError("get/set_rng_state_all used: it initialises every visible GPU from every rank")


def _as_rank(monkeypatch, rank: int, world_size: int) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)


def test_checkpoint_saves_and_restores_this_ranks_cuda_rng(monkeypatch, tmp_path, tiny_config):
    fake = FakeCuda(monkeypatch, device=3)
    assert {rank: s[0].item() for rank, s in ckpt.capture_rng_state()["cuda_by_rank"].items()} == {0: 13}
    # Through a checkpoint on disk (weights_only loading), restored onto this process's GPU only.
    path = ckpt.save_checkpoint(tmp_path, 1, GPT(tiny_config))
    ckpt.load_checkpoint(path, GPT(tiny_config), restore_rng=True)
    assert [(device, state[0].item()) for device, state in fake.set_calls] == [(3, 13)]


def test_all_ranks_gathers_each_ranks_state_and_each_rank_restores_its_own(monkeypatch, caplog):
    fake = FakeCuda(monkeypatch, device=1)
    _as_rank(monkeypatch, rank=1, world_size=2)

    def all_gather_object(out, obj):  # rank 0 runs on GPU 0, this rank (1) on GPU 1
        out[:] = [torch.full((16,), 10, dtype=torch.uint8), obj]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    state = ckpt.capture_rng_state(all_ranks=True)
    assert {rank: s[0].item() for rank, s in state["cuda_by_rank"].items()} == {0: 10, 1: 11}
    ckpt.restore_rng_state(state)
    assert [(device, s[0].item()) for device, s in fake.set_calls] == [(1, 11)]  # rank 1's, not rank 0's

    fake.set_calls.clear()
    _as_rank(monkeypatch, rank=2, world_size=3)
    ckpt.restore_rng_state(state)  # a checkpoint of 2 ranks resumed on 3: rank 2 has no state
    assert fake.set_calls == [] and "not of rank 2" in caplog.text

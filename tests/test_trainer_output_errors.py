"""A full disk (or any OSError) while a run writes metrics.jsonl or a checkpoint ends it with one line: the
file, what to do, and the newest intact checkpoint to resume from.
"""

from __future__ import annotations

import errno

import pytest
import torch

from gpt2 import GPT, GPTConfig, TrainConfig
from gpt2.errors import Gpt2Error
from gpt2.train import checkpoint as ckpt
from gpt2.train import metrics
from gpt2.train.metrics import RunOutputError
from gpt2.train.trainer import Trainer

TOKENS = torch.randint(0, 64, (2048,), generator=torch.Generator().manual_seed(1))


def _fit(tmp_path) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    config = TrainConfig(
        micro_batch_size=2,
        seq_len=16,
        max_steps=6,
        max_lr=1e-3,
        checkpoint_interval=2,
        eval_interval=0,
        out_dir=str(tmp_path),
        device="cpu",
        plot=False,
        progress=False,
    )
    with Trainer(model, config, TOKENS, sinks=[]) as trainer:
        trainer.fit()


def _check_one_line(error: BaseException, file: str, tmp_path) -> None:
    text = str(error)
    assert "\n" not in text and file in text
    assert "No space left on device" in text and "free some space on that disk" in text
    assert f"the newest checkpoint {tmp_path / 'checkpoints' / 'step_000002'} is intact" in text
    assert isinstance(error, Gpt2Error) and isinstance(error, OSError) and error.errno == errno.ENOSPC


def test_a_full_disk_while_appending_metrics_names_the_file_and_the_checkpoint(tmp_path, monkeypatch):
    real_open = open

    class FullFile:
        """metrics.jsonl on a disk that fills up at step 3's record."""

        def __init__(self, f):
            self.f = f

        def write(self, text):
            if '"step": 3' in text:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def open_(path, mode="r", **kwargs):
        f = real_open(path, mode, **kwargs)
        if mode == "a":
            return FullFile(f)
        return f

    monkeypatch.setattr(metrics, "open", open_, raising=False)
    with pytest.raises(RunOutputError) as info:
        _fit(tmp_path)
    _check_one_line(info.value, "metrics.jsonl", tmp_path)
    assert info.value.filename == str(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_full_disk_while_writing_a_checkpoint_names_the_file_and_the_checkpoint(tmp_path, monkeypatch):
    real_save = ckpt.save_checkpoint

    def save(root, step, *args, **kwargs):
        if step == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(root / "step_000004" / "model.safetensors"))
        return real_save(root, step, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", save)
    with pytest.raises(RunOutputError) as info:
        _fit(tmp_path)
    _check_one_line(info.value, "step_000004/model.safetensors", tmp_path)


def test_the_checkpoint_writer_s_own_error_is_one_line_too(tmp_path, monkeypatch):
    real_save_weights = ckpt.save_weights
    calls = iter(range(100))

    def save_weights(*args, **kwargs):
        # the second checkpoint (step 4) fails writing its weights
        if next(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save_weights(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_weights", save_weights)
    with pytest.raises(ckpt.CheckpointSaveError) as info:
        _fit(tmp_path)
    text = str(info.value)
    assert "\n" not in text and "model.safetensors" in text and "No space left on device" in text
    assert "step_000002 is intact" in text and info.value.errno == errno.ENOSPC

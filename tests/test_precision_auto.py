"""precision="auto" on a CPU: bf16 only where the CPU multiplies bf16 natively (AMX or AVX512-BF16), fp32 elsewhere
(bf16 autocast there is emulated, slower than fp32); the choice and its reason are one INFO line at start.
"""

from __future__ import annotations

import logging

import pytest
import torch

from gpt2 import GPT, GPTConfig, TrainConfig
from gpt2.train import precision
from gpt2.train.precision import cpu_native_bf16, default_precision, resolve_precision
from gpt2.train.trainer import Trainer


def _auto_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision auto")]


def _capabilities(monkeypatch, **features) -> None:
    """This CPU, as torch.cpu.get_capabilities() would describe one with ``features``."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "x86_64", "avx2": True, **features})


@pytest.mark.skipif(cpu_native_bf16() is not None, reason="this CPU multiplies bf16 natively")
def test_auto_is_fp32_on_a_cpu_without_native_bf16(caplog):
    """This machine (an AMD EPYC with AVX2 only): fp32, and the log line says why."""
    assert default_precision("cpu") == "fp32"
    with caplog.at_level(logging.INFO, logger="gpt2"):
        assert resolve_precision("auto", "cpu").name == "fp32"
    capability = torch.backends.cpu.get_cpu_capability()
    assert _auto_lines(caplog) == [f"precision auto -> fp32: this CPU ({capability}) has no native bf16 matmul"]


@pytest.mark.parametrize("feature, name", [("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")])
def test_auto_is_bf16_on_a_cpu_that_multiplies_it_natively(monkeypatch, caplog, feature, name):
    _capabilities(monkeypatch, **{feature: True})
    assert cpu_native_bf16() == name and default_precision("cpu") == "bf16"
    with caplog.at_level(logging.INFO, logger="gpt2"):
        policy = resolve_precision("auto", "cpu")
    assert policy.name == "bf16" and policy.autocast_dtype == torch.bfloat16
    assert _auto_lines(caplog) == [f"precision auto -> bf16: this CPU multiplies bf16 natively ({name})"]


def test_auto_is_fp32_where_the_cpu_only_emulates_bf16_or_torch_cannot_tell(monkeypatch):
    # AVX-512 without its BF16 extension: oneDNN emulates bf16 (torch's mkldnn "bf16 supported" says yes)
    _capabilities(monkeypatch, avx512_f=True, avx512_bw=True, avx512_bf16=False, amx_bf16=False)
    assert cpu_native_bf16() is None and default_precision("cpu") == "fp32"
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert cpu_native_bf16() is None and default_precision("cpu") == "fp32"


def test_the_trainer_logs_the_auto_choice_once_at_start(monkeypatch, caplog):
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: None)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    config = TrainConfig(micro_batch_size=2, seq_len=16, max_steps=1, device="cpu", precision="auto", out_dir=None)
    with caplog.at_level(logging.INFO, logger="gpt2"):
        with Trainer(model, config, torch.randint(0, 64, (512,)), sinks=[]) as trainer:
            assert trainer.precision.name == "fp32"
    assert len(_auto_lines(caplog)) == 1 and "-> fp32: this CPU" in _auto_lines(caplog)[0]

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


# "and it is faster for the model at hand": on a CPU with native bf16, auto times the model's largest matmul.


def _gpt(n_embd: int = 32, vocab_size: int = 256) -> GPT:
    return GPT(GPTConfig(block_size=16, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=n_embd))


def test_the_probe_multiplies_the_models_largest_linear_with_its_rows_capped():
    # the LM head (256 x 32) is the largest linear of this model: a micro-batch of 4 x 16 tokens
    assert precision.probe_shape(_gpt(), 64) == (64, 32, 256)
    # GPT-2 124M's head: 38.6M weights, so the rows are capped at PROBE_MIN_ROWS (~1 GFLOP per product at most)
    head = torch.nn.Linear(768, 50257, bias=False, device="meta")
    shape = precision.probe_shape(torch.nn.Sequential(torch.nn.Linear(768, 3072, device="meta"), head), 4 * 1024)
    assert shape == (precision.PROBE_MIN_ROWS, 768, 50257)
    assert str(shape) == "64 x 768 @ 768 x 50257"
    # the MLP alone: as many rows as fit in PROBE_MAX_MACS multiply-adds
    assert precision.probe_shape(torch.nn.Linear(768, 3072, device="meta"), 4 * 1024) == (455, 768, 3072)
    assert precision.probe_shape(torch.nn.LayerNorm(8), 64) is None


@pytest.mark.parametrize(
    "seconds, picked, said",
    [
        ((2.0e-3, 1.0e-3), "bf16", "ran 2.00x as fast in bf16 (1.00 ms against 2.00 ms in fp32)"),
        ((1.0e-3, 1.0e-3), "fp32", "ran 1.00x as fast in bf16 (1.00 ms against 1.00 ms in fp32): bf16 pays from 1.25x"),
    ],
)
def test_auto_picks_bf16_only_where_the_models_matmul_is_faster_in_it(monkeypatch, caplog, seconds, picked, said):
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: "AMX")
    monkeypatch.setattr(precision, "time_bf16_matmul", lambda shape: seconds)
    shape = precision.probe_shape(_gpt(), 64)
    with caplog.at_level(logging.INFO, logger="gpt2"):
        assert resolve_precision("auto", "cpu", shape).name == picked
    (line,) = _auto_lines(caplog)
    assert line.startswith(f"precision auto -> {picked}: this CPU multiplies bf16 natively (AMX)")
    assert f"the model's largest matmul (64 x 32 @ 32 x 256) {said}" in line
    # without a shape (sampling, evaluation) the CPU's features decide alone
    assert default_precision("cpu") == "bf16"


def test_with_several_processes_bf16_only_where_every_one_measured_it_faster(monkeypatch):
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: "AMX")
    monkeypatch.setattr(precision, "time_bf16_matmul", lambda shape: (2.0, 1.0))
    # another process's probe found bf16 slower: the minimum over the processes is 0
    monkeypatch.setattr(precision.distributed, "all_reduce_min", lambda value: 0)
    name, why = precision._auto_precision(torch.device("cpu"), precision.MatmulShape(64, 32, 256))
    assert name == "fp32" and why.endswith(
        "ran 2.00x as fast in bf16 (1000.00 ms against 2000.00 ms in fp32), but another process measured it slower"
    )


def test_the_real_probe_decides_by_what_it_measured(monkeypatch, caplog):
    """The probe itself, on this machine's CPU (told it has native bf16): whatever it measures, the choice follows
    its own numbers (on a CPU that emulates bf16, like this AVX2 one, fp32: bf16 is several times slower there).
    """
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: "AMX")
    measured = []
    real_probe = precision.time_bf16_matmul

    def recorded(shape):
        seconds = real_probe(shape)
        measured.append(seconds)
        return seconds

    monkeypatch.setattr(precision, "time_bf16_matmul", recorded)
    model = _gpt(n_embd=64, vocab_size=512)
    config = TrainConfig(micro_batch_size=2, seq_len=16, max_steps=1, device="cpu", precision="auto", out_dir=None)
    with caplog.at_level(logging.INFO, logger="gpt2"):
        with Trainer(model, config, torch.randint(0, 512, (512,)), sinks=[]) as trainer:
            chosen = trainer.precision.name
    ((fp32_seconds, bf16_seconds),) = measured
    assert fp32_seconds > 0 and bf16_seconds > 0
    expected = "bf16" if fp32_seconds / bf16_seconds >= precision.BF16_MIN_SPEEDUP else "fp32"
    (line,) = _auto_lines(caplog)
    assert chosen == expected and line.startswith(f"precision auto -> {expected}: this CPU multiplies bf16 natively")
    # the trainer probed the head (512 x 64) over one micro-batch's 2 x 16 tokens
    assert "the model's largest matmul (32 x 64 @ 64 x 512)" in line

"""MFU against the peak of the run's precision, on a faked CUDA device."""

from __future__ import annotations

import pytest
import torch

from gpt2.train.metrics import PEAK_FLOPS, detect_peak_flops, mfu, peak_flops_for


@pytest.fixture
def fake_h100(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")


def test_each_precision_is_measured_against_its_own_peak(fake_h100):
    cuda = torch.device("cuda")
    peaks = {name: detect_peak_flops(cuda, None, name) for name in ("fp32", "tf32", "bf16", "fp16")}
    # NVIDIA's H100 SXM data sheet: 67 TFLOP/s fp32; 989 (TF32) and 1,979 (bf16/fp16) with sparsity
    assert peaks == {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12}
    # The same speed is a 15x larger fraction of the fp32 peak than of the bf16 one.
    flops_per_token, tokens_per_second = 6 * 124e6, 20_000.0
    assert mfu(flops_per_token, tokens_per_second, peaks["fp32"]) == pytest.approx(0.2221, abs=1e-4)
    assert mfu(flops_per_token, tokens_per_second, peaks["bf16"]) == pytest.approx(0.01504, abs=1e-5)
    assert detect_peak_flops(cuda, 1e12, "fp32") == 1e12  # an explicit peak wins
    assert detect_peak_flops(torch.device("cpu"), None, "fp32") is None


def test_unknown_gpu_has_no_peak(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert detect_peak_flops(torch.device("cuda"), None, "bf16") is None
    assert "Some Future GPU" in caplog.text


def test_peak_table_is_ordered_by_precision():
    for pattern, peaks in PEAK_FLOPS:
        assert 0 < peaks.fp32 <= peaks.tf32 <= peaks.bf16, pattern
    # GPUs without TF32 tensor cores run "tf32" as plain fp32
    assert peak_flops_for("Tesla V100-SXM2-16GB", "tf32") == peak_flops_for("Tesla V100-SXM2-16GB", "fp32")
    assert peak_flops_for("NVIDIA A100-SXM4-80GB", "tf32") == 156e12


def test_bench_table_is_markdown_with_mfu_and_peak_memory():
    from gpt2.train.bench import RungResult, format_table

    fp32 = RungResult("fp32", {}, ms_per_step=200.0, tokens_per_second=81920.0, mfu=0.31, peak_memory_gib=30.25)
    bf16 = RungResult("bf16", {}, ms_per_step=50.0, tokens_per_second=327680.0, mfu=0.124, peak_memory_gib=18.0)
    compiled = RungResult("compile", {}, skipped=True, note="compile disabled")
    for r in (fp32, bf16):
        r.repeat_ms, r.spread = [r.ms_per_step] * 3, 0.02
    lines = format_table([fp32, bf16, compiled], "`gpt2 bench` on NVIDIA H100 80GB HBM3, torch 2.9").splitlines()
    assert lines[0].endswith("torch 2.9") and lines[1] == ""
    header, rule, *rows = lines[2:7]
    assert [c.strip() for c in header.strip("|").split("|")][:6] == [
        "rung",
        "ms/step",
        "spread",
        "tokens/s",
        "MFU",
        "peak memory",
    ]
    assert rule.startswith("|---|")
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert cells[0] == ["fp32", "200.0", "2%", "81,920", "31.0%", "30.2 GiB", "1.00x", ""]
    assert cells[1][:7] == ["bf16", "50.0", "2%", "327,680", "12.4%", "18.0 GiB", "4.00x"]
    assert cells[2][0] == "compile" and cells[2][-1] == "compile disabled"

"""--seed makes a run reproducible from the first step: the initial weights (train) and LoRA's
random A matrices (finetune) are seeded, not only the data order. (That a 2-process run equals a
1-process run of the same global batch is tested in tests/test_interrupt.py, on the one
2-process launch it makes.)
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from gpt2.cli import main

# A tiny model on the start of Tiny Shakespeare (the offline copy conftest points at), no validation.
TRAIN = [
    "train",
    "--model",
    "tiny",
    "--seq-len",
    "32",
    "--micro-batch-size",
    "2",
    "--max-steps",
    "3",
    "--warmup-steps",
    "1",
    "--val-fraction",
    "0",
    "--eval-interval",
    "0",
    "--num-samples",
    "0",
    "--no-progress",
    "--no-plot",
    "--device",
    "cpu",
    "--precision",
    "fp32",
]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_train_with_one_seed_gives_identical_losses(tmp_path, shakespeare_file):
    runs = []
    for i in range(2):
        torch.manual_seed(100 + i)  # whatever the global RNG held before, --seed decides
        assert (
            main([*TRAIN, "--data", str(shakespeare_file), "--seed", "7", "--out-dir", str(tmp_path / f"run{i}")]) == 0
        )
        runs.append(losses(tmp_path / f"run{i}"))
    assert len(runs[0]) == 3 and runs[0] == runs[1]  # bit for bit: same weights, same data
    # and the seed matters: another one starts from other weights
    assert main([*TRAIN, "--data", str(shakespeare_file), "--seed", "8", "--out-dir", str(tmp_path / "other")]) == 0
    assert losses(tmp_path / "other")[0] != runs[0][0]


def test_finetune_with_one_seed_gives_identical_lora_init(tmp_path, hf_dir, shakespeare_file, caplog):
    from safetensors.torch import load_file

    args = [
        "finetune",
        "--init",
        str(hf_dir),
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--max-steps",
        "2",
        "--warmup-steps",
        "1",
        "--val-fraction",
        "0",
        "--eval-interval",
        "0",
        "--num-samples",
        "0",
        "--no-progress",
        "--no-plot",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--seed",
        "3",
        "--data",
        str(shakespeare_file),
    ]
    adapters = []
    for i in range(2):
        torch.manual_seed(200 + i)
        out = tmp_path / f"lora{i}"
        with caplog.at_level(logging.INFO):
            assert main([*args, "--out-dir", str(out)]) == 0
        files = sorted((out / "adapter").rglob("*.safetensors"))
        adapters.append({k: v for f in files for k, v in load_file(str(f)).items()})
        assert len(losses(out)) == 2
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for name in adapters[0]:
        assert torch.equal(adapters[0][name], adapters[1][name]), name
    assert losses(tmp_path / "lora0") == losses(tmp_path / "lora1")
    # the weights' source in one line: the directory once, the count with thousands separators
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    assert loaded and all(
        m.count(str(hf_dir)) == 1 and re.search(r"\(\d{1,3}(,\d{3})+ parameters\)", m) for m in loaded
    ), loaded

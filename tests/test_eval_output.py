"""``gpt2 eval --output FILE`` writes a new file, or with ``--overwrite`` replaces a regular file (never a
checkpoint's trainer_state.json without it, never a device node), and nothing beside it.
"""

from __future__ import annotations

import json
import os

import pytest
from _tiny_run import tiny_config, tiny_tokens

from gpt2 import GPT, GPTConfig
from gpt2.cli import main
from gpt2.train.trainer import Trainer


@pytest.fixture
def run_dir(tmp_path):
    out = tmp_path / "run"
    # GPT-2's vocabulary: the evaluated text is tokenised with GPT-2's tokenizer
    model = GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16))
    with Trainer(model, tiny_config(out, max_steps=2), tiny_tokens(), sinks=[]) as trainer:
        trainer.fit()
    return out


def _eval(run_dir, shakespeare_file, *extra):
    return main(
        [
            "eval",
            "--model",
            str(run_dir),
            "--data",
            str(shakespeare_file),
            "--max-batches",
            "1",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            *extra,
        ]
    )


def test_eval_output_refuses_a_file_gpt2_did_not_write(run_dir, shakespeare_file, capsys):
    state = run_dir / "checkpoints" / "step_000002" / "trainer_state.json"
    before = state.read_bytes()
    assert _eval(run_dir, shakespeare_file, "--output", str(state)) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "exists: choose another path" in err, err
    assert "--overwrite" in err and state.read_bytes() == before
    mine = run_dir.parent / "mine.json"
    mine.write_text('{"mine": 1}')
    assert _eval(run_dir, shakespeare_file, "--output", str(mine)) == 2
    assert json.loads(mine.read_text()) == {"mine": 1}
    # Named with --overwrite: the user asked for it.
    assert _eval(run_dir, shakespeare_file, "--output", str(mine), "--overwrite") == 0
    assert "val_loss" in json.loads(mine.read_text())


def test_eval_output_is_replaced_only_with_overwrite_and_nothing_is_written_beside_it(run_dir, shakespeare_file):
    folder = run_dir.parent / "results"
    out = folder / "eval.json"
    assert _eval(run_dir, shakespeare_file, "--output", str(out)) == 0
    out.write_text('{"edited": true}')
    assert _eval(run_dir, shakespeare_file, "--output", str(out)) == 2
    assert json.loads(out.read_text()) == {"edited": True}
    assert _eval(run_dir, shakespeare_file, "--output", str(out), "--overwrite") == 0
    assert "val_loss" in json.loads(out.read_text())
    assert sorted(p.name for p in folder.iterdir()) == ["eval.json"]


def test_eval_output_never_replaces_a_device_even_with_overwrite(run_dir, shakespeare_file, capsys):
    """--output /dev/null --overwrite replaced the device node with a regular file. A named pipe of the test's own
    stands for the device here: a failing run must not break the machine's /dev/null.
    """
    device = run_dir.parent / "device"
    os.mkfifo(device)
    assert _eval(run_dir, shakespeare_file, "--output", str(device), "--overwrite") == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{device} is not a regular file" in err, err
    assert device.is_fifo()

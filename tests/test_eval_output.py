"""Issue 27: ``gpt2 eval --output FILE`` replaced any file (a run's results.json is gpt2's; a checkpoint's
trainer_state.json or a user's file is not, and replacing trainer_state.json made the checkpoint "damaged").
"""

from __future__ import annotations

import json

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
    assert len(err.splitlines()) == 1 and "gpt2 has no record of writing it" in err, err
    assert "--overwrite" in err and state.read_bytes() == before
    mine = run_dir.parent / "mine.json"
    mine.write_text('{"mine": 1}')
    assert _eval(run_dir, shakespeare_file, "--output", str(mine)) == 2
    assert json.loads(mine.read_text()) == {"mine": 1}
    # Named with --overwrite: the user asked for it.
    assert _eval(run_dir, shakespeare_file, "--output", str(mine), "--overwrite") == 0
    assert "val_loss" in json.loads(mine.read_text())


def test_eval_output_replaces_its_own_earlier_file(run_dir, shakespeare_file, capsys):
    out = run_dir.parent / "eval.json"
    assert _eval(run_dir, shakespeare_file, "--output", str(out)) == 0
    first = out.read_text()
    assert _eval(run_dir, shakespeare_file, "--output", str(out)) == 0
    assert json.loads(out.read_text()).keys() == json.loads(first).keys()
    # ... but not once the user changed it.
    out.write_text('{"edited": true}')
    assert _eval(run_dir, shakespeare_file, "--output", str(out)) == 2
    assert json.loads(out.read_text()) == {"edited": True}

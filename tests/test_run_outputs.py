"""The run directory: ``--overwrite`` deletes only what gpt2 recorded writing, and a damaged record never
blocks a resume (and makes ``--overwrite`` delete nothing). The record is gpt2/outputs.py's; the run
directory's rule is gpt2/train/rundir.py's.
"""

from __future__ import annotations

import json
import logging

import pytest
from _tiny_run import tiny_config, tiny_model, tiny_tokens

from gpt2.outputs import RECORD_FILE
from gpt2.train import rundir
from gpt2.train.trainer import Trainer


def _train(out, **overrides):
    with Trainer(tiny_model(), tiny_config(out, **overrides), tiny_tokens(), sinks=[]) as trainer:
        trainer.fit()
    return trainer


def test_a_run_records_only_what_it_wrote_with_what_identifies_it(tmp_path):
    out = tmp_path / "run"
    _train(out, max_steps=2)
    record = json.loads((out / RECORD_FILE).read_text())
    # Pretraining writes no adapter, results.json, TensorBoard or W&B folder: none is claimed.
    assert set(record) == {"checkpoints", "metrics.jsonl"}
    assert record["checkpoints"]["digests"] == "SHA256SUMS"
    assert record["metrics.jsonl"]["appends"] is True and len(record["metrics.jsonl"]["sha256"]) == 64


def test_overwrite_never_deletes_a_folder_the_run_did_not_write(tmp_path):
    """A user's run/adapter/notes.txt made after a pretraining run was deleted by the next --overwrite
    (the old record listed every name a run might write, adapter included).
    """
    out = tmp_path / "run"
    _train(out, max_steps=2)
    (out / "adapter").mkdir()
    (out / "adapter" / "notes.txt").write_text("mine")
    try:
        _train(out, max_steps=2, overwrite=True)
    except rundir.RunDirNotEmptyError as e:
        assert "adapter" in str(e)
    assert (out / "adapter" / "notes.txt").read_text() == "mine"


def test_overwrite_keeps_a_users_file_inside_a_folder_gpt2_wrote_and_names_it(tmp_path, caplog):
    out = tmp_path / "run"
    _train(out, max_steps=2)
    notes = out / "checkpoints" / "notes.txt"
    notes.write_text("mine")
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        _train(out, max_steps=2, overwrite=True)
    assert notes.read_text() == "mine"
    assert "overwrite=True kept" in caplog.text and "notes.txt" in caplog.text
    # The earlier run's checkpoints went; the new run's are there.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["notes.txt", "step_000002"]


@pytest.mark.parametrize("damage", ["{not json", "[1, 2", '"a string"'])
def test_a_damaged_record_does_not_block_resume_auto(tmp_path, damage, caplog):
    """A damaged .gpt2-outputs.json made --resume auto refuse, advising to move the checkpoints away."""
    out = tmp_path / "run"
    _train(out, max_steps=2)
    (out / RECORD_FILE).write_text(damage)
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        trainer = _train(out, max_steps=4, resume="auto")
    assert trainer.step == 4
    assert "is damaged" in caplog.text
    # The record is rebuilt from what the resumed run wrote.
    assert {"checkpoints", "metrics.jsonl"} <= set(json.loads((out / RECORD_FILE).read_text()))


def test_overwrite_of_a_run_whose_record_is_truncated_deletes_nothing(tmp_path):
    """A truncated record made --overwrite delete checkpoints/ whole, a user's notes inside it included."""
    out = tmp_path / "run"
    _train(out, max_steps=2)
    record = (out / RECORD_FILE).read_text()
    (out / RECORD_FILE).write_text(record[: len(record) // 2])
    notes = out / "checkpoints" / "step_000002" / "notes.txt"
    notes.write_text("mine")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    with pytest.raises(rundir.RunDirNotEmptyError, match="cannot tell"):
        _train(out, max_steps=2, overwrite=True)
    assert notes.read_text() == "mine"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before


def test_overwrite_refuses_to_replace_a_metrics_or_results_file_the_user_edited(tmp_path):
    """--overwrite said it kept an edited metrics.jsonl or results.json, then the new run replaced it."""
    out = tmp_path / "run"
    _train(out, max_steps=2)
    rundir.record_outputs(out, ["metrics.jsonl"])
    for name in ("metrics.jsonl", "results.json"):
        edited = out / name
        if name == "results.json":
            edited.write_text('{"val_loss": 1.0}\n')
            rundir.record_outputs(out, [name])
        edited.write_text("my notes on this run\n")
        with pytest.raises(rundir.RunDirNotEmptyError, match=f"{name} changed since gpt2 wrote"):
            _train(out, max_steps=2, overwrite=True)
        assert edited.read_text() == "my notes on this run\n"
        edited.unlink()
    _train(out, max_steps=2, overwrite=True)

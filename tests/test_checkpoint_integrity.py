"""Damaged checkpoints and failed saves: every case ends in success (the newest intact checkpoint)
or in one error that names the file and what is wrong with it; nothing is lost or left behind.
"""

from __future__ import annotations

import errno
import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from _tiny_run import tiny_config, tiny_model, tiny_tokens

from gpt2.cli import main
from gpt2.model.checkpoint_files import (
    CheckpointError,
    NonFiniteWeightsError,
    load_weights,
    read_checkpoint,
    save_state,
)
from gpt2.model.gpt import GPT
from gpt2.train import checkpoint as ckpt
from gpt2.train.config import RecoveryConfig
from gpt2.train.trainer import Trainer

_config, _model, _tokens = tiny_config, tiny_model, tiny_tokens


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _rewrite_weights(path: Path, value: float) -> None:
    state, _ = load_weights(path)
    name = "transformer.h.0.mlp.c_fc.weight"
    state[name] = state[name].clone()
    state[name][0, 0] = value
    ckpt.save_weights({k: v for k, v in state.items() if k != "lm_head.weight"}, path)


def _garbage_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**40) + data[8:])


def _header_not_json(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))


# (damage, file it hits, words the error uses for it)
DAMAGE = {
    "truncated safetensors": (lambda p: _truncate(p / ckpt.WEIGHTS_FILE, 0.9), ckpt.WEIGHTS_FILE, "cannot be read"),
    "safetensors cut in its header": (
        lambda p: _truncate(p / ckpt.WEIGHTS_FILE, 0.001),
        ckpt.WEIGHTS_FILE,
        "cannot be read",
    ),
    "garbage header length": (lambda p: _garbage_header(p / ckpt.WEIGHTS_FILE), ckpt.WEIGHTS_FILE, "cannot be read"),
    "header not JSON": (lambda p: _header_not_json(p / ckpt.WEIGHTS_FILE), ckpt.WEIGHTS_FILE, "cannot be read"),
    "bytes appended": (
        lambda p: open(p / ckpt.WEIGHTS_FILE, "ab").write(b"\0" * 10),
        ckpt.WEIGHTS_FILE,
        "cannot be read",
    ),
    "empty safetensors": (lambda p: (p / ckpt.WEIGHTS_FILE).write_bytes(b""), ckpt.WEIGHTS_FILE, "cannot be read"),
    "missing safetensors": (lambda p: (p / ckpt.WEIGHTS_FILE).unlink(), ckpt.WEIGHTS_FILE, "is missing"),
    "nan weight": (
        lambda p: _rewrite_weights(p / ckpt.WEIGHTS_FILE, float("nan")),
        ckpt.WEIGHTS_FILE,
        "non-finite.*h.0.mlp.c_fc.weight",
    ),
    "inf weight": (
        lambda p: _rewrite_weights(p / ckpt.WEIGHTS_FILE, float("inf")),
        ckpt.WEIGHTS_FILE,
        "non-finite.*h.0.mlp.c_fc.weight",
    ),
    "corrupted json": (lambda p: (p / ckpt.META_FILE).write_text("{not json"), ckpt.META_FILE, "not valid JSON"),
    "truncated json": (lambda p: _truncate(p / ckpt.META_FILE), ckpt.META_FILE, "not valid JSON"),
    "json of another step": (
        lambda p: (p / ckpt.META_FILE).write_text(json.dumps({"step": 3})),
        ckpt.META_FILE,
        "'step' is 3 but the directory is step_000004",
    ),
    "missing json": (lambda p: (p / ckpt.META_FILE).unlink(), ckpt.META_FILE, "is missing"),
    "corrupted trainer_state": (
        lambda p: (p / ckpt.STATE_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage"),
        ckpt.STATE_FILE,
        "cannot be read",
    ),
    "truncated trainer_state": (lambda p: _truncate(p / ckpt.STATE_FILE), ckpt.STATE_FILE, "cannot be read"),
    "missing trainer_state": (lambda p: (p / ckpt.STATE_FILE).unlink(), ckpt.STATE_FILE, "is missing"),
    "pickled object in trainer_state": (
        lambda p: torch.save({"optimizer": Path("x")}, p / ckpt.STATE_FILE),
        ckpt.STATE_FILE,
        "holds pickled Python objects, which gpt2 never loads",
    ),
    "trainer_state without optimizer": (
        lambda p: save_state({"rng": None}, p / ckpt.STATE_FILE),
        ckpt.STATE_FILE,
        r"lacks \['optimizer', 'scaler'\]",
    ),
    "json list": (lambda p: (p / ckpt.META_FILE).write_text("[4]"), ckpt.META_FILE, "not hold a JSON object"),
    "safetensors is a directory": (
        lambda p: ((p / ckpt.WEIGHTS_FILE).unlink(), (p / ckpt.WEIGHTS_FILE).mkdir()),
        ckpt.WEIGHTS_FILE,
        "is not a file",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_falls_back_past_a_damaged_newest_checkpoint(run, case, caplog):
    damage, file, words = DAMAGE[case]
    newest = run / "checkpoints" / "step_000004"
    damage(newest)
    # Resuming skips it, says which and why, and continues from step 2 (the same run).
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        with Trainer(_model(), _config(run, resume="auto"), _tokens(), sinks=[]) as trainer:
            assert trainer.step == 2 and trainer.last_checkpoint.name == "step_000002"
    assert f"skipping damaged checkpoint {newest}" in caplog.text and file in caplog.text
    # The damaged checkpoint itself, asked for by name: one error naming the file, nothing raw.
    with pytest.raises(CheckpointError, match=words) as info:
        ckpt.load_checkpoint(newest, _model(), torch.optim.AdamW(_model().parameters()), restore_rng=True)
    message = str(info.value)
    assert file in message and "\n" not in message and "Pick another checkpoint" in message
    assert [p for p, _ in info.value.problems] == [str(newest / file)]
    # never torch's own advice to unpickle the file (weights_only=False runs code from it)
    assert "weights_only" not in message and "weights_only" not in caplog.text


@pytest.mark.parametrize("case", ["truncated safetensors", "nan weight", "corrupted json", "missing safetensors"])
def test_sample_eval_export_use_the_newest_intact_checkpoint(run, case, caplog):
    DAMAGE[case][0](run / "checkpoints" / "step_000004")
    good = _model()
    ckpt.load_checkpoint(run / "checkpoints" / "step_000002", good)
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        model = GPT.from_pretrained(run)
    assert "step_000002, the newest intact checkpoint" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), good.state_dict().values()))
    # trainer_state.safetensors is not needed to rebuild the model: a damaged one does not block sampling.
    (run / "checkpoints" / "step_000002" / ckpt.STATE_FILE).write_bytes(b"junk")
    GPT.from_pretrained(run)


def test_all_checkpoints_damaged_is_one_error_naming_every_file(run, tmp_path, capsys):
    _truncate(run / "checkpoints" / "step_000004" / ckpt.WEIGHTS_FILE)
    (run / "checkpoints" / "step_000002" / ckpt.META_FILE).write_text("{")
    (run / "checkpoints" / "step_000002" / ckpt.STATE_FILE).write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        Trainer(_model(), _config(run, resume="auto"), _tokens(), sinks=[])
    message = str(info.value)
    for part in (
        "step_000004/model.safetensors cannot be read",
        "step_000002/trainer_state.json is not valid JSON",
        "step_000002/trainer_state.safetensors cannot be read",
        "overwrite=True",
    ):
        assert part in message
    assert len(info.value.problems) == 3 and "\n" not in message
    # resume='auto' never starts from scratch silently, and the lock was released on the way out
    assert not (run / "run.lock").exists()
    # the command line: exit code 2, one line naming the files, no traceback
    code = main(["export", "--model", str(run), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and "step_000004/model.safetensors" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


def test_export_command_falls_back_to_the_newest_intact_checkpoint(run, tmp_path, caplog):
    _rewrite_weights(run / "checkpoints" / "step_000004" / ckpt.WEIGHTS_FILE, float("nan"))
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        assert main(["export", "--model", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "skipping damaged checkpoint" in caplog.text and "non-finite" in caplog.text
    assert (tmp_path / "hf" / "config.json").is_file()


def test_non_finite_checkpoint_is_never_the_last_good_one(run):
    _rewrite_weights(run / "checkpoints" / "step_000004" / ckpt.WEIGHTS_FILE, float("inf"))
    with pytest.raises(NonFiniteWeightsError, match="transformer.h.0.mlp.c_fc.weight"):
        read_checkpoint(run / "checkpoints" / "step_000004")
    model = _model()
    trainer = Trainer(
        model, _config(run, resume="auto", max_steps=8, recovery=RecoveryConfig(max_bad_steps=1)), _tokens(), sinks=[]
    )
    assert trainer.last_checkpoint.name == "step_000002"
    model.register_forward_hook(lambda m, i, out: (out[0], out[1] * float("nan")))
    with pytest.raises(Exception) as info:  # TrainingDivergedError at once
        trainer.fit()
    # step 2's next step here was not finite: not named either
    assert "No checkpoint of this run is known good" in str(info.value) and "step_000004" not in str(info.value)
    trainer.close()


def test_load_weights_wraps_every_safetensors_error(tmp_path):
    path = tmp_path / "w.safetensors"
    ckpt.save_weights({"a": torch.ones(4)}, path)
    data = path.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    header["a"]["shape"] = [5]  # the bytes say 4 floats, the header 5
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    path.write_bytes(data[:8] + raw + data[8 + header_len :])
    with pytest.raises(CheckpointError, match="w.safetensors cannot be read .*offset for tensor"):
        load_weights(path)
    header["a"] = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    header["__metadata__"] = {"aliases": "{not json"}
    path.write_bytes(
        data[:8] + json.dumps(header, separators=(",", ":")).encode().ljust(header_len) + data[8 + header_len :]
    )
    with pytest.raises(CheckpointError, match="aliases"):
        load_weights(path)


# ------------------------------------------------------------------------------ failed saves


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 1024 vs 960"),
        PermissionError(errno.EACCES, "Permission denied"),
    ],
)
@pytest.mark.parametrize("where", ["save_weights", "replace_atomically", "sha256_file", "_move_into_place"])
def test_failed_save_says_the_previous_checkpoint_is_intact(run, monkeypatch, failure, where):
    root = run / "checkpoints"
    before = sorted(p.name for p in root.iterdir())

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(ckpt, where, fail)
    with pytest.raises(ckpt.CheckpointSaveError) as info:
        ckpt.save_checkpoint(root, 6, _model())
    message = str(info.value)
    assert f"the newest checkpoint {root / 'step_000004'} is intact" in message and "\n" not in message
    assert "resume" in message and str(failure).split("]")[-1].strip()[:10] in message
    if isinstance(failure, OSError):
        assert info.value.errno == failure.errno
    assert sorted(p.name for p in root.iterdir()) == before  # no temporary directory, nothing new
    monkeypatch.undo()
    read_checkpoint(root / "step_000004")  # untouched


def test_failed_resave_of_the_same_step_keeps_the_old_copy(run, monkeypatch):
    root = run / "checkpoints"
    real_replace = ckpt.os.replace

    def second_rename_fails(src, dst):
        if Path(src).name.startswith(".tmp-step_000004"):  # step_000004 was moved aside, the new copy cannot move in
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", second_rename_fails)
    with pytest.raises(ckpt.CheckpointSaveError, match="newest checkpoint .*step_000004 is intact"):
        ckpt.save_checkpoint(root, 4, _model())
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004"]
    read_checkpoint(root / "step_000004")


def test_trainer_save_failure_is_one_clear_error_and_resume_works(run, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    trainer = Trainer(_model(), _config(run, resume="auto", max_steps=6), _tokens(), sinks=[])
    monkeypatch.setattr(ckpt, "replace_atomically", disk_full)
    with pytest.raises(ckpt.CheckpointSaveError, match="No space left on device.*step_000004 is intact"):
        trainer.fit()
    trainer.close()
    monkeypatch.undo()
    resumed = Trainer(_model(), _config(run, resume="auto", max_steps=6), _tokens(), sinks=[])
    assert resumed.step == 4
    resumed.close()


# ------------------------------------------------------------------------------ interrupted saves


def test_a_prune_killed_half_way_leaves_a_leftover_not_a_torn_checkpoint(run, monkeypatch):
    """The delete of an old checkpoint is not atomic: killed during it, the folder was left with some
    files under its step_* name and never removed. It is renamed away first now.
    """
    root = run / "checkpoints"
    names = [p.name for p in ckpt.list_checkpoints(root)]
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda path, **kw: (Path(path) / ckpt.WEIGHTS_FILE).unlink())  # "killed"
    removed = ckpt.prune_checkpoints(root, keep_last=1)
    assert [p.name for p in removed] == names[:-1]
    assert sorted(p.name for p in root.glob("step_*")) == names[-1:]  # no torn step_* left
    assert len(list(root.glob(".tmp-step_*"))) == len(removed)
    monkeypatch.undo()
    ckpt.clean_interrupted_saves(root)  # what the next run does at start, holding the lock
    assert sorted(p.name for p in root.iterdir()) == names[-1:]


def test_leftovers_of_an_interrupted_save_are_cleaned_up_at_start(run, caplog):
    root = run / "checkpoints"
    # killed while writing step 6 and between the two renames of re-saving step 4 (the only copy
    # of step 4 is the .old- one)
    (root / ".tmp-step_000006-0123abcd").mkdir()
    (root / ".tmp-step_000006-0123abcd" / ckpt.WEIGHTS_FILE).write_bytes(b"partial")
    (root / "step_000004").rename(root / ".old-step_000004-4567cdef")
    # The Trainer holds the run's lock, so at start it removes every leftover and restores step 4.
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        with Trainer(_model(), _config(run, resume="auto"), _tokens(), sinks=[]) as trainer:
            assert trainer.step == 4
    assert "interrupted save" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004"]

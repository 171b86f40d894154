"""gpt2.outputs: gpt2 deletes or replaces only what it can prove it wrote (issue 27)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest

from gpt2 import outputs
from gpt2.outputs import RECORD_FILE, NotOursError, check_replaceable, is_owned, record_written, remove_owned

FLAG = "--overwrite"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _record(folder: Path) -> dict:
    return json.loads((folder / RECORD_FILE).read_text())


def test_a_file_is_replaceable_only_while_it_is_what_gpt2_wrote(tmp_path):
    out = _write(tmp_path / "results.json", "{}")
    with pytest.raises(NotOursError, match=rf"results.json exists and gpt2 has no record of writing it: .*pass {FLAG}"):
        check_replaceable(out, overwrite=False, flag=FLAG)
    record_written(out)
    check_replaceable(out, overwrite=False, flag=FLAG)
    entry = _record(tmp_path)["results.json"]
    assert entry == {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}

    out.write_text("{} ")  # the user edited it
    with pytest.raises(NotOursError, match="results.json has changed since gpt2 wrote it") as info:
        check_replaceable(out, overwrite=False, flag=FLAG)
    assert isinstance(info.value, FileExistsError) and "\n" not in str(info.value)
    check_replaceable(out, overwrite=True, flag=FLAG)  # the user named it and asked
    check_replaceable(tmp_path / "absent.json", overwrite=False, flag=FLAG)


def test_a_users_file_added_inside_a_recorded_folder_survives(tmp_path):
    export = tmp_path / "export"
    _write(export / "config.json", "c")
    _write(export / "sub" / "weights.bin", "w")
    record_written(export, files=["config.json", "sub/weights.bin"])
    _write(export / "notes.txt", "mine")
    assert not is_owned(export)  # a folder is gpt2's only when all of it is

    removed, kept = remove_owned(tmp_path, ["export"])
    assert sorted(removed) == [export / "config.json", export / "sub" / "weights.bin"]
    assert kept == [export / "notes.txt"]
    assert sorted(p.name for p in export.iterdir()) == ["notes.txt"]  # sub/ was left empty: removed
    assert (export / "notes.txt").read_text() == "mine"
    assert _record(tmp_path) == {"export": {"files": {}}}


def test_a_folder_all_gpt2_wrote_is_removed_whole_and_its_record_with_it(tmp_path):
    export = tmp_path / "export"
    _write(export / "config.json", "c")
    _write(tmp_path / "thesis.tex", "mine")
    record_written(export, files=["config.json"])
    assert is_owned(export) and outputs.is_recorded(export)
    assert remove_owned(tmp_path, ["export", "thesis.tex"]) == ([export], [tmp_path / "thesis.tex"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis.tex"]  # nothing left to record


def test_a_changed_file_in_a_recorded_folder_is_neither_replaced_nor_deleted(tmp_path):
    export = tmp_path / "export"
    _write(export / "config.json", "c")
    _write(export / "model.bin", "w")
    record_written(export, files=["config.json", "model.bin"])
    check_replaceable(export / "config.json", overwrite=False, flag=FLAG, within=export)
    (export / "config.json").write_text("edited")
    with pytest.raises(NotOursError, match="config.json has changed since gpt2 wrote it"):
        check_replaceable(export / "config.json", overwrite=False, flag=FLAG, within=export)
    with pytest.raises(NotOursError, match="no record of writing it"):
        check_replaceable(_write(export / "tokenizer.json", "t"), overwrite=False, flag=FLAG, within=export)
    assert remove_owned(tmp_path, ["export"]) == (
        [export / "model.bin"],
        [export / "config.json", export / "tokenizer.json"],
    )
    assert (export / "config.json").read_text() == "edited"


def test_a_folder_is_never_replaced_even_with_overwrite(tmp_path):
    _write(tmp_path / "runs" / "notes.txt", "mine")
    with pytest.raises(
        NotOursError, match=rf"runs is a folder holding files gpt2 did not write.*{FLAG} replaces files"
    ):
        check_replaceable(tmp_path / "runs", overwrite=True, flag=FLAG)


def test_a_legacy_list_record_counts_only_where_the_caller_allows_and_is_rebuilt(tmp_path):
    (tmp_path / RECORD_FILE).write_text(json.dumps(["checkpoints", "metrics.jsonl", "wandb"]))
    _write(tmp_path / "checkpoints" / "step_000001" / "model.safetensors", "w")
    metrics = _write(tmp_path / "metrics.jsonl", "{}\n")
    assert outputs.recorded_names(tmp_path) == {"checkpoints", "metrics.jsonl", "wandb"}
    assert not outputs.is_recorded(metrics)  # a name, no identity
    with pytest.raises(NotOursError, match="recorded by an older gpt2 without its size and sha256"):
        check_replaceable(metrics, overwrite=False, flag=FLAG)
    check_replaceable(metrics, overwrite=False, flag=FLAG, legacy=True)
    assert remove_owned(tmp_path, ["metrics.jsonl"]) == ([], [metrics])

    _write(tmp_path / "results.json", "{}")
    record_written(tmp_path / "results.json")  # rebuilt in the new format
    record = _record(tmp_path)
    assert record["checkpoints"] == record["wandb"] == {"legacy": True}
    assert set(record) == {"checkpoints", "metrics.jsonl", "wandb", "results.json"}  # names, as the old reader read

    removed, kept = remove_owned(tmp_path, ["checkpoints", "metrics.jsonl"], legacy=True)
    assert sorted(removed) == [tmp_path / "checkpoints", metrics] and kept == []
    assert set(_record(tmp_path)) == {"results.json", "wandb"}


def test_a_damaged_record_is_named_claims_nothing_it_cannot_read_and_is_rebuilt(tmp_path, caplog):
    mine = _write(tmp_path / "a.txt", "a")
    record_written(mine)
    (tmp_path / RECORD_FILE).write_text('{"a.txt": {"size": 1, ')  # cut short
    with caplog.at_level(logging.WARNING, logger="gpt2.outputs"):
        with pytest.raises(NotOursError):
            check_replaceable(mine, overwrite=False, flag=FLAG)
    assert f"{tmp_path / RECORD_FILE} is damaged (it is not readable JSON" in caplog.text
    record_written(mine)
    assert set(_record(tmp_path)) == {"a.txt"}

    ok = {"size": 1, "sha256": hashlib.sha256(b"b").hexdigest()}
    _write(tmp_path / "b.txt", "b")
    bad = {"size": "1", "sha256": ok["sha256"]}
    record = {"a.txt": bad, "b.txt": ok, "../x": ok, "c": {"files": {"/etc/passwd": ok}}, "d": {"legacy": "yes"}}
    (tmp_path / RECORD_FILE).write_text(json.dumps(record))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpt2.outputs"):
        assert is_owned(tmp_path / "b.txt") and not is_owned(mine)
    assert "its entries 'a.txt', '../x', 'c', 'd' are not valid" in caplog.text
    record_written(_write(tmp_path / "e.txt", "e"))
    assert set(_record(tmp_path)) == {"b.txt", "e.txt"}

    (tmp_path / RECORD_FILE).write_text("42")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpt2.outputs"):
        assert outputs.recorded_names(tmp_path) == set()
    assert "it holds a JSON int, not an object of names" in caplog.text


def test_a_link_is_never_followed_for_deletion(tmp_path):
    outside = tmp_path / "outside"
    _write(outside / "model.bin", "w")
    _write(outside / "sub" / "model.bin", "w")
    run = tmp_path / "run"
    export = run / "export"
    _write(export / "model.bin", "w")
    _write(export / "sub" / "model.bin", "w")
    record_written(export, files=["model.bin", "sub/model.bin"])
    # The user swaps in links to files with the very bytes gpt2 recorded.
    (export / "model.bin").unlink()
    (export / "model.bin").symlink_to(outside / "model.bin")
    (export / "sub" / "model.bin").unlink()
    (export / "sub").rmdir()
    (export / "sub").symlink_to(outside / "sub")
    assert not is_owned(export / "sub" / "model.bin", within=export)
    with pytest.raises(NotOursError):
        check_replaceable(export / "model.bin", overwrite=False, flag=FLAG, within=export)
    removed, kept = remove_owned(run, ["export"])
    assert removed == [] and sorted(kept) == [export / "model.bin", export / "sub"]
    assert (outside / "model.bin").read_text() == (outside / "sub" / "model.bin").read_text() == "w"

    # A recorded name that is now a link to a folder: kept, nothing behind it touched.
    _write(tmp_path / "ckpts" / "x", "w")
    _write(run / "checkpoints" / "x", "w")
    record_written(run / "checkpoints", files=["x"])
    (run / "checkpoints" / "x").unlink()
    (run / "checkpoints").rmdir()
    (run / "checkpoints").symlink_to(tmp_path / "ckpts")
    assert remove_owned(run, ["checkpoints"]) == ([], [run / "checkpoints"])
    assert (tmp_path / "ckpts" / "x").read_text() == "w"


def _checkpoint(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        _write(folder / name, text)
    sums = "".join(f"{hashlib.sha256(t.encode()).hexdigest()}  {n}\n" for n, t in files.items())
    (folder / "SHA256SUMS").write_text(sums)


def test_digest_files_vouch_for_their_neighbours(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    record_written(ckpts, digests="SHA256SUMS")  # once: later checkpoints carry their own digests
    _checkpoint(ckpts / "step_000001", {"model.safetensors": "w1", "trainer_state.json": "{}"})
    _checkpoint(ckpts / "step_000002", {"model.safetensors": "w2", "trainer_state.json": "{}"})
    _checkpoint(ckpts / "step_000003", {"model.safetensors": "w3"})
    assert is_owned(ckpts)
    check_replaceable(ckpts / "step_000001" / "model.safetensors", overwrite=False, flag=FLAG, within=ckpts)
    (ckpts / "step_000002" / "model.safetensors").write_text("bit rot")
    _write(ckpts / "step_000003" / "notes.txt", "mine")
    removed, kept = remove_owned(tmp_path, ["checkpoints"])
    # A damaged checkpoint keeps its digests, the evidence of what it should hold.
    assert sorted(kept) == [ckpts / "step_000002" / n for n in ("SHA256SUMS", "model.safetensors")] + [
        ckpts / "step_000003" / "notes.txt"
    ]
    assert not (ckpts / "step_000001").exists() and (ckpts / "step_000002" / "trainer_state.json") in removed
    assert sorted(p.name for p in (ckpts / "step_000003").iterdir()) == ["notes.txt"]


def test_an_appended_log_stays_gpt2s_while_it_starts_with_what_was_recorded(tmp_path):
    log = _write(tmp_path / "metrics.jsonl", '{"step": 1}\n')
    record_written(log, appends=True)
    with open(log, "a") as f:
        f.write('{"step": 2}\n')
    assert is_owned(log)
    log.write_text('{"step": 9}\n{"step": 2}\n')
    assert not is_owned(log)


def test_a_name_never_recorded_is_kept_even_when_the_caller_lists_it(tmp_path):
    _write(tmp_path / "loss.png", "png")
    assert remove_owned(tmp_path, ["loss.png", "absent"]) == ([], [tmp_path / "loss.png"])
    assert not (tmp_path / RECORD_FILE).exists()
    with pytest.raises(ValueError, match="takes names"):
        remove_owned(tmp_path, ["../loss.png"])


def test_the_record_is_written_atomically(tmp_path, monkeypatch, caplog):
    first = _write(tmp_path / "a.txt", "a")
    record_written(first)
    before = (tmp_path / RECORD_FILE).read_bytes()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with caplog.at_level(logging.WARNING, logger="gpt2.outputs"):
        record_written(_write(tmp_path / "b.txt", "b"))  # a warning: the file counts as not gpt2's
    monkeypatch.undo()
    assert "could not record that gpt2 wrote" in caplog.text and "No space left" in caplog.text
    assert (tmp_path / RECORD_FILE).read_bytes() == before  # the old record, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD_FILE, "a.txt", "b.txt"]  # no temporary left
    assert is_owned(first) and not is_owned(tmp_path / "b.txt")


def test_record_written_takes_only_what_gpt2_writes(tmp_path):
    (tmp_path / "link").symlink_to(_write(tmp_path / "x", "x"))
    with pytest.raises(ValueError, match="not a plain file"):
        record_written(tmp_path / "link")
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="not a path inside"):
        record_written(tmp_path / "d", files=["../x"])
    with pytest.raises(FileNotFoundError):
        record_written(tmp_path / "d", files=["not-written-yet"])
    assert not (tmp_path / RECORD_FILE).exists()


def test_the_current_folder_is_recorded_in_its_parent(tmp_path, monkeypatch):
    here = tmp_path / "here"
    _write(here / "f", "f")
    monkeypatch.chdir(here)
    record_written(".", files=["f"])
    assert _record(tmp_path) == {"here": {"files": {"f": {"size": 1, "sha256": hashlib.sha256(b"f").hexdigest()}}}}
    check_replaceable("f", overwrite=False, flag=FLAG, within=".")

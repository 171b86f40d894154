"""gpt2.outputs: gpt2 deletes or replaces only what the record inside a folder proves it wrote, unchanged
since; and nothing is written outside the paths a user names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from gpt2 import GPT, GPTConfig
from gpt2.cli import main
from gpt2.files import OutputExistsError, check_new_file, replace_atomically
from gpt2.outputs import DIGEST_FILE, RECORD_FILE, OutputFolder, checkpoint_files


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _record(folder: Path) -> dict:
    return json.loads((folder / RECORD_FILE).read_text())


def test_a_file_is_gpt2s_only_while_it_is_what_gpt2_wrote(tmp_path):
    folder = OutputFolder(tmp_path)
    out = _write(tmp_path / "results.json", "{}")
    assert not folder.owns("results.json")
    folder.record(["results.json"])
    assert folder.owns("results.json")
    assert _record(tmp_path)["results.json"] == {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    out.write_text("{} ")  # the user edited it
    assert not folder.owns("results.json")
    assert folder.remove(["results.json"]) == ([], [out])
    assert out.read_text() == "{} "


def test_a_users_file_inside_a_recorded_folder_survives_and_is_named(tmp_path):
    folder = OutputFolder(tmp_path)
    _write(tmp_path / "export" / "config.json", "c")
    _write(tmp_path / "export" / "sub" / "weights.bin", "w")
    folder.record(["export"])
    notes = _write(tmp_path / "export" / "notes.txt", "mine")
    removed, kept = folder.remove(["export"])
    assert sorted(removed) == [tmp_path / "export" / "config.json", tmp_path / "export" / "sub" / "weights.bin"]
    assert kept == [notes] and notes.read_text() == "mine"
    # sub/ was left empty: removed; what is gone left the record with it.
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["notes.txt"]
    assert _record(tmp_path) == {}


def test_an_appended_log_stays_gpt2s_while_it_starts_with_what_was_recorded(tmp_path):
    folder = OutputFolder(tmp_path)
    log = _write(tmp_path / "metrics.jsonl", '{"step": 1}\n')
    folder.record([], appends=["metrics.jsonl"])
    with open(log, "a") as f:
        f.write('{"step": 2}\n')
    assert folder.owns("metrics.jsonl")
    log.write_text('{"step": 9}\n{"step": 2}\n')
    assert not folder.owns("metrics.jsonl")


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"a": {"size": -1}}'])
def test_a_damaged_record_is_named_and_proves_nothing(tmp_path, damage, caplog):
    folder = OutputFolder(tmp_path)
    _write(tmp_path / "a.txt", "a")
    folder.record(["a.txt"])
    (tmp_path / RECORD_FILE).write_text(damage)
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        assert folder.remove(["a.txt"]) == ([], [tmp_path / "a.txt"])
    assert "is damaged" in caplog.text and (tmp_path / "a.txt").exists()


def test_a_link_is_never_followed_nor_gpt2s(tmp_path):
    outside = _write(tmp_path / "outside" / "keep.txt", "keep")
    run = tmp_path / "run"
    _write(run / "logs" / "a.txt", "a")
    folder = OutputFolder(run)
    folder.record(["logs"])
    (run / "logs" / "link").symlink_to(tmp_path / "outside")
    removed, kept = folder.remove(["logs"])
    assert removed == [run / "logs" / "a.txt"] and kept == [run / "logs" / "link"]
    assert outside.read_text() == "keep"


def test_a_file_that_cannot_be_read_is_left_out_of_the_record(tmp_path, monkeypatch, caplog):
    """A file that cannot be hashed when gpt2 records its writes (an I/O error, a file gone in between) is
    not vouched for, and the record stays readable: it used to hold a null digest, after which the whole
    record counted as damaged and every file in the folder as not gpt2's.
    """
    import gpt2.outputs

    folder = OutputFolder(tmp_path)
    _write(tmp_path / "logs" / "a.txt", "a")
    _write(tmp_path / "logs" / "b.txt", "b")
    real = gpt2.outputs.sha256_file

    def flaky(path, size=None):
        if Path(path).name == "b.txt":
            raise OSError(5, "Input/output error", str(path))
        return real(path, size)

    monkeypatch.setattr(gpt2.outputs, "sha256_file", flaky)
    with caplog.at_level(logging.WARNING):
        folder.record(["logs"])
    assert set(_record(tmp_path)) == {"logs/a.txt"} and "damaged" not in caplog.text
    monkeypatch.setattr(gpt2.outputs, "sha256_file", real)
    assert folder.owns("logs/a.txt") and not folder.owns("logs/b.txt")
    assert folder.remove(["logs"]) == ([tmp_path / "logs" / "a.txt"], [tmp_path / "logs" / "b.txt"])


def test_a_checkpoint_is_vouched_for_by_its_own_record(tmp_path):
    step = tmp_path / "step_000001"
    weights = _write(step / "model.safetensors", "w")
    shard = _write(step / "shards" / "0.distcp", "s")
    sums = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(step).as_posix()}\n" for p in (weights, shard)
    )
    _write(step / DIGEST_FILE, sums)
    notes = _write(step / "notes.txt", "mine")
    mine, others = checkpoint_files(step)
    assert sorted(mine) == sorted([weights, shard, step / DIGEST_FILE]) and others == [notes]
    weights.write_text("changed")
    mine, others = checkpoint_files(step)
    assert mine == [shard] and sorted(others) == sorted([weights, notes, step / DIGEST_FILE])


def test_a_named_file_is_written_only_where_new_or_with_overwrite_over_a_regular_file(tmp_path):
    out = tmp_path / "a" / "r.json"
    out.parent.mkdir()

    def save(path, overwrite):
        check_new_file(path, overwrite=overwrite, flag="--overwrite")
        replace_atomically(path, lambda f: f.write(b"{}"))

    save(out, overwrite=False)
    with pytest.raises(OutputExistsError, match="r.json exists: choose another path, or pass --overwrite"):
        save(out, overwrite=False)
    save(out, overwrite=True)
    link = tmp_path / "a" / "link.json"
    link.symlink_to(out)
    # A named pipe stands for a device such as /dev/null.
    device = tmp_path / "a" / "device"
    os.mkfifo(device)
    for path in (device, link, tmp_path / "a"):
        with pytest.raises(OutputExistsError, match="gpt2 writes a new file there only"):
            save(path, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["device", "link.json", "r.json"]
    assert device.is_fifo()


def test_nothing_is_written_outside_the_paths_a_user_names(tmp_path, shakespeare_file, monkeypatch):
    """save_pretrained, export --gguf, eval --output and train each left a/.gpt2-outputs.json beside what they wrote."""
    pytest.importorskip("gguf")
    monkeypatch.chdir(tmp_path)
    a = tmp_path / "a"
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16))
    model.save_pretrained(a / "model")
    model.save_pretrained(a / "model", overwrite=True)
    for extra in ([], ["--overwrite"]):
        assert main(["export", "--model", str(a / "model"), "--gguf", str(a / "m.gguf"), *extra]) == 0
        evaluate = ["eval", "--model", str(a / "model"), "--data", str(shakespeare_file), "--output", str(a / "r.json")]
        assert main([*evaluate, "--max-batches", "1", "--batch-size", "1", "--seq-len", "16", *extra]) == 0
        train = ["train", "--model", "tiny", "--data", str(shakespeare_file), "--out-dir", str(a / "run")]
        train += ["--seq-len", "16", "--micro-batch-size", "2", "--max-steps", "1", "--warmup-steps", "0"]
        assert main([*train, "--no-progress", "--num-samples", "0", *extra]) == 0
    assert sorted(p.name for p in a.iterdir()) == ["m.gguf", "model", "r.json", "run"]
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_a_recorded_file_of_another_size_is_judged_without_reading_it(tmp_path, monkeypatch):
    from gpt2 import outputs

    folder = outputs.OutputFolder(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "metrics.jsonl").write_bytes(b"{}\n")
    folder.record(["model.safetensors"], appends=["metrics.jsonl"])
    (tmp_path / "model.safetensors").write_bytes(b"x" * 101)
    (tmp_path / "metrics.jsonl").write_bytes(b"{}\n{}\n")
    read = []
    sha256 = outputs._sha256
    monkeypatch.setattr(outputs, "_sha256", lambda path, size=None: read.append(path.name) or sha256(path, size))
    # grown: not the file gpt2 wrote, and not read; a log that grew is read up to its recorded size
    assert not folder.owns("model.safetensors") and folder.owns("metrics.jsonl")
    assert read == ["metrics.jsonl"]

"""`prepare` is atomic: shards and their record (.gpt2-outputs.json) are written whole or not at
all, and a folder whose shards do not match the record is refused by the loader.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal
import socket
from pathlib import Path

import numpy as np
import pytest
from conftest import forked

from gpt2 import outputs
from gpt2.data import ShardManifestError, ShardWriteError, TokenLoader, load_tokens, prepare, write_shards, write_tokens
from gpt2.data.loader import make_loader
from gpt2.files import Stopped
from gpt2.outputs import RECORD_FILE

B, T = 1, 4
OLD = ["an earlier data set, " * 3, "kept when a prepare fails"]
NEW = ["First Citizen: Before we proceed any further, hear me speak.", "All: Speak, speak.", "Resolved." * 4]


class Bytes:
    """A tokenizer of UTF-8 bytes (ids 0..255, 256 = end of text): fast, and known exactly."""

    eot_token = 256

    def encode_ordinary(self, text):
        return list(text.encode("utf-8"))


def stream(docs):
    return np.concatenate([[256, *d.encode("utf-8")] for d in docs])


def prepare_into(out, docs, **kwargs):
    return write_shards(docs, out, prefix="t", shard_size=16, tokenizer=Bytes(), progress=False, **kwargs)


def snapshot(folder: Path):
    """Every file and folder under ``folder`` (hidden ones too) with its bytes; None if absent."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else "dir" for p in sorted(folder.rglob("*"))}


def read_all(out: Path, split: str) -> np.ndarray:
    """Every token of ``split`` through the loader, so each shard's digest is checked."""
    loader = TokenLoader(out, B, T, split=split, vocab_size=257)
    for _ in range(loader.num_tokens // (B * T) + loader.num_shards):
        loader.next_batch()
    return np.concatenate([load_tokens(p) for p in sorted(out.glob(f"t_{split}_*.npy"))])


@pytest.fixture
def earlier(tmp_path):
    """A folder holding an earlier data set and a file of the user's."""
    out = tmp_path / "data"
    prepare_into(out, OLD)
    (out / "notes.txt").write_text("the user's")
    return out


def test_record_lists_every_shard_before_they_move_in(tmp_path, monkeypatch):
    moved, real_replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (moved.append(Path(dst)), real_replace(src, dst)))
    out = tmp_path / "data"
    paths = prepare_into(out, NEW)
    record = json.loads((out / RECORD_FILE).read_text())
    assert sorted(record) == sorted(p.name for p in paths) and len(paths) > 3
    for path in paths:
        assert record[path.name]["size"] == path.stat().st_size
        assert record[path.name]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    np.testing.assert_array_equal(np.concatenate([load_tokens(p) for p in paths]), stream(NEW))
    # Into the folder go: the record, then the shards.
    into_out = [p.name for p in moved if p.parent == out]
    assert into_out == [RECORD_FILE, *[p.name for p in paths]]
    assert sorted(os.listdir(out)) == sorted([p.name for p in paths] + [RECORD_FILE])  # no leftovers


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", "t_train_000002.npy is missing"),
        ("truncated", "t_train_000002.npy has 130 bytes, the record lists 160"),
        ("changed", "t_train_000002.npy has changed"),
        ("extra", "t_train_000099.npy is not listed"),
        ("record damaged", f"{RECORD_FILE} is damaged"),
    ],
)
def test_loader_refuses_a_folder_that_does_not_match_its_record(earlier, damage, message):
    shard, record = earlier / "t_train_000002.npy", earlier / RECORD_FILE
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-30])
    elif damage == "changed":  # same size, same token count: only the digest tells
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "extra":
        np.save(earlier / "t_train_000099.npy", np.arange(20, dtype=np.uint16))
    else:
        record.write_text(record.read_text()[:50])
    with pytest.raises(ShardManifestError, match=f"{message}.*re-run `gpt2 prepare`"):
        read_all(earlier, "train")
    # train and eval build their loaders the same way.
    with pytest.raises(ShardManifestError, match=message):
        loader = make_loader(str(earlier), "train", B, T, vocab_size=257)
        for _ in range(20):
            loader.next_batch()


def test_digests_are_checked_when_a_shard_is_first_opened(earlier):
    shard = earlier / "t_train_000001.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    loader = TokenLoader(earlier, B, T, split="train")  # sizes and counts only: the data is not read yet
    with pytest.raises(ShardManifestError, match="t_train_000001.npy has changed"):
        loader.next_batch()
    with pytest.raises(ShardManifestError, match="t_train_000001.npy has changed"):
        TokenLoader(earlier, B, T, split="train", vocab_size=257)  # opens (and checks) the first shard now


def test_a_folder_without_record_loads_with_one_warning(tmp_path, caplog):
    ids = np.arange(100, dtype=np.uint16)
    nanogpt, llmc = tmp_path / "fineweb", tmp_path / "llmc"
    nanogpt.mkdir()
    llmc.mkdir()
    np.save(nanogpt / "edufineweb_val_000000.npy", ids)  # build-nanogpt's fineweb.py
    np.save(nanogpt / "edufineweb_train_000001.npy", ids[::-1].copy())
    write_tokens(llmc / "tiny_val_000000.bin", ids)  # llm.c's headered .bin
    with caplog.at_level(logging.WARNING, logger="gpt2.data.loader"):
        for split in ("train", "val", "train"):
            assert TokenLoader(nanogpt, B, T, split=split, vocab_size=257).num_tokens == 100
        assert TokenLoader(llmc, B, T, vocab_size=257).num_tokens == 100
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("no record" in w and "nothing verifies" in w for w in warnings)
    assert str(nanogpt) in warnings[0] and str(llmc) in warnings[1]


def test_leftovers_of_a_killed_prepare_are_removed_by_the_next(tmp_path):
    out = tmp_path / "data"

    def docs():
        yield from NEW
        os.kill(os.getpid(), signal.SIGKILL)  # killed after some shards are written

    killed = forked(lambda: prepare_into(out, docs()))
    killed.join(timeout=120)
    assert killed.exitcode == -signal.SIGKILL
    (leftover,) = os.listdir(out)  # nothing but the hidden staging folder, shards inside
    assert leftover.startswith(".prepare-") and any((out / leftover).glob("t_*.npy"))
    with pytest.raises(FileNotFoundError, match="no token files"):
        TokenLoader(out, B, T)
    alive = out / f".prepare-{os.getpid()}-{socket.gethostname()}-x1"  # a prepare still running
    dead_pid = leftover.split("-")[1]
    elsewhere = out / f".prepare-{dead_pid}-some-other-host-x2"  # a pid that cannot be checked from here
    alive.mkdir()
    elsewhere.mkdir()
    paths = prepare_into(out, OLD)
    assert sorted(os.listdir(out)) == sorted([alive.name, elsewhere.name, RECORD_FILE, *(p.name for p in paths)])
    np.testing.assert_array_equal(read_all(out, "train"), stream(OLD)[16:])


@pytest.mark.parametrize("where", ["a shard", "the record", "moving into place"])
def test_disk_full_leaves_the_folder_as_it_was(earlier, tmp_path, monkeypatch, where):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    calls = {"n": 0}
    real_write, real_replace = prepare.write_tokens, os.replace

    def third_shard_fails(path, tokens):
        calls["n"] += 1
        return disk_full() if calls["n"] == 3 else real_write(path, tokens)

    def fourth_move_fails(src, dst):  # old shards already moved aside, some new ones in
        calls["n"] += Path(dst).parent.name == "data"  # into the folder, not the staging one
        return disk_full() if calls["n"] == 4 and Path(src).parent.name != "data" else real_replace(src, dst)

    if where == "a shard":
        monkeypatch.setattr(prepare, "write_tokens", third_shard_fails)
    elif where == "the record":
        monkeypatch.setattr(outputs, "replace_atomically", disk_full)
    else:
        monkeypatch.setattr(os, "replace", fourth_move_fails)
    before = snapshot(earlier)
    with pytest.raises(ShardWriteError, match=r"'t' shards in .*data'.*No space left.*left as it was before"):
        prepare_into(earlier, NEW, overwrite=True)
    assert snapshot(earlier) == before
    fresh = tmp_path / "new" / "data"
    with pytest.raises(ShardWriteError):
        calls["n"] = 0
        prepare_into(fresh, NEW)
    assert not (tmp_path / "new").exists()  # a folder the failed prepare made is gone again
    monkeypatch.undo()
    np.testing.assert_array_equal(read_all(earlier, "train"), stream(OLD)[16:])  # the old data set, intact


@pytest.mark.parametrize("error", [KeyboardInterrupt, PermissionError])
def test_ctrl_c_or_a_bad_input_while_writing_discards_the_new_data_set(earlier, error):
    def docs():  # Ctrl-C, or an input file that cannot be read, after some shards are written
        yield from NEW
        raise error

    before = snapshot(earlier)
    with pytest.raises(error):  # an input's own error stays itself (no ShardWriteError)
        prepare_into(earlier, docs(), overwrite=True)
    assert snapshot(earlier) == before


def test_a_signal_while_moving_into_place_completes_the_data_set(earlier):
    # SIGTERM (what schedulers send) arrives as the first new shard is moved into place.
    def signalled_while_moving() -> None:
        real_replace = os.replace

        def replace(src, dst):
            if Path(dst).name.startswith("t_") and Path(dst).parent == earlier:
                os.kill(os.getpid(), signal.SIGTERM)
            real_replace(src, dst)

        # in the forked process only, which has SIGTERM's default action, as a new one does
        os.replace = replace
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            prepare_into(earlier, NEW, overwrite=True)
        except Stopped as e:
            os._exit(128 + e.signum)

    done = forked(signalled_while_moving)
    done.join(timeout=120)
    assert done.exitcode == 128 + signal.SIGTERM  # the signal still ends the prepare ...
    np.testing.assert_array_equal(read_all(earlier, "val"), stream(NEW)[:16])  # ... after the move
    np.testing.assert_array_equal(read_all(earlier, "train"), stream(NEW)[16:])
    assert (earlier / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in earlier.iterdir() if p.name.startswith(".")) == [RECORD_FILE]

"""`gpt2 prepare` replaces only its prefix's shards that the folder's record proves it wrote, and one
prepare at a time writes a prefix into a folder.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import forked

from gpt2 import files
from gpt2.cli import main
from gpt2.data import PrepareLockedError, ShardManifestError, TokenLoader, load_tokens, write_shards
from gpt2.outputs import RECORD_FILE

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 30


class Bytes:
    """A tokenizer of UTF-8 bytes (ids 0..255, 256 = end of text): fast, and known exactly."""

    eot_token = 256

    def encode_ordinary(self, text):
        return list(text.encode("utf-8"))


def prepare_bytes(out, docs, prefix="t", **kwargs):
    return write_shards(docs, out, prefix=prefix, shard_size=16, tokenizer=Bytes(), progress=False, **kwargs)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def cli_prepare(text: Path, out: Path, *flags: str) -> int:
    return main(["prepare", "--input", str(text), "--out-dir", str(out), "--no-progress", *flags])


@pytest.mark.parametrize("overwrite", [False, True])
def test_preparing_corpus_leaves_corpus_val_shards_alone(tmp_path, capsys, overwrite):
    """Prefix `corpus` used to glob `corpus_val_*`: with --overwrite it deleted corpus_val.txt's shards,
    without it the refusal counted them as corpus's own.
    """
    out = tmp_path / "shards"
    (tmp_path / "corpus_val.txt").write_text(TEXT)
    (tmp_path / "corpus.txt").write_text(TEXT.upper())
    assert cli_prepare(tmp_path / "corpus_val.txt", out) == 0
    theirs = folder_bytes(out)
    assert sorted(theirs) == [RECORD_FILE, "corpus_val_train_000001.npy", "corpus_val_val_000000.npy"]
    theirs.pop(RECORD_FILE)

    flags = ["--overwrite"] if overwrite else []
    assert cli_prepare(tmp_path / "corpus.txt", out, *flags) == 0, capsys.readouterr().err
    now = folder_bytes(out)
    assert {name: now[name] for name in theirs} == theirs
    assert sorted(set(now) - set(theirs)) == [RECORD_FILE, "corpus_train_000001.npy", "corpus_val_000000.npy"]
    # Both data sets verify against the folder's record.
    loader = TokenLoader(out, 1, 4)
    assert loader.num_tokens == sum(len(load_tokens(out / name)) for name in now if name.endswith(".npy"))

    # corpus's own shards are the ones a second prepare of corpus counts (and --overwrite replaces).
    capsys.readouterr()
    assert cli_prepare(tmp_path / "corpus.txt", out) == 2
    assert "already holds 2 shard(s) with prefix 'corpus' (e.g. corpus_train_000001.npy)" in capsys.readouterr().err
    (tmp_path / "corpus.txt").write_text(TEXT.lower())
    assert cli_prepare(tmp_path / "corpus.txt", out, "--overwrite") == 0
    now = folder_bytes(out)
    assert {name: now[name] for name in theirs} == theirs
    assert TokenLoader(out, 1, 4).num_shards == 4


def test_a_second_prepare_of_the_prefix_is_refused_while_the_first_runs(tmp_path):
    out = tmp_path / "data"
    seen = {}

    def docs():
        yield "the first prepare's first document"
        # The first prepare holds the lock now: a second one of its prefix is refused, another prefix is not.
        with pytest.raises(PrepareLockedError, match=f"another prepare \\(pid {os.getpid()} on host .*'t' into"):
            prepare_bytes(out, ["the second prepare"])
        with pytest.raises(PrepareLockedError):
            prepare_bytes(out, ["the second prepare"], overwrite=True)
        seen["other prefix"] = prepare_bytes(out, ["another prefix, same folder"], prefix="u")
        yield "the first prepare's second document"

    paths = prepare_bytes(out, docs())
    assert [p.name for p in seen["other prefix"]] == ["u_val_000000.npy", "u_train_000001.npy"]
    stream = np.concatenate([load_tokens(p) for p in paths])
    assert bytes(stream[stream != 256].astype(np.uint8)).decode() == (
        "the first prepare's first documentthe first prepare's second document"
    )
    # No lock or staging folder is left, and both data sets verify.
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [RECORD_FILE]
    assert TokenLoader(out, 1, 4, vocab_size=257).num_shards == len(paths) + 2


def wait_for(path: Path, process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.is_alive(), f"the other prepare ended (exit code {process.exitcode})"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def test_gpt2_prepare_is_refused_in_one_line_while_another_process_prepares_the_prefix(tmp_path, capsys):
    out, ready, go = tmp_path / "data", tmp_path / "ready", tmp_path / "go"

    def docs():
        yield "the first prepare's document"
        ready.write_text(str(os.getpid()))
        while not go.exists():
            time.sleep(0.05)

    first = forked(lambda: prepare_bytes(out, docs(), prefix="corpus"))
    try:
        wait_for(ready, first)
        (tmp_path / "corpus.txt").write_text(TEXT)
        capsys.readouterr()
        assert cli_prepare(tmp_path / "corpus.txt", out) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"gpt2 prepare: error: another prepare (pid {first.pid} on host" in err
        assert "is writing prefix 'corpus' into" in err and "wait for it to finish" in err
        go.touch()
        first.join(timeout=120)
        assert first.exitcode == 0
    finally:
        first.kill()
        first.join()
    # The lock went with the first prepare: the next one replaces its data set.
    assert cli_prepare(tmp_path / "corpus.txt", out, "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == [
        RECORD_FILE,
        "corpus_train_000001.npy",
        "corpus_val_000000.npy",
    ]


def test_a_lock_left_by_a_killed_prepare_is_taken_over(tmp_path, caplog):
    out = tmp_path / "data"

    def docs():
        yield "some documents " * 4
        os.kill(os.getpid(), signal.SIGKILL)

    killed = forked(lambda: prepare_bytes(out, docs()))
    killed.join(timeout=120)
    assert killed.exitcode == -signal.SIGKILL
    folder = out / ".prepare-t.staging"
    assert json.loads((folder / ".lock").read_text())["pid"] == killed.pid
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        paths = prepare_bytes(out, ["written after the kill"])
    assert "taking over" in caplog.text and f"pid {killed.pid}" in caplog.text
    assert sorted(os.listdir(out)) == sorted([RECORD_FILE, *(p.name for p in paths)])


@pytest.mark.parametrize("holder", ["alive", "dead", "elsewhere"])
def test_without_flock_the_lock_file_and_its_pid_are_the_lock(tmp_path, monkeypatch, holder):
    monkeypatch.setattr(files, "fcntl", None)
    out = tmp_path / "data"
    folder = out / ".prepare-t.staging"
    folder.mkdir(parents=True)
    pids = {"alive": os.getpid(), "dead": 2**22 + 12345, "elsewhere": os.getpid()}
    host = "some-other-host" if holder == "elsewhere" else socket.gethostname()
    (folder / ".lock").write_text(json.dumps({"pid": pids[holder], "host": host, "started": "earlier"}))
    if holder == "dead":
        assert [p.name for p in prepare_bytes(out, ["taken over"])] == ["t_val_000000.npy"]
        assert sorted(os.listdir(out)) == [RECORD_FILE, "t_val_000000.npy"]
        return
    with pytest.raises(PrepareLockedError, match=f"pid {pids[holder]} on host {host}.*if it is gone, delete"):
        prepare_bytes(out, ["refused"])
    assert sorted(os.listdir(out)) == [folder.name]


@pytest.mark.parametrize("damage", ["unreadable", "a path for a name"])
def test_a_damaged_record_is_refused_with_or_without_overwrite(tmp_path, damage):
    out = tmp_path / "data"
    prepare_bytes(out, ["an earlier data set " * 3])
    record = out / RECORD_FILE
    if damage == "unreadable":
        record.write_text(record.read_text()[:40])
    else:
        content = json.loads(record.read_text())
        content["../elsewhere.npy"] = content.pop("t_val_000000.npy")
        record.write_text(json.dumps(content))
    before = folder_bytes(out)
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=r"record is damaged.*even with --overwrite \(overwrite=True\)"):
            prepare_bytes(out, ["a new data set"], overwrite=overwrite)
        assert folder_bytes(out) == before and not (out / ".prepare-t.staging").exists()
    # The loader says what to do about it: remove it by hand first.
    with pytest.raises(ShardManifestError, match="delete the record, then re-run `gpt2 prepare`"):
        TokenLoader(out, 1, 4)


def test_a_prepare_killed_while_moving_is_repaired_by_the_next_with_overwrite(tmp_path):
    out = tmp_path / "data"
    prepare_bytes(out, ["an earlier data set, " * 4])

    def killed_while_moving() -> None:
        real_replace, moved_in = os.replace, []

        def replace(src, dst):
            real_replace(src, dst)
            if Path(src).parent.name == ".prepare-t.staging" and Path(dst).parent == out:
                moved_in.append(dst)
            # The old shards are moved aside, the record lists the new ones, and two of them are in.
            if len(moved_in) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        os.replace = replace  # in the forked process only
        prepare_bytes(out, ["a new data set, " * 6], overwrite=True)

    killed = forked(killed_while_moving)
    killed.join(timeout=120)
    assert killed.exitcode == -signal.SIGKILL
    with pytest.raises(ShardManifestError, match="is missing.*with overwrite"):
        TokenLoader(out, 1, 4)
    with pytest.raises(FileExistsError, match="already holds .* shard\\(s\\) with prefix 't'"):
        prepare_bytes(out, ["the data set again"])
    paths = prepare_bytes(out, ["the data set again, " * 3], overwrite=True)
    assert sorted(os.listdir(out)) == sorted([RECORD_FILE, *(p.name for p in paths)])
    assert TokenLoader(out, 1, 4, vocab_size=257).num_shards == len(paths)


@pytest.mark.parametrize("overwrite", [False, True])
def test_shards_named_like_the_prefix_but_unlisted_are_never_replaced(tmp_path, overwrite):
    """build-nanogpt's fineweb.py (or an older version) wrote them, without gpt2's record: they are not
    prepare's to replace, and the new shards would land on them.
    """
    out = tmp_path / "fineweb"
    out.mkdir()
    np.save(out / "t_val_000000.npy", np.arange(100, dtype=np.uint16))
    np.save(out / "t_train_000001.npy", np.arange(100, dtype=np.uint16))
    before = folder_bytes(out)
    with pytest.raises(FileExistsError, match=r"2 file\(s\) named as shards of prefix 't' .*even with --overwrite"):
        prepare_bytes(out, ["a new data set"], overwrite=overwrite)
    assert folder_bytes(out) == before and sorted(os.listdir(out)) == sorted(before)


def test_a_shard_changed_since_prepare_wrote_it_is_kept_even_with_overwrite(tmp_path):
    out = tmp_path / "data"
    prepare_bytes(out, ["an earlier data set " * 3])
    changed = out / "t_train_000001.npy"
    changed.write_bytes(changed.read_bytes()[:-2] + b"!!")
    before = folder_bytes(out)
    with pytest.raises(FileExistsError, match=r"1 file\(s\) named as shards of prefix 't' \(e.g. t_train_000001.npy\)"):
        prepare_bytes(out, ["a new data set"], overwrite=True)
    assert folder_bytes(out) == before


def test_a_run_is_not_mixed_into_a_prepared_shard_folder(tmp_path):
    """The folder's record proves the shards are gpt2's, but they are not a run's: a fresh run there is refused,
    and one with overwrite keeps them.
    """
    from _tiny_run import tiny_config, tiny_model, tiny_tokens

    from gpt2 import Trainer
    from gpt2.train.rundir import RunDirNotEmptyError

    out = tmp_path / "data"
    prepare_bytes(out, ["an earlier data set " * 3])
    before = folder_bytes(out)
    with pytest.raises(RunDirNotEmptyError, match=r"did not write \(t_train_000001.npy"):
        Trainer(tiny_model(), tiny_config(out), tiny_tokens(), sinks=[])
    assert folder_bytes(out) == before
    with Trainer(tiny_model(), tiny_config(out, max_steps=1, overwrite=True), tiny_tokens(), sinks=[]) as trainer:
        trainer.fit()
    assert {name: folder_bytes(out)[name] for name in before if name != RECORD_FILE} == {
        name: data for name, data in before.items() if name != RECORD_FILE
    }


def test_on_a_filesystem_without_flock_a_second_prepare_is_still_refused(tmp_path, monkeypatch):
    class NoFlock:
        LOCK_EX, LOCK_NB = 2, 4

        @staticmethod
        def flock(fd, operation):
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(files, "fcntl", NoFlock)
    out = tmp_path / "data"

    def docs():
        yield "the first prepare"
        with pytest.raises(PrepareLockedError, match=f"pid {os.getpid()} on host .*if it is gone, delete"):
            prepare_bytes(out, ["the second prepare"], overwrite=True)
        yield "its second document"

    paths = prepare_bytes(out, docs())
    assert sorted(os.listdir(out)) == sorted([RECORD_FILE, *(p.name for p in paths)])


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_stop_signal_during_prepare_says_so_and_cleans_up_its_staging_folder(tmp_path, monkeypatch, sig):
    """SIGHUP ended a single-process `gpt2 prepare` with no message and left its staging folder and lock behind."""
    import gpt2.cli.prepare
    import gpt2.data.prepare

    out, ready, err = tmp_path / "data", tmp_path / "ready", tmp_path / "stderr"
    (tmp_path / "corpus.jsonl").write_text('{"text": "a document"}\n')

    def docs(inputs, text_field):
        yield "the first document"
        ready.touch()
        time.sleep(120)
        yield "never reached"

    def run():
        monkeypatch.setattr(gpt2.cli.prepare, "_documents", docs)
        monkeypatch.setattr(gpt2.data.prepare, "get_tokenizer", Bytes)
        sys.stderr = open(err, "w")
        code = main(["prepare", "--input", str(tmp_path / "corpus.jsonl"), "--out-dir", str(out), "--no-progress"])
        sys.stderr.flush()
        os._exit(code)

    child = forked(run)
    try:
        wait_for(ready, child)
        assert (out / ".prepare-shard.staging" / ".lock").exists()
        os.kill(child.pid, sig)
        child.join(timeout=60)
    finally:
        child.kill()
        child.join()
    assert child.exitcode == 128 + sig
    assert err.read_text().strip() == f"gpt2 prepare: stopped by {sig.name}; nothing was written"
    assert not out.exists()


def test_a_staging_folder_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    out = tmp_path / "data"
    out.mkdir()
    (out / ".prepare-t.staging").symlink_to(mine)
    with pytest.raises(PrepareLockedError, match="is a symbolic link"):
        prepare_bytes(out, ["a document"])
    assert sorted(os.listdir(mine)) == ["thesis.tex"]

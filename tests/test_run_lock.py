"""One run per out_dir: the lock (another process, a crashed one, another host, another Trainer in
this process) and the fresh-run check (refusal with the ways out, overwrite, resume).
"""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _tiny_run import tiny_config, tiny_model, tiny_tokens

from gpt2 import files
from gpt2.train import checkpoint as ckpt
from gpt2.train import rundir
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
_FORK = mp.get_context("fork")


def _config(out_dir, **overrides) -> TrainConfig:
    return tiny_config(out_dir, **{"max_steps": 2, "checkpoint_interval": 1, **overrides})


_model, _tokens = tiny_model, tiny_tokens


def _hold_lock_in_subprocess(out_dir: Path) -> mp.process.BaseProcess:
    """Another process (forked: no interpreter start-up) that takes out_dir's lock and keeps it
    until it is killed.
    """
    ready = _FORK.Event()
    proc = _FORK.Process(target=_hold, args=(str(out_dir), ready), daemon=True)
    proc.start()
    assert ready.wait(30), "the lock holder did not start"
    return proc


def _hold(out_dir: str, ready) -> None:
    rundir.RunLock(out_dir).acquire()
    ready.set()
    time.sleep(120)


def _try_lock(out_dir: Path) -> str:
    """'acquired' or the refusal, from a fresh (forked) process."""
    queue = _FORK.Queue()
    proc = _FORK.Process(target=_probe, args=(str(out_dir), queue))
    proc.start()
    answer = queue.get(timeout=30)
    proc.join(30)
    return answer


def _probe(out_dir: str, queue) -> None:
    try:
        rundir.RunLock(out_dir).acquire().release()
        queue.put("acquired")
    except rundir.RunDirLockedError as e:
        queue.put(f"refused: {e}")


def test_second_process_fails_at_once_and_a_crashed_holder_leaves_no_stuck_lock(tmp_path, caplog):
    out = tmp_path / "run"
    holder = _hold_lock_in_subprocess(out)
    try:
        with pytest.raises(rundir.RunDirLockedError) as info:  # LOCK_NB: refused, never waits
            Trainer(_model(), _config(out), _tokens(), sinks=[])
        message = str(info.value)
        assert f"pid {holder.pid}" in message and socket.gethostname() in message and "another out_dir" in message
        assert "\n" not in message
        with pytest.raises(rundir.RunDirLockedError):  # resume='auto' too: it would write there as well
            Trainer(_model(), _config(out, resume="auto"), _tokens(), sinks=[])
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a crash: no clean-up of its own
        holder.join()
    assert (out / rundir.LOCK_FILE).exists()  # its record is still there ...
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        with Trainer(_model(), _config(out), _tokens(), sinks=[]) as trainer:  # ... but not its lock
            trainer.fit()
    assert f"left by pid {holder.pid}" in caplog.text and "no longer running" in caplog.text
    assert not (out / rundir.LOCK_FILE).exists()  # close() released it


def test_lock_is_held_for_the_trainers_lifetime_and_released_by_close(tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(_model(), _config(out), _tokens(), sinks=[])
    record = json.loads((out / rundir.LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname() and "started" in record
    answer = _try_lock(out)
    assert answer.startswith("refused") and f"pid {os.getpid()}" in answer
    trainer.fit()
    trainer.close()
    assert _try_lock(out) == "acquired"


def test_a_script_that_never_closes_its_trainer_leaves_no_lock(tmp_path):
    """At interpreter exit (atexit) the locks still held are released."""
    out = tmp_path / "run"
    trainer = Trainer(_model(), _config(out, max_steps=1), _tokens(), sinks=[])
    trainer.fit()
    assert (out / rundir.LOCK_FILE).exists()
    rundir._release_at_exit()  # what the interpreter runs on its way out
    assert not (out / rundir.LOCK_FILE).exists() and trainer._run_lock.fd is None


def test_stale_record_of_a_dead_pid_is_taken_over(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    (out / rundir.LOCK_FILE).write_text(
        json.dumps({"pid": proc.pid, "host": socket.gethostname(), "started": "yesterday"})
    )
    with caplog.at_level(logging.WARNING, logger="gpt2"), Trainer(_model(), _config(out), _tokens(), sinks=[]):
        assert json.loads((out / rundir.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"left by pid {proc.pid}" in caplog.text
    (out / rundir.LOCK_FILE).write_bytes(b"\x00garbage")  # a lock file nobody holds, with junk in it
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        rundir.RunLock(out).acquire().release()
    assert "left by a process with no readable record" in caplog.text


def test_record_from_another_host_is_refused_with_how_to_remove_it(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / rundir.LOCK_FILE
    lock.write_text(json.dumps({"pid": 4242, "host": "gpu-node-7", "started": "2026-01-01 00:00:00 UTC"}))
    with pytest.raises(rundir.RunDirLockedError) as info:
        Trainer(_model(), _config(out), _tokens(), sinks=[])
    message = str(info.value)
    assert "pid 4242 on host gpu-node-7" in message and f"delete {lock}" in message
    assert json.loads(lock.read_text())["host"] == "gpu-node-7"  # left for its owner
    lock.unlink()  # the way out the message names
    Trainer(_model(), _config(out), _tokens(), sinks=[]).close()


def test_a_newer_trainer_in_the_same_process_takes_the_lock_over(tmp_path):
    out = tmp_path / "run"
    first = Trainer(_model(), _config(out, max_steps=4), _tokens(), sinks=[])
    first.fit(until_step=1)
    second = Trainer(_model(), _config(out, max_steps=4, resume="auto"), _tokens(), sinks=[])
    assert second.step == 1
    with pytest.raises(rundir.RunDirLockedError, match="no longer owns out_dir"):
        first.fit()  # the abandoned Trainer may not write into the newer one's run
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_000001"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    first.close()  # does not release the newer Trainer's lock
    assert (out / rundir.LOCK_FILE).exists()
    second.fit()
    second.close()
    assert not (out / rundir.LOCK_FILE).exists()


def test_a_closed_trainer_may_not_write_into_its_former_out_dir(tmp_path):
    """Its lock is released on close(): another run may own the folder now, and this Trainer's
    checkpoints (and their pruning) would mix with that run's.
    """
    out = tmp_path / "run"
    with Trainer(_model(), _config(out, max_steps=4), _tokens(), sinks=[]) as first:
        first.fit(until_step=1)
    with Trainer(_model(), _config(out, max_steps=4, resume="auto"), _tokens(), sinks=[]) as second:
        second.fit(until_step=2)
        with pytest.raises(rundir.RunDirLockedError, match="this Trainer was closed.*make a new Trainer"):
            first.fit()
        with pytest.raises(rundir.RunDirLockedError, match="this Trainer was closed"):
            first.save_checkpoint()
        assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_000001", "step_000002"]
        assert (out / rundir.LOCK_FILE).exists()  # still the second's


def test_without_flock_the_exclusive_record_is_the_lock(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(files, "fcntl", None)  # e.g. Windows, or a filesystem without flock
    out = tmp_path / "run"
    lock = rundir.RunLock(out).acquire()
    answer = _try_lock(out)  # the forked child inherits the patch
    assert answer.startswith("refused") and f"pid {os.getpid()}" in answer
    lock.release()
    assert _try_lock(out) == "acquired"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    (out / rundir.LOCK_FILE).write_text(json.dumps({"pid": proc.pid, "host": socket.gethostname()}))
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        rundir.RunLock(out).acquire().release()
    assert f"left by pid {proc.pid} on host" in caplog.text and "no longer running" in caplog.text


def test_on_a_filesystem_whose_flock_fails_the_creator_of_the_lock_file_holds_it(tmp_path, monkeypatch):
    # Some network filesystems have fcntl but refuse flock (ENOLCK): the first run must still start
    # (it used to find its own just-created empty lock file and refuse itself), a second is refused.
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(files.fcntl, "flock", no_flock)
    out = tmp_path / "run"
    lock = rundir.RunLock(out).acquire()
    assert json.loads((out / rundir.LOCK_FILE).read_text())["pid"] == os.getpid()
    # A second run (a forked child: it inherits the patch) is refused, naming this one.
    answer = _try_lock(out)
    assert answer.startswith("refused") and f"pid {os.getpid()}" in answer
    lock.release()
    assert _try_lock(out) == "acquired"


def test_unwritable_or_full_out_dir_names_the_lock_file(tmp_path, monkeypatch):
    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", disk_full)
    with pytest.raises(OSError, match="cannot lock out_dir .*No space left on device.*run.lock") as info:
        rundir.RunLock(tmp_path / "run").acquire()
    assert info.value.errno == 28
    monkeypatch.undo()
    rundir.RunLock(tmp_path / "run").acquire().release()  # nothing stuck behind


# ------------------------------------------------------------------------------ fresh runs


def _finished_run(out: Path) -> None:
    with Trainer(_model(), _config(out), _tokens(), sinks=[]) as trainer:
        trainer.fit()
    # as gpt2 train writes it: recorded after the write (a results.json gpt2 has no record of is the user's)
    (out / "results.json").write_text("{}")
    rundir.record_outputs(out, ["results.json"])
    (out / "notes.txt").write_text("mine")


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    """run.lock as a link to a file outside the run: that file was overwritten with the lock record."""
    outside = tmp_path / "precious.txt"
    outside.write_text("mine")
    out = tmp_path / "run"
    out.mkdir()
    (out / rundir.LOCK_FILE).symlink_to(outside)
    with pytest.raises(rundir.RunDirLockedError, match="run.lock is a symbolic link: gpt2 never writes through one"):
        Trainer(_model(), _config(out), _tokens(), sinks=[])
    assert outside.read_text() == "mine" and (out / rundir.LOCK_FILE).is_symlink()
    (out / rundir.LOCK_FILE).unlink()
    (out / rundir.LOCK_FILE).symlink_to(tmp_path / "absent")  # a dangling link is refused too
    with pytest.raises(rundir.RunDirLockedError, match="symbolic link"):
        rundir.RunLock(out).acquire()
    assert not (tmp_path / "absent").exists()


def test_fresh_run_into_another_runs_directory_is_refused_with_the_ways_out(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(rundir.RunDirNotEmptyError) as info:
        Trainer(_model(), _config(out, max_steps=5), _tokens(), sinks=[])
    message = str(info.value)
    for way_out in ("resume='auto'", "new out_dir", "overwrite=True", "step_000001..step_000002", "metrics.jsonl"):
        assert way_out in message
    assert "\n" not in message and isinstance(info.value, FileExistsError)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing touched
    assert not (out / rundir.LOCK_FILE).exists()  # and the lock was given back
    # way out 1: continue it
    with Trainer(_model(), _config(out, max_steps=3, resume="auto"), _tokens(), sinks=[]) as trainer:
        assert trainer.step == 2
        assert [r["step"] for r in trainer.fit()] == [3]
    # way out 3: overwrite=True deletes that run's files (and only those), then starts at step 0
    with Trainer(_model(), _config(out, max_steps=1, overwrite=True), _tokens(), sinks=[]) as trainer:
        assert trainer.step == 0
        assert not (out / "results.json").exists() and not (out / "checkpoints").exists()
        trainer.fit()
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_000001"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="overwrite=True .* resume='auto' .* choose one"):
        Trainer(_model(), _config(out, resume="auto", overwrite=True), _tokens(), sinks=[])


def test_only_metrics_or_only_damaged_checkpoints_count_as_a_run_too(tmp_path):
    out = tmp_path / "a"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    with pytest.raises(rundir.RunDirNotEmptyError, match="metrics.jsonl"):
        Trainer(_model(), _config(out), _tokens(), sinks=[])
    out = tmp_path / "b"
    (out / "checkpoints" / "step_000007").mkdir(parents=True)  # an incomplete one
    with pytest.raises(rundir.RunDirNotEmptyError, match="step_000007"):
        Trainer(_model(), _config(out), _tokens(), sinks=[])
    # an empty out_dir is fine
    Trainer(_model(), _config(tmp_path / "c"), _tokens(), sinks=[]).close()


def test_resuming_an_older_checkpoint_or_another_runs_checkpoint(tmp_path):
    out = tmp_path / "run"
    with Trainer(_model(), _config(out, max_steps=3), _tokens(), sinks=[]) as trainer:
        trainer.fit()
    older = out / "checkpoints" / "step_000001"
    # From an older step of this run: the newer checkpoints are another history.
    with pytest.raises(rundir.RunDirNotEmptyError, match="older than checkpoints step_000002, step_000003"):
        Trainer(_model(), _config(out, max_steps=3, resume=str(older)), _tokens(), sinks=[])
    with Trainer(_model(), _config(out, max_steps=3, resume=str(older), overwrite=True), _tokens(), sinks=[]) as t:
        assert t.step == 1 and [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_000001"]
        t.fit()
    # From another run's checkpoint into a directory that holds a run: refused as well.
    other = tmp_path / "other"
    with pytest.raises(rundir.RunDirNotEmptyError, match="resuming from"):
        Trainer(_model(), _config(out, resume=str(other / "step_000001")), _tokens(), sinks=[])
    with Trainer(_model(), _config(other, max_steps=3, resume=str(older)), _tokens(), sinks=[]) as t:
        assert t.step == 1  # into an empty out_dir it is fine (a branch of the run)
    # resume=<the run directory itself> is resume='auto' by another name
    with Trainer(_model(), _config(out, max_steps=3, resume=str(out)), _tokens(), sinks=[]) as t:
        assert t.step == 3


def test_overwrite_flag_and_the_refusal_in_command_line_terms(tmp_path, capsys):
    from gpt2.cli import COMMANDS, main

    for name in ("train", "finetune"):
        assert COMMANDS[name].parse(["--overwrite"], prog=name).train.overwrite is True
        assert COMMANDS[name].parse([], prog=name).train.overwrite is False
    # A fresh `gpt2 train` into an old run's directory: refused in one line.
    out = tmp_path / "old"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    text = tmp_path / "input.txt"
    text.write_text("ROMEO: to be or not to be\n" * 200)
    code = main(
        [
            "train",
            "--model",
            "tiny",
            "--data",
            str(text),
            "--seq-len",
            "16",
            "--micro-batch-size",
            "2",
            "--max-steps",
            "1",
            "--warmup-steps",
            "0",
            "--out-dir",
            str(out),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    # one line, the library's words (its fields are the flags: resume -> --resume, overwrite -> --overwrite)
    assert code == 2 and "resume='auto'" in err and "overwrite=True" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.dist
def test_under_ddp_every_rank_fails_together_when_out_dir_is_locked(dist_run):
    """tests/_dist_worker.py's "locked" job: another process holds out_dir; rank 0 finds it
    locked, and rank 1 must raise too instead of waiting for rank 0 forever (the launch would
    then hang until its timeout).
    """
    rank0, rank1 = dist_run.reports("locked")
    assert rank0["refused"] and rank1["refused"], (rank0, rank1)
    assert "raised on rank 0" in rank1["refused"]


_LOCAL_ERROR_JOB = """
import sys
import torch.distributed as dist
import torch.multiprocessing as mp
from gpt2.train.checkpoint import run_on_all_ranks

def work(rank, store):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)

    class LocalError(Exception):
        pass

    def fail():
        if rank == 0:
            raise LocalError("only rank 0 failed")

    try:
        run_on_all_ranks(fail)
    except Exception as e:
        # a file per rank: two processes printing to one pipe may interleave their writes
        with open(f"{store}.rank{rank}", "w") as f:
            f.write(f"{rank} {type(e).__name__} {e}")
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1],), nprocs=2)
"""


@pytest.mark.dist
def test_an_error_whose_class_cannot_be_pickled_still_reaches_every_rank(tmp_path):
    # a class defined inside a function: sent by name, so rank 0 does not fail before the collective
    script = tmp_path / "job.py"
    script.write_text(_LOCAL_ERROR_JOB)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [(tmp_path / f"store.rank{rank}").read_text() for rank in (0, 1)]
    assert lines[0] == "0 LocalError only rank 0 failed", lines
    assert lines[1].startswith("1 RuntimeError ") and lines[1].endswith("only rank 0 failed (raised on rank 0)"), lines

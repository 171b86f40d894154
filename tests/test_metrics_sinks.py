"""TrainConfig.log_to: TensorBoard and Weights & Biases (offline) sinks fed by a real Trainer run."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import time

import pytest
import torch

from gpt2 import GPT, GPTConfig
from gpt2.train.config import TrainConfig
from gpt2.train.metrics import make_sinks, read_jsonl, wandb_mode
from gpt2.train.trainer import Trainer


def _fit(tmp_path, log_to, steps: int = 4, **overrides):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    tokens = torch.randint(0, 64, (2048,), generator=torch.Generator().manual_seed(1))
    config = TrainConfig(
        micro_batch_size=2,
        seq_len=16,
        max_steps=steps,
        eval_interval=2,
        eval_steps=2,
        out_dir=str(tmp_path / "run"),
        log_to=log_to,
        device="cpu",
        plot=False,
        progress=False,
        **{"checkpoint_interval": 0, **overrides},
    )
    with Trainer(model, config, tokens, tokens, sinks=[]) as trainer:
        history = trainer.fit()
    return tmp_path / "run", history


def test_log_to_is_checked_and_normalised(tmp_path):
    assert TrainConfig(out_dir=str(tmp_path), log_to="tensorboard, WandB").log_to == ("tensorboard", "wandb")
    assert TrainConfig(out_dir=str(tmp_path), log_to=["tensorboard,wandb", "tensorboard"]).log_to == (
        "tensorboard",
        "wandb",
    )
    assert TrainConfig.from_dict(TrainConfig(log_to=("wandb",)).to_dict()).log_to == ("wandb",)
    with pytest.raises(ValueError, match="unknown target.*mlflow"):
        TrainConfig(log_to=("mlflow",))
    with pytest.raises(ValueError, match="out_dir is None"):
        TrainConfig(out_dir=None, log_to=("tensorboard",))


def test_cli_log_to_flag_reaches_the_train_config():
    from gpt2.cli import COMMANDS

    cmd = COMMANDS["train"]
    for argv in (["--log-to", "tensorboard", "wandb"], ["--log-to", "tensorboard,wandb"]):
        assert cmd.parse(argv, prog="gpt2 train").train.log_to == ("tensorboard", "wandb")
    assert cmd.parse([], prog="gpt2 train").train.log_to == ()


def test_tensorboard_sink_writes_every_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, history = _fit(tmp_path, ("tensorboard",))
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == [1, 2, 3, 4]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in history], rel=1e-6)
    assert [e.step for e in events.Scalars("val_loss")] == [2, 4]
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([r["lr"] for r in history], rel=1e-6)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]  # the JSONL is still written


def test_tensorboard_after_a_resume_shows_the_redone_steps_once(tmp_path):
    """A run that resumes from step 2 after writing steps 1-4 (a crash after step 4, its last
    checkpoint at 2) redoes 3 and 4: TensorBoard showed both versions, metrics.jsonl only the new.
    """
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = _fit(tmp_path, ("tensorboard",), checkpoint_interval=2)
    shutil.rmtree(run / "checkpoints" / "step_000004")  # as if killed after step 4, before its checkpoint
    time.sleep(1.1)  # a new event file name (they are named by the second)
    _, history = _fit(tmp_path, ("tensorboard",), checkpoint_interval=2, resume="auto")
    assert [r["step"] for r in history] == [3, 4]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("loss")]
    assert steps == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("val_loss")] == [2, 4]


def _wandb_records(path):
    """Protobuf records of a .wandb file (a LevelDB-style log: 32 KiB blocks, 7-byte chunk headers)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, records, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            records.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            records.append(pending + chunk)
    return records


def test_wandb_sink_offline_run_holds_the_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login: offline
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert wandb_mode() == "offline"

    run, history = _fit(tmp_path, ("wandb",))
    (run_dir,) = (run / "wandb").glob("offline-run-*")
    (log_file,) = run_dir.glob("run-*.wandb")

    def parsed():
        for raw in _wandb_records(log_file):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            yield record

    # wandb's service process may still be writing the file when finish() returns: wait for the
    # run's "exit" record (written last) before reading the history
    deadline = time.time() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in parsed()) and time.time() < deadline:
        time.sleep(0.2)
    steps = {}
    for record in parsed():
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            steps[row["_step"]] = row
    assert sorted(steps) == [1, 2, 3, 4]
    assert [steps[s]["loss"] for s in (1, 2, 3, 4)] == pytest.approx([r["loss"] for r in history], rel=1e-6)
    assert steps[2]["val_loss"] == pytest.approx(history[1]["val_loss"], rel=1e-6)
    assert "val_loss" not in steps[1]


def test_wandb_mode_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"


@pytest.mark.parametrize("target, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_missing_package_names_the_extra(tmp_path, monkeypatch, target, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=rf"pip install 'gpt2-minlora\[{target}\]'"):
        make_sinks([target], tmp_path)
    # fit() fails before the first step and before opening metrics.jsonl
    with pytest.raises(ImportError, match=rf"gpt2-minlora\[{target}\]"):
        _fit(tmp_path, ("tensorboard", target) if target == "wandb" else (target,), steps=1)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_validation_and_final_evaluation_show_progress(tmp_path, capsys, monkeypatch):
    """No silent evaluation: a 'val' bar (and 'evaluating' on the training bar) inside fit, an
    'eval' bar for evaluate_loss(progress=True), which computes the same loss as without it.
    """
    # bars show on a terminal only (a redirected log gets the metric lines): be one
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    from gpt2.eval.loss import evaluate_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    tokens = torch.randint(0, 64, (2048,), generator=torch.Generator().manual_seed(1))
    config = TrainConfig(
        micro_batch_size=2,
        seq_len=16,
        max_steps=2,
        eval_interval=2,
        eval_steps=3,
        out_dir=None,
        device="cpu",
        progress=True,
    )
    Trainer(model, config, tokens, tokens, sinks=[]).fit()
    err = capsys.readouterr().err
    assert "evaluating" in err and "val:" in err and "/3 [" in err

    quiet = evaluate_loss(model, tokens, 2, 16, max_batches=4)
    assert "eval" not in capsys.readouterr().err
    shown = evaluate_loss(model, tokens, 2, 16, max_batches=4, progress=True)
    assert "eval" in capsys.readouterr().err and shown == quiet


def test_fit_log_closes_the_sinks_it_opened_when_metrics_jsonl_fails(tmp_path, monkeypatch):
    from gpt2.train import metrics

    closed = []

    class Sink:
        def log(self, record):
            pass

        def close(self):
            closed.append(True)

    monkeypatch.setattr(metrics, "make_sinks", lambda *args: [Sink()])
    # A folder where metrics.jsonl goes: the log cannot be written.
    (tmp_path / metrics.METRICS_FILE).mkdir()
    config = TrainConfig(out_dir=str(tmp_path), log_to=("tensorboard",), progress=False)
    with pytest.raises(metrics.RunOutputError, match="metrics.jsonl failed"):
        metrics.FitLog([], config, out_dir=tmp_path, step=0, is_main=True)
    assert closed == [True]


def test_read_jsonl_skips_blank_lines_without_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n   \n{"step": 2}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    assert "malformed" not in caplog.text

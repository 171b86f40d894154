"""The Trainer: learning, gradient accumulation, exact resume, NaN guard, config, data, metrics,
compile, and the benchmark ladder. Tiny models on CPU.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import sys

import numpy as np
import pytest
import torch

from gpt2 import GPT, GPTConfig
from gpt2.data import TokenLoader
from gpt2.model import checkpoint_files
from gpt2.model.checkpoint_files import load_weights, non_finite_tensors
from gpt2.train import checkpoint as ckpt
from gpt2.train.config import RecoveryConfig, TrainConfig, grad_accum_steps
from gpt2.train.metrics import (
    PEAK_FLOPS,
    ConsoleSink,
    format_line,
    peak_flops_for,
    plot_loss_curve,
    read_jsonl,
)
from gpt2.train.trainer import Trainer, TrainingDivergedError


def _config(**overrides) -> TrainConfig:
    base = dict(
        micro_batch_size=2,
        seq_len=16,
        max_steps=4,
        max_lr=1e-3,
        out_dir=None,
        progress=False,
        eval_interval=0,
        plot=False,
    )
    return TrainConfig(**{**base, **overrides})


def _tokens(n: int = 4096, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _model(tiny_config, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**tiny_config.to_dict(), **overrides}))


def _nan_loss_at(model, calls: set[int] | None = None, from_call: int | None = None):
    """Make the loss non-finite on the given forward calls (1-based)."""
    count = {"n": 0}

    def hook(module, inputs, output):
        count["n"] += 1
        n = count["n"]
        if (calls and n in calls) or (from_call is not None and n >= from_call):
            return output[0], output[1] * float("nan")

    return model.register_forward_hook(hook)


# ------------------------------------------------------------------------------ learning


def test_overfits_one_batch(tiny_config):
    model = _model(tiny_config)
    tokens = _tokens(4 * 16 + 1)  # exactly one batch: the loader serves it every step
    config = _config(micro_batch_size=4, max_steps=60, warmup_steps=5, max_lr=1e-2, weight_decay=0.0)
    history = Trainer(model, config, tokens, sinks=[]).fit()
    assert history[0]["loss"] > 4.0  # ~ln(128) at initialisation
    assert history[-1]["loss"] < 0.05


def test_gradient_accumulation_equals_one_big_batch(tiny_config):
    big_model = _model(tiny_config)
    small_model = copy.deepcopy(big_model)
    tokens = _tokens()
    # fp32, whatever auto picks on this CPU: the tolerances are fp32's
    big = Trainer(big_model, _config(micro_batch_size=8, total_batch_size=8 * 16, precision="fp32"), tokens, sinks=[])
    small = Trainer(
        small_model, _config(micro_batch_size=2, total_batch_size=8 * 16, precision="fp32"), tokens, sinks=[]
    )
    assert (big.grad_accum_steps, small.grad_accum_steps) == (1, 4)
    r_big, r_small = big.train_step(), small.train_step()
    torch.testing.assert_close(r_small["loss"], r_big["loss"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r_small["grad_norm"], r_big["grad_norm"], rtol=1e-5, atol=1e-7)
    for (name, p_big), p_small in zip(big_model.named_parameters(), small_model.parameters()):
        torch.testing.assert_close(p_small.grad, p_big.grad, rtol=1e-5, atol=1e-7, msg=f"gradient of {name}")
        torch.testing.assert_close(p_small, p_big, rtol=1e-5, atol=1e-6, msg=f"updated {name}")
    assert big.tokens_per_step == small.tokens_per_step == 128


@pytest.mark.parametrize("grad_clip", [1e6, 1e-3])
def test_gradients_over_the_limit_are_scaled_to_it_and_others_are_not_touched(tiny_config, grad_clip, monkeypatch):
    clips = []
    clip = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *args: clips.append(args) or clip(*args))
    tokens = _tokens()
    # grad_clip=0: the raw gradients, measured and left in .grad
    raw, clipped = (
        Trainer(_model(tiny_config), _config(precision="fp32", grad_clip=limit), tokens, sinks=[])
        for limit in (0.0, grad_clip)
    )
    norm = raw.train_step()["grad_norm"]
    clips.clear()
    assert clipped.train_step()["grad_norm"] == norm
    over = norm > grad_clip
    assert len(clips) == int(over)
    # clip_grad_norm_'s factor
    factor = grad_clip / (norm + 1e-6) if over else 1.0
    for p_raw, p_clipped in zip(raw.model.parameters(), clipped.model.parameters()):
        torch.testing.assert_close(p_clipped.grad, p_raw.grad * factor, rtol=1e-6, atol=0)
    clipped_norm = torch.cat([p.grad.flatten() for p in clipped.model.parameters()]).norm()
    assert float(clipped_norm) == pytest.approx(min(norm, grad_clip), rel=1e-5)


# ------------------------------------------------------------------------------ resume


class _CrashAt:
    """A sink that simulates the process dying right after step ``step`` was logged."""

    def __init__(self, step: int):
        self.step = step

    def log(self, record):
        if record["step"] == self.step:
            raise KeyboardInterrupt(f"simulated crash at step {self.step}")


def test_resume_after_crash_is_bit_exact(tiny_config, tmp_path):
    """8 uninterrupted steps == crash after 6 (last checkpoint at 4) + resume to 8: same losses,
    validation losses, weights and optimizer state, bit for bit (dropout on, so RNG matters).
    """
    tokens, val = _tokens(), _tokens(1024, seed=2)
    kwargs = dict(max_steps=8, warmup_steps=2, eval_interval=3, eval_steps=2, checkpoint_interval=4)

    full = Trainer(
        _model(tiny_config, dropout=0.1), _config(out_dir=str(tmp_path / "a"), **kwargs), tokens, val, sinks=[]
    )
    expected = full.fit()

    cfg = _config(out_dir=str(tmp_path / "b"), **kwargs)
    first = Trainer(_model(tiny_config, dropout=0.1), cfg, tokens, val, sinks=[_CrashAt(6)])
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    resume_cfg = _config(out_dir=str(tmp_path / "b"), resume="auto", **kwargs)
    # another initialisation: resuming must replace all of it
    second = Trainer(_model(tiny_config, seed=5, dropout=0.1), resume_cfg, tokens, val, sinks=[])
    assert second.step == 4 and second.last_checkpoint.name == "step_000004"
    resumed = second.fit()

    combined = first.history[:4] + resumed
    assert [r["step"] for r in combined] == list(range(1, 9))
    assert [r["loss"] for r in combined] == [r["loss"] for r in expected]  # exact equality
    assert [r.get("val_loss") for r in combined] == [r.get("val_loss") for r in expected]
    assert sum(r.get("val_loss") is not None for r in expected) == 3  # steps 3, 6 and 8
    for (name, a), b in zip(full.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    opt_a, opt_b = full.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert all(torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"]) for i in opt_a)

    # The metrics log continues the crashed run's: steps 5 and 6 of the first attempt were dropped.
    records = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == [r["loss"] for r in expected]


def test_fit_until_step_then_resume_from_explicit_path(tiny_config, tmp_path):
    tokens = _tokens()
    cfg = _config(out_dir=str(tmp_path), max_steps=6, warmup_steps=2, checkpoint_interval=0)
    first = Trainer(_model(tiny_config), cfg, tokens, sinks=[])
    assert len(first.fit(until_step=3)) == 3
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step_000003"]
    resume_cfg = _config(
        out_dir=str(tmp_path),
        max_steps=6,
        warmup_steps=2,
        checkpoint_interval=0,
        resume=str(tmp_path / "checkpoints" / "step_000003"),
    )
    second = Trainer(_model(tiny_config), resume_cfg, tokens, sinks=[])
    history = second.fit()
    assert [r["step"] for r in history] == [4, 5, 6]
    # the learning rate continued the 6-step schedule (warmup 2), it did not restart
    assert history[0]["lr"] < cfg.max_lr and history[-1]["lr"] > cfg.final_lr
    assert second.fit() == []  # already finished
    meta = json.loads((tmp_path / "checkpoints" / "step_000006" / ckpt.META_FILE).read_text())
    assert meta["step"] == 6 and meta["data"]["train"] == second.train_loader.state_dict()
    assert meta["model_config"]["n_layer"] == 2 and meta["config"]["max_steps"] == 6


def test_frozen_base_trains_and_saves_only_trainable_parameters(tiny_config, tmp_path):
    """The LoRA situation (a frozen base, a few trainable tensors), here with plain requires_grad."""
    model = _model(tiny_config)
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = {"transformer.ln_f.weight", "transformer.ln_f.bias"}
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    frozen_before = {k: v.clone() for k, v in model.state_dict().items() if k not in trainable}
    cfg = _config(out_dir=str(tmp_path), max_steps=3, save_trainable_only=True)
    trainer = Trainer(model, cfg, _tokens(), sinks=[])
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(model.transformer.ln_f.weight),
        id(model.transformer.ln_f.bias),
    }
    trainer.fit()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen_before.items())
    weights, _ = load_weights(tmp_path / "checkpoints" / "step_000003" / ckpt.WEIGHTS_FILE)
    assert set(weights) == trainable
    # Resuming needs the same frozen base in the model; the checkpoint supplies the rest.
    base = _model(tiny_config)
    for name, p in base.named_parameters():
        p.requires_grad_(name in trainable)
    resumed = Trainer(base, _config(out_dir=str(tmp_path), max_steps=3, resume="auto"), _tokens(), sinks=[])
    assert resumed.step == 3
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), model.state_dict().values()))


def test_callbacks_see_every_step_and_their_entries_reach_metrics_jsonl(tiny_config, tmp_path):
    seen = []

    def every_other_step(trainer, record):
        seen.append((trainer.step, "val_loss" in record))  # runs after validation
        if record["step"] % 2 == 0:
            record["custom_score"] = float(record["step"])

    config = _config(out_dir=str(tmp_path), eval_interval=2, eval_steps=1)
    Trainer(_model(tiny_config), config, _tokens(), _tokens(seed=2), sinks=[], callbacks=[every_other_step]).fit()
    assert seen == [(1, False), (2, True), (3, False), (4, True)]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r.get("custom_score") for r in records] == [None, 2.0, None, 4.0]


def test_resume_auto_without_checkpoint_starts_fresh(tiny_config, tmp_path):
    trainer = Trainer(_model(tiny_config), _config(out_dir=str(tmp_path), resume="auto"), _tokens(), sinks=[])
    assert trainer.step == 0 and trainer.last_checkpoint is None
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer(_model(tiny_config), _config(resume=str(tmp_path / "nope")), _tokens(), sinks=[])


# ------------------------------------------------------------------------------ NaN guard


def test_non_finite_loss_is_skipped_and_training_continues(tiny_config):
    model = _model(tiny_config)
    trainer = Trainer(model, _config(max_steps=4, recovery=RecoveryConfig(max_bad_steps=2)), _tokens(), sinks=[])
    handle = _nan_loss_at(model, calls={2})
    snapshots = []
    for _ in range(4):
        snapshots.append([p.detach().clone() for p in model.parameters()])
        record = trainer.train_step()
        assert record["skipped"] == (record["step"] == 2)
    handle.remove()
    # the weights before step 3 are those before step 2: step 2 never reached them
    assert all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))
    assert trainer.skipped_steps == 1 and trainer.recovery.consecutive_bad_steps == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_repeated_non_finite_steps_raise_and_name_last_good_checkpoint(tiny_config, tmp_path, caplog):
    model = _model(tiny_config)
    # recovery off: stop at the first divergence (test_recovery covers going back instead)
    config = _config(
        out_dir=str(tmp_path),
        max_steps=20,
        checkpoint_interval=2,
        recovery=RecoveryConfig(enabled=False, max_bad_steps=3),
    )
    trainer = Trainer(model, config, _tokens(), sinks=[])
    _nan_loss_at(model, calls={3}, from_call=6)  # step 3 bad once, then every step from 6 on
    with caplog.at_level(logging.WARNING, logger="gpt2"), pytest.raises(TrainingDivergedError) as info:
        trainer.fit()
    err = info.value
    assert err.step == 8 and math.isnan(err.loss) and err.last_checkpoint.name == "step_000004"
    message = str(err)
    assert "step 8" in message and "3 consecutive" in message and "step_000004" in message
    assert "still those of step 5" in message
    assert "step 3 skipped" in caplog.text
    # The checkpoint due at step 6 (a skipped step) was postponed; every checkpoint is finite.
    saved = ckpt.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in saved] == ["step_000002", "step_000004"]
    for path in saved:
        weights, _ = load_weights(path / ckpt.WEIGHTS_FILE)
        assert not non_finite_tensors(weights)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["skipped"]] == [3, 6, 7, 8]
    assert records[-1]["skipped_steps"] == 4


def test_divergence_without_any_checkpoint_says_so(tiny_config):
    model = _model(tiny_config)
    trainer = Trainer(model, _config(recovery=RecoveryConfig(enabled=False, max_bad_steps=2)), _tokens(), sinks=[])
    _nan_loss_at(model, from_call=1)
    with pytest.raises(TrainingDivergedError, match="No checkpoint of this run is known good"):
        trainer.fit()


def test_trainer_never_saves_non_finite_weights(tiny_config, tmp_path):
    model = _model(tiny_config)
    trainer = Trainer(model, _config(out_dir=str(tmp_path)), _tokens(), sinks=[])
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(TrainingDivergedError, match="non-finite weights.*lm_head.weight"):
        trainer.save_checkpoint()
    assert ckpt.list_checkpoints(tmp_path / "checkpoints") == []


def test_crash_during_save_keeps_last_checkpoint_resumable(tiny_config, tmp_path, monkeypatch):
    cfg = _config(out_dir=str(tmp_path), max_steps=4, checkpoint_interval=2)
    trainer = Trainer(_model(tiny_config), cfg, _tokens(), sinks=[])
    real_write = checkpoint_files.replace_atomically

    def flaky(dest, write):
        if dest.name == ckpt.STATE_FILE and ".tmp-step_000004" in str(dest):  # weights already written
            raise OSError("disk full")
        return real_write(dest, write)

    monkeypatch.setattr(checkpoint_files, "replace_atomically", flaky)
    with pytest.raises(OSError, match="disk full"):
        trainer.fit()
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]
    resumed = Trainer(
        _model(tiny_config), _config(out_dir=str(tmp_path), max_steps=4, resume="auto"), _tokens(), sinks=[]
    )
    assert resumed.step == 2


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(max_lr=-1e-3), "max_lr must be a finite number > 0"),
        (dict(max_lr="6e-4"), "must be a finite number"),
        (dict(max_lr=1e-4, min_lr=1e-3), "min_lr .* is larger than max_lr"),
        (dict(warmup_steps=10, max_steps=5), "warmup_steps \\(10\\) exceeds max_steps \\(5\\)"),
        (dict(precision="fp8"), "precision must be one of"),
        (dict(micro_batch_size=0), "micro_batch_size must be a positive integer"),
        (dict(seq_len=16, micro_batch_size=2, total_batch_size=100), "multiple of micro_batch_size \\* seq_len"),
        (dict(grad_clip=-1.0), "grad_clip"),
        (dict(betas=(0.9, 1.5)), "betas"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(fused_adamw="yes"), "fused_adamw"),
        (dict(resume="auto", out_dir=None), "out_dir is None"),
        (dict(eval_interval=-1), "eval_interval must be an integer >= 0"),
    ],
)
def test_config_rejects_impossible_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**overrides)


def test_config_round_trips_through_json():
    config = TrainConfig(precision="bf16", total_batch_size=524288, max_steps=19073, warmup_steps=715)
    again = TrainConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.min_lr is None and again.final_lr == pytest.approx(config.max_lr / 10)
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"lr": 1.0})


def test_batch_size_must_divide_across_processes(tiny_config):
    config = _config(micro_batch_size=2, seq_len=16, total_batch_size=128)
    assert grad_accum_steps(config, world_size=2) == 2
    with pytest.raises(ValueError, match=r"total_batch_size=128 tokens is not divisible by .* 2 x 16 x 3 = 96"):
        grad_accum_steps(config, world_size=3)


def test_trainer_rejects_unusable_inputs(tiny_config):
    tokens = _tokens()
    with pytest.raises(ValueError, match="seq_len=128 exceeds the model's block_size=64"):
        Trainer(_model(tiny_config), _config(seq_len=128), tokens, sinks=[])
    with pytest.raises(ValueError, match="must be float32"):
        Trainer(_model(tiny_config).half(), _config(), tokens, sinks=[])
    with pytest.raises(TypeError, match="train_data must be"):
        Trainer(_model(tiny_config), _config(), [1, 2, 3], sinks=[])
    with pytest.raises(ValueError, match=r"batch_size=4 \(this run needs 2\)"):
        Trainer(_model(tiny_config), _config(), TokenLoader(tokens, 4, 16), sinks=[])
    with pytest.raises(ValueError, match="no validation data"):
        Trainer(_model(tiny_config), _config(), tokens, sinks=[]).evaluate()


# ------------------------------------------------------------------------------ data sources


def test_data_sources(tiny_config, tmp_path):
    tokens = _tokens(2048)
    rows = tokens[: 2 * 16 + 1]
    expected_x = rows[:-1].view(2, 16)
    np.save(tmp_path / "toks.npy", tokens.numpy().astype(np.uint16))
    shards = tmp_path / "shards"
    shards.mkdir()
    np.save(shards / "tiny_val_000000.npy", tokens[1024:].numpy().astype(np.uint16))
    np.save(shards / "tiny_train_000001.npy", tokens[:1024].numpy().astype(np.uint16))
    loader = TokenLoader(tokens, 2, 16)
    for source in (tokens, tokens.numpy(), str(tmp_path / "toks.npy"), tmp_path / "toks.npy", shards, loader):
        trainer = Trainer(_model(tiny_config), _config(), source, sinks=[])
        x, _ = trainer.train_loader.next_batch()
        assert torch.equal(x, expected_x), source
    assert trainer.train_loader is loader  # a fitting loader is used as it is
    trainer = Trainer(_model(tiny_config), _config(), shards, shards, sinks=[])
    x, _ = trainer.val_loader.next_batch()
    assert torch.equal(x, tokens[1024 : 1024 + 32].view(2, 16))  # the "val" shard


# ------------------------------------------------------------------------------ metrics


def test_console_line_format():
    """Optional fields add a segment only when present; every number reads back within its rounding."""
    record = {
        "step": 50,
        "loss": 5.08601,
        "lr": 6e-5,
        "grad_norm": 0.4123,
        "dt_ms": 50.61,
        "tokens_per_second": 161818.2,
    }

    def segments(rec: dict) -> dict[str, str]:
        parts = format_line(rec).split(" | ")
        assert parts[0] == f"step {rec['step']}"
        named = {}
        for part in parts[1:]:
            words = part.split()
            # "50.6 ms" and "161,818 tok/s" put the unit last; the rest put the name first
            key, value = (words[-1], words[0]) if words[-1] in ("ms", "tok/s") else (words[0], " ".join(words[1:]))
            named[key] = value
        return named

    plain = segments({**record, "mfu": None, "val_loss": None, "loss_scale": None, "skipped": False})
    assert set(plain) == {"loss", "lr", "norm", "ms", "tok/s"}  # no empty or "None" segment
    assert float(plain["loss"]) == pytest.approx(record["loss"], abs=5e-5)
    assert float(plain["lr"]) == pytest.approx(record["lr"], rel=0.05)
    assert float(plain["norm"]) == pytest.approx(record["grad_norm"], abs=5e-3)
    assert float(plain["ms"]) == pytest.approx(record["dt_ms"], abs=0.05)
    assert float(plain["tok/s"].replace(",", "")) == pytest.approx(record["tokens_per_second"], abs=0.5)
    full = segments(
        {**record, "mfu": 0.4413, "val_loss": 4.5, "loss_scale": 32768.0, "skipped": True, "skipped_steps": 2}
    )
    assert set(full) - set(plain) == {"mfu", "val", "scale", "skipped"}
    assert float(full["mfu"].rstrip("%")) == pytest.approx(44.13, abs=0.05)
    assert float(full["val"]) == 4.5 and float(full["scale"]) == 32768.0 and "2" in full["skipped"]


def test_metrics_jsonl_plot_console_and_mfu(tiny_config, tmp_path):
    lines: list[str] = []
    config = _config(
        out_dir=str(tmp_path),
        max_steps=5,
        eval_interval=2,
        eval_steps=1,
        log_interval=2,
        plot=True,
        peak_flops=1e12,
        checkpoint_interval=0,
    )
    trainer = Trainer(_model(tiny_config), config, _tokens(), _tokens(1024), sinks=[ConsoleSink(2, lines.append)])
    history = trainer.fit()
    assert [line.split(" | ")[0] for line in lines] == ["step 1", "step 2", "step 4", "step 5"]
    assert "val " in lines[1] and "mfu " in lines[0]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(records) == 5 and records == json.loads(json.dumps(history))
    keys = {"step", "loss", "lr", "grad_norm", "dt_ms", "tokens_per_second", "mfu", "skipped", "skipped_steps"}
    assert all(keys <= set(r) for r in records)
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 5]
    assert trainer.best_val_loss == min(r["val_loss"] for r in records if "val_loss" in r)
    r = history[-1]
    assert r["tokens_per_second"] == pytest.approx(32 / (r["dt_ms"] / 1000))
    assert r["mfu"] == pytest.approx(trainer.model.flops_per_token(16) * r["tokens_per_second"] / 1e12)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_mfu_on_cpu_and_plot_without_matplotlib(tiny_config, tmp_path, monkeypatch, caplog):
    trainer = Trainer(_model(tiny_config), _config(max_steps=1), _tokens(), sinks=[])
    assert trainer.train_step()["mfu"] is None  # CPU: no peak to compare with
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        assert plot_loss_curve([{"step": 1, "loss": 1.0}], tmp_path / "x.png") is None
    assert "matplotlib is not installed" in caplog.text and not (tmp_path / "x.png").exists()


def test_peak_flops_lookup_tells_similar_names_apart():
    """Patterns are tried in order: a name that contains another GPU's name gets its own peak."""
    table = {pattern: peaks.bf16 for pattern, peaks in PEAK_FLOPS}
    assert peak_flops_for("NVIDIA A10") == table[r"\bA10\b"] != peak_flops_for("NVIDIA A100-SXM4-80GB")
    assert peak_flops_for("NVIDIA L4") == table[r"\bL4\b"] != peak_flops_for("NVIDIA L40S") == table["L40S"]
    assert peak_flops_for("NVIDIA H100 PCIe") == table[r"H100.*PCIe"] != peak_flops_for("NVIDIA H100 80GB HBM3")
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == table[r"H100|GH200"]
    assert peak_flops_for("Some Future GPU") is None


# ------------------------------------------------------------------------------ compile


# Compiled training, evaluation, checkpoints and generation: tests/test_inductor.py (Inductor).


# ------------------------------------------------------------------------------ benchmark


def test_benchmark_ladder_cpu_smoke(tmp_path):
    from gpt2.train.bench import RUNGS, format_table, run_ladder, rung_settings

    # the ladder is cumulative: each rung keeps everything the rung below it switched on
    plain = rung_settings(RUNGS[0])
    assert not any(v for k, v in plain.items() if k not in ("precision", "pad_vocab_multiple"))
    for lower, higher in zip(RUNGS, RUNGS[1:]):
        below, above = rung_settings(lower), rung_settings(higher)
        assert below.keys() == above.keys() and below != above, f"{higher} switches nothing on"
        assert all(above[k] for k, v in below.items() if v is True), f"{higher} drops what {lower} switched on"
        assert above["pad_vocab_multiple"] >= below["pad_vocab_multiple"]
    results = run_ladder("tiny", batch_size=2, seq_len=16, steps=2, warmup=1, repeats=2, device="cpu", vocab_size=257)
    assert [r.rung for r in results] == list(RUNGS)
    by_rung = {r.rung: r for r in results}
    assert by_rung["compile"].skipped and by_rung["compile"].ms_per_step is None  # CPU: no compile
    for r in results:
        if not r.skipped:
            assert r.ms_per_step > 0 and r.tokens_per_second == pytest.approx(32 / (r.ms_per_step / 1000))
            assert r.mfu is None and len(r.step_ms) == 4 and math.isfinite(r.loss)
            # ms/step is the median of the two repeats' medians; spread is how far apart they are
            assert r.repeat_ms == pytest.approx([sum(r.step_ms[:2]) / 2, sum(r.step_ms[2:]) / 2])
            assert r.ms_per_step == pytest.approx(sum(r.repeat_ms) / 2)
            assert r.spread == pytest.approx(abs(r.repeat_ms[0] - r.repeat_ms[1]) / r.ms_per_step)
    table = format_table(results)
    assert "compiling on a CPU is slow (--compile times it)" in table
    # repeats further apart than 10% are named in a note under the table, close ones are not
    timed = [r for r in results if not r.skipped]
    timed[0].repeat_ms, timed[0].spread = [10.0, 12.0], 0.2
    for r in timed[1:]:
        r.repeat_ms, r.spread = [10.0, 10.5], 0.05
    note = format_table(results).splitlines()[-1]
    assert note.startswith("note:") and timed[0].rung in note and timed[1].rung not in note


def test_a_compiled_model_is_trained_uncompiled_with_a_warning_and_an_empty_out_dir_is_refused(tiny_config, caplog):
    """torch.compile(model) is unwrapped (checkpoints hold the plain module's names): the Trainer
    says so and how to compile instead. out_dir="" meant the current directory.
    """
    model = _model(tiny_config)
    with caplog.at_level(logging.WARNING, logger="gpt2.train.trainer"):
        with Trainer(torch.compile(model, backend="eager"), _config(), _tokens(), sinks=[]) as trainer:
            assert trainer.model is model
    assert "training the module inside OptimizedModule, uncompiled (compile=True compiles it)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpt2.train.trainer"):
        Trainer(model, _config(), _tokens(), sinks=[]).close()
    assert "uncompiled" not in caplog.text
    with pytest.raises(ValueError, match=r"TrainConfig.out_dir is empty: give a folder .* or None"):
        _config(out_dir="")


def test_the_users_sinks_are_closed_with_the_trainer(tiny_config):
    """docs/training.md: a sink is an object with log(record) and optionally close(); close() was
    never called, so a file-writing sink was never flushed.
    """

    class Sink:
        def __init__(self):
            self.records, self.closed = [], 0

        def log(self, record):
            self.records.append(record["step"])

        def close(self):
            self.closed += 1

    sink = Sink()
    trainer = Trainer(_model(tiny_config), _config(max_steps=2), _tokens(), sinks=[sink, print])
    trainer.fit()
    assert sink.records == [1, 2] and sink.closed == 0  # open between fit() calls
    trainer.close()
    trainer.close()
    assert sink.closed == 1

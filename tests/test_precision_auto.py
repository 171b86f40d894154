"""precision="auto" by the device and the CPU's features alone (gpt2.torch_compat.cpu_native_bf16): training in bf16
on a CPU that multiplies it natively (AMX or AVX512-BF16), in fp32 elsewhere; sampling and evaluation in fp32 on any
CPU. The tests that take the ``native_bf16`` fixture run under both answers on any machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from _tiny_run import tiny_config, tiny_model, tiny_tokens

from gpt2 import GPT, torch_compat
from gpt2.cli import common, main
from gpt2.errors import InvalidValueError
from gpt2.train.checkpoint import META_FILE
from gpt2.train.precision import auto_precision, inference_autocast, resolve_precision
from gpt2.train.trainer import Trainer

pytestmark = pytest.mark.cpu_features


def _auto_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision")]


def _capabilities(monkeypatch, **features) -> None:
    """This CPU, as torch.cpu.get_capabilities() would describe one with ``features`` (and no override)."""
    monkeypatch.delenv(torch_compat.NATIVE_BF16_VARIABLE, raising=False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "x86_64", "avx2": True, **features})


@pytest.mark.parametrize("feature, name", [("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")])
def test_a_cpu_that_multiplies_bf16_natively_says_which_feature(monkeypatch, feature, name):
    _capabilities(monkeypatch, **{feature: True})
    assert torch_compat.cpu_native_bf16() == name
    assert auto_precision("cpu") == ("bf16", f"this CPU multiplies bf16 natively ({name})")


def test_a_cpu_that_only_emulates_bf16_has_none(monkeypatch):
    # AVX-512 without its BF16 extension: oneDNN emulates bf16 (torch's mkldnn "bf16 supported" says yes)
    _capabilities(monkeypatch, avx512_f=True, avx512_bw=True, avx512_bf16=False, amx_bf16=False)
    assert torch_compat.cpu_native_bf16() is None
    capability = torch.backends.cpu.get_cpu_capability()
    assert auto_precision("cpu") == ("fp32", f"this CPU ({capability}) has no native bf16 matmul")


def test_the_variable_overrides_what_the_cpu_says(monkeypatch):
    _capabilities(monkeypatch, amx_bf16=True)
    monkeypatch.setenv(torch_compat.NATIVE_BF16_VARIABLE, "0")
    assert torch_compat.cpu_native_bf16() is None
    _capabilities(monkeypatch)
    monkeypatch.setenv(torch_compat.NATIVE_BF16_VARIABLE, "1")
    assert torch_compat.cpu_native_bf16() == "GPT2_CPU_NATIVE_BF16=1"


def test_auto_trains_in_bf16_where_the_cpu_multiplies_it_natively(native_bf16, caplog):
    expected = "bf16" if native_bf16 else "fp32"
    with caplog.at_level(logging.INFO, logger="gpt2"):
        policy = resolve_precision("auto", "cpu")
    assert policy.name == expected
    assert policy.autocast_dtype == (torch.bfloat16 if native_bf16 else None)
    (line,) = _auto_lines(caplog)
    assert line.startswith(f"precision auto -> {expected}: this CPU ")


def test_two_trainers_with_auto_and_one_seed_give_the_same_losses(native_bf16, caplog):
    """No timing decides: the same model, data and seed give the same losses, run after run (the wall-time probe
    this replaces chose fp32 once and bf16 three times in four identical Trainers).
    """
    losses, chosen = [], []
    config = tiny_config(None, precision="auto", device="cpu", max_steps=3, checkpoint_interval=0)
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="gpt2"):
            with Trainer(tiny_model(), config, tiny_tokens(), sinks=[]) as trainer:
                chosen.append(trainer.precision.name)
                losses.append([trainer.train_step()["loss"] for _ in range(3)])
    assert chosen == ["bf16" if native_bf16 else "fp32"] * 2
    assert losses[0] == losses[1]
    # one line per Trainer, at its start
    assert len(_auto_lines(caplog)) == 2


def test_a_resumed_run_keeps_its_recorded_precision(native_bf16, monkeypatch, tmp_path, caplog):
    """A run that auto started in bf16 resumes in bf16 on a machine where auto picks fp32, and the other way."""
    picked = "bf16" if native_bf16 else "fp32"
    config = tiny_config(tmp_path / "run", precision="auto", device="cpu", max_steps=2)
    with Trainer(tiny_model(), config, tiny_tokens(), sinks=[]) as trainer:
        trainer.fit()
    monkeypatch.setenv(torch_compat.NATIVE_BF16_VARIABLE, str(int(not native_bf16)))
    resumed = dataclasses.replace(config, max_steps=4, resume="auto")
    with caplog.at_level(logging.INFO, logger="gpt2"):
        with Trainer(tiny_model(), resumed, tiny_tokens(), sinks=[]) as trainer:
            assert trainer.step == 2 and trainer.precision.name == picked
            trainer.fit()
            recorded = json.loads((trainer.last_checkpoint / META_FILE).read_text())
            assert recorded["precision"] == picked
    other = "fp32" if native_bf16 else "bf16"
    assert f"precision {picked}, as the checkpoint recorded (auto picks {other} here)" in _auto_lines(caplog)
    # a named precision is what the run asked for
    named = dataclasses.replace(config, max_steps=6, resume="auto", precision=other)
    with Trainer(tiny_model(), named, tiny_tokens(), sinks=[]) as trainer:
        assert trainer.precision.name == other


def test_inference_on_a_cpu_is_fp32_unless_asked(native_bf16, caplog):
    with caplog.at_level(logging.INFO, logger="gpt2"):
        autocast = inference_autocast("auto", "cpu")
        with autocast():
            assert not torch.is_autocast_enabled("cpu")
        bf16 = inference_autocast("bf16", "cpu")
        with bf16():
            assert torch.is_autocast_enabled("cpu")
    lines = [r.getMessage() for r in caplog.records]
    assert "precision auto -> fp32: inference on a CPU runs in fp32 (--precision bf16 asks for bf16)" in lines
    assert "bf16 on a CPU: losses, scores and logits differ from fp32's in the last digits" in lines


def test_gpt2_sample_and_eval_default_to_fp32_on_a_cpu(native_bf16, monkeypatch, tmp_path, caplog, tiny_config):
    """Whatever the CPU: sampling at fp32's speed, evaluation with the reference numbers."""
    used = []

    def recorded(name, device):
        autocast = inference_autocast(name, device)
        used.append(autocast.__self__.name)
        return autocast

    monkeypatch.setattr(common, "inference_autocast", recorded)
    GPT(dataclasses.replace(tiny_config, vocab_size=50257)).save_pretrained(tmp_path / "m")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).integers(0, 50257, 2_000).astype(np.uint16))
    assert main(["sample", "--model", str(tmp_path / "m"), "--prompt", "Hi", "--max-new-tokens", "3"]) == 0
    argv = ["eval", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "x.npy"), "--seq-len", "16"]
    assert main([*argv, "--output", str(tmp_path / "fp32.json")]) == 0
    assert main([*argv, "--output", str(tmp_path / "bf16.json"), "--precision", "bf16"]) == 0
    assert used == ["fp32", "fp32", "bf16"]
    assert "bf16 on a CPU: losses, scores and logits differ from fp32's in the last digits" in caplog.messages
    fp32, bf16 = (json.loads((tmp_path / f"{name}.json").read_text())["val_loss"] for name in ("fp32", "bf16"))
    assert fp32 != bf16 and bf16 == pytest.approx(fp32, rel=1e-2)


@pytest.mark.parametrize(
    "command, recipe", [("train", "shakespeare"), ("train", "gpt2-124m-fineweb"), ("finetune", "finetune")]
)
def test_the_cpu_recipes_train_in_bf16_where_it_is_native(native_bf16, command, recipe, capsys):
    """`bash run.sh` (the shakespeare recipe) and the other CPU recipes: bf16 through auto on an AMX CPU."""
    assert main([command, "--recipe", recipe, "--device", "cpu", "--print-config"]) == 0
    (precision,) = [
        line.split(": ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("precision:")
    ]
    assert resolve_precision(precision, "cpu").name == ("bf16" if native_bf16 else "fp32")


def test_a_recorded_precision_that_needs_another_set_up_is_named_not_switched(tmp_path):
    """An fp16 run (loss-scaled) resumed with auto: the loss scaler is set up already, so the error names the fix."""
    config = tiny_config(tmp_path / "run", precision="fp16", device="cpu", max_steps=2)
    with Trainer(tiny_model(), config, tiny_tokens(), sinks=[]) as trainer:
        trainer.fit()
    resumed = dataclasses.replace(config, max_steps=4, resume="auto", precision="auto")
    with pytest.raises(InvalidValueError, match="the checkpoint trained in fp16 and precision='auto' picks"):
        Trainer(tiny_model(), resumed, tiny_tokens(), sinks=[])


def test_the_samples_after_training_decode_in_fp32_on_a_cpu(monkeypatch, tmp_path):
    """A bf16 run (auto on an AMX CPU) still samples in fp32 at its end, as gpt2 sample does."""
    seen = []

    def stream_text(model, prompt, max_new_tokens, *, autocast=None, **kwargs):
        seen.append(autocast)
        yield "x"

    monkeypatch.setattr(common, "stream_text", stream_text)
    config = tiny_config(None, precision="bf16", device="cpu", max_steps=1)
    with Trainer(tiny_model(), config, tiny_tokens()) as trainer:
        sampling = common.SamplingOptions(num_samples=1, max_new_tokens=2)
        common.final_report(trainer, None, sampling, final_eval_batches=None, prompt="p", save=False)
    assert seen == [None]

"""Precision policies and fp16 loss scaling on CPU."""

from __future__ import annotations

import pytest
import torch

from gpt2 import GPT
from gpt2.train.config import RecoveryConfig, TrainConfig
from gpt2.train.optim import build_optimizer
from gpt2.train.precision import resolve_precision
from gpt2.train.trainer import Trainer


def test_policies_on_cpu(monkeypatch):
    # a CPU without native bf16 (tests/test_precision_auto.py: one with it)
    monkeypatch.setenv("GPT2_CPU_NATIVE_BF16", "0")
    assert resolve_precision("auto", "cpu").name == "fp32"
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for name, dtype in (
        ("fp32", torch.float32),
        ("tf32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
    ):
        policy = resolve_precision(name, "cpu")
        policy.apply()  # a no-op on CPU, must not fail
        with policy.autocast():
            assert (a @ b).dtype == dtype
        assert (policy.make_scaler() is not None) == (name == "fp16")
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        resolve_precision("fp8", "cpu")


def test_loss_is_fp32_under_autocast(tiny_config):
    model = GPT(tiny_config)
    x = torch.randint(0, tiny_config.vocab_size, (2, 8))
    for name in ("bf16", "fp16"):
        with resolve_precision(name, "cpu").autocast():
            logits, loss = model(x)[0], model(x, x)[1]
        assert logits.dtype != torch.float32 and loss.dtype == torch.float32


def _overflow_once(model, at_call: int, factor: float = 1e8):
    """Multiply the loss of the ``at_call``-th forward by ``factor``: finite in fp32, but its
    gradients overflow fp16 (max 65,504) in the backward of the autocast matmuls.
    """
    calls = {"n": 0}

    def hook(module, inputs, output):
        calls["n"] += 1
        if calls["n"] == at_call:
            return output[0], output[1] * factor

    return model.register_forward_hook(hook)


def test_fp16_scaler_skips_overflow_step_and_training_continues(tiny_config):
    torch.manual_seed(0)
    model = GPT(tiny_config)
    tokens = torch.randint(0, tiny_config.vocab_size, (4000,))
    config = TrainConfig(
        micro_batch_size=4,
        seq_len=16,
        max_steps=6,
        max_lr=1e-3,
        precision="fp16",
        out_dir=None,
        progress=False,
        recovery=RecoveryConfig(max_bad_steps=1),
    )
    trainer = Trainer(model, config, tokens, sinks=[])
    assert trainer.scaler is not None
    handle = _overflow_once(model, at_call=3)
    records, changed = [], []
    for _ in range(6):
        before = [p.detach().clone() for p in model.parameters()]
        records.append(trainer.train_step())
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    handle.remove()
    scales = [r["loss_scale"] for r in records]
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    assert changed == [True, True, False, True, True, True]  # the skipped step left the weights alone
    assert scales[2] == scales[1] / 2  # scale reduced by the backoff factor
    assert trainer.skipped_steps == 1 and records[-1]["skipped_steps"] == 1
    # A scaler overflow is the scale search, not divergence: max_bad_steps=1 did not stop training.
    assert trainer.recovery.consecutive_bad_steps == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records[3:])


def test_same_overflow_without_scaler_gives_nan_weights(tiny_config):
    """What the scaler prevents: the plain fp16-autocast update turns the weights into NaN."""
    torch.manual_seed(0)
    model = GPT(tiny_config)
    policy = resolve_precision("fp16", "cpu")
    optimizer = build_optimizer(model, max_lr=1e-3)
    handle = _overflow_once(model, at_call=1)
    x = torch.randint(0, tiny_config.vocab_size, (4, 16))
    with policy.autocast():
        _, loss = model(x, x)
    handle.remove()
    assert torch.isfinite(loss)  # the loss itself is fine ...
    loss.backward()
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())  # ... its gradients are not
    optimizer.step()
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_training_on_cpu_learns(tiny_config):
    torch.manual_seed(0)
    model = GPT(tiny_config)
    tokens = torch.arange(0, 4 * 16 + 1) % tiny_config.vocab_size  # one batch, seen every step
    config = TrainConfig(
        micro_batch_size=4, seq_len=16, max_steps=15, max_lr=3e-3, precision="bf16", out_dir=None, progress=False
    )
    history = Trainer(model, config, tokens, sinks=[]).fit()
    assert history[-1]["loss"] < history[0]["loss"] - 1.0
    assert "loss_scale" not in history[0]  # no scaler for bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights


def test_fp16_resume_restores_the_loss_scale(tiny_config, tmp_path):
    torch.manual_seed(0)
    model = GPT(tiny_config)
    tokens = torch.randint(0, tiny_config.vocab_size, (4000,))
    config = TrainConfig(
        micro_batch_size=4,
        seq_len=16,
        max_steps=6,
        max_lr=1e-3,
        precision="fp16",
        out_dir=str(tmp_path),
        progress=False,
        plot=False,
    )
    first = Trainer(model, config, tokens, sinks=[])
    handle = _overflow_once(model, at_call=2)
    first.fit(until_step=3)
    handle.remove()
    assert first.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale() / 2  # backed off once
    resumed = Trainer(GPT(tiny_config), TrainConfig(**{**config.to_dict(), "resume": "auto"}), tokens, sinks=[])
    assert resumed.step == 3 and resumed.skipped_steps == 1
    assert resumed.scaler.state_dict() == first.scaler.state_dict()
    next_first, next_resumed = first.train_step(), resumed.train_step()
    assert next_first["loss"] == next_resumed["loss"] and next_first["loss_scale"] == next_resumed["loss_scale"]


# The TF32 switch changes process-wide state (and on PyTorch >= 2.9 setting the new API makes
# the legacy getters raise), so each check runs in its own process: forked from this one, which
# costs no interpreter start-up and leaves this process's state alone.
_TF32_SCRIPT = r"""
import torch
from gpt2.train.precision import PrecisionPolicy

calls = []
def legacy(*args):
    calls.append(args)
torch.set_float32_matmul_precision = lambda p: legacy("set_float32_matmul_precision", p)
type(torch.backends.cudnn).allow_tf32 = property(lambda self: None, lambda self, v: legacy("cudnn.allow_tf32", v))
for name in ("tf32", "fp32"):
    PrecisionPolicy(name, "cuda", None).apply()
    print(name, torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
print("legacy", calls)
"""


def _run_tf32_script() -> list[str]:
    import contextlib
    import os
    import traceback

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run the script, print into the pipe, never return into pytest
        os.close(read)
        code = 1
        try:
            with os.fdopen(write, "w") as out, contextlib.redirect_stdout(out):
                exec(_TF32_SCRIPT, {"__name__": "__main__"})
            code = 0
        except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the TF32 script failed; see the captured stderr"
    return out.strip().splitlines()


def test_tf32_switch_uses_only_fp32_precision():
    assert _run_tf32_script() == ["tf32 tf32 tf32", "fp32 ieee ieee", "legacy []"]


def test_no_module_but_precision_touches_the_tf32_switches():
    """On PyTorch >= 2.9 the legacy getters (``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.get_float32_matmul_precision``) raise once the new ``fp32_precision`` API was set, which
    ``PrecisionPolicy.apply`` does: no other module may read or set TF32 through either API.
    """
    import re
    from pathlib import Path

    import gpt2

    switches = re.compile(r"allow_tf32|float32_matmul_precision|fp32_precision")
    root = Path(gpt2.__file__).parent
    hits = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "precision.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if switches.search(line)
    ]
    assert hits == []


def test_describe_machine_names_the_cpu_its_bf16_features_torch_and_threads(monkeypatch):
    from gpt2.train.precision import describe_machine

    fake = {"cpu_name": "Intel Xeon Platinum", "amx_bf16": True, "avx512_bf16": False}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: fake)
    line = describe_machine("cpu", threads=1)
    assert line.startswith("Intel Xeon Platinum (") and "; AMX, no AVX512-BF16)" in line
    assert f"torch {torch.__version__}" in line and line.endswith("1 thread(s)")

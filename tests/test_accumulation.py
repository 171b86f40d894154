"""Token-exact gradient accumulation: one Trainer step over N micro-batches gives the
gradient of ONE batch holding all their rows, the mean over every scored target, however
unevenly the targets fall on the micro-batches; fp16 (loss-scaled) and bf16 too, compiled too.
2 processes vs 1: tests/test_distributed.py.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from _dist_worker import ByteTokenizer, uneven_rows
from _tiny_run import Batches

from gpt2 import GPT, GPTConfig
from gpt2.data.instruct import InstructionLoader
from gpt2.data.loader import TokenLoader
from gpt2.model.gpt import IGNORE_INDEX
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer

B, T, MICRO_STEPS = 2, 128, 4


def _config(**overrides) -> TrainConfig:
    base = dict(
        micro_batch_size=B,
        seq_len=T,
        total_batch_size=B * T * MICRO_STEPS,
        max_steps=2,
        warmup_steps=0,
        grad_clip=0.0,  # the raw accumulated gradient stays in .grad after the step
        eval_interval=0,
        out_dir=None,
        progress=False,
        device="cpu",
        precision="fp32",
        plot=False,
    )
    return TrainConfig(**{**base, **overrides})


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=T, vocab_size=257, n_layer=2, n_head=4, n_embd=32))


def _concat(batches: list[tuple]) -> tuple:
    """One batch holding the rows of all ``batches`` (forward kwargs concatenated too)."""
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    kwargs = {k: torch.cat([b[2][k] for b in batches]) for k in batches[0][2]} if len(batches[0]) > 2 else {}
    return x, y, kwargs


def _reference(model: nn.Module, batches: list[tuple], precision: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and gradient of one big batch: the mean over its scored targets (F.cross_entropy's)."""
    model = copy.deepcopy(model)
    x, y, kwargs = _concat(batches)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        _, loss = model(x, y, **kwargs)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _mean_of_means_grads(model: nn.Module, batches: list[tuple]) -> dict[str, torch.Tensor]:
    """What the Trainer did before: each micro-batch's mean loss / number of micro-steps."""
    model = copy.deepcopy(model)
    for x, y, *rest in batches:
        (model(x, y, **(rest[0] if rest else {}))[1] / len(batches)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _relative_error(grads: dict, reference: dict) -> float:
    diff = torch.cat([(grads[n] - reference[n]).flatten() for n in reference])
    return float(diff.norm() / torch.cat([g.flatten() for g in reference.values()]).norm())


def _instruction_loader(pack: bool) -> InstructionLoader:
    return InstructionLoader(uneven_rows(96), B, T, pack=pack, seed=5, tokenizer=ByteTokenizer())


def _step_and_compare(model, train_data, batches, *, tolerance, **config):
    loss, reference = _reference(model, batches, config.get("precision", "fp32"))
    with Trainer(model, _config(**config), train_data, sinks=[]) as trainer:
        record = trainer.train_step()
        grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    assert not record["skipped"]
    assert record["scored_tokens"] == sum(int((b[1] != IGNORE_INDEX).sum()) for b in batches)
    error = _relative_error(grads, reference)
    assert error < tolerance, error
    assert record["loss"] == pytest.approx(loss, rel=tolerance)  # the logged loss: the same global mean
    return record


@pytest.mark.parametrize("pack", [False, True])
def test_instruction_micro_batches_give_the_one_batch_gradient(pack):
    model, loader = _model(), _instruction_loader(pack)
    reader = _instruction_loader(pack)
    batches = [reader.next_batch() for _ in range(MICRO_STEPS)]
    counts = [int((b[1] != IGNORE_INDEX).sum()) for b in batches]
    assert max(counts) > 2 * min(counts), counts  # uneven: the old mean of means is wrong here
    assert _relative_error(_mean_of_means_grads(model, batches), _reference(model, batches, "fp32")[1]) > 0.05
    _step_and_compare(model, loader, batches, tolerance=1e-6)


def test_pretraining_micro_batches_give_the_one_batch_gradient():
    tokens = torch.randint(0, 257, (B * T * MICRO_STEPS * 2 + 1,), generator=torch.Generator().manual_seed(3))
    reader = TokenLoader(tokens, B, T)
    batches = [reader.next_batch() for _ in range(MICRO_STEPS)]
    _step_and_compare(_model(), tokens, batches, tolerance=1e-6)


@pytest.mark.parametrize("precision, tolerance", [("bf16", 1e-2), ("fp16", 3e-3)])
def test_low_precision_micro_batches_give_the_one_batch_gradient(precision, tolerance):
    """Under autocast (fp16: through the GradScaler, unscaled before the comparison) the step's
    gradient is the big batch's up to the low precision's rounding (bf16 ~2e-3, fp16 ~4e-4 here);
    the mean of means is off by more than 5e-2 (checked in the fp32 test).
    """
    model, reader = _model(), _instruction_loader(True)
    batches = [reader.next_batch() for _ in range(MICRO_STEPS)]
    record = _step_and_compare(model, _instruction_loader(True), batches, tolerance=tolerance, precision=precision)
    assert ("loss_scale" in record) == (precision == "fp16")


def test_compiled_micro_batches_give_the_one_batch_gradient(monkeypatch):
    # Inductor's C++ build takes about two minutes here and is PyTorch's to test; "aot_eager" keeps
    # what matters for this test: Dynamo traces forward(..., reduction="sum", attn_mask, position_ids).
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, **{"backend": "aot_eager", **kw}))
    model, reader = _model(), _instruction_loader(True)
    batches = [reader.next_batch() for _ in range(MICRO_STEPS)]
    _step_and_compare(model, _instruction_loader(True), batches, tolerance=1e-6, compile=True)


class MeanOnly(nn.Module):
    """A model with only ``forward(idx, targets) -> (logits, mean loss)``: no ``reduction``."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, targets):
        return self.gpt(idx, targets)


def test_a_model_without_reduction_sum_is_weighted_by_its_targets_and_an_empty_micro_batch_adds_zero():
    reader = _instruction_loader(False)
    batches = [reader.next_batch() for _ in range(MICRO_STEPS)]
    x, y = batches[1]
    batches[1] = (x, torch.full_like(y, IGNORE_INDEX))  # its mean loss is 0/0 = NaN
    model = MeanOnly(_model())
    _step_and_compare(model, Batches(batches), batches, tolerance=1e-6)


def test_a_loaders_hugging_face_ignore_index_is_refused_before_any_update():
    """-100 (transformers' ignore index) is no token here: a loader of the user's that sends it
    stops the step with the fix, before a forward (on a GPU the loss could not check it).
    """
    x = torch.randint(0, 257, (B, T))
    y = torch.roll(x, -1, 1)
    y[:, :4] = -100
    model = _model()
    before = copy.deepcopy(model.state_dict())
    with Trainer(model, _config(), Batches([(x, y)] * MICRO_STEPS), sinks=[]) as trainer:
        with pytest.raises(ValueError, match=r"or -1 \(not scored\), got -100; .*-100 in Hugging Face"):
            trainer.train_step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_step_without_scored_targets_is_skipped_without_nan(caplog):
    x = torch.randint(0, 257, (B, T))
    empty = (x, torch.full_like(x, IGNORE_INDEX))
    scored = (x, torch.roll(x, -1, 1))
    model = _model()
    before = copy.deepcopy(model.state_dict())
    loader = Batches([empty] * MICRO_STEPS + [scored] * MICRO_STEPS)
    with Trainer(model, _config(max_lr=1e-2), loader, sinks=[]) as trainer:
        with caplog.at_level(logging.WARNING, logger="gpt2.train.trainer"):
            record = trainer.train_step()
        assert record["skipped"] and record["scored_tokens"] == 0 and trainer.skipped_steps == 1
        assert record["loss"] == 0.0 and record["grad_norm"] == 0.0
        assert "no scored targets" in caplog.text
        assert trainer.recovery.consecutive_bad_steps == 0 and not trainer.optimizer.state  # AdamW never stepped
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        record = trainer.train_step()  # the next step trains normally
    assert not record["skipped"] and record["scored_tokens"] == B * T * MICRO_STEPS
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

"""Every numeric field of GPTConfig / TrainConfig / RecoveryConfig is checked when the config is built: finite,
of the right kind (no bools, no strings, no floats for int fields) and within its range.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from gpt2.model.config import GPTConfig
from gpt2.train.config import RecoveryConfig, TrainConfig


def _fields_of(cls: type, kind: type) -> list[str]:
    """Names of the fields whose annotation holds ``kind`` (``float``, ``float | None``...), read
    from the class itself so that a field added later is tested too.
    """
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        # `float` itself or a union such as `float | None` (not `tuple[float, float]`: betas)
        is_union = typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType"
        args = typing.get_args(hint) if is_union else (hint,)
        if kind in args and bool not in args:
            names.append(f.name)
    return names


CONFIGS = (GPTConfig, TrainConfig, RecoveryConfig)
FLOAT_FIELDS = [(cls, n) for cls in CONFIGS for n in _fields_of(cls, float)]
INT_FIELDS = [(cls, n) for cls in CONFIGS for n in _fields_of(cls, int)]
# Fields for which a negative value is meaningless (all of today's float fields are).
NEGATIVE_INVALID = {
    "dropout",
    "layer_norm_epsilon",
    "max_lr",
    "min_lr",
    "weight_decay",
    "eps",
    "grad_clip",
    "peak_flops",
    "lr_factor",
    "divergence_factor",
}


def _build(cls: type, **kwargs):
    # A small TrainConfig so the cross-field checks (warmup <= max_steps...) pass.
    if cls is TrainConfig:
        kwargs = {"out_dir": None, "micro_batch_size": 2, "seq_len": 8, **kwargs}
    return cls(**kwargs)


def test_every_float_field_is_covered():
    names = {n for _, n in FLOAT_FIELDS}
    # The known ones, so the discovery above cannot silently find nothing.
    assert {
        "dropout",
        "layer_norm_epsilon",
        "max_lr",
        "min_lr",
        "weight_decay",
        "eps",
        "grad_clip",
        "peak_flops",
    } <= names


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("cls,name", FLOAT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS])
def test_float_fields_reject_non_finite(cls, name, bad):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name} must be a finite number"):
        _build(cls, **{name: bad})


@pytest.mark.parametrize("cls,name", FLOAT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS])
def test_float_fields_reject_bool_and_string(cls, name):
    for bad in (True, False):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name} must be .* got {bad!r}"):
            _build(cls, **{name: bad})
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name} .*YAML.*6\.0e-4"):
        _build(cls, **{name: "6e-4"})


@pytest.mark.parametrize(
    "cls,name",
    [(c, n) for c, n in FLOAT_FIELDS if n in NEGATIVE_INVALID],
    ids=[f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS if n in NEGATIVE_INVALID],
)
def test_float_fields_reject_negative(cls, name):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name} must be"):
        _build(cls, **{name: -0.5})


@pytest.mark.parametrize("cls,name", FLOAT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS])
def test_float_fields_accept_an_int_and_store_a_float(cls, name):
    # An int is a fine float (YAML `weight_decay: 0`); it is stored as a float.
    value = 0 if name in ("dropout", "weight_decay", "grad_clip", "min_lr") else 2 if name == "divergence_factor" else 1
    config = _build(cls, **{name: value})
    assert isinstance(getattr(config, name), float) and getattr(config, name) == value


@pytest.mark.parametrize(
    "field,value", [("dropout", 1.0), ("eps", 0.0), ("max_lr", 0.0), ("peak_flops", 0.0), ("layer_norm_epsilon", 0.0)]
)
def test_float_fields_reject_their_bounds(field, value):
    cls = GPTConfig if field in ("dropout", "layer_norm_epsilon") else TrainConfig
    with pytest.raises(ValueError, match=rf"\.{field} must be"):
        _build(cls, **{field: value})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1.0, -0.1, True, "0.9"])
@pytest.mark.parametrize("index", [0, 1])
def test_betas_are_finite_probabilities(index, bad):
    betas = [0.9, 0.95]
    betas[index] = bad
    with pytest.raises(ValueError, match=rf"TrainConfig\.betas\[{index}\] must be"):
        _build(TrainConfig, betas=tuple(betas))
    with pytest.raises(ValueError, match=r"TrainConfig\.betas must be two numbers"):
        _build(TrainConfig, betas="ab")
    assert _build(TrainConfig, betas=[0, 0.5]).betas == (0.0, 0.5)  # a JSON list, ints allowed


@pytest.mark.parametrize("cls,name", INT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in INT_FIELDS])
def test_int_fields_reject_bool_float_string_and_negative(cls, name):
    for bad in (True, 2.0, float("nan"), "4", -1):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name} must be .*integer"):
            _build(cls, **{name: bad})


@pytest.mark.parametrize(
    "cls,name", [(GPTConfig, "bias"), (GPTConfig, "flash"), (TrainConfig, "compile"), (TrainConfig, "plot")]
)
def test_bool_fields_reject_strings(cls, name):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name} must be True or False"):
        _build(cls, **{name: "false"})


def test_defaults_and_none_pass():
    config = _build(TrainConfig, min_lr=None, grad_clip=None, peak_flops=None, total_batch_size=None)
    assert config.min_lr is None and math.isclose(config.final_lr, config.max_lr / 10)
    GPTConfig()


def test_numpy_numbers_are_taken_as_python_ones():
    """A sweep script's np.int64 / np.float32 values were refused with "must be a positive
    integer, got np.int64(100)"; they are numbers, stored as Python ones.
    """
    import numpy as np
    import torch

    from gpt2 import GPT

    config = TrainConfig(max_steps=np.int64(100), max_lr=np.float32(1e-3), micro_batch_size=np.int32(2))
    assert (config.max_steps, config.micro_batch_size) == (100, 2) and type(config.max_steps) is int
    assert config.max_lr == pytest.approx(1e-3) and type(config.max_lr) is float
    model_config = GPTConfig(n_layer=np.int64(1), n_head=2, n_embd=np.int16(16), block_size=8, vocab_size=32)
    assert type(model_config.n_layer) is int and model_config.n_embd == 16
    out = GPT(model_config).generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=np.int64(3), top_k=np.int8(5))
    assert out.shape == (1, 4)
    with pytest.raises(ValueError, match=r"TrainConfig.max_steps must be a positive integer, got np.True_"):
        TrainConfig(max_steps=np.bool_(True))


def test_a_seed_past_numpys_range_is_a_config_error():
    """--seed 4294967296 ended in numpy's "Seed must be between 0 and 2**32 - 1" (exit 1) after set-up."""
    assert TrainConfig(seed=2**32 - 1).seed == 2**32 - 1
    with pytest.raises(ValueError, match=r"TrainConfig.seed must be an integer in \[0, 4294967295\], got 4294967296"):
        TrainConfig(seed=2**32)


def test_decay_lr_false_keeps_max_lr_after_warmup_and_ignores_min_lr():
    from gpt2.train.optim import lr_at

    # min_lr above max_lr is refused only where the cosine would use it
    with pytest.raises(ValueError, match="min_lr"):
        _build(TrainConfig, max_lr=1e-3, min_lr=3e-3)
    config = _build(TrainConfig, max_lr=1e-3, min_lr=3e-3, decay_lr=False, warmup_steps=4, max_steps=20)
    assert config.final_lr == config.max_lr
    rates = [
        lr_at(step, max_lr=config.max_lr, min_lr=config.final_lr, warmup_steps=4, max_steps=20) for step in range(20)
    ]
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert rates[4:] == pytest.approx([1e-3] * 16)
    decayed = _build(TrainConfig, max_lr=1e-3, warmup_steps=4, max_steps=20)
    assert decayed.final_lr == pytest.approx(1e-4)


def test_the_trainer_names_a_config_or_model_of_the_wrong_type():
    import torch

    from gpt2 import GPT, Trainer

    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    data = torch.randint(0, 64, (256,))
    with pytest.raises(TypeError, match="config must be a gpt2.TrainConfig, got dict"):
        Trainer(model, {"max_steps": 1}, data)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module .* got str"):
        Trainer("gpt2", TrainConfig(max_steps=1, device="cpu"), data)

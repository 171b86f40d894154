"""Bad LoRA settings fail when the config / parametrization is built, with the field named."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

import minlora
from minlora import LoRAConfig, LoRAParametrization

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rank", 0, "rank must be a positive integer"),
        ("rank", -4, "rank must be a positive integer"),
        ("rank", 2.0, "rank must be a positive integer"),
        ("rank", True, "rank must be a positive integer"),
        ("rank", "8", "rank must be a positive integer"),
        ("alpha", NAN, "alpha must be a finite number"),
        ("alpha", INF, "alpha must be a finite number"),
        ("alpha", -INF, "alpha must be a finite number"),
        ("alpha", 0.0, r"alpha must be in \(0, inf\)"),
        ("alpha", -1.0, r"alpha must be in \(0, inf\)"),
        ("alpha", True, "alpha must be a number"),
        ("alpha", "16", "alpha must be a number"),
        ("dropout", NAN, "dropout must be a finite number"),
        ("dropout", INF, "dropout must be a finite number"),
        ("dropout", 1.0, r"dropout must be in \[0, 1\)"),
        ("dropout", -0.1, r"dropout must be in \[0, 1\)"),
        ("dropout", False, "dropout must be a number"),
        ("use_rslora", "yes", "use_rslora must be True or False"),
        ("include_lm_head", 1, "include_lm_head must be True or False"),
    ],
)
def test_lora_config_rejects_bad_settings(field, value, message):
    with pytest.raises(ValueError, match=rf"LoRAConfig\.{message}"):
        LoRAConfig(**{field: value})


def test_lora_config_from_dict_checks_too():
    # JSON allows NaN: a config file with "alpha": NaN must not get through either
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        LoRAConfig.from_dict({"rank": 4, "alpha": NAN})


def test_good_settings_still_build():
    config = LoRAConfig(rank=1, alpha=0.5, dropout=0.0)
    assert (config.rank, config.alpha, config.dropout) == (1, 0.5, 0.0)
    assert LoRAConfig(alpha=16, dropout=0.999).alpha == 16  # an int alpha is a number


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=0), "rank must be a positive integer"),
        (dict(rank=True), "rank must be a positive integer"),
        (dict(lora_alpha=NAN), "lora_alpha must be a finite number"),
        (dict(lora_alpha=INF), "lora_alpha must be a finite number"),
        (dict(lora_alpha=0), "lora_alpha must not be 0"),
        (dict(lora_alpha=True), "lora_alpha must be a number"),
        (dict(lora_dropout_p=NAN), "lora_dropout_p must be a finite number"),
        (dict(lora_dropout_p=1.0), r"lora_dropout_p must be in \[0, 1\)"),
        (dict(lora_dropout_p=-0.5), r"lora_dropout_p must be in \[0, 1\)"),
    ],
)
@pytest.mark.parametrize("constructor", ["from_linear", "from_embedding", "from_conv2d"])
def test_parametrization_constructors_reject_bad_settings(constructor, kwargs, message):
    layer = {"from_linear": nn.Linear(8, 4), "from_embedding": nn.Embedding(10, 4), "from_conv2d": nn.Conv2d(2, 3, 3)}[
        constructor
    ]
    with pytest.raises(ValueError, match=f"LoRAParametrization: {message}"):
        getattr(LoRAParametrization, constructor)(layer, **kwargs)


def test_parametrization_direct_and_set_scaling():
    with pytest.raises(ValueError, match="fan_in must be a positive integer"):
        LoRAParametrization(0, 4)
    lora = LoRAParametrization(8, 4, rank=2, lora_alpha=-2.0)  # a negative alpha is allowed: it only scales
    assert lora.scaling == -1.0
    with pytest.raises(ValueError, match="LoRAParametrization: lora_alpha must be a finite number"):
        lora.set_scaling(NAN)
    assert lora.scaling == -1.0  # unchanged by the refused call


def test_nan_alpha_never_reaches_a_forward():
    """The failure the checks exist for: alpha=nan used to make every output NaN, silently."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.raises(ValueError):
        minlora.add_lora(model, LoRAConfig(alpha=NAN))
    assert not minlora.lora_sites(model)
    minlora.add_lora(model, LoRAConfig(rank=2, alpha=2.0))
    assert all(math.isfinite(v) for v in model(torch.randn(3, 8)).flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.int8, "bfloat16", torch.bool])
def test_save_dtype_must_be_a_floating_torch_dtype(dtype, tmp_path):
    model = nn.Sequential(nn.Linear(8, 8))
    minlora.add_lora(model)
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
        minlora.save_adapter(model, tmp_path / "a", dtype=dtype)
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
        minlora.export_peft_adapter(model, tmp_path / "p", dtype=dtype)
    assert not (tmp_path / "a").exists() and not (tmp_path / "p").exists()


def test_rank_above_a_layers_smaller_side_is_accepted_with_one_warning_naming_the_layers():
    # wasteful, not wrong: minLoRA and PEFT accept it, and minLoRA's demo puts rank 4 on a Linear(7, 3)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 3), nn.Linear(3, 2))
    x = torch.randn(4, 16)
    before = model(x)
    with pytest.warns(UserWarning) as record:
        minlora.add_lora(model, LoRAConfig(rank=4))
    assert len(record) == 1, "one warning per add_lora call, however many layers it names"
    message = str(record[0].message)
    assert "1.weight (weight shape (3, 16)) has rank 4, useful maximum 3" in message
    assert "2.weight (weight shape (2, 3)) has rank 4, useful maximum 2" in message
    assert "0.weight" not in message, "a layer the rank fits is not named"
    assert record[0].filename == __file__, "the warning points at the add_lora call"
    assert [s.lora.rank for s in minlora.lora_sites(model)] == [4, 4, 4]
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    with torch.no_grad():
        for p in minlora.get_lora_params(model):
            p.normal_(0.0, 0.1)
    adapted = model(x)
    assert not torch.allclose(adapted, before)
    minlora.merge_lora(model)
    torch.testing.assert_close(model(x), adapted, rtol=1e-5, atol=1e-5)


def test_a_rank_that_fits_every_layer_gives_no_warning():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        minlora.add_lora(model, LoRAConfig(rank=3))
    assert [s.lora.rank for s in minlora.lora_sites(model)] == [3, 3]


def test_many_oversized_layers_are_named_in_one_bounded_warning():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(9)])
    with pytest.warns(UserWarning, match=r"on 9 layer\(s\): 0\.weight .*5\.weight .*; and 3 more\.") as record:
        minlora.add_lora(model)
    assert len(record) == 1 and "6.weight" not in str(record[0].message)


@pytest.mark.parametrize(
    "layer, config, shape, rank, useful",
    [
        (nn.Embedding(10, 2), LoRAConfig(rank=3, include_embeddings=True, target_types=()), r"\(10, 2\)", 3, 2),
        (nn.Conv2d(1, 2, 1), LoRAConfig(rank=2, target_types=("Conv2d",)), r"\(2, 1, 1, 1\)", 2, 1),
        # minLoRA's dict, rank 4
        (nn.Linear(2, 8), {nn.Linear: {"weight": LoRAParametrization.from_linear}}, r"\(8, 2\)", 4, 2),
    ],
)
def test_rank_above_the_bound_works_for_every_layer_family_and_config_kind(layer, config, shape, rank, useful):
    with pytest.warns(UserWarning, match=rf"weight \(weight shape {shape}\) has rank {rank}, useful maximum {useful}"):
        minlora.add_lora(layer, config)
    (site,) = minlora.lora_sites(layer)
    assert site.lora.rank == rank
    with torch.no_grad():
        for p in minlora.get_lora_params(layer):
            p.normal_(0.0, 0.1)
        # the weight path and the fast path agree at this rank too
        if isinstance(layer, nn.Embedding):
            x = torch.arange(10)
        elif isinstance(layer, nn.Conv2d):
            x = torch.randn(1, 1, 3, 3)
        else:
            x = torch.randn(3, 2)
        fast = layer(x)
        minlora.set_fast_path(layer, False)
        torch.testing.assert_close(layer(x), fast)


def test_adapters_with_a_rank_above_the_bound_save_load_and_move_to_peft(tmp_path):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))

    ours = model()
    with pytest.warns(UserWarning, match="useful maximum 3"):
        minlora.add_lora(ours)
    with torch.no_grad():
        for p in minlora.get_lora_params(ours):
            p.normal_(0.0, 0.1)
    x = torch.randn(4, 5)
    expected = ours(x)
    minlora.save_adapter(ours, tmp_path / "adapter")
    minlora.export_peft_adapter(ours, tmp_path / "peft", task_type=None)
    for load in (
        lambda m: minlora.load_adapter(m, tmp_path / "adapter"),
        lambda m: minlora.import_peft_adapter(m, tmp_path / "peft"),
    ):
        fresh = model()
        with warnings.catch_warnings():
            # loading names no layer: the adapter is what it is
            warnings.simplefilter("error")
            load(fresh)
        assert [s.lora.rank for s in minlora.lora_sites(fresh)] == [4, 4]
        torch.testing.assert_close(fresh(x), expected, rtol=0, atol=0)
    # into a model that already has LoRA of that rank (the layers' factors are replaced)
    again = model()
    with pytest.warns(UserWarning):
        minlora.add_lora(again)
    minlora.load_adapter(again, tmp_path / "adapter")
    torch.testing.assert_close(again(x), expected, rtol=0, atol=0)


def test_check_float_names_open_ends_of_a_range():
    from minlora.parametrization import check_float

    with pytest.raises(ValueError, match=r"x must be in \[-inf, 2\), got 3"):
        check_float(3, "x", high=2)
    with pytest.raises(ValueError, match=r"x must be in \(0, inf\), got 0"):
        check_float(0, "x", low=0, low_open=True)
    check_float(1.5, "x", high=2)  # inside: no error


def test_every_deliberate_error_is_a_minlora_error_and_keeps_its_builtin_base():
    linear = nn.Linear(4, 4)
    cases = [
        # a config of the wrong kind
        (lambda: minlora.add_lora(linear, [nn.Linear]), TypeError),
        # a factory that does not return a LoRAParametrization
        (lambda: minlora.add_lora(linear, {nn.Linear: {"weight": lambda layer: nn.Identity()}}), TypeError),
        # a layer without a floating-point weight
        (lambda: LoRAParametrization.from_linear(nn.Identity()), TypeError),
        # a name-based LoRAConfig given to the per-layer helper
        (lambda: minlora.apply_lora(linear, lora_config=LoRAConfig(target_modules=["x"])), TypeError),
        # settings
        (lambda: LoRAConfig(rank=0), ValueError),
    ]
    for call, builtin in cases:
        with pytest.raises(minlora.MinloraError) as info:
            call()
        assert isinstance(info.value, builtin)
    assert not minlora.lora_sites(linear)
    minlora.add_lora(linear, LoRAConfig(rank=2))
    minlora.load_multiple_lora(linear, [minlora.get_lora_state_dict(linear)])
    with pytest.raises(minlora.LoRAIndexError, match="out of range") as info:
        minlora.select_lora(linear, 1)
    assert isinstance(info.value, IndexError) and isinstance(info.value, minlora.MinloraError)


def test_use_rslora_none_is_plain_lora():
    lora = LoRAParametrization(8, 4, rank=4, lora_alpha=2, use_rslora=None)
    assert lora.use_rslora is False and lora.scaling == 0.5

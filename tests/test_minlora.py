"""minlora core: minLoRA's API and workflows, and what minLoRA gets wrong, fixed."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from minlora.config import LoRAConfig
from minlora.model import (
    LoRAParametrization,
    add_lora,
    add_lora_by_name,
    apply_lora,
    default_lora_config,
    lora_sites,
    merge_lora,
    remove_lora,
)
from minlora.utils import (
    count_parameters,
    disable_lora,
    enable_lora,
    get_bias_params,
    get_lora_params,
    get_lora_state_dict,
    load_multiple_lora,
    mark_only_lora_as_trainable,
    name_is_lora,
    select_lora,
    set_fast_path,
    tie_weights,
    untie_weights,
)


def randomize_lora(model: nn.Module, std: float = 0.1) -> None:
    """B starts at zero (LoRA is a no-op); give every factor random values so LoRA matters."""
    with torch.no_grad():
        for p in get_lora_params(model):
            p.normal_(0.0, std)


def tiny_gpt(**overrides) -> GPT:
    cfg = dict(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg)).eval()


def tokens(batch: int = 2, T: int = 16, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, T))


# --------------------------------------------------------------------------- minLoRA README workflow
def test_readme_workflow_on_a_linear_model():
    # minLoRA's README has a Linear(5, 3); rank 4 fits every layer of this one (a larger rank warns)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4))
    x = torch.randn(4, 5)
    y0 = model(x)

    add_lora(model)
    assert torch.equal(model(x), y0), "B is zero-initialised: adding LoRA must not change outputs"

    with torch.no_grad():
        model[0].parametrizations.weight[0].lora_B.normal_()
    y1 = model(x)
    assert not torch.allclose(y1, y0), "non-zero B must change outputs"

    disable_lora(model)
    torch.testing.assert_close(model(x), y0, rtol=0, atol=0)
    enable_lora(model)
    torch.testing.assert_close(model(x), y1, rtol=0, atol=0)

    # save the LoRA state dict, remove LoRA, add it again, load: same outputs
    lora_sd = get_lora_state_dict(model)
    assert sorted(lora_sd) == [
        "0.parametrizations.weight.0.lora_A",
        "0.parametrizations.weight.0.lora_B",
        "2.parametrizations.weight.0.lora_A",
        "2.parametrizations.weight.0.lora_B",
    ]
    remove_lora(model)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    torch.testing.assert_close(model(x), y0, rtol=0, atol=0)
    add_lora(model)
    model.load_state_dict(lora_sd, strict=False)
    torch.testing.assert_close(model(x), y1, rtol=0, atol=0)

    # merge: same outputs, no parametrization left, plain modules again
    merge_lora(model)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert type(model[0]) is nn.Linear
    torch.testing.assert_close(model(x), y1, rtol=1e-5, atol=1e-6)


def test_disable_lora_as_context_manager_restores_previous_state():
    model = tiny_gpt()
    x = tokens()
    base = model(x)[0]
    add_lora(model)
    randomize_lora(model)
    lora_out = model(x)[0]
    with disable_lora(model) as m:
        assert m is model
        torch.testing.assert_close(model(x)[0], base, rtol=0, atol=0)
    torch.testing.assert_close(model(x)[0], lora_out, rtol=0, atol=0)
    # nested: an inner enable inside a disabled block restores "disabled" on exit
    with disable_lora(model):
        with enable_lora(model):
            torch.testing.assert_close(model(x)[0], lora_out, rtol=0, atol=0)
        torch.testing.assert_close(model(x)[0], base, rtol=0, atol=0)


def test_names_init_and_scaling_follow_minlora():
    layer = nn.Linear(8, 6)
    add_lora(layer, {nn.Linear: {"weight": partial(LoRAParametrization.from_linear, rank=2, lora_alpha=4)}})
    lora = layer.parametrizations.weight[0]
    assert lora.lora_A.shape == (2, 8) and lora.lora_B.shape == (6, 2)
    assert torch.count_nonzero(lora.lora_B) == 0 and torch.count_nonzero(lora.lora_A) > 0
    assert lora.scaling == 4 / 2
    names = [n for n, _ in layer.named_parameters()]
    assert "parametrizations.weight.0.lora_A" in names and "parametrizations.weight.0.lora_B" in names
    assert [name_is_lora(n) for n in names].count(True) == 2
    assert not name_is_lora("lora_A") and not name_is_lora("weight")
    # embedding layout: A (num_embeddings, r), B (r, dim)
    emb = LoRAParametrization.from_embedding(nn.Embedding(10, 4), rank=3)
    assert emb.lora_A.shape == (10, 3) and emb.lora_B.shape == (3, 4)
    assert LoRAParametrization.from_linear(nn.Linear(4, 4), rank=4, lora_alpha=8, use_rslora=True).scaling == 8 / 2
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LoRAParametrization(4, 4, rank=0)
    assert default_lora_config[nn.Linear]["weight"](nn.Linear(3, 2)).rank == 4
    # full state dicts saved from minLoRA models carry an all-ones `lora_dropout_mask` buffer
    state = dict(layer.state_dict())
    state["parametrizations.weight.0.lora_dropout_mask"] = torch.ones(1, 8)
    layer.load_state_dict(state, strict=True)


def test_lora_parameters_recognised_by_type_not_name():
    model = tiny_gpt()
    add_lora(model)
    lora_ids = {id(p) for p in get_lora_params(model)}
    expected = {id(m.lora_A) for m in model.modules() if isinstance(m, LoRAParametrization)}
    expected |= {id(m.lora_B) for m in model.modules() if isinstance(m, LoRAParametrization)}
    assert lora_ids == expected and len(lora_ids) == 2 * 9  # 4 Linear per block x 2 + lm_head
    biases = list(get_bias_params(model))
    assert biases and all(p.dim() == 1 for p in biases)


def test_apply_lora_per_layer_like_minlora():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.apply(apply_lora)
    assert len(lora_sites(model)) == 2
    model.apply(partial(apply_lora, register=False, merge=True))
    assert not lora_sites(model) and type(model[0]) is nn.Linear
    # A LoRAConfig selects by names a layer alone does not have: it used to adapt everything.
    with pytest.raises(TypeError, match=r"a LoRAConfig selects by name .*use add_lora\(model, config\)"):
        model.apply(partial(apply_lora, lora_config=LoRAConfig(target_modules=["0"])))
    assert not lora_sites(model)
    model.apply(partial(apply_lora, lora_config=LoRAConfig(rank=2)))  # no names: its layer types and settings
    assert len(lora_sites(model)) == 2 and lora_sites(model)[0].lora.rank == 2


# --------------------------------------------------------------------------- no stacking, clear errors
def test_add_lora_twice_is_a_logged_no_op(caplog):
    model = tiny_gpt()
    add_lora(model)
    n_params = sum(p.numel() for p in model.parameters())
    with caplog.at_level(logging.WARNING, logger="minlora.model"):
        add_lora(model)
        add_lora(model, LoRAConfig(rank=8))
    assert "already carry a LoRA adapter" in caplog.text
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert all(len(site.plist) == 1 for site in lora_sites(model))


def test_targets_that_match_nothing_raise_clear_errors():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="'q_proj' matches no module"):
        add_lora(model, LoRAConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="include_lm_head=True"):
        add_lora(model, LoRAConfig(target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="include_embeddings=True"):
        add_lora(model, LoRAConfig(target_modules=["wte"]))
    with pytest.raises(ValueError, match="'q_proj' matches no module name"):
        add_lora_by_name(model, ["q_proj"])
    with pytest.raises(ValueError, match="none of them is or contains a layer"):
        add_lora_by_name(model, ["ln_1"])
    with pytest.raises(ValueError, match="no layer of the types"):
        add_lora(nn.Sequential(nn.ReLU()))
    assert not lora_sites(model), "a failed add_lora must not leave adapters behind"


def test_add_lora_by_name_uses_minlora_substring_rule():
    model = tiny_gpt()
    add_lora_by_name(model, ["attn", "c_attn"])  # overlapping names: each layer once
    names = sorted(s.name for s in lora_sites(model))
    assert names == sorted(f"transformer.h.{i}.attn.{n}.weight" for i in range(2) for n in ("c_attn", "c_proj"))


def test_lora_config_selection():
    model = tiny_gpt()
    add_lora(model, LoRAConfig(rank=2, alpha=4, target_modules=["c_attn", "mlp.c_proj"]))
    assert sorted(s.name for s in lora_sites(model)) == sorted(
        [f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)]
        + [f"transformer.h.{i}.mlp.c_proj.weight" for i in range(2)]
    )
    assert all(s.lora.rank == 2 and s.lora.scaling == 2.0 for s in lora_sites(model))

    model = tiny_gpt()
    add_lora(model, LoRAConfig(target_modules="transformer.h.1.*", exclude_modules=["c_fc"]))
    assert sorted(s.name for s in lora_sites(model)) == [
        "transformer.h.1.attn.c_attn.weight",
        "transformer.h.1.attn.c_proj.weight",
        "transformer.h.1.mlp.c_proj.weight",
    ]

    model = tiny_gpt()
    add_lora(model, LoRAConfig())  # defaults: every Linear but the (tied) LM head
    names = {s.name for s in lora_sites(model)}
    assert "lm_head.weight" not in names and len(names) == 8
    model = tiny_gpt()
    add_lora(model, LoRAConfig(include_embeddings=True, include_lm_head=True))
    names = {s.name for s in lora_sites(model)}
    assert {"lm_head.weight", "transformer.wte.weight", "transformer.wpe.weight"} <= names

    cfg = LoRAConfig(rank=4, alpha=8.0, target_modules=("c_fc",), target_types=(nn.Linear, nn.Conv2d))
    assert LoRAConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="is not supported"):
        LoRAConfig(target_types=(nn.LayerNorm,))
    with pytest.raises(ValueError, match="unknown LoRAConfig field"):
        LoRAConfig.from_dict({"rnak": 4})
    assert set(cfg.to_lora_config()) == {nn.Linear, nn.Conv2d}


# --------------------------------------------------------------------------- merge / remove
class _Scale(nn.Module):
    """A user's own parametrization (not LoRA): W -> 2 W."""

    def forward(self, X):
        return 2 * X


def test_merge_and_remove_touch_only_lora_parametrizations():
    x = torch.randn(3, 6)
    # LoRA first, user's parametrization after it: merge folds LoRA in, keeps _Scale
    layer = nn.Linear(6, 5)
    add_lora(layer)
    parametrize.register_parametrization(layer, "weight", _Scale())
    randomize_lora(layer)
    y = layer(x)
    merge_lora(layer)
    assert [type(p) for p in layer.parametrizations.weight] == [_Scale]
    torch.testing.assert_close(layer(x), y, rtol=1e-5, atol=1e-6)

    # user's parametrization first: remove_lora keeps it; merge explains why it cannot fold
    layer = nn.Linear(6, 5)
    w0 = layer.weight.detach().clone()
    parametrize.register_parametrization(layer, "weight", _Scale())
    add_lora(layer)
    randomize_lora(layer)
    with pytest.raises(ValueError, match="follows another parametrization"):
        merge_lora(layer)
    remove_lora(layer)
    assert [type(p) for p in layer.parametrizations.weight] == [_Scale]
    torch.testing.assert_close(layer.weight, 2 * w0)
    # a parametrization on another tensor of the same layer stays too
    layer = nn.Linear(6, 5)
    parametrize.register_parametrization(layer, "bias", _Scale())
    add_lora(layer)
    merge_lora(layer)
    assert parametrize.is_parametrized(layer, "bias") and not parametrize.is_parametrized(layer, "weight")


def test_merge_of_disabled_lora_keeps_the_base_weight_and_merge_never_writes_the_old_tensor():
    layer = nn.Linear(4, 4)
    add_lora(layer)
    randomize_lora(layer)
    original = layer.parametrizations.weight.original
    before = original.detach().clone()
    disable_lora(layer)
    merge_lora(layer)
    assert torch.equal(layer.weight, before)
    assert layer.weight is not original and torch.equal(original, before)


# --------------------------------------------------------------------------- tied weights
@pytest.mark.parametrize("pad", [1, 64])
def test_tied_head_merge_equals_unmerged_and_keeps_the_embedding(pad, caplog):
    model = tiny_gpt(pad_vocab_multiple=pad, vocab_size=100)
    x = tokens(vocab=100)
    wte_before = model.transformer.wte.weight.detach().clone()
    add_lora(model)  # minLoRA's default: every Linear, the tied LM head included
    randomize_lora(model)
    # LoRA on the tied head adapts the output projection only: the embedding still reads W
    assert model.lm_head.parametrizations.weight.original is model.transformer.wte.weight
    unmerged = model(x)[0]
    with caplog.at_level(logging.WARNING, logger="minlora.model"):
        merge_lora(model)
    assert "no longer tied" in caplog.text
    merged = model(x)[0]
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-5)
    assert torch.equal(model.transformer.wte.weight, wte_before), "the embedding must not be rewritten"
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert not lora_sites(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    merge_lora(model)  # merging twice changes nothing
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    torch.testing.assert_close(model(x)[0], merged, rtol=0, atol=0)


def test_remove_lora_restores_the_tie():
    model = tiny_gpt()
    add_lora(model)
    remove_lora(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert type(model.lm_head) is nn.Linear


def test_tie_weights_shares_one_update_between_embedding_and_head():
    # minLoRA's demo config: LoRA on embeddings and linears, then one update tied across them
    config = {
        nn.Embedding: {"weight": partial(LoRAParametrization.from_embedding, rank=4)},
        nn.Linear: {"weight": partial(LoRAParametrization.from_linear, rank=4)},
    }
    model = tiny_gpt()
    x = tokens()
    add_lora(model, config)
    tie_weights(linear=model.lm_head, embedding=model.transformer.wte)
    randomize_lora(model)
    torch.testing.assert_close(model.transformer.wte.weight, model.lm_head.weight, rtol=0, atol=0)
    emb_lora = model.transformer.wte.parametrizations.weight[0]
    assert emb_lora.lora_A is model.lm_head.parametrizations.weight[0].lora_B
    y = model(x)[0]
    merge_lora(model)
    assert model.lm_head.weight is model.transformer.wte.weight, "a tied update merges into one shared tensor"
    torch.testing.assert_close(model(x)[0], y, rtol=0, atol=1e-5)

    model = tiny_gpt()
    add_lora(model, config)
    tie_weights(model.lm_head, model.transformer.wte)
    untie_weights(model.lm_head, model.transformer.wte)
    randomize_lora(model)
    assert not torch.equal(model.transformer.wte.weight, model.lm_head.weight)
    with pytest.raises(ValueError, match="carries 0 LoRAs"):
        tie_weights(nn.Linear(4, 10), model.transformer.wte)


# --------------------------------------------------------------------------- several adapters
def test_load_multiple_lora_and_select_equal_loading_each_alone():
    model = tiny_gpt()
    x = tokens()
    add_lora(model)
    state_dicts, outputs = [], []
    for _ in range(3):
        randomize_lora(model)
        state_dicts.append({k: v.clone() for k, v in get_lora_state_dict(model).items()})
        outputs.append(model(x)[0])
    load_multiple_lora(model, state_dicts)
    for i in (0, 2, 1):
        select_lora(model, i)
        torch.testing.assert_close(model(x)[0], outputs[i], rtol=0, atol=0)
    # each one loaded alone into a fresh LoRA model gives the same
    for i, sd in enumerate(state_dicts):
        fresh = copy.deepcopy(model)
        remove_lora(fresh)
        add_lora(fresh)
        fresh.load_state_dict(sd, strict=False)
        torch.testing.assert_close(fresh(x)[0], outputs[i], rtol=0, atol=0)
    with pytest.raises(IndexError, match="out of range"):
        select_lora(model, 3)
    with pytest.raises(ValueError, match="not LoRA factors"):
        load_multiple_lora(model, [{"lm_head.weight": torch.zeros(1)}])
    # A bad dict after good ones (a wrong key, a wrong shape) or none at all leave the adapters as they were.
    wrong_shape = {k: torch.zeros(1) for k in state_dicts[0]}
    for bad in ([state_dicts[2], {"lm_head.weight": torch.zeros(1)}], [state_dicts[2], wrong_shape], []):
        with pytest.raises(ValueError, match="not LoRA factors|no state dicts"):
            load_multiple_lora(model, bad)
        select_lora(model, 1)
        torch.testing.assert_close(model(x)[0], outputs[1], rtol=0, atol=0)
    assert "stored_lora_A_0" not in model.state_dict(), "stored adapters stay out of state_dict"


# --------------------------------------------------------------------------- precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lora_params_fp32_on_low_precision_base_and_merge_in_fp32(dtype):
    model = tiny_gpt().to(dtype)
    x = tokens()
    add_lora(model)
    randomize_lora(model, std=0.3)
    assert all(p.dtype == torch.float32 for p in get_lora_params(model))
    assert model.lm_head.parametrizations.weight.original.dtype == dtype
    logits = model(x)[0]
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    site = next(s for s in lora_sites(model) if s.name == "transformer.h.0.mlp.c_fc.weight")
    lora, w = site.lora, site.original.detach().clone()
    expected = (w.float() + (lora.lora_B @ lora.lora_A) * lora.scaling).to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an enclosing autocast must not lower the merge
        merge_lora(model)
    merged = model.transformer.h[0].mlp.c_fc.weight
    assert merged.dtype == dtype and torch.equal(merged, expected)


# --------------------------------------------------------------------------- pickle / deepcopy / repr
def test_lora_models_pickle_deepcopy_and_repr():
    model = tiny_gpt()
    x = tokens()
    add_lora(model, LoRAConfig(include_lm_head=True, include_embeddings=True, dropout=0.1))
    randomize_lora(model)
    y = model(x)[0]
    assert "LoRAParametrization" in repr(model)  # the parametrized modules print

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x)[0], y, rtol=0, atol=0)
    assert loaded.lm_head.parametrizations.weight.original is loaded.transformer.wte.parametrizations.weight.original

    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(x)[0], y, rtol=0, atol=0)
    # torch's own deepcopy shares the generated class between copies, so merging the copy would
    # delete the original's `weight` property; each LoRA module has its own class here.
    merge_lora(clone)
    torch.testing.assert_close(clone(x)[0], y, rtol=0, atol=1e-5)
    torch.testing.assert_close(model(x)[0], y, rtol=0, atol=0)
    assert model.transformer.h[0].attn.c_attn.weight.shape == (96, 32)


# --------------------------------------------------------------------------- fast path
def _weight_path_calls(model: nn.Module) -> list[int]:
    calls = [0]
    for m in model.modules():
        if isinstance(m, LoRAParametrization):
            m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_fast_path_matches_the_plain_parametrization_outputs_and_gradients():
    torch.manual_seed(0)
    model = tiny_gpt()
    add_lora(model, LoRAConfig(include_embeddings=True, include_lm_head=True))
    mark_only_lora_as_trainable(model)
    randomize_lora(model)
    x, y = tokens(), tokens()
    results = {}
    for fast in (True, False):
        set_fast_path(model, fast)
        calls = _weight_path_calls(model)
        model.zero_grad(set_to_none=True)
        logits, loss = model(x)[0], model(x, y)[1]  # with targets the logits are None
        loss.backward()
        results[fast] = (logits.detach(), [p.grad.clone() for p in get_lora_params(model)], calls[0])
    (l_fast, g_fast, calls_fast), (l_plain, g_plain, calls_plain) = results[True], results[False]
    assert calls_fast == 0, "the fast path must not build W + BA"
    assert calls_plain > 0
    torch.testing.assert_close(l_fast, l_plain, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_fast, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # the frozen weight gets no gradient at all on the fast path
    assert model.transformer.h[0].attn.c_attn.parametrizations.weight.original.grad is None


def test_fast_path_applies_dropout_to_the_input():
    layer = nn.Linear(16, 8)
    add_lora(layer, {nn.Linear: {"weight": partial(LoRAParametrization.from_linear, rank=4, lora_dropout_p=0.5)}})
    randomize_lora(layer)
    lora = layer.parametrizations.weight[0]
    x = torch.randn(5, 16)
    layer.train()
    torch.manual_seed(1)
    out = layer(x)
    torch.manual_seed(1)
    dropped = F.dropout(x, 0.5, training=True)
    base = F.linear(x, layer.parametrizations.weight.original, layer.bias)
    expected = base + (dropped @ lora.lora_A.T * lora.scaling) @ lora.lora_B.T
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    layer.eval()
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)


def test_cached_weight_in_eval():
    model = tiny_gpt()
    add_lora(model)
    randomize_lora(model)
    x = tokens()
    y = model(x)[0]
    calls = _weight_path_calls(model)
    with parametrize.cached():
        torch.testing.assert_close(model(x)[0], y, rtol=1e-5, atol=1e-6)
        model(x)
    assert calls[0] == len(lora_sites(model)), "inside cached() each merged weight is built once"


def test_conv2d_lora():
    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1))
    x = torch.randn(2, 3, 8, 8)
    y0 = conv(x)
    add_lora(conv, {nn.Conv2d: {"weight": partial(LoRAParametrization.from_conv2d, rank=2)}})
    torch.testing.assert_close(conv(x), y0, rtol=0, atol=0)
    randomize_lora(conv)
    y1 = conv(x)
    assert not torch.allclose(y1, y0)
    merge_lora(conv)
    torch.testing.assert_close(conv(x), y1, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- training helpers
@pytest.mark.parametrize("bias", ["none", "all", "lora_only"])
def test_mark_only_lora_as_trainable_and_frozen_weights_stay_bit_identical(bias):
    model = tiny_gpt()
    model.train()
    add_lora(model, LoRAConfig(rank=4, target_modules=["c_attn", "c_fc"]))
    mark_only_lora_as_trainable(model, bias=bias)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora_names = {n for n in trainable if n.endswith(("lora_A", "lora_B"))}
    assert len(lora_names) == 2 * 4
    biases = trainable - lora_names
    if bias == "none":
        assert not biases
    elif bias == "all":
        assert biases == {n for n, _ in model.named_parameters() if n.endswith("bias")}
    else:
        assert biases == {f"transformer.h.{i}.{m}.bias" for i in range(2) for m in ("attn.c_attn", "mlp.c_fc")}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(tokens(), tokens())[1].backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{n} changed although frozen"
    with pytest.raises(ValueError, match="bias must be"):
        mark_only_lora_as_trainable(model, bias="some")


def test_count_parameters():
    model = tiny_gpt()
    total = model.num_params()
    add_lora(model, LoRAConfig(rank=2, target_modules=["c_attn"]))
    mark_only_lora_as_trainable(model)
    count = count_parameters(model)
    lora = 2 * (2 * 32 + 96 * 2)  # two layers of A (2, 32) and B (96, 2)
    assert (count.trainable, count.total) == (lora, total + lora)
    assert f"trainable params: {lora:,} || all params: {total + lora:,}" in str(count)
    assert count.fraction == pytest.approx(lora / (total + lora))


def test_top_level_exports_cover_minlora():
    import minlora

    assert minlora.__all__ and all(hasattr(minlora, name) for name in minlora.__all__)


@pytest.mark.slow
def test_gpt2_124m_shape_merge_parity(all_threads):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt2", pad_vocab_multiple=64)).eval()
    x = torch.randint(0, 50257, (1, 32))
    wte = model.transformer.wte.weight.detach().clone()
    add_lora(model)  # every Linear, tied head included
    randomize_lora(model, std=0.02)
    unmerged = model(x)[0]
    merge_lora(model)
    torch.testing.assert_close(model(x)[0], unmerged, rtol=0, atol=1e-5)
    assert torch.equal(model.transformer.wte.weight, wte)


def test_models_with_weight_norm_and_embeddings_with_frequency_scaling():
    """A new-style weight_norm layer anywhere in the model made add_lora raise AttributeError (its
    parametrization has original0/original1); an Embedding with scale_grad_by_freq got other
    gradients on the fast path than on the weight path (the flag was dropped).
    """
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    net = nn.Sequential(nn.Linear(8, 8), weight_norm(nn.Linear(8, 4)))
    add_lora(net, LoRAConfig(rank=2, exclude_modules=("1",)))
    assert [s.name for s in lora_sites(net)] == ["0.weight"]
    with pytest.raises(TypeError, match="no floating-point weight parameter"):
        add_lora(nn.Sequential(weight_norm(nn.Linear(8, 4))), LoRAConfig(rank=2))

    # (sparse=True: the weight path failed in backward, "reshape is not implemented for sparse tensors")
    for kwargs in (
        dict(scale_grad_by_freq=True),
        dict(padding_idx=1),
        dict(sparse=True),
        dict(sparse=True, padding_idx=1),
    ):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 6, **kwargs)
        add_lora(emb, LoRAConfig(rank=2, include_embeddings=True))
        with torch.no_grad():
            emb.parametrizations.weight[0].lora_B.normal_()
        idx = torch.tensor([[1, 1, 1, 3], [3, 5, 1, 0]])
        grads = []
        for cached in (False, True):  # the forward as called, then the weight path
            emb.zero_grad()
            with parametrize.cached() if cached else contextlib.nullcontext():
                (emb(idx) ** 2).sum().backward()
            grads.append([p.grad.clone() for p in get_lora_params(emb)])
        for called, weight in zip(*grads):
            torch.testing.assert_close(called, weight)

"""minLoRA's demo and advanced-usage notebooks, as workflows: the public calls they make, in their order,
checked with assertions of our own. minlora is a drop-in for minLoRA, so code written against minLoRA's
examples must run here unchanged; that includes minLoRA's default rank 4 on layers narrower than 4,
which minlora accepts with a warning (as minLoRA and PEFT accept it).
"""

from __future__ import annotations

import copy
import logging
from functools import partial

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from minlora import (
    LoRAParametrization,
    add_lora,
    apply_to_lora,
    disable_lora,
    enable_lora,
    get_lora_params,
    get_lora_state_dict,
    load_multiple_lora,
    merge_lora,
    name_is_lora,
    remove_lora,
    select_lora,
    tie_weights,
    untie_weights,
)

OVERSIZED = r"rank above min\(in_features, out_features\)"


@pytest.fixture(autouse=True)
def no_grad():
    """The notebooks run with gradients off; restored for the other tests."""
    with torch.no_grad():
        yield


def lora_of(layer: nn.Module) -> LoRAParametrization:
    return layer.parametrizations.weight[0]


def is_plain(model: nn.Module) -> bool:
    return not any(parametrize.is_parametrized(m) for m in model.modules())


# --------------------------------------------------------------------------- the demo: one adapter's life
def test_demo_workflow_add_switch_save_reload_merge():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    inputs = torch.randn(2, 5)
    base_out = net(inputs)

    # the default config (rank 4) on a layer with 3 outputs: accepted, one warning naming that layer only
    with pytest.warns(UserWarning, match=OVERSIZED) as record:
        add_lora(net)
    assert len(record) == 1 and "1.weight" in str(record[0].message) and "0.weight" not in str(record[0].message)
    assert [lora_of(layer).rank for layer in net] == [4, 4]
    torch.testing.assert_close(net(inputs), base_out, rtol=0, atol=0)

    net.apply(apply_to_lora(lambda lora: nn.init.ones_(lora.lora_B)))
    lora_out = net(inputs)
    assert not torch.allclose(lora_out, base_out)

    disable_lora(net)
    torch.testing.assert_close(net(inputs), base_out, rtol=0, atol=0)
    enable_lora(net)
    torch.testing.assert_close(net(inputs), lora_out, rtol=0, atol=0)

    saved = get_lora_state_dict(net)
    assert sorted(saved) == [f"{i}.parametrizations.weight.0.lora_{factor}" for i in (0, 1) for factor in ("A", "B")]
    assert saved["1.parametrizations.weight.0.lora_B"].shape == (3, 4)

    remove_lora(net)
    assert is_plain(net)
    torch.testing.assert_close(net(inputs), base_out, rtol=0, atol=0)

    with pytest.warns(UserWarning, match=OVERSIZED):
        add_lora(net)
    # fresh factors: B is zero again until the saved ones are loaded
    torch.testing.assert_close(net(inputs), base_out, rtol=0, atol=0)
    result = net.load_state_dict(saved, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) == {
        f"{i}.{name}" for i in (0, 1) for name in ("bias", "parametrizations.weight.original")
    }
    torch.testing.assert_close(net(inputs), lora_out, rtol=0, atol=0)

    merge_lora(net)
    assert is_plain(net) and all(type(layer) is nn.Linear for layer in net)
    assert not list(get_lora_params(net))
    torch.testing.assert_close(net(inputs), lora_out, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- the demo: training and several adapters
def test_demo_training_export_and_switching_between_adapters(caplog):
    torch.manual_seed(1)
    layer = nn.Linear(5, 3)
    inputs = torch.randn(2, 5)
    with pytest.warns(UserWarning, match=OVERSIZED):
        add_lora(layer)

    params = list(get_lora_params(layer))
    assert [tuple(p.shape) for p in params] == [(4, 5), (3, 4)]
    optimizer = torch.optim.AdamW([{"params": params}], lr=1e-3)
    assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], params))

    # "training": every factor gets new values
    layer.apply(apply_to_lora(lambda lora: nn.init.normal_(lora.lora_A)))
    layer.apply(apply_to_lora(lambda lora: nn.init.normal_(lora.lora_B)))
    trained_out = layer(inputs)

    exported = {k: v for k, v in layer.state_dict().items() if name_is_lora(k)}
    assert sorted(exported) == ["parametrizations.weight.0.lora_A", "parametrizations.weight.0.lora_B"]
    assert exported.keys() == get_lora_state_dict(layer).keys()

    # adding LoRA where one sits changes nothing (logged), so loading the export and merging is exact
    with caplog.at_level(logging.WARNING, logger="minlora"):
        add_lora(layer)
    assert "already carry a LoRA adapter" in caplog.text
    layer.load_state_dict(exported, strict=False)
    merge_lora(layer)
    assert type(layer) is nn.Linear
    torch.testing.assert_close(layer(inputs), trained_out, rtol=1e-6, atol=1e-6)

    # three adapters on the merged layer, kept side by side
    remove_lora(layer)
    with pytest.warns(UserWarning, match=OVERSIZED):
        add_lora(layer)
    adapters = [
        exported,
        {k: torch.ones_like(v) for k, v in exported.items()},
        {k: torch.zeros_like(v) for k, v in exported.items()},
    ]
    load_multiple_lora(layer, adapters)
    switched = [select_lora(layer, i)(inputs) for i in range(len(adapters))]
    assert select_lora(layer, 1) is layer

    # each equals loading that adapter alone and merging it into the same base
    merged_base = {k: v.clone() for k, v in layer.state_dict().items() if not name_is_lora(k)}
    base_weights = {k.replace("parametrizations.weight.original", "weight"): v for k, v in merged_base.items()}
    for adapter, expected in zip(adapters, switched):
        remove_lora(layer)
        layer.load_state_dict(base_weights, strict=False)
        with pytest.warns(UserWarning, match=OVERSIZED):
            add_lora(layer)
        layer.load_state_dict(adapter, strict=False)
        merge_lora(layer)
        torch.testing.assert_close(layer(inputs), expected, rtol=1e-6, atol=1e-6)
    # the all-zero adapter is the base layer itself
    torch.testing.assert_close(switched[2], nn.functional.linear(inputs, base_weights["weight"], base_weights["bias"]))


# --------------------------------------------------------------------------- advanced usage: configs and tied layers
def lora_config_rank_4():
    return {
        nn.Embedding: {"weight": partial(LoRAParametrization.from_embedding, rank=4)},
        nn.Linear: {"weight": partial(LoRAParametrization.from_linear, rank=4)},
    }


def test_advanced_dict_config_covers_embeddings_and_linears():
    torch.manual_seed(2)
    net = nn.Sequential(nn.Embedding(3, 2), nn.Linear(2, 3))
    with pytest.warns(UserWarning, match=OVERSIZED) as record:
        add_lora(net, lora_config=lora_config_rank_4())
    assert len(record) == 1, "one warning for the whole call"
    assert "0.weight (weight shape (3, 2)) has rank 4, useful maximum 2" in str(record[0].message)
    assert "1.weight (weight shape (3, 2)) has rank 4, useful maximum 2" in str(record[0].message)
    embedding_lora, linear_lora = lora_of(net[0]), lora_of(net[1])
    assert embedding_lora.fan_in_fan_out and not linear_lora.fan_in_fan_out
    assert (embedding_lora.lora_A.shape, embedding_lora.lora_B.shape) == ((3, 4), (4, 2))
    assert (linear_lora.lora_A.shape, linear_lora.lora_B.shape) == ((4, 2), (3, 4))
    tokens = torch.tensor([[0, 2, 1]])
    assert net(tokens).shape == (1, 3, 3)


def test_advanced_tying_by_hand_shares_one_update():
    torch.manual_seed(3)
    head = nn.Linear(2, 3)
    embedding = nn.Embedding(3, 2)
    embedding.weight = head.weight
    assert embedding.weight is head.weight

    with pytest.warns(UserWarning, match=OVERSIZED):
        add_lora(head)
    head.apply(apply_to_lora(lambda lora: nn.init.ones_(lora.lora_B)))
    # the head now computes its weight; the embedding still holds the stored one
    assert not torch.allclose(embedding.weight, head.weight)
    assert type(head.weight) is torch.Tensor and isinstance(embedding.weight, nn.Parameter)

    with pytest.warns(UserWarning, match=OVERSIZED):
        add_lora(embedding, lora_config=lora_config_rank_4())
    # transposed layouts: the embedding's A is the head's B and the other way round
    lora_of(embedding).lora_A = lora_of(head).lora_B
    lora_of(embedding).lora_B = lora_of(head).lora_A
    head.apply(apply_to_lora(lambda lora: nn.init.uniform_(lora.lora_B)))
    torch.testing.assert_close(head.weight, embedding.weight)
    assert lora_of(embedding).lora_A.shape == lora_of(head).lora_B.shape == (3, 4)

    # a change made through either layer shows in both
    head.apply(apply_to_lora(lambda lora: nn.init.uniform_(lora.lora_A)))
    torch.testing.assert_close(head.weight, embedding.weight)
    embedding.apply(apply_to_lora(lambda lora: nn.init.uniform_(lora.lora_B)))
    torch.testing.assert_close(head.weight, embedding.weight)


def test_advanced_tie_weights_embedding_first_survives_merge_and_untie_separates():
    torch.manual_seed(4)
    net = nn.Sequential(nn.Embedding(3, 2), nn.Linear(2, 3))
    with pytest.warns(UserWarning, match=OVERSIZED):
        add_lora(net, lora_config=lora_config_rank_4())
    # minLoRA's example passes the embedding first
    tie_weights(net[0], net[1])
    assert lora_of(net[0]).lora_A is lora_of(net[1]).lora_B
    # called on the layer itself, as minLoRA's example does, the wrapper skips it (not a LoRA): a no-op
    before = net[1].weight.clone()
    apply_to_lora(lambda lora: nn.init.uniform_(lora.lora_B))(net[1])
    torch.testing.assert_close(net[1].weight, before, rtol=0, atol=0)
    # through Module.apply it reaches the LoRA, and the tied embedding follows
    net[1].apply(apply_to_lora(lambda lora: nn.init.uniform_(lora.lora_B)))
    assert not torch.allclose(net[1].weight, before)
    torch.testing.assert_close(net[0].weight, net[1].weight)

    # the same tied model, to untie below
    twin = copy.deepcopy(net)

    merge_lora(net)
    assert is_plain(net)
    torch.testing.assert_close(net[0].weight, net[1].weight)
    assert net[0].weight is net[1].weight, "a shared weight and update stay one tensor after merging"

    # untied, the embedding keeps the shared values but no longer follows the head
    untie_weights(twin[1], twin[0])
    torch.testing.assert_close(twin[0].weight, twin[1].weight)
    twin[1].apply(apply_to_lora(lambda lora: nn.init.zeros_(lora.lora_B)))
    assert not torch.allclose(twin[0].weight, twin[1].weight)

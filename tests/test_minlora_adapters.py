"""minlora adapters on disk: save_adapter / load_adapter (one safetensors file, its config in the metadata)."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file

from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from minlora.adapters import ADAPTER_FILE_NAME, load_adapter, save_adapter
from minlora.config import LoRAConfig
from minlora.model import LoRAParametrization, add_lora, lora_sites, remove_lora
from minlora.utils import get_lora_params, get_lora_state_dict, tie_weights


def tiny_gpt(**overrides) -> GPT:
    cfg = dict(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg)).eval()


def adapter_config(path) -> dict:
    with safe_open(str(path / ADAPTER_FILE_NAME), framework="pt") as f:
        return json.loads(f.metadata()["minlora"])


def randomize_lora(model: nn.Module) -> None:
    with torch.no_grad():
        for p in get_lora_params(model):
            p.normal_(0.0, 0.1)


@pytest.fixture
def trained(tmp_path):
    """A LoRA GPT with random factors, its base weights, its logits and its saved adapter."""
    torch.manual_seed(0)
    model = tiny_gpt()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    add_lora(model, LoRAConfig(rank=4, alpha=8, include_lm_head=True, use_rslora=True))
    randomize_lora(model)
    x = torch.randint(0, 128, (2, 16))
    path = save_adapter(model, tmp_path / "adapter")
    return model, base_state, x, model(x)[0], path


def fresh_base(base_state, **overrides) -> GPT:
    model = tiny_gpt(**overrides)
    model.load_state_dict(base_state)
    return model


def test_adapter_files_hold_only_lora_and_the_config(trained):
    model, _, _, _, path = trained
    assert sorted(p.name for p in path.iterdir()) == [ADAPTER_FILE_NAME]  # one file
    tensors = load_file(str(path / ADAPTER_FILE_NAME))
    assert sorted(tensors) == sorted(f"{s.name}.{p}" for s in lora_sites(model) for p in ("lora_A", "lora_B"))
    assert all(t.dtype == torch.float32 for t in tensors.values())
    config = adapter_config(path)
    target = config["targets"]["transformer.h.0.attn.c_attn.weight"]
    assert (target["rank"], target["lora_alpha"], target["use_rslora"], target["layer"]) == (4, 8, True, "Linear")


def test_a_file_path_works_as_well_as_a_directory(trained, tmp_path):
    model, base_state, x, expected, _ = trained
    file = save_adapter(model, tmp_path / "my_adapter.safetensors")
    assert file.is_file()
    fresh = fresh_base(base_state)
    load_adapter(fresh, file)
    torch.testing.assert_close(fresh(x)[0], expected, rtol=0, atol=0)


def test_load_into_a_model_without_lora_recreates_it(trained):
    _, base_state, x, expected, path = trained
    model = fresh_base(base_state)
    load_adapter(model, path)
    torch.testing.assert_close(model(x)[0], expected, rtol=0, atol=0)
    lora = model.transformer.h[1].mlp.c_fc.parametrizations.weight[0]
    assert lora.rank == 4 and lora.scaling == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(rank)


def test_load_into_a_model_with_lora_of_the_same_rank(trained):
    _, base_state, x, expected, path = trained
    model = fresh_base(base_state)
    add_lora(model, LoRAConfig(rank=4, alpha=1, include_lm_head=True))  # other alpha: the adapter's wins
    load_adapter(model, path)
    torch.testing.assert_close(model(x)[0], expected, rtol=0, atol=0)


def test_rank_mismatch_is_a_clear_error_and_changes_nothing(trained, tmp_path):
    _, base_state, x, _, path = trained
    model = fresh_base(base_state)
    add_lora(model, LoRAConfig(rank=8, include_lm_head=True))
    before = {k: v.clone() for k, v in get_lora_state_dict(model).items()}
    with pytest.raises(ValueError, match="adapter has LoRA of rank 4 for .* the model there has LoRA of rank 8"):
        load_adapter(model, path)
    assert all(torch.equal(v, get_lora_state_dict(model)[k]) for k, v in before.items())
    # and the other way round: a rank-8 adapter into a rank-4 model
    donor = tiny_gpt()
    add_lora(donor, LoRAConfig(rank=8))
    save_adapter(donor, tmp_path / "r8")
    model = tiny_gpt()
    add_lora(model, LoRAConfig(rank=4))
    with pytest.raises(ValueError, match="has LoRA of rank 8 .* has LoRA of rank 4; call minlora.remove_lora"):
        load_adapter(model, tmp_path / "r8")
    # DoRA at the same rank: the difference is named (it read "rank 4 ... but rank 4")
    donor = tiny_gpt()
    add_lora(donor, LoRAConfig(rank=4, use_dora=True))
    save_adapter(donor, tmp_path / "dora")
    with pytest.raises(ValueError, match="adapter has DoRA of rank 4 for .* the model there has LoRA of rank 4"):
        load_adapter(model, tmp_path / "dora")


def test_target_and_shape_mismatches_are_clear_errors(trained, tmp_path):
    _, base_state, _, _, path = trained
    with pytest.raises(ValueError, match="has no such module"):
        load_adapter(tiny_gpt(n_layer=1), path)
    with pytest.raises(ValueError, match="made for a model of another shape"):
        load_adapter(tiny_gpt(n_embd=64), path)
    # LoRA in the model that the adapter does not cover: refused unless strict=False (the refusal
    # and that it changes nothing: tests/test_minlora_atomicity.py)
    model = fresh_base(base_state)
    add_lora(model, LoRAConfig(include_embeddings=True, include_lm_head=True, rank=4))
    load_adapter(model, path, strict=False)
    with pytest.raises(FileNotFoundError, match="must contain"):
        load_adapter(model, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="the model has no LoRA"):
        save_adapter(tiny_gpt(), tmp_path / "empty")


def test_tied_factors_round_trip_and_bf16_storage(tmp_path):
    config = {
        nn.Embedding: {"weight": partial(LoRAParametrization.from_embedding, rank=2)},
        nn.Linear: {"weight": partial(LoRAParametrization.from_linear, rank=2)},
    }
    model = tiny_gpt()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    add_lora(model, config)
    tie_weights(model.lm_head, model.transformer.wte)
    randomize_lora(model)
    x = torch.randint(0, 128, (2, 16))
    expected = model(x)[0]
    save_adapter(model, tmp_path / "tied")
    save_adapter(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert adapter_config(tmp_path / "tied")["tied"] == [
        {"linear": "lm_head.weight", "embedding": "transformer.wte.weight"}
    ]
    fresh = tiny_gpt()
    fresh.load_state_dict(base_state)
    load_adapter(fresh, tmp_path / "tied")
    assert fresh.transformer.wte.parametrizations.weight[0].lora_A is fresh.lm_head.parametrizations.weight[0].lora_B
    torch.testing.assert_close(fresh(x)[0], expected, rtol=0, atol=0)
    remove_lora(fresh)
    load_adapter(fresh, tmp_path / "bf16")
    assert all(p.dtype == torch.float32 for p in get_lora_params(fresh))
    torch.testing.assert_close(fresh(x)[0], expected, rtol=0, atol=2e-2)

"""DoRA (LoRAConfig(use_dora=True)): the math, the fast path, merge / remove, tied weights, adapter
files, and parity with PEFT's DoRA both ways on transformers' GPT-2.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import minlora
from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from minlora import LoRAConfig, LoRAParametrization

VOCAB = 100  # with pad_vocab_multiple=64 our model has 128 vocabulary rows, transformers' 100


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16)).eval()


def perturb(model: nn.Module, seed: int = 1) -> None:
    """B starts at zero and m at ||W||_c: random factors and magnitudes, so DoRA matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:  # ours: ...lora_magnitude_vector, PEFT's: ....default.weight
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


# --------------------------------------------------------------------------- the math
@pytest.mark.parametrize("layer", [nn.Linear(12, 7), nn.Embedding(11, 6), nn.Conv2d(3, 5, 3)])
def test_dora_weight_is_magnitude_times_the_normalised_adapted_weight(layer):
    W = layer.weight.detach().clone()
    config = LoRAConfig(rank=2, alpha=4, use_dora=True, include_embeddings=True, target_types=("Linear", "Conv2d"))
    minlora.add_lora(layer, config)
    lora = layer.parametrizations.weight[0]
    torch.testing.assert_close(layer.weight, W, rtol=1e-6, atol=1e-6)  # m starts at the norms: no change
    embedding = isinstance(layer, nn.Embedding)
    W2 = W if embedding else W.reshape(W.shape[0], -1)
    torch.testing.assert_close(lora.lora_magnitude_vector, W2.norm(dim=0 if embedding else 1))
    perturb(layer)
    delta = (lora.lora_A @ lora.lora_B if embedding else lora.lora_B @ lora.lora_A) * lora.scaling
    V = W2 + delta
    m = lora.lora_magnitude_vector
    expected = V * m / V.norm(dim=0) if embedding else V * (m / V.norm(dim=1))[:, None]
    torch.testing.assert_close(layer.weight.detach().reshape(W2.shape), expected, rtol=1e-5, atol=1e-6)
    assert lora.param_names == ("lora_A", "lora_B", "lora_magnitude_vector")
    assert len(list(minlora.get_lora_params(layer))) == 3


def test_fast_path_matches_the_weight_path_and_the_norm_gets_no_gradient():
    torch.manual_seed(0)
    model = tiny_gpt()
    minlora.add_lora(model, LoRAConfig(rank=2, use_dora=True, include_embeddings=True, include_lm_head=True))
    minlora.mark_only_lora_as_trainable(model)
    perturb(model)
    x, y = tokens(), tokens()
    results = {}
    for fast in (True, False):
        minlora.set_fast_path(model, fast)
        model.zero_grad(set_to_none=True)
        logits, loss = model(x)[0], model(x, y)[1]  # with targets the logits are None
        loss.backward()
        results[fast] = logits.detach(), [p.grad.clone() for p in minlora.get_lora_params(model)]
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # the gradient of a DoRA linear layer treats ||W + s B A||_c as a constant, as PEFT does
    layer = nn.Linear(5, 4)
    minlora.add_lora(layer, LoRAConfig(rank=2, use_dora=True))
    perturb(layer)
    lora, x = layer.parametrizations.weight[0], torch.randn(3, 5)
    layer(x).square().sum().backward()
    V = layer.parametrizations.weight.original + lora.lora_B @ lora.lora_A * lora.scaling
    expected = F.linear(x, V * (lora.lora_magnitude_vector / V.norm(dim=1).detach())[:, None], layer.bias)
    grads = torch.autograd.grad(expected.square().sum(), [lora.lora_A, lora.lora_B, lora.lora_magnitude_vector])
    for param, g in zip((lora.lora_A, lora.lora_B, lora.lora_magnitude_vector), grads):
        torch.testing.assert_close(param.grad, g, rtol=1e-5, atol=1e-6)


def test_training_with_dropout_follows_pefts_formula():
    """PEFT's DoRA forward with dropout: base(x) + (m/||V|| - 1) * x_d W^T + m/||V|| * s * B A x_d."""
    layer = nn.Linear(6, 5)
    minlora.add_lora(layer, LoRAConfig(rank=2, use_dora=True, dropout=0.5))
    perturb(layer)
    lora, x = layer.parametrizations.weight[0], torch.randn(4, 6)
    layer.train()
    torch.manual_seed(3)
    out = layer(x)
    torch.manual_seed(3)
    dropped = F.dropout(x, 0.5, training=True)
    W = layer.parametrizations.weight.original
    scale = lora.lora_magnitude_vector / (W + lora.lora_B @ lora.lora_A * lora.scaling).norm(dim=1)
    expected = (
        F.linear(x, W, layer.bias)
        + (scale - 1) * F.linear(dropped, W)
        + scale * (dropped @ lora.lora_A.T @ lora.lora_B.T) * lora.scaling
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_zero_output_channel_stays_zero_instead_of_nan():
    layer = nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight[1] = 0  # e.g. a padded vocabulary row
    minlora.add_lora(layer, LoRAConfig(rank=2, use_dora=True))
    out = layer(torch.randn(2, 4))
    assert torch.isfinite(out).all() and torch.equal(out[:, 1], layer.bias[1].expand(2))


# --------------------------------------------------------------------------- merge, remove, ties
def test_merge_and_remove_are_exact_and_the_tied_head_keeps_its_embedding():
    model = tiny_gpt()
    wte = model.transformer.wte.weight.detach().clone()
    minlora.add_lora(model, LoRAConfig(rank=2, use_dora=True, include_lm_head=True))
    perturb(model)
    x = tokens()
    adapted = model(x)[0]
    merged = copy.deepcopy(model)
    minlora.merge_lora(merged)
    torch.testing.assert_close(merged(x)[0], adapted, rtol=0, atol=1e-5)
    assert torch.equal(merged.transformer.wte.weight, wte), "the tied embedding keeps W"
    minlora.remove_lora(model)
    assert model.lm_head.weight is model.transformer.wte.weight and torch.equal(model.lm_head.weight, wte)
    torch.testing.assert_close(model(x)[0], tiny_gpt()(x)[0], rtol=0, atol=0)  # the same seed: the same base


def test_tie_weights_refuses_dora_and_several_adapters_keep_their_magnitudes():
    model = tiny_gpt()
    config = {
        nn.Embedding: {"weight": lambda m: LoRAParametrization.from_embedding(m, rank=2, use_dora=True)},
        nn.Linear: {"weight": lambda m: LoRAParametrization.from_linear(m, rank=2, use_dora=True)},
    }
    minlora.add_lora(model, config)
    with pytest.raises(ValueError, match="one DoRA update cannot be shared"):
        minlora.tie_weights(model.lm_head, model.transformer.wte)
    x, states, outputs = tokens(), [], []
    for seed in (1, 2):
        perturb(model, seed)
        states.append({k: v.clone() for k, v in minlora.get_lora_state_dict(model).items()})
        outputs.append(model(x)[0])
    assert any(k.endswith("lora_magnitude_vector") for k in states[0])
    minlora.load_multiple_lora(model, states)
    for i in (0, 1):
        minlora.select_lora(model, i)
        torch.testing.assert_close(model(x)[0], outputs[i], rtol=0, atol=0)


# --------------------------------------------------------------------------- adapter files
def test_native_round_trip_and_a_plain_lora_model_is_told_why_it_does_not_fit(tmp_path):
    source = tiny_gpt()
    minlora.add_lora(source, LoRAConfig(rank=2, use_dora=True, include_embeddings=True))
    perturb(source)
    path = minlora.save_adapter(source, tmp_path / "dora")
    fresh = tiny_gpt()
    minlora.load_adapter(fresh, path)
    assert all(s.lora.use_dora for s in minlora.lora_sites(fresh))
    torch.testing.assert_close(fresh(tokens())[0], source(tokens())[0], rtol=0, atol=0)
    plain = tiny_gpt()
    minlora.add_lora(plain, LoRAConfig(rank=2, include_embeddings=True))
    with pytest.raises(ValueError, match="DoRA of rank 2 .* has LoRA of rank 2; call minlora.remove_lora"):
        minlora.load_adapter(plain, path)


# --------------------------------------------------------------------------- PEFT parity
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A randomly initialised transformers GPT-2 on disk (nothing is downloaded)."""
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "base"
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def hf_model(path):
    return transformers.GPT2LMHeadModel.from_pretrained(path).eval()


@pytest.mark.parametrize(
    "pad, targets", [(1, ["c_attn", "c_fc"]), (64, ["c_attn", "c_proj", "c_fc", "wte", "lm_head"])]
)
def test_peft_dora_adapter_loads_here_with_the_same_logits(hf_dir, tmp_path, pad, targets):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about Conv1D fan_in_fan_out and tied layers
        peft_model = peft.get_peft_model(
            hf_model(hf_dir),
            peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=targets, rank_pattern={"h.1.mlp.c_fc": 2}),
        )
    perturb(peft_model)
    peft_model.eval()
    x = tokens()
    expected = peft_model(x).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(tmp_path / "adapter")
    ours = GPT.from_pretrained(hf_dir, pad_vocab_multiple=pad)
    assert not torch.allclose(ours(x)[0], expected, atol=1e-3), "the adapter must matter"
    minlora.import_peft_adapter(ours, tmp_path / "adapter")
    assert all(s.lora.use_dora for s in minlora.lora_sites(ours))
    torch.testing.assert_close(ours(x)[0], expected, rtol=0, atol=1e-5)
    minlora.set_fast_path(ours, False)  # the weight path agrees too
    torch.testing.assert_close(ours(x)[0], expected, rtol=0, atol=1e-5)
    minlora.merge_lora(ours)
    torch.testing.assert_close(ours(x)[0], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pad", [1, 64])
@pytest.mark.parametrize("targets", [["c_attn", "c_fc", "lm_head"], ["c_attn", "wte"]])
def test_dora_adapter_trained_here_loads_with_peft(hf_dir, tmp_path, pad, targets):
    """With padding, the embedding's DoRA norms run over padded rows the twin does not have: the
    exported magnitudes are rescaled to the twin's rows (they were off by ~3e-4).
    """
    ours = GPT.from_pretrained(hf_dir, pad_vocab_multiple=pad)
    config = LoRAConfig(rank=4, alpha=8, use_dora=True, target_modules=targets, include_lm_head=True)
    minlora.add_lora(ours, dataclasses.replace(config, include_embeddings="wte" in targets))
    perturb(ours)
    x = tokens()
    expected = ours(x)[0]
    minlora.export_peft_adapter(ours, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["use_dora"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.PeftModel.from_pretrained(hf_model(hf_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(peft_model(x).logits, expected, rtol=0, atol=1e-5)
    back = GPT.from_pretrained(hf_dir, pad_vocab_multiple=pad)  # and back: the same
    minlora.import_peft_adapter(back, tmp_path / "adapter")
    torch.testing.assert_close(back(x)[0], expected, rtol=0, atol=1e-6)


def test_peft_refuses_a_mix_of_dora_and_plain_lora(tmp_path):
    model = tiny_gpt()
    minlora.add_lora(model, LoRAConfig(rank=2, target_modules=["c_attn"]))
    minlora.add_lora(model, LoRAConfig(rank=2, use_dora=True, target_modules=["c_fc"]))
    with pytest.raises(ValueError, match="use_dora is on for some layers and off for others"):
        minlora.export_peft_adapter(model, tmp_path / "mixed")

"""PEFT interop: adapters move between gpt2.GPT + minlora and transformers GPT-2 + peft, same logits."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from gpt2 import GPT  # noqa: E402
from minlora.config import LoRAConfig  # noqa: E402
from minlora.model import add_lora, lora_sites  # noqa: E402
from minlora.peft import PEFT_CONFIG_NAME, export_peft_adapter, import_peft_adapter  # noqa: E402
from minlora.utils import get_lora_params  # noqa: E402

VOCAB = 100  # not a multiple of 64: with pad_vocab_multiple=64 our model has 128 rows, HF has 100


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A randomly initialised transformers GPT-2 saved to disk (nothing is downloaded); the tests
    only read it.
    """
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    path = tmp_path_factory.mktemp("hf") / "base"
    model.save_pretrained(path)
    return path


def hf_model(path):
    return transformers.GPT2LMHeadModel.from_pretrained(path).eval()


def peft_model_with_random_adapter(path, **lora_kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about Conv1D fan_in_fan_out and tied layers
        model = peft.get_peft_model(hf_model(path), peft.LoraConfig(**lora_kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)  # B starts at zero in PEFT too: make the adapter matter
    return model.eval()


@pytest.mark.parametrize("pad", [1, 64])
def test_peft_adapter_trained_on_transformers_loads_here(hf_dir, tmp_path, pad):
    peft_model = peft_model_with_random_adapter(
        hf_dir,
        r=4,
        lora_alpha=8,
        target_modules=["c_attn", "c_proj", "c_fc", "lm_head", "wte"],
        rank_pattern={"h.1.mlp.c_fc": 2},
        alpha_pattern={"h.0.attn.c_attn": 3},
    )
    x = torch.randint(0, VOCAB, (2, 16))
    expected = peft_model(x).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(tmp_path / "adapter")

    ours = GPT.from_pretrained(hf_dir, pad_vocab_multiple=pad)
    with torch.no_grad():
        assert not torch.allclose(ours(x)[0], expected, atol=1e-3), "the adapter must matter"
    import_peft_adapter(ours, tmp_path / "adapter")
    torch.testing.assert_close(ours(x)[0], expected, rtol=0, atol=1e-5)
    c_fc = ours.transformer.h[1].mlp.c_fc.parametrizations.weight[0]
    assert (c_fc.rank, c_fc.scaling) == (2, 8 / 2)
    assert ours.transformer.h[0].attn.c_attn.parametrizations.weight[0].scaling == 3 / 4
    assert ours.transformer.wte.parametrizations.weight[0].fan_in_fan_out


@pytest.mark.parametrize("pad", [1, 64])
def test_adapter_trained_here_loads_with_peft(hf_dir, tmp_path, pad):
    ours = GPT.from_pretrained(hf_dir, pad_vocab_multiple=pad)
    add_lora(
        ours,
        LoRAConfig(
            rank=4, alpha=16, include_embeddings=True, include_lm_head=True, exclude_modules=["wpe"], use_rslora=True
        ),
    )
    with torch.no_grad():
        for p in get_lora_params(ours):
            p.normal_(0.0, 0.2)
    x = torch.randint(0, VOCAB, (2, 16))
    expected = ours(x)[0]
    export_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    config = json.loads((tmp_path / "adapter" / PEFT_CONFIG_NAME).read_text())
    assert config["target_modules"] == ["c_attn", "c_fc", "c_proj", "lm_head", "wte"]
    assert config["fan_in_fan_out"] is True and config["use_rslora"] is True
    assert config["base_model_name_or_path"] == str(hf_dir)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.PeftModel.from_pretrained(hf_model(hf_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(peft_model(x).logits, expected, rtol=0, atol=1e-5)


def test_mixed_ranks_use_rank_pattern(hf_dir, tmp_path):
    ours = GPT.from_pretrained(hf_dir)
    add_lora(ours, LoRAConfig(rank=4, alpha=8, target_modules=["transformer.h.0.*"]))
    add_lora(ours, LoRAConfig(rank=2, alpha=8, target_modules=["transformer.h.1.attn.c_attn"]))
    with torch.no_grad():
        for p in get_lora_params(ours):
            p.normal_(0.0, 0.2)
    x = torch.randint(0, VOCAB, (2, 16))
    expected = ours(x)[0]
    export_peft_adapter(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / PEFT_CONFIG_NAME).read_text())
    assert config["r"] == 4 and list(config["rank_pattern"].values()) == [2]
    # the layers are a subset of the c_attn/c_proj/c_fc layers: full names, not suffixes
    assert "transformer.h.1.attn.c_attn" in config["target_modules"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.PeftModel.from_pretrained(hf_model(hf_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(peft_model(x).logits, expected, rtol=0, atol=1e-5)
    # and back
    fresh = GPT.from_pretrained(hf_dir)
    import_peft_adapter(fresh, tmp_path / "adapter")
    assert sorted(s.name for s in lora_sites(fresh)) == sorted(s.name for s in lora_sites(ours))
    torch.testing.assert_close(fresh(x)[0], expected, rtol=0, atol=0)


def test_unsupported_peft_options_and_mismatches_are_rejected(hf_dir, tmp_path):
    peft_model = peft_model_with_random_adapter(hf_dir, r=4, lora_alpha=8, target_modules=["c_attn"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(tmp_path / "adapter")
    config_path = tmp_path / "adapter" / PEFT_CONFIG_NAME
    original = json.loads(config_path.read_text())

    for key, value, message in [
        ("use_dora", True, "with use_dora=True a lora_magnitude_vector"),  # DoRA without its magnitudes
        ("bias", "all", "bias='all'"),
        ("modules_to_save", ["score"], "modules_to_save"),
        ("peft_type", "IA3", "only LORA"),
        ("r", 8, r"has shape \(4, 32\); at rank 8 this layer needs \(8, 32\)"),
    ]:
        config_path.write_text(json.dumps({**original, key: value}))
        with pytest.raises(ValueError, match=message):
            import_peft_adapter(GPT.from_pretrained(hf_dir), tmp_path / "adapter")
    config_path.write_text(json.dumps(original))

    ours = GPT.from_pretrained(hf_dir)
    add_lora(ours, LoRAConfig(rank=8, target_modules=["c_attn"]))
    with pytest.raises(ValueError, match="has LoRA of rank 4 .* has LoRA of rank 8"):
        import_peft_adapter(ours, tmp_path / "adapter")
    # a model of another depth: the adapter targets a module it does not have
    deeper = peft_model_with_random_adapter(hf_dir, r=4, lora_alpha=8, target_modules=["c_attn"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deeper.save_pretrained(tmp_path / "adapter2")
    small = GPT.from_pretrained(hf_dir)
    small.transformer.h = small.transformer.h[:1]
    with pytest.raises(ValueError, match="has no such module"):
        import_peft_adapter(small, tmp_path / "adapter2")


@pytest.mark.parametrize(
    "layout",
    [["vocab_size"], {"vocab": 100}, {"vocab_size": 100, "padded_vocab_modules": ["block"]}],
    ids=["not-a-dict", "unknown-key", "padded-layer-without-weight"],
)
def test_a_wrong_layout_method_is_a_clear_error(tmp_path, layout):
    """A model's ``peft_adapter_layout()`` is code its author wrote: a wrong answer says what is expected."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 8))

        def peft_adapter_layout(self):
            return layout

    model = Net()
    add_lora(model, LoRAConfig(rank=2))
    with pytest.raises(TypeError, match=r"Net.peft_adapter_layout\(\) must return a dict with keys among"):
        export_peft_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_a_rank_above_a_layers_smaller_side_moves_both_ways(hf_dir, tmp_path):
    """Wasteful, not wrong: PEFT accepts r=40 on 32-wide layers, and so does minlora (add_lora warns)."""
    targets = ["c_attn", "c_proj"]
    peft_model = peft_model_with_random_adapter(hf_dir, r=40, lora_alpha=8, target_modules=targets)
    x = torch.randint(0, VOCAB, (2, 16))
    expected = peft_model(x).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(tmp_path / "from_peft")
    ours = GPT.from_pretrained(hf_dir)
    with warnings.catch_warnings():
        # importing warns about nothing: the adapter is what it is
        warnings.simplefilter("error")
        import_peft_adapter(ours, tmp_path / "from_peft")
    assert {s.lora.rank for s in lora_sites(ours)} == {40}
    torch.testing.assert_close(ours(x)[0], expected, rtol=0, atol=1e-5)

    # and back: a rank-40 LoRA made here (one warning) exports to a PEFT adapter PEFT computes the same
    mine = GPT.from_pretrained(hf_dir)
    with pytest.warns(UserWarning, match=r"transformer\.h\.0\.attn\.c_attn\.weight .* useful maximum 32") as record:
        add_lora(mine, LoRAConfig(rank=40, alpha=8, target_modules=targets))
    assert len(record) == 1
    with torch.no_grad():
        for p in get_lora_params(mine):
            p.normal_(0.0, 0.2)
    expected = mine(x)[0]
    export_peft_adapter(mine, tmp_path / "from_minlora")
    assert json.loads((tmp_path / "from_minlora" / PEFT_CONFIG_NAME).read_text())["r"] == 40
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(hf_model(hf_dir), tmp_path / "from_minlora").eval()
    torch.testing.assert_close(loaded(x).logits, expected, rtol=0, atol=1e-5)

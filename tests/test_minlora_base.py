"""Adapters know their base model (base_fingerprint), NaN / inf never reach or leave an adapter file,
and adapter files get the user's umask.
"""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

import minlora
from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from minlora import AdapterBaseMismatchError, AdapterFileError, LoRAConfig, NonFiniteAdapterError
from minlora.adapters import ADAPTER_FILE_NAME


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**dict(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=16), **overrides})).eval()


def lora_gpt(seed: int = 0, **overrides) -> GPT:
    model = tiny_gpt(seed, **overrides)
    minlora.add_lora(model, LoRAConfig(rank=2, alpha=4, target_modules=["c_attn", "c_fc"]))
    with torch.no_grad():
        for p in minlora.get_lora_params(model):
            p.normal_(0.0, 0.1)
    return model


def recorded(path) -> dict:
    with safe_open(str(path / ADAPTER_FILE_NAME), framework="pt") as f:
        return json.loads(f.metadata()["minlora"])


def tokens() -> torch.Tensor:
    return torch.arange(12).view(2, 6)


# --------------------------------------------------------------------------- base_fingerprint
def test_the_fingerprint_covers_the_adapted_base_weights_in_any_precision(tmp_path):
    model = lora_gpt()
    fingerprint = minlora.base_fingerprint(model)
    assert len(fingerprint) == 64
    assert fingerprint == recorded(minlora.save_adapter(model, tmp_path / "a"))["base"]["sha256"]
    with torch.no_grad():  # training the adapter does not change the base
        for p in minlora.get_lora_params(model):
            p.add_(1.0)
    assert minlora.base_fingerprint(model) == fingerprint
    assert minlora.base_fingerprint(lora_gpt(seed=1)) != fingerprint  # other weights
    # Settings that leave the weights alone (dropout, the attention kernel) and the base's precision
    # are the same base.
    assert minlora.base_fingerprint(lora_gpt(dropout=0.1, flash=False)) == fingerprint
    assert minlora.base_fingerprint(lora_gpt().to(torch.bfloat16)) == fingerprint
    assert minlora.base_fingerprint(lora_gpt(n_embd=32)) != fingerprint  # other shapes
    with torch.no_grad():  # a base weight LoRA does not touch is not part of it
        model.transformer.h[0].ln_1.weight.add_(1.0)
    assert minlora.base_fingerprint(model) == fingerprint
    with pytest.raises(ValueError, match="no LoRA"):
        minlora.base_fingerprint(tiny_gpt())
    plain = nn.Sequential(nn.Linear(4, 4))  # no config: the weights alone
    minlora.add_lora(plain)
    assert len(minlora.base_fingerprint(plain)) == 64


def test_loading_onto_other_base_weights_is_refused_unless_allowed(tmp_path, caplog):
    source = lora_gpt()
    path = minlora.save_adapter(source, tmp_path / "adapter")
    other = tiny_gpt(seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        AdapterBaseMismatchError, match="base weights of the 4 adapted layers differ.*allow_base_mismatch=True"
    ) as info:
        minlora.load_adapter(other, path)
    assert "config" not in str(info.value).split("differ")[0]  # the config is the same
    assert not minlora.lora_sites(other) and all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())
    with caplog.at_level(logging.WARNING, logger="minlora.adapters"):
        minlora.load_adapter(other, path, allow_base_mismatch=True)
    assert "loading it anyway" in caplog.text and len(minlora.lora_sites(other)) == 4
    same = tiny_gpt()
    minlora.load_adapter(same, path)  # the right base: no error
    torch.testing.assert_close(same(tokens())[0], source(tokens())[0], rtol=0, atol=0)


def test_loading_onto_the_same_weights_with_other_settings_or_precision_works(tmp_path):
    """A base trained with dropout 0.1 (the GPU recipe) or loaded in bf16 is the base the adapter
    was trained on: it loads. Other weights are refused and the config's differences
    are named as a hint.
    """
    source = lora_gpt()
    path = minlora.save_adapter(source, tmp_path / "adapter")
    same = tiny_gpt(dropout=0.1, flash=False)
    minlora.load_adapter(same, path)
    torch.testing.assert_close(same.eval()(tokens())[0], source(tokens())[0])  # manual attention: rounding
    minlora.load_adapter(tiny_gpt().to(torch.bfloat16), path)
    with pytest.raises(
        AdapterBaseMismatchError,
        match=r"base weights of the 4 adapted layers differ \(and the model config: dropout: 0\.0 in the adapter, "
        r"0\.1 here\)",
    ):
        minlora.load_adapter(tiny_gpt(seed=1, dropout=0.1), path)


def test_a_damaged_base_record_is_a_file_error(tmp_path):
    path = minlora.save_adapter(lora_gpt(), tmp_path / "adapter")
    with safe_open(str(path / ADAPTER_FILE_NAME), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    config = json.loads(metadata["minlora"])
    config["base"] = "abc"
    from safetensors.torch import save_file

    save_file(tensors, str(path / ADAPTER_FILE_NAME), metadata={**metadata, "minlora": json.dumps(config)})
    with pytest.raises(AdapterFileError, match="'base' must be an object"):
        minlora.load_adapter(tiny_gpt(), path)


def test_export_peft_adapter_records_the_base_model_name(tmp_path):
    model = lora_gpt()
    for name in ("gpt2", None):
        out = minlora.export_peft_adapter(model, tmp_path / str(name), base_model_name_or_path=name)
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == name


# --------------------------------------------------------------------------- NaN / inf
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_save_refuses_non_finite_weights_and_keeps_the_good_file(tmp_path, bad):
    model = lora_gpt()
    path = minlora.save_adapter(model, tmp_path / "adapter")
    peft = minlora.export_peft_adapter(model, tmp_path / "peft")
    good = (path / ADAPTER_FILE_NAME).read_bytes(), (peft / "adapter_model.safetensors").read_bytes()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.parametrizations.weight[0].lora_B[3, 1] = bad
    with pytest.raises(NonFiniteAdapterError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight\.lora_B holds 1 NaN/inf"):
        minlora.save_adapter(model, path)
    with pytest.raises(NonFiniteAdapterError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight\.lora_B holds 1 NaN/inf"):
        minlora.export_peft_adapter(model, peft)
    assert ((path / ADAPTER_FILE_NAME).read_bytes(), (peft / "adapter_model.safetensors").read_bytes()) == good
    assert sorted(os.listdir(path)) == [ADAPTER_FILE_NAME]  # no temp file either
    with pytest.raises(NonFiniteAdapterError):
        minlora.save_adapter(model, tmp_path / "new")
    assert not (tmp_path / "new" / ADAPTER_FILE_NAME).exists()


def test_loading_non_finite_weights_is_a_named_error_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    model = lora_gpt()
    path = minlora.save_adapter(model, tmp_path / "adapter")
    peft = minlora.export_peft_adapter(model, tmp_path / "peft")
    peft_key = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
    for file, key in (
        (path / ADAPTER_FILE_NAME, "transformer.h.0.attn.c_attn.weight.lora_A"),
        (peft / "adapter_model.safetensors", peft_key),
    ):
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(file))
        tensors[key][0, 0] = float("nan")
        save_file(tensors, str(file), metadata=metadata)
    with pytest.raises(NonFiniteAdapterError, match=rf"{key.replace('.', '[.]')} holds 1 NaN/inf"):
        minlora.import_peft_adapter(tiny_gpt(), peft)
    with pytest.raises(NonFiniteAdapterError, match=r"transformer\.h\.0\.attn\.c_attn\.weight\.lora_A holds 1 NaN"):
        minlora.load_adapter(tiny_gpt(), path)


# --------------------------------------------------------------------------- file modes
@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_files_get_the_users_umask(tmp_path, umask):
    model = lora_gpt()
    previous = os.umask(umask)
    try:
        path = minlora.save_adapter(model, tmp_path / "adapter")
        minlora.save_adapter(model, path)  # replacing keeps it
        peft = minlora.export_peft_adapter(model, tmp_path / "peft")
    finally:
        os.umask(previous)
    for file in (path / ADAPTER_FILE_NAME, peft / "adapter_model.safetensors", peft / "adapter_config.json"):
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file

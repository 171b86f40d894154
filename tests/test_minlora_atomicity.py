"""minlora adapters are all-or-nothing: damaged files get a named error and leave the model as it
was; an interrupted save_adapter leaves the old adapter or the new one; tie_weights in either order.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import minlora
from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from minlora import AdapterFileError, LoRAConfig, LoRAParametrization
from minlora.adapters import ADAPTER_FILE_NAME, load_adapter, save_adapter
from minlora.peft import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=16)).eval()


def randomize(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in minlora.get_lora_params(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def snapshot(model: nn.Module) -> dict:
    """Everything a load could change: every tensor, which tensors carry LoRA, each LoRA's scaling."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "sites": [s.name for s in minlora.lora_sites(model)],
        "scaling": [s.lora.scaling for s in minlora.lora_sites(model)],
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["sites"] == before["sites"] and after["scaling"] == before["scaling"]
    assert after["state"].keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), f"{k} changed by a failed load"


@pytest.fixture
def saved(tmp_path):
    """An adapter of a LoRA GPT (two ranks of targets, the tied head included) and its directory."""
    model = tiny_gpt()
    minlora.add_lora(model, LoRAConfig(rank=2, alpha=4, include_lm_head=True))
    randomize(model, 1)
    return save_adapter(model, tmp_path / "adapter")


def targets_models():
    """A model without LoRA (load adds it) and one with LoRA of the adapter's rank (load fills it)."""
    with_lora = tiny_gpt()
    minlora.add_lora(with_lora, LoRAConfig(rank=2, alpha=1, include_lm_head=True))
    randomize(with_lora, 7)
    return [tiny_gpt(), with_lora]


# --------------------------------------------------------------------------- damaged minlora files
def read_adapter(path: Path) -> tuple[dict, dict]:
    """(tensors, metadata) of the adapter file in ``path``."""
    with safe_open(str(path / ADAPTER_FILE_NAME), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def rewrite(path: Path, tensors_fn=None, metadata_fn=None) -> None:
    tensors, metadata = read_adapter(path)
    if tensors_fn:
        tensors_fn(tensors)
    if metadata_fn:
        metadata_fn(metadata)
    save_file(tensors, str(path / ADAPTER_FILE_NAME), metadata=metadata)


def edit_config(path: Path, fn) -> None:
    def edit(metadata):
        config = json.loads(metadata["minlora"])
        fn(config)
        metadata["minlora"] = json.dumps(config)

    rewrite(path, metadata_fn=edit)


def set_metadata(path: Path, text: str) -> None:
    rewrite(path, metadata_fn=lambda m: m.update(minlora=text))


def last_target(config: dict) -> dict:
    return config["targets"][sorted(config["targets"])[-1]]


CONFIG_DAMAGE = {
    "truncated JSON": (lambda p: set_metadata(p, read_adapter(p)[1]["minlora"][:40]), "is not valid JSON"),
    "not an object": (lambda p: set_metadata(p, "[1, 2]"), "must hold a JSON object"),
    "no config": (lambda p: rewrite(p, metadata_fn=lambda m: m.pop("minlora")), "not a minlora adapter"),
    "unknown format": (lambda p: edit_config(p, lambda c: c.update(format="something.else")), "not a minlora adapter"),
    "newer version": (lambda p: edit_config(p, lambda c: c.update(format_version=99)), "upgrade minlora"),
    "no targets": (lambda p: edit_config(p, lambda c: c.pop("targets")), "'targets' must be a non-empty object"),
    "rank as text": (
        lambda p: edit_config(p, lambda c: last_target(c).update(rank="2")),
        r"rank must be a positive integer",
    ),
    "alpha NaN": (
        lambda p: edit_config(p, lambda c: last_target(c).update(lora_alpha=float("nan"))),
        r"lora_alpha must be a finite",
    ),
    "missing field": (lambda p: edit_config(p, lambda c: last_target(c).pop("rank")), "lacks the field 'rank'"),
    "dropout out of range": (
        lambda p: edit_config(p, lambda c: last_target(c).update(lora_dropout_p=1.5)),
        r"lora_dropout_p must be",
    ),
    "tied entry malformed": (
        lambda p: edit_config(p, lambda c: c.update(tied=[{"linear": "nowhere.weight"}])),
        "each 'tied' entry must be",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_DAMAGE))
def test_damaged_config_is_a_named_error_and_changes_nothing(saved, case):
    damage, message = CONFIG_DAMAGE[case]
    damage(saved)
    for model in targets_models():
        before = snapshot(model)
        with pytest.raises(AdapterFileError, match=message) as info:
            load_adapter(model, saved)
        assert ADAPTER_FILE_NAME in str(info.value)  # the message names the file
        assert_unchanged(model, before)


def rewrite_weights(path: Path, fn) -> None:
    rewrite(path, tensors_fn=fn)


def last_key(tensors: dict) -> str:
    return sorted(tensors)[-1]


WEIGHTS_DAMAGE = {
    "truncated file": (
        lambda p: (p / ADAPTER_FILE_NAME).write_bytes((p / ADAPTER_FILE_NAME).read_bytes()[:-50]),
        "not a readable safetensors file",
    ),
    "empty file": (lambda p: (p / ADAPTER_FILE_NAME).write_bytes(b""), "not a readable safetensors file"),
    "garbage header": (
        lambda p: (p / ADAPTER_FILE_NAME).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + b"\x00" * 64),
        "not a readable safetensors file",
    ),
    "missing factor": (lambda p: rewrite_weights(p, lambda t: t.pop(last_key(t))), "lacks"),
    "unexpected tensor": (lambda p: rewrite_weights(p, lambda t: t.update(extra=torch.zeros(2))), "does not list"),
    "NaN factor": (
        lambda p: rewrite_weights(p, lambda t: t[last_key(t)].view(-1).__setitem__(0, float("nan"))),
        "NaN/inf",
    ),
    "inf factor": (
        lambda p: rewrite_weights(p, lambda t: t[last_key(t)].view(-1).__setitem__(-1, float("inf"))),
        "NaN/inf",
    ),
    "integer factor": (
        lambda p: rewrite_weights(p, lambda t: t.update({last_key(t): t[last_key(t)].to(torch.int32)})),
        "not a floating-point one",
    ),
}


@pytest.mark.parametrize("case", sorted(WEIGHTS_DAMAGE))
def test_damaged_weights_are_a_named_error_and_change_nothing(saved, case):
    damage, message = WEIGHTS_DAMAGE[case]
    damage(saved)
    for model in targets_models():
        before = snapshot(model)
        with pytest.raises(AdapterFileError, match=message) as info:
            load_adapter(model, saved)
        assert ADAPTER_FILE_NAME in str(info.value)
        assert_unchanged(model, before)


def test_wrong_factor_shape_of_the_last_target_changes_nothing(saved):
    """The shape check runs for every target before the first one is applied."""

    def grow(t):
        key = last_key(t)
        t[key] = torch.cat([t[key], t[key][:1]])

    rewrite_weights(saved, grow)
    for model in targets_models():
        before = snapshot(model)
        with pytest.raises(ValueError, match="has shape"):
            load_adapter(model, saved)
        assert_unchanged(model, before)


def test_strict_cover_failure_changes_nothing(saved):
    model = tiny_gpt()
    minlora.add_lora(model, LoRAConfig(rank=2, include_lm_head=True, include_embeddings=True))
    before = snapshot(model)
    with pytest.raises(ValueError, match="does not cover"):
        load_adapter(model, saved)
    assert_unchanged(model, before)


# --------------------------------------------------------------------------- tied pairs
TIE_CONFIG = {
    nn.Embedding: {"weight": partial(LoRAParametrization.from_embedding, rank=2)},
    nn.Linear: {"weight": partial(LoRAParametrization.from_linear, rank=2)},
}


def tied_model(seed: int = 3) -> GPT:
    model = tiny_gpt()
    minlora.add_lora(model, TIE_CONFIG)
    minlora.tie_weights(model.lm_head, model.transformer.wte)
    randomize(model, seed)
    return model


def test_tied_pair_with_disagreeing_values_is_refused_before_any_change(tmp_path):
    path = save_adapter(tied_model(), tmp_path / "tied")
    rewrite_weights(path, lambda t: t["transformer.wte.weight.lora_A"].mul_(2))  # no longer the head's lora_B
    for model in (tiny_gpt(), tied_model(seed=9)):
        before = snapshot(model)
        with pytest.raises(AdapterFileError, match="holding one update"):
            load_adapter(model, path)
        assert_unchanged(model, before)


def test_tied_pair_with_swapped_roles_is_refused(tmp_path):
    path = save_adapter(tied_model(), tmp_path / "tied")
    edit_config(path, lambda c: c.update(tied=[{"linear": "transformer.wte.weight", "embedding": "lm_head.weight"}]))
    model = tiny_gpt()
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match="must be a linear layer's and an embedding's"):
        load_adapter(model, path)
    assert_unchanged(model, before)


def test_tied_dora_pair_is_refused_before_any_change(tmp_path):
    """A hand-made file tying two DoRA layers: tie_weights refuses DoRA, so the load must refuse it first."""
    path = save_adapter(tied_model(), tmp_path / "tied")

    def to_dora(tensors):
        tensors["lm_head.weight.lora_magnitude_vector"] = torch.ones(100)
        tensors["transformer.wte.weight.lora_magnitude_vector"] = torch.ones(16)

    def dora_config(metadata):
        config = json.loads(metadata["minlora"])
        for name in ("lm_head.weight", "transformer.wte.weight"):
            config["targets"][name]["use_dora"] = True
        metadata["minlora"] = json.dumps(config)

    rewrite(path, to_dora, dora_config)
    model = tiny_gpt()
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match="DoRA"):
        load_adapter(model, path)
    assert_unchanged(model, before)


@pytest.mark.parametrize("order", ["linear first", "embedding first (positional)", "embedding first (keywords)"])
def test_tie_weights_accepts_either_order(order):
    model = tiny_gpt()
    minlora.add_lora(model, TIE_CONFIG)
    head, wte = model.lm_head, model.transformer.wte
    if order == "linear first":
        minlora.tie_weights(head, wte)
    elif order == "embedding first (positional)":
        minlora.tie_weights(wte, head)
    else:
        minlora.tie_weights(linear=wte, embedding=head)
    emb_lora, head_lora = wte.parametrizations.weight[0], head.parametrizations.weight[0]
    assert emb_lora.lora_A is head_lora.lora_B and emb_lora.lora_B is head_lora.lora_A
    randomize(model, 2)
    torch.testing.assert_close(wte.weight, head.weight, rtol=0, atol=0)  # one weight, one update
    minlora.untie_weights(wte, head)  # either order too
    assert emb_lora.lora_A is not head_lora.lora_B


def test_tie_weights_refuses_two_layers_of_one_layout():
    model = tiny_gpt()
    minlora.add_lora(model, TIE_CONFIG)
    with pytest.raises(ValueError, match="needs one layer with LoRA from from_linear .* both"):
        minlora.tie_weights(model.lm_head, model.transformer.h[0].mlp.c_fc)


# --------------------------------------------------------------------------- pairs of saves
def outputs(model: nn.Module) -> torch.Tensor:
    x = torch.arange(12).view(2, 6) % 100
    return model(x)[0]


def lora_model(seed: int) -> GPT:
    model = tiny_gpt()
    minlora.add_lora(model, LoRAConfig(rank=2, alpha=4))
    randomize(model, seed)
    return model


def loaded_outputs(path: Path) -> torch.Tensor:
    model = tiny_gpt()
    load_adapter(model, path)
    return outputs(model)


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != ADAPTER_FILE_NAME)


@pytest.mark.parametrize("fail_at", ["fsync", "rename"])
def test_failed_save_keeps_the_old_adapter_and_no_tmp(tmp_path, monkeypatch, fail_at):
    old = lora_model(1)
    path = save_adapter(old, tmp_path / "adapter")
    expected = outputs(old)

    def fail(*args):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(os, "fsync" if fail_at == "fsync" else "replace", fail)
    with pytest.raises(OSError, match="simulated"):
        save_adapter(lora_model(2), path)
    monkeypatch.undo()
    assert leftovers(path) == []
    torch.testing.assert_close(loaded_outputs(path), expected, rtol=0, atol=0)


def test_failed_write_during_save_keeps_the_old_adapter_and_no_tmp(tmp_path, monkeypatch):
    old = lora_model(1)
    path = save_adapter(old, tmp_path / "adapter")
    import minlora.adapters as adapters

    def half_written(tensors, filename, metadata=None):  # dies after writing part of the file
        Path(filename).write_bytes(b"\x00" * 100)
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(adapters, "save_file", half_written)
    with pytest.raises(OSError, match="simulated"):
        save_adapter(lora_model(2), path)
    assert leftovers(path) == []
    torch.testing.assert_close(loaded_outputs(path), outputs(old), rtol=0, atol=0)


def crash_images(path: Path, new: nn.Module, monkeypatch, tmp_path: Path) -> dict[str, Path]:
    """Run ``save_adapter(new, path)`` and copy the directory, as it is on disk, at every point where
    a crash could stop the save: mid-write of the new file, before and after the rename. A copy is
    exactly what a killed process would leave (no cleanup).
    """
    import shutil

    import minlora.adapters as adapters

    images: dict[str, Path] = {}

    def image(label: str) -> None:
        images[label] = Path(shutil.copytree(path, tmp_path / "images" / label))

    real_replace, real_save_file = os.replace, adapters.save_file

    def replace(src, dst):
        image("before rename")
        real_replace(src, dst)
        image("after rename")

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 100)  # a half-written temp file
        image("mid-write")
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(adapters, "save_file", save_file)
    save_adapter(new, path)
    monkeypatch.undo()
    return images


def test_a_crash_at_any_step_leaves_the_old_or_the_new_adapter(tmp_path, monkeypatch):
    """Overwriting an adapter: until the rename the directory loads as the old adapter, afterwards
    as the new one; never a mix. The next save replaces a stale temp file.
    """
    old, new = lora_model(1), lora_model(2)
    path = save_adapter(old, tmp_path / "adapter")
    images = crash_images(path, new, monkeypatch, tmp_path)
    assert sorted(images) == ["after rename", "before rename", "mid-write"]
    old_out, new_out = outputs(old), outputs(new)
    for label, image in images.items():
        expected = new_out if label == "after rename" else old_out
        torch.testing.assert_close(loaded_outputs(image), expected, rtol=0, atol=0, msg=f"crash {label}")
        save_adapter(new, image)
        assert leftovers(image) == [], f"crash {label}: {leftovers(image)}"
        torch.testing.assert_close(loaded_outputs(image), new_out, rtol=0, atol=0, msg=f"crash {label}")


# --------------------------------------------------------------------------- PEFT files
@pytest.fixture
def peft_dir(tmp_path):
    model = tiny_gpt()
    minlora.add_lora(model, LoRAConfig(rank=2, alpha=4, target_modules=("c_attn", "c_fc")))
    randomize(model, 1)
    return minlora.export_peft_adapter(model, tmp_path / "peft")


def edit_peft_config(path: Path, **changes) -> None:
    config = json.loads((path / PEFT_CONFIG_NAME).read_text())
    config.update(changes)
    (path / PEFT_CONFIG_NAME).write_text(json.dumps(config))


PEFT_DAMAGE = {
    "truncated config": (
        lambda p: (p / PEFT_CONFIG_NAME).write_text('{"peft_type": "LO'),
        "is not valid JSON",
        PEFT_CONFIG_NAME,
    ),
    "r as text": (lambda p: edit_peft_config(p, r="2"), "r must be a positive integer", PEFT_CONFIG_NAME),
    "alpha inf": (
        lambda p: edit_peft_config(p, lora_alpha=float("inf")),
        "lora_alpha must be a finite",
        PEFT_CONFIG_NAME,
    ),
    "bad rank_pattern": (
        lambda p: edit_peft_config(p, rank_pattern={"c_fc": 0}),
        r"rank_pattern\['c_fc'\] must be a positive integer",
        PEFT_CONFIG_NAME,
    ),
    "truncated weights": (
        lambda p: (p / PEFT_WEIGHTS_NAME).write_bytes((p / PEFT_WEIGHTS_NAME).read_bytes()[:-40]),
        "not a readable safetensors file",
        PEFT_WEIGHTS_NAME,
    ),
    "NaN factor": (
        lambda p: save_file(
            {
                k: (v.fill_(float("nan")) if k == last_key(load_file(str(p / PEFT_WEIGHTS_NAME))) else v)
                for k, v in load_file(str(p / PEFT_WEIGHTS_NAME)).items()
            },
            str(p / PEFT_WEIGHTS_NAME),
        ),
        "NaN/inf",
        PEFT_WEIGHTS_NAME,
    ),
}


@pytest.mark.parametrize("case", sorted(PEFT_DAMAGE))
def test_damaged_peft_adapter_is_a_named_error_and_changes_nothing(peft_dir, case):
    damage, message, filename = PEFT_DAMAGE[case]
    damage(peft_dir)
    model = tiny_gpt()
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match=message) as info:
        minlora.import_peft_adapter(model, peft_dir)
    assert filename in str(info.value)
    assert_unchanged(model, before)


def test_peft_round_trip_still_exact(peft_dir):
    """The layout protocol (GPT.peft_adapter_layout) keeps export + import exact."""
    source = tiny_gpt()
    minlora.add_lora(source, LoRAConfig(rank=2, alpha=4, target_modules=("c_attn", "c_fc")))
    randomize(source, 1)
    model = tiny_gpt()
    minlora.import_peft_adapter(model, peft_dir)
    torch.testing.assert_close(outputs(model), outputs(source), rtol=0, atol=0)
    assert json.loads((peft_dir / PEFT_CONFIG_NAME).read_text())["fan_in_fan_out"] is True

"""A fresh user's path through loading and exporting: a mistyped folder named as such,
one message offline, PEFT adapters that name the base they were trained on, and quiet exports.
"""

from __future__ import annotations

import json

import pytest
import torch

import minlora
from gpt2.cli import main
from gpt2.cli.export import peft_base
from gpt2.errors import MissingFileError
from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT

TINY = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32, pad_vocab_multiple=64)


@pytest.fixture
def no_hub(monkeypatch):
    """Any download attempt fails the test: these names must never reach the hub."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


@pytest.fixture
def base(tmp_path):
    torch.manual_seed(0)
    return GPT(TINY).save_pretrained(tmp_path / "base")


def test_a_mistyped_folder_is_named_with_the_closest_one(tmp_path, monkeypatch, no_hub):
    (tmp_path / "runs" / "shakespeare").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MissingFileError, match=r"'runs/shakespere' does not exist.*did you mean 'runs/shakespeare'\?"):
        GPT.from_pretrained("runs/shakespere")
    with pytest.raises(MissingFileError, match=r"'\./runs/shakespere/x' does not exist.*'runs/shakespeare/x'"):
        GPT.from_pretrained("./runs/shakespere/x")
    with pytest.raises(MissingFileError, match=r"'model\.pt' does not exist.*ends with \.pt\); check the path"):
        GPT.from_pretrained("model.pt")


def test_an_owner_slash_name_that_is_no_local_folder_is_still_a_hub_id(tmp_path, monkeypatch, base):
    import gpt2.model.hf as hf

    monkeypatch.chdir(tmp_path)
    asked = []
    monkeypatch.setattr(hf, "_download", lambda repo_id, cache_dir, revision: asked.append(repo_id) or base)
    GPT.from_pretrained("someone/tiny-gpt2")
    assert asked == ["someone/tiny-gpt2"]


def test_offline_without_a_cached_copy_is_one_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConnectionError, match=r"offline mode is on.*local directory") as caught:
        GPT.from_pretrained("gpt2", cache_dir=tmp_path)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def _with_adapter(model: GPT) -> GPT:
    minlora.add_lora(model, minlora.LoRAConfig(rank=2))
    return model


def test_a_peft_export_names_the_folder_or_hub_id_the_model_came_from(tmp_path, monkeypatch, base):
    import gpt2.model.hf as hf

    minlora.export_peft_adapter(_with_adapter(GPT.from_pretrained(base)), tmp_path / "local")
    config = json.loads((tmp_path / "local" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())

    monkeypatch.setattr(hf, "_download", lambda repo_id, cache_dir, revision: base)
    minlora.export_peft_adapter(_with_adapter(GPT.from_pretrained("gpt2")), tmp_path / "hub")
    assert json.loads((tmp_path / "hub" / "adapter_config.json").read_text())["base_model_name_or_path"] == "gpt2"
    # The caller's base wins; a model built in memory has none.
    minlora.export_peft_adapter(_with_adapter(GPT(TINY)), tmp_path / "mem", base_model_name_or_path="x")
    assert json.loads((tmp_path / "mem" / "adapter_config.json").read_text())["base_model_name_or_path"] == "x"


def test_a_run_folder_as_peft_base_gets_a_readable_note(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert peft_base(str(run)) == str(run.resolve())
    note = capsys.readouterr().out
    assert note.startswith(f"note: PEFT's base {run} is a gpt2 run or checkpoint folder, which transformers cannot")
    assert f"`gpt2 export --model {run} --out DIR` and load the adapter on DIR" in note


def _cli(*argv) -> int:
    return main([str(a) for a in argv])


def test_a_peft_only_export_merges_nothing_and_warns_of_nothing(tmp_path, base, capsys, caplog):
    model = GPT.from_pretrained(base)
    minlora.add_lora(model, minlora.LoRAConfig(rank=2, include_lm_head=True))
    minlora.save_adapter(model, tmp_path / "adapter")
    assert _cli("export", "--model", base, "--adapter", tmp_path / "adapter", "--peft-out", tmp_path / "p") == 0
    out, err = capsys.readouterr()
    assert "merge_lora" not in out + err + caplog.text and "tied" not in out + err + caplog.text
    assert "wrote PEFT adapter" in out


def test_a_gguf_export_says_once_what_it_wrote(tmp_path, capsys, caplog):
    pytest.importorskip("gguf")
    torch.manual_seed(0)
    base = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)).save_pretrained(tmp_path / "base")
    caplog.set_level("DEBUG", logger="gguf")
    assert _cli("export", "--model", base, "--gguf", tmp_path / "m.gguf", "--gguf-type", "f32") == 0
    out, err = capsys.readouterr()
    said = out + err + caplog.text
    assert "tmp" not in said.replace(str(tmp_path), "") and "Little Endian" not in said
    file = tmp_path / "m.gguf"
    size = file.stat().st_size / 1e6
    assert [line for line in said.splitlines() if "m.gguf" in line] == [
        f"wrote model {file} (f32, {size:.1f} MB; run with llama.cpp: llama-cli -m {file})"
    ]

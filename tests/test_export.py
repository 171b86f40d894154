"""``gpt2 export --out`` folders that work everywhere with no extra flags: transformers'
``pipeline`` and ``AutoTokenizer`` (the tokenizer comes along), PEFT (the adapter names its base),
and LoRA / DoRA adapters merged in.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

import minlora
from gpt2.cli import main
from gpt2.files import OutputExistsError
from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from gpt2.model.tokenizer import get_tokenizer
from gpt2.outputs import RECORD_FILE

TINY = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32, pad_vocab_multiple=64)


def _cli(*argv) -> int:
    return main([str(a) for a in argv])


@pytest.fixture
def base(tmp_path):
    """A tiny random GPT-2 saved as a transformers folder."""
    torch.manual_seed(0)
    model = GPT(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))  # clear winners for greedy decoding
    return model.eval(), model.save_pretrained(tmp_path / "base")


@pytest.fixture
def tokenizer_from_cache_only(shared_data, tmp_path, monkeypatch):
    """No GPT2_TOKENIZER_DIR (nor a tiktoken cache): the BPE files come from the tokenizer's cache
    folder, as for a user.
    """
    cache = tmp_path / "cache"
    shutil.copytree(shared_data / "gpt2-tokenizer", cache / "gpt2-tokenizer")
    for name in ("GPT2_TOKENIZER_DIR", "TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPT2_CACHE_DIR", str(cache))


def _adapter(model: GPT, path, *, use_dora: bool) -> GPT:
    return _adapter_on(model, path, minlora.LoRAConfig(rank=4, use_dora=use_dora))


def _adapter_on(model: GPT, path, config: minlora.LoRAConfig) -> GPT:
    minlora.add_lora(model, config)
    with torch.no_grad():  # B = 0 at init: make the adapter change the outputs
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    minlora.save_adapter(model, path)
    return model


def test_export_works_in_a_transformers_pipeline(base, tmp_path, tokenizer_from_cache_only):
    model, base_dir = base
    out = tmp_path / "export"
    assert _cli("export", "--model", base_dir, "--out", out) == 0  # no --tokenizer-dir, no env var
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file(), name

    ours = get_tokenizer()
    text = "Hello world, said the tokenizer.<|endoftext|> Again!"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode(text) == ours.encode(text)
    assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id) == (50257, 50256, 50256)

    prompt = "ROMEO: What light"
    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    generated = pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    greedy = model.generate(torch.tensor([ours.encode(prompt)]), 8, temperature=0.0)[0]
    assert generated == ours.decode(greedy)  # the prompt and 8 new tokens, not the prompt alone
    assert len(tokenizer.encode(generated)) > len(tokenizer.encode(prompt))


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_export_merges_the_adapter_and_names_the_base_for_peft(base, tmp_path, capsys, use_dora):
    peft = pytest.importorskip("peft")
    model, base_dir = base
    tuned = _adapter(GPT.from_pretrained(base_dir), tmp_path / "adapter", use_dora=use_dora)
    x = torch.randint(0, 50257, (2, 12))
    with torch.no_grad():
        want = tuned(x)[0]
        assert not torch.allclose(want, model(x)[0], atol=1e-3)  # the adapter does something

    merged, peft_dir = tmp_path / "merged", tmp_path / "peft"
    argv = ["export", "--model", base_dir, "--adapter", tmp_path / "adapter", "--out", merged, "--peft-out", peft_dir]
    assert _cli(*argv) == 0
    capsys.readouterr()
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    assert config["use_dora"] is use_dora

    with torch.no_grad():
        hf_merged = transformers.GPT2LMHeadModel.from_pretrained(merged).eval()(x).logits
        # AutoPeftModel finds the base through base_model_name_or_path alone.
        hf_peft = peft.AutoPeftModelForCausalLM.from_pretrained(peft_dir).eval()(x).logits
    torch.testing.assert_close(hf_merged, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hf_peft, want, rtol=1e-4, atol=1e-4)


def test_peft_base_is_the_hub_id_when_the_model_is_one(base, tmp_path, monkeypatch):
    """A hub id is written as given (PEFT then downloads the same base); the hub is faked here."""
    import gpt2.model.hf as hf

    _, base_dir = base
    monkeypatch.setattr(hf, "_download", lambda repo_id, cache_dir, revision: base_dir)
    _adapter(GPT.from_pretrained(base_dir), tmp_path / "adapter", use_dora=False)
    assert _cli("export", "--model", "gpt2", "--adapter", tmp_path / "adapter", "--peft-out", tmp_path / "p") == 0
    assert json.loads((tmp_path / "p" / "adapter_config.json").read_text())["base_model_name_or_path"] == "gpt2"


def test_export_refuses_one_folder_for_both_and_the_models_own_folder(base, tmp_path, capsys):
    """One folder with the merged weights and adapter_config.json: transformers applies the adapter twice.
    The model's own folder: its weights would be replaced by the merged ones.
    """
    _, base_dir = base
    _adapter(GPT.from_pretrained(base_dir), tmp_path / "adapter", use_dora=False)
    files = {p.name: p.read_bytes() for p in base_dir.iterdir()}
    same = [tmp_path / "same", tmp_path / "x" / ".." / "same"]  # one folder, spelled two ways
    cases = [
        (["--out", same[0], "--peft-out", same[1]], "--out and --peft-out are one folder"),
        (["--out", base_dir], "the model's own folder"),
        (["--peft-out", base_dir, "--overwrite"], "the model's own folder"),
    ]
    for argv, message in cases:
        assert _cli("export", "--model", base_dir, "--adapter", tmp_path / "adapter", *argv) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "same").exists() and {p.name: p.read_bytes() for p in base_dir.iterdir()} == files


@pytest.mark.parametrize("option", ["include_embeddings", "include_lm_head"])
def test_export_refuses_an_adapter_that_unties_the_head_before_writing_anything(base, tmp_path, capsys, option):
    """Merging LoRA into the embedding or the head alone unties them; GPT2LMHeadModel holds one tensor."""
    _, base_dir = base
    _adapter_on(GPT.from_pretrained(base_dir), tmp_path / "adapter", minlora.LoRAConfig(rank=2, **{option: True}))
    argv = ["--out", tmp_path / "out", "--peft-out", tmp_path / "peft"]
    assert _cli("export", "--model", base_dir, "--adapter", tmp_path / "adapter", *argv) == 2
    assert "the LM head differs from the token embedding" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "peft").exists()


def test_dora_is_one_flag_and_sample_runs_with_a_dora_adapter(base, tmp_path, capsys):
    assert _cli("finetune", "--help") == 0
    assert "--lora.use-dora" in capsys.readouterr().out
    _, base_dir = base
    _adapter(GPT.from_pretrained(base_dir), tmp_path / "dora", use_dora=True)
    args = ["--model", base_dir, "--prompt", "Hello", "--max-new-tokens", "5", "--temperature", "0"]
    assert _cli("sample", *args, "--adapter", tmp_path / "dora", "--device", "cpu") == 0
    with_dora = capsys.readouterr().out
    assert _cli("sample", *args, "--device", "cpu") == 0
    assert with_dora != capsys.readouterr().out  # the adapter was applied


def test_an_export_replaces_only_its_own_earlier_files(base, tmp_path, capsys):
    """save_pretrained replaces what it recorded writing (the record is inside the folder), nothing else; a file
    the user changed since is refused in one line naming it and the flag, before anything is written.
    """
    model, base_dir = base
    out = tmp_path / "out"
    model.save_pretrained(out)
    recorded = json.loads((out / RECORD_FILE).read_text())
    assert sorted([*recorded, RECORD_FILE]) == sorted(p.name for p in out.iterdir())
    assert not (tmp_path / RECORD_FILE).exists()
    (out / "config.json").write_text('{"edited": "by hand"}')
    assert _cli("export", "--model", base_dir, "--out", out) != 0
    assert f"{out} holds config.json, which gpt2 did not write there" in capsys.readouterr().err

    weights = (out / "model.safetensors").read_bytes()
    with pytest.raises(OutputExistsError, match=r"config.json, which gpt2 did not write .* pass overwrite=True"):
        model.save_pretrained(out, safe_serialization=False)
    assert (out / "model.safetensors").read_bytes() == weights and not (out / "pytorch_model.bin").exists()
    model.save_pretrained(out, overwrite=True)
    assert "edited" not in (out / "config.json").read_text()

    # A user's files beside the export, even one named like a weights file, are never touched.
    (out / "notes.txt").write_text("mine")
    (out / "model_backup.safetensors").write_bytes(weights)
    model.save_pretrained(out, safe_serialization=False)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model_backup.safetensors").read_bytes() == weights
    assert not (out / "model.safetensors").exists()  # its own earlier weights: replaced by the .bin

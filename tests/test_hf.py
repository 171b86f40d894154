"""Hugging Face interop against randomly initialised ``transformers`` GPT-2 models (no downloads)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

from gpt2.errors import MissingFileError
from gpt2.model.checkpoint_files import CheckpointMismatchError
from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from gpt2.model.hf_convert import config_from_hf, gpt_to_hf_state_dict, hf_config_from_gpt, hf_to_gpt_state_dict
from gpt2.outputs import RECORD_FILE


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    """transformers warns about bos/eos ids outside a tiny vocabulary; keep the output readable."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


TINY = dict(n_positions=32, n_embd=32, n_layer=2, n_head=4, vocab_size=100, bos_token_id=None, eos_token_id=None)


def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every tensor random and distinct (HF initialises biases to 0 and LayerNorms to 1, which
    would hide a swapped bias or a missed LayerNorm in the conversion).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def _hf_model(**overrides) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**{**TINY, **overrides}))
    _randomise(model)
    return model.eval()


@pytest.fixture(scope="module")
def hf_model() -> GPT2LMHeadModel:
    return _hf_model()


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf_tiny")
    hf_model.save_pretrained(d)
    return d


def _ids(vocab: int = 100, shape=(2, 16), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _assert_same_logits_and_loss(ours: GPT, hf: GPT2LMHeadModel, idx: torch.Tensor) -> None:
    with torch.no_grad():
        hf_out = hf(idx, labels=idx)  # HF shifts labels inside: position t predicts idx[t + 1]
        targets = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -1)], dim=1)  # last one ignored
        logits, loss = ours(idx)[0], ours(idx, targets)[1]
    assert logits.shape == hf_out.logits.shape
    assert (logits - hf_out.logits).abs().max().item() <= 1e-4
    assert abs(loss.item() - hf_out.loss.item()) <= 1e-5


# ---------------------------------------------------------------------------- loading
def test_from_pretrained_matches_transformers(hf_model, hf_dir):
    ours = GPT.from_pretrained(hf_dir)
    assert not ours.training
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert ours.config == GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=4, n_embd=32)
    assert ours.num_params() == sum(p.numel() for p in hf_model.parameters())
    _assert_same_logits_and_loss(ours, hf_model, _ids())
    # The classmethod delegates to the same loader.
    _assert_same_logits_and_loss(GPT.from_pretrained(str(hf_dir)), hf_model, _ids(seed=2))


def test_from_pretrained_dtype_device_dropout(hf_dir):
    ours = GPT.from_pretrained(hf_dir, dtype=torch.bfloat16, device="cpu", dropout=0.1)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert ours.config.dropout == 0.1
    reference = GPT.from_pretrained(hf_dir)
    torch.testing.assert_close(
        ours.transformer.h[0].mlp.c_fc.weight, reference.transformer.h[0].mlp.c_fc.weight.bfloat16()
    )


def _legacy_state_dict(hf_model: GPT2LMHeadModel, prefix: bool) -> dict[str, torch.Tensor]:
    """What old transformers versions saved: the causal-mask buffers included, and (for GPT2Model
    checkpoints such as the hub's ``gpt2``) keys without ``transformer.`` and no ``lm_head``.
    """
    sd = {k: v.clone() for k, v in hf_model.state_dict().items()}
    if not prefix:
        sd = {k.removeprefix("transformer."): v for k, v in sd.items() if k != "lm_head.weight"}
    n = hf_model.config.n_positions
    for i in range(hf_model.config.n_layer):
        p = f"{'transformer.' if prefix else ''}h.{i}.attn."
        sd[p + "bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
        sd[p + "masked_bias"] = torch.tensor(-1e4)
    return sd


def _write_dir(d: Path, hf_model, sd: dict[str, torch.Tensor], fmt: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    hf_model.config.to_json_file(d / "config.json")
    if fmt == "bin":
        torch.save(sd, d / "pytorch_model.bin")
    elif fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in sd.items()}, d / "model.safetensors", metadata={"format": "pt"})
    else:  # sharded: half the keys per shard, plus the index transformers writes
        ext = "bin" if fmt == "sharded-bin" else "safetensors"
        keys = sorted(sd)
        shards = {f"model-0000{i + 1}-of-00002.{ext}": keys[i::2] for i in range(2)}
        weight_map = {}
        for name, shard_keys in shards.items():
            part = {k: sd[k].contiguous() for k in shard_keys}
            torch.save(part, d / name) if ext == "bin" else save_file(part, d / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard_keys, name))
        index = "pytorch_model.bin.index.json" if ext == "bin" else "model.safetensors.index.json"
        (d / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


@pytest.mark.parametrize("fmt", ["bin", "safetensors", "sharded-bin", "sharded-safetensors"])
@pytest.mark.parametrize("prefix", [True, False], ids=["GPT2LMHeadModel-keys", "GPT2Model-keys"])
def test_from_pretrained_file_formats(hf_model, tmp_path, fmt, prefix):
    d = _write_dir(tmp_path / fmt, hf_model, _legacy_state_dict(hf_model, prefix), fmt)
    _assert_same_logits_and_loss(GPT.from_pretrained(d), hf_model, _ids())


def test_from_pretrained_prefers_safetensors(hf_model, hf_dir, tmp_path):
    d = tmp_path / "both"
    d.mkdir()
    for f in hf_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    torch.save({"garbage": torch.zeros(1)}, d / "pytorch_model.bin")  # would fail the key check
    _assert_same_logits_and_loss(GPT.from_pretrained(d), hf_model, _ids())


def test_gpt2model_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    base = GPT2Model(GPT2Config(**TINY))
    _randomise(base)
    base.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(tmp_path)
    head = GPT2LMHeadModel(GPT2Config(**TINY))
    head.transformer.load_state_dict(base.state_dict())
    head.tie_weights()
    _assert_same_logits_and_loss(ours, head.eval(), _ids())


# ---------------------------------------------------------------------------- round trips
def test_files_round_trip_hf_ours_hf(hf_model, hf_dir, tmp_path):
    GPT.from_pretrained(hf_dir).save_pretrained(tmp_path)
    original, written = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert set(written) == set(original)  # the tied head is stored once, as transformers does
    for key in original:
        assert torch.equal(written[key], original[key]), key
    # Conv1D weights really are transposed in our layout (a square c_proj would hide a missed
    # transpose by shape; the round trip above would hide a transpose done twice).
    ours = hf_to_gpt_state_dict(hf_model.state_dict(), config_from_hf(hf_model.config))
    hf_weight = hf_model.state_dict()["transformer.h.0.attn.c_proj.weight"]
    assert hf_weight.shape[0] == hf_weight.shape[1]
    torch.testing.assert_close(ours["transformer.h.0.attn.c_proj.weight"], hf_weight.T)


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(pad_vocab_multiple=64), dict(bias=False), dict(layer_norm_epsilon=1e-6)],
    ids=["plain", "padded-vocab", "no-bias", "eps"],
)
def test_save_pretrained_loads_in_transformers(tmp_path, overrides):
    config = GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=4, n_embd=32, **overrides)
    ours = GPT(config).eval()
    _randomise(ours)
    out = GPT.save_pretrained(ours, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD_FILE, "config.json", "model.safetensors"]
    hf = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    assert hf.config.vocab_size == 100 and hf.config.layer_norm_epsilon == config.layer_norm_epsilon
    _assert_same_logits_and_loss(ours, hf, _ids())
    # And back: our loader reads what we wrote.
    again = GPT.from_pretrained(tmp_path, pad_vocab_multiple=config.pad_vocab_multiple)
    idx = _ids()
    torch.testing.assert_close(again(idx)[0], ours(idx)[0])
    assert Path(out) == tmp_path


def test_crash_during_save_pretrained_keeps_the_previous_export(tmp_path, monkeypatch):
    config = GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=4, n_embd=32)
    first, second = GPT(config).eval(), GPT(config).eval()
    _randomise(first, seed=1)
    _randomise(second, seed=2)
    first.save_pretrained(tmp_path)
    import gpt2.files

    real_fsync = gpt2.files.os.fsync

    def crash_midway(fd):  # the temporary weights file is written, the disk fills up before the rename
        if os.fstat(fd).st_size > 1000:
            raise OSError("disk full")
        return real_fsync(fd)

    monkeypatch.setattr(gpt2.files.os, "fsync", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        second.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        RECORD_FILE,
        "config.json",
        "model.safetensors",
    ]  # no temp left
    _assert_same_logits_and_loss(first, GPT2LMHeadModel.from_pretrained(tmp_path).eval(), _ids())


def test_save_pretrained_of_a_compiled_model_writes_plain_names(tmp_path, hf_model):
    config = config_from_hf(hf_model.config)
    ours = GPT(config).eval()
    ours.load_state_dict(hf_to_gpt_state_dict(hf_model.state_dict(), config))
    torch.compile(ours).save_pretrained(tmp_path)  # no compilation happens: never called
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert not any(k.startswith(("_orig_mod", "module")) or "._orig_mod" in k for k in keys)
    _assert_same_logits_and_loss(ours, GPT2LMHeadModel.from_pretrained(tmp_path).eval(), _ids())


def test_save_pretrained_pytorch_bin_and_tokenizer(tmp_path, hf_model, shared_data):
    import tiktoken

    config = config_from_hf(hf_model.config)
    ours = GPT(config).eval()
    ours.load_state_dict(hf_to_gpt_state_dict(hf_model.state_dict(), config))
    ours.save_pretrained(tmp_path, safe_serialization=False, tokenizer_dir=shared_data / "gpt2-tokenizer")
    assert not (tmp_path / "model.safetensors").exists()
    sd = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)  # tensors only, no pickled code
    assert set(sd) == set(hf_model.state_dict()) - {"lm_head.weight"}  # tied head stored once
    _assert_same_logits_and_loss(GPT.from_pretrained(tmp_path), hf_model, _ids())
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello world, said the GPT-2 tokenizer.<|endoftext|> Again!"
    assert tokenizer.encode(text) == tiktoken.get_encoding("gpt2").encode(text, allowed_special="all")
    assert tokenizer.eos_token_id == 50256


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_save_pretrained_over_a_sharded_save_leaves_no_stale_weights(tmp_path, hf_model, safe_serialization):
    """An index (and its shards) of an earlier save would win over a new pytorch_model.bin, in
    transformers and in our loader: every other weights file goes.
    """
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded safetensors
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    shard, sd = "pytorch_model-00001-of-00001.bin", hf_model.state_dict()  # and a sharded .bin
    torch.save(sd, tmp_path / shard)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(sd, shard)}))
    config = config_from_hf(hf_model.config)
    ours = GPT(config).eval()  # other (random) weights than hf_model's
    # transformers wrote these files, not gpt2: replacing them takes overwrite.
    ours.save_pretrained(tmp_path, safe_serialization=safe_serialization, overwrite=True)
    weights = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("model", "pytorch_model")))
    assert weights == ["model.safetensors" if safe_serialization else "pytorch_model.bin"]
    _assert_same_logits_and_loss(ours, GPT2LMHeadModel.from_pretrained(tmp_path).eval(), _ids())
    torch.testing.assert_close(GPT.from_pretrained(tmp_path).eval()(_ids())[0], ours(_ids())[0], rtol=0, atol=0)


def test_save_pretrained_of_a_toy_vocabulary_over_a_gpt2_export_removes_its_tokenizer(tmp_path, shared_data, config):
    """A model without GPT-2's vocabulary gets no tokenizer files: an earlier export's, left in the
    folder, made AutoTokenizer produce ids the model does not have.
    """
    big = GPT(dataclasses.replace(config, vocab_size=50257))
    big.save_pretrained(tmp_path, tokenizer_dir=shared_data / "gpt2-tokenizer")
    assert (tmp_path / "vocab.json").is_file()
    GPT(config).save_pretrained(tmp_path)
    assert not [n for n in ("vocab.json", "merges.txt", "tokenizer_config.json") if (tmp_path / n).exists()]
    assert GPT2LMHeadModel.from_pretrained(tmp_path).config.vocab_size == config.vocab_size


def test_padded_vocab_import_and_export(hf_model, hf_dir, tmp_path):
    padded = GPT.from_pretrained(hf_dir, pad_vocab_multiple=64)
    wte = padded.transformer.wte.weight
    assert wte.shape == (128, 32) and padded.config.vocab_size == 100
    assert torch.count_nonzero(wte[100:]) == 0  # inert zero rows
    torch.testing.assert_close(wte[:100], hf_model.transformer.wte.weight)
    _assert_same_logits_and_loss(padded, hf_model, _ids())
    exported = gpt_to_hf_state_dict(padded.state_dict(), padded.config)
    assert exported["transformer.wte.weight"].shape == (100, 32)
    assert exported["lm_head.weight"] is exported["transformer.wte.weight"]
    assert torch.equal(exported["transformer.wte.weight"], hf_model.transformer.wte.weight)


# ---------------------------------------------------------------------------- generation
def test_greedy_generation_matches_transformers(hf_model, hf_dir):
    from gpt2.model.generate import pad_prompts

    ours = GPT.from_pretrained(hf_dir)
    prompt = _ids(shape=(2, 6), seed=3)
    expected = hf_model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False, pad_token_id=0
    )
    # Left-padded prompts of different lengths, as transformers batches them.
    ids, mask = pad_prompts([[5, 17, 3], [9, 8, 7, 6, 5, 4, 3]], pad_id=0)
    expected_padded = hf_model.generate(
        ids, attention_mask=mask.long(), max_new_tokens=20, do_sample=False, pad_token_id=0
    )
    for use_cache in (True, False):  # the reference is computed once for both
        assert torch.equal(ours.generate(prompt, 20, temperature=0, use_cache=use_cache), expected), use_cache
        padded = ours.generate(ids, 20, temperature=0, attention_mask=mask, use_cache=use_cache)
        assert torch.equal(padded, expected_padded), use_cache


# ---------------------------------------------------------------------------- configs
def test_config_round_trip():
    config = GPTConfig(block_size=48, vocab_size=300, n_layer=3, n_head=2, n_embd=16, layer_norm_epsilon=1e-6)
    hf_config = GPT2Config(**hf_config_from_gpt(config))
    assert config_from_hf(hf_config) == config
    assert config_from_hf(hf_config.to_dict(), pad_vocab_multiple=64).padded_vocab_size == 320
    assert hf_config_from_gpt(GPTConfig.from_name("gpt2"))["eos_token_id"] == 50256
    assert hf_config_from_gpt(config)["eos_token_id"] is None  # <|endoftext|> is not in a 300-token vocab


def test_context_length_is_read_as_transformers_reads_it():
    """n_positions, 1024 where absent; n_ctx is ignored, as GPT2Config ignores it."""
    shape = {"n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 300}
    for config in ({**shape, "n_ctx": 64}, {**shape, "n_ctx": 64, "n_positions": 32}):
        assert config_from_hf(config).block_size == GPT2Config.from_dict(config).n_positions


def test_preset_sizes_match_transformers():
    for name in ("gpt2", "gpt2-xl"):
        config = GPTConfig.from_name(name)
        with torch.device("meta"):
            hf = GPT2LMHeadModel(GPT2Config(**hf_config_from_gpt(config)))
            ours = GPT(config)
        assert ours.num_params() == sum(p.numel() for p in hf.parameters()), name


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(activation_function="relu"), r"activation_function='relu'"),
        (dict(n_inner=64), r"n_inner=64 \(this model's MLP is 4 \* n_embd = 128 wide\)"),
        (dict(scale_attn_by_inverse_layer_idx=True), r"scale_attn_by_inverse_layer_idx=True"),
        (dict(reorder_and_upcast_attn=True), r"reorder_and_upcast_attn=True"),
        (dict(scale_attn_weights=False), r"scale_attn_weights=False"),
        (dict(tie_word_embeddings=False), r"tie_word_embeddings=False"),
        (dict(model_type="gpt_neo"), r"not a GPT-2 config: model_type is 'gpt_neo'"),
    ],
)
def test_unsupported_configs_are_rejected(overrides, message):
    config = {**GPT2Config(**TINY).to_dict(), **overrides}
    with pytest.raises(ValueError, match=message):
        config_from_hf(config)


def test_unsupported_config_rejected_by_from_pretrained(tmp_path, hf_dir):
    for f in hf_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "gelu"}))
    with pytest.raises(ValueError, match=r"unsupported GPT-2 config: activation_function='gelu'"):
        GPT.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------- errors
@pytest.fixture
def config(hf_model) -> GPTConfig:
    return config_from_hf(hf_model.config)


def test_missing_key(hf_model, config):
    sd = dict(hf_model.state_dict())
    del sd["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(CheckpointMismatchError, match=r"missing key 'h.1.mlp.c_fc.bias' \(expected shape \(128,\)\)"):
        hf_to_gpt_state_dict(sd, config)


def test_unexpected_key(hf_model, config):
    sd = {**hf_model.state_dict(), "transformer.h.0.attn.q_proj.weight": torch.zeros(32, 32)}
    with pytest.raises(CheckpointMismatchError, match=r"unexpected key 'h.0.attn.q_proj.weight' \(shape \(32, 32\)\)"):
        hf_to_gpt_state_dict(sd, config)


def test_wrong_shape(hf_model, config):
    sd = {**hf_model.state_dict(), "transformer.wpe.weight": torch.zeros(16, 32)}
    with pytest.raises(CheckpointMismatchError, match=r"key 'wpe.weight': expected shape \(32, 32\), found \(16, 32\)"):
        hf_to_gpt_state_dict(sd, config)
    sd = {**hf_model.state_dict(), "transformer.h.0.attn.c_attn.weight": torch.zeros(96, 32)}  # Linear layout
    with pytest.raises(
        CheckpointMismatchError, match=r"key 'h.0.attn.c_attn.weight': expected shape \(32, 96\), found \(96, 32\)"
    ):
        hf_to_gpt_state_dict(sd, config)


def test_wrong_size_checkpoint_in_a_directory(tmp_path, hf_model):
    _write_dir(
        tmp_path,
        hf_model,
        {k: v for k, v in hf_model.state_dict().items() if ".h.1." not in k and k != "lm_head.weight"},
        "safetensors",
    )
    with pytest.raises(CheckpointMismatchError, match=r"missing key 'h.1.ln_1.weight'"):
        GPT.from_pretrained(tmp_path)


def test_tied_weight_stored_under_lm_head_only(hf_model, config):
    sd = {k: v for k, v in hf_model.state_dict().items() if k != "transformer.wte.weight"}
    ours = hf_to_gpt_state_dict(sd, config)
    assert torch.equal(ours["transformer.wte.weight"], hf_model.transformer.wte.weight)


def test_untied_lm_head_is_rejected(hf_model, config):
    sd = {**hf_model.state_dict(), "lm_head.weight": torch.zeros(100, 32)}
    with pytest.raises(CheckpointMismatchError, match="'lm_head.weight' differs from 'transformer.wte.weight'"):
        hf_to_gpt_state_dict(sd, config)


def test_export_errors(config):
    model = GPT(config)
    _randomise(model)
    sd = model.state_dict()
    with pytest.raises(CheckpointMismatchError, match=r"missing key 'transformer.ln_f.bias'"):
        gpt_to_hf_state_dict({k: v for k, v in sd.items() if k != "transformer.ln_f.bias"}, config)
    with pytest.raises(CheckpointMismatchError, match=r"model._orig_mod for torch.compile"):
        gpt_to_hf_state_dict({"_orig_mod." + k: v for k, v in sd.items()}, config)
    with pytest.raises(
        CheckpointMismatchError, match=r"key 'transformer.wpe.weight': expected shape \(32, 32\), found \(64, 32\)"
    ):
        gpt_to_hf_state_dict(GPT(dataclasses.replace(config, block_size=64)).state_dict(), config)
    bias_free = dataclasses.replace(config, bias=False)
    with pytest.raises(CheckpointMismatchError, match=r"non-zero biases but config.bias=False"):
        hf_to_gpt_state_dict(gpt_to_hf_state_dict(sd, config), bias_free)


def test_save_pretrained_refuses_parametrized_model(tmp_path, config):
    from torch.nn.utils import parametrize

    class Scale(torch.nn.Module):  # stands in for a LoRA parametrization
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return 2 * weight

    model = GPT(config)
    parametrize.register_parametrization(model.transformer.h[0].attn.c_attn, "weight", Scale())
    with pytest.raises(
        ValueError,
        match=r"parametrizations \(e.g. LoRA\) on \['transformer.h.0.attn.c_attn'\].*minlora.merge_lora\(model\)",
    ):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_nonexistent_path(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="does not exist: it is neither an existing directory nor a Hugging Face hub id"
    ):
        GPT.from_pretrained(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(FileNotFoundError, match="'./checkpoints/missing' does not exist"):
        GPT.from_pretrained("./checkpoints/missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        GPT.from_pretrained(tmp_path / "file.txt")
    with pytest.raises(FileNotFoundError, match=r"holds no model: .*no config.json"):
        GPT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(GPT2Config(**TINY).to_dict()))
    with pytest.raises(FileNotFoundError, match=r"no weights in .* expected model.safetensors"):
        GPT.from_pretrained(tmp_path)


def test_hub_unreachable(tmp_path, monkeypatch):
    # conftest sets HF_HUB_OFFLINE=1: with an empty cache the real snapshot_download fails offline.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConnectionError, match=r"(?s)could not load 'gpt2'.*hub could not be reached.*HF_HOME.*local directory"
    ):
        GPT.from_pretrained("gpt2", cache_dir=tmp_path)
    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(
        ConnectionError, match=r"could not load 'openai-community/gpt2-medium'.*Name or service not known"
    ):
        GPT.from_pretrained("openai-community/gpt2-medium")


def test_hub_snapshot_is_loaded_with_bin_fallback(tmp_path, monkeypatch, hf_model):
    """A hub id goes through snapshot_download (here a fake serving a .bin-only repo)."""
    import huggingface_hub

    repo = _write_dir(tmp_path / "snapshot", hf_model, _legacy_state_dict(hf_model, prefix=False), "bin")
    calls = []

    def fake_snapshot_download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None, **kwargs):
        calls.append((repo_id, revision, tuple(allow_patterns)))
        return str(repo)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    # A directory that is no checkpoint (this repo's own gpt2/ package, say) does not shadow the id.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2").mkdir()
    ours = GPT.from_pretrained("gpt2", revision="main", cache_dir=tmp_path / "cache")
    _assert_same_logits_and_loss(ours, hf_model, _ids())
    assert [c[:2] for c in calls] == [("gpt2", "main")] * 2  # safetensors first, then the .bin fallback
    assert any(p.endswith(".safetensors") for p in calls[0][2])
    assert any(p.endswith(".bin") for p in calls[1][2])


# ---------------------------------------------------------------------------- 124M
@pytest.mark.slow
def test_full_124m_shape_parity(tmp_path, all_threads):
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config()).eval()  # the gpt2 (124M) shape, random weights
    with torch.no_grad():  # non-trivial biases and LayerNorms, cheaply (only the small tensors)
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(tmp_path)
    assert ours.config == GPTConfig.from_name("gpt2")
    idx = _ids(vocab=50257, shape=(1, 16))
    _assert_same_logits_and_loss(ours, hf, idx)


@pytest.mark.parametrize("fmt", ["sharded-bin", "sharded-safetensors"])
def test_a_shard_missing_from_a_transformers_folder_is_named_as_its_index_lists_it(hf_model, tmp_path, fmt):
    d = _write_dir(tmp_path / fmt, hf_model, _legacy_state_dict(hf_model, True), fmt)
    ext = "bin" if fmt == "sharded-bin" else "safetensors"
    (d / f"model-00002-of-00002.{ext}").unlink()
    with pytest.raises(
        MissingFileError, match=rf"shard 'model-00002-of-00002.{ext}' listed in .*index.json is missing"
    ):
        GPT.from_pretrained(d)

"""GGUF export: the file read back with gguf's own reader (every tensor, the metadata, the
tokenizer), adapters merged by ``gpt2 export --gguf``, and, where llama-cpp-python is installed,
llama.cpp's logits and greedy tokens against ours on a briefly trained model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import minlora
from gpt2.cli import main
from gpt2.files import OutputExistsError
from gpt2.model.config import GPTConfig
from gpt2.model.gguf import _gguf_tensors, save_gguf
from gpt2.model.gpt import GPT
from gpt2.model.tokenizer import bpe_files, get_tokenizer

gguf = pytest.importorskip("gguf")

TINY = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64, pad_vocab_multiple=64)  # 50304 rows


def _random_model(seed: int = 0) -> GPT:
    """Every tensor random and distinct (zero biases and unit LayerNorms would hide a swap)."""
    torch.manual_seed(seed)
    model = GPT(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    return model.eval()


def _expected_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """llama.cpp's GPT-2 names, written out by hand from its converter, mapped to our weights."""
    sd = model.state_dict()
    out = {
        "token_embd.weight": sd["transformer.wte.weight"][:50257],  # padding rows cut
        "position_embd.weight": sd["transformer.wpe.weight"],
        "output_norm.weight": sd["transformer.ln_f.weight"],
        "output_norm.bias": sd["transformer.ln_f.bias"],
    }
    ours = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj"}
    ours |= {"ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
    for i in range(model.config.n_layer):
        for theirs, mine in ours.items():
            for kind in ("weight", "bias"):
                out[f"blk.{i}.{theirs}.{kind}"] = sd[f"transformer.h.{i}.{mine}.{kind}"]
    return out


def _read_tensor(t) -> np.ndarray:
    """A tensor of the file as float32 (rows, columns), q8_0 decoded by hand: blocks of one
    float16 scale and 32 int8 values.
    """
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        blocks = np.asarray(t.data).reshape(-1, 34)
        scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        values = scale * blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return values.reshape([int(n) for n in reversed(t.shape)])
    return np.asarray(t.data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])


def _reader(path):
    """gguf's own reader, on the file's bytes in memory rather than a numpy memmap: it takes a slice
    per part of every field (~250,000 for GPT-2's vocabulary), and a memmap slice costs ~3x an
    array's (seconds a file).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(np, "memmap", lambda path, mode="r": np.fromfile(path, dtype=np.uint8))
        return gguf.GGUFReader(path)


def _field(reader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_gguf_file_holds_every_tensor_and_the_tokenizer(tmp_path, dtype):
    model = _random_model()
    reader = _reader(save_gguf(model, tmp_path / "m.gguf", dtype=dtype))

    expected = _expected_tensors(model)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(expected)  # no output.weight: the head is tied to token_embd
    for name, want in expected.items():
        t, want = tensors[name], want.numpy()
        got = _read_tensor(t)
        assert got.shape == want.shape, name  # (out, in) as nn.Linear: nothing transposed
        if want.ndim == 1:  # norms and biases stay float32 in every type
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(got, want)
        elif dtype == "f32":
            np.testing.assert_array_equal(got, want)
        elif dtype == "f16":
            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))
        else:  # q8_0: within half a step (step = block max / 127), plus the step's own float16
            # rounding (relative 2**-11) times the largest multiplier, 127
            assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
            step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            err = np.abs(got.reshape(-1, 32) - want.reshape(-1, 32))
            assert (err <= step * (0.5 + 127 * 2**-11) + 1e-7).all(), name

    config = model.config
    assert _field(reader, "general.architecture") == "gpt2"
    for key, value in {
        "context_length": config.block_size,
        "embedding_length": config.n_embd,
        "block_count": config.n_layer,
        "feed_forward_length": 4 * config.n_embd,
        "attention.head_count": config.n_head,
    }.items():
        assert _field(reader, f"gpt2.{key}") == value, key
    assert _field(reader, "gpt2.attention.layer_norm_epsilon") == pytest.approx(config.layer_norm_epsilon)
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}
    assert _field(reader, "general.file_type") == file_types.get(dtype, gguf.LlamaFileType.MOSTLY_Q8_0)

    # The tokenizer: GPT-2's own files, id for id; <|endoftext|> is BOS/EOS, a control token.
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    vocab_bpe, encoder_json = bpe_files()
    encoder = json.loads(encoder_json.read_text(encoding="utf-8"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == 50257 and all(encoder[tok] == i for i, tok in enumerate(tokens))
    tok = get_tokenizer()
    assert tokens[tok.encode(" Hello")[0]] == "\u0120Hello"  # GPT-2 writes the space as U+0120
    merges = _field(reader, "tokenizer.ggml.merges")
    assert merges == vocab_bpe.read_text(encoding="utf-8").splitlines()[1:50001] and len(merges) == 50000
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[50256] == gguf.TokenType.CONTROL and set(types[:50256]) == {gguf.TokenType.NORMAL}
    for key in ("bos_token_id", "eos_token_id"):
        assert _field(reader, f"tokenizer.ggml.{key}") == 50256
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False


def test_export_gguf_merges_a_dora_adapter(tmp_path, capsys):
    base = _random_model()
    base.save_pretrained(tmp_path / "base")
    tuned = GPT.from_pretrained(tmp_path / "base")
    minlora.add_lora(tuned, minlora.LoRAConfig(rank=4, use_dora=True))
    with torch.no_grad():  # B = 0 at init: make the adapter change the weights
        for name, p in tuned.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    minlora.save_adapter(tuned, tmp_path / "adapter")
    x = torch.randint(0, 50257, (1, 12))
    want_logits = tuned(x)[0]
    minlora.merge_lora(tuned)

    out = tmp_path / "tuned.gguf"
    argv = ["export", "--model", tmp_path / "base", "--adapter", tmp_path / "adapter", "--gguf", out]
    assert main([str(a) for a in [*argv, "--gguf-type", "f32"]]) == 0
    assert "merged model" in capsys.readouterr().out
    tensors = {t.name: _read_tensor(t) for t in _reader(out).tensors}
    for name, want in _expected_tensors(tuned).items():
        np.testing.assert_allclose(tensors[name], want.numpy(), rtol=0, atol=1e-6, err_msg=name)
    assert not np.allclose(tensors["blk.0.attn_qkv.weight"], base.transformer.h[0].attn.c_attn.weight.detach())
    torch.testing.assert_close(tuned(x)[0], want_logits, rtol=1e-4, atol=1e-4)  # merged == adapter on


def test_save_gguf_refusals(tmp_path):
    model = _random_model()
    with pytest.raises(ValueError, match="'q4_0'.*f32, f16, q8_0"):
        save_gguf(model, tmp_path / "m.gguf", dtype="q4_0")
    minlora.add_lora(model, minlora.LoRAConfig(rank=2))
    with pytest.raises(ValueError, match=r"adapter.*minlora.merge_lora"):
        save_gguf(model, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="100-token vocabulary.*50257"):
        save_gguf(GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=32)), tmp_path / "m.gguf")
    bias_free = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, bias=False))
    assert not _gguf_tensors(bias_free, bias_free.config)["blk.0.attn_qkv.bias"].any()  # llama.cpp needs biases
    with pytest.raises(TypeError, match="expects a gpt2.GPT"):
        save_gguf(torch.nn.Linear(2, 2), tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("dtype, big", [("f16", 7e4), ("f16", -1e6), ("q8_0", 1e7)])
def test_a_weight_the_type_cannot_hold_keeps_its_tensor_in_f32(tmp_path, caplog, dtype, big):
    """f16 holds |x| <= 65504 and q8_0's f16 block scales |x| / 127 no more; beyond that the
    file held inf (and exited 0). That tensor is f32 instead, named in a warning; the others keep the type.
    """
    model = _random_model()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[3, 5] = big
    with caplog.at_level("WARNING", logger="gpt2.model.gguf"):
        reader = _reader(save_gguf(model, tmp_path / "m.gguf", dtype=dtype))
    tensors = {t.name: t for t in reader.tensors}
    for name, t in tensors.items():
        assert np.isfinite(_read_tensor(t)).all(), name
    up = tensors["blk.1.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(_read_tensor(up), model.transformer.h[1].mlp.c_fc.weight.detach().numpy())
    assert tensors["blk.0.ffn_up.weight"].tensor_type == getattr(gguf.GGMLQuantizationType, dtype.upper())
    assert "blk.1.ffn_up.weight holds values up to" in caplog.text and f"beyond what {dtype} can hold" in caplog.text
    assert caplog.text.count("GGUF export:") == 1


def test_save_gguf_writes_a_new_file_or_replaces_one_only_with_overwrite(tmp_path):
    """Any llama.cpp model is a GGUF file: an existing one is replaced only when the user asks, and nothing is
    written beside it.
    """
    model = _random_model()
    theirs = tmp_path / "llama.gguf"
    theirs.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(OutputExistsError, match=r"llama.gguf exists: choose another path, or pass overwrite=True"):
        save_gguf(model, theirs, dtype="f32")
    assert theirs.read_bytes() == b"GGUF" + bytes(60)
    path = save_gguf(model, tmp_path / "m.gguf", dtype="f32")
    with pytest.raises(OutputExistsError, match="m.gguf exists"):
        save_gguf(model, path, dtype="f16")
    save_gguf(model, theirs, dtype="f32", overwrite=True)
    assert len(_reader(theirs).tensors) == len(_expected_tensors(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.gguf", "m.gguf"]


def _adapter(base_dir, path, tie: bool = False, **config) -> GPT:
    model = GPT.from_pretrained(base_dir)
    minlora.add_lora(model, minlora.LoRAConfig(rank=2, **config))
    if tie:  # one update shared by the head and the embedding
        minlora.tie_weights(model.lm_head, model.transformer.wte)
    with torch.no_grad():  # B = 0 at init: make the adapter change the weights
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    minlora.save_adapter(model, path)
    return model


@pytest.mark.parametrize("option", ["include_embeddings", "include_lm_head"])
def test_an_adapter_that_unties_the_head_is_refused_with_nothing_written(tmp_path, capsys, option):
    """The file holds token_embd only and llama.cpp uses it as the head too: a merged adapter on the
    embedding or the head alone would make that model silently wrong.
    """
    _random_model().save_pretrained(tmp_path / "base")
    tuned = _adapter(tmp_path / "base", tmp_path / "adapter", **{option: True})
    out, peft = tmp_path / "m.gguf", tmp_path / "peft"
    argv = [
        "export",
        "--model",
        tmp_path / "base",
        "--adapter",
        tmp_path / "adapter",
        "--gguf",
        out,
        "--peft-out",
        peft,
    ]
    assert main([str(a) for a in argv]) == 2
    assert "the LM head differs from the token embedding" in capsys.readouterr().err
    assert not out.exists() and not peft.exists()  # checked before the PEFT adapter is written
    minlora.merge_lora(tuned)
    with pytest.raises(ValueError, match="LM head differs from the token embedding"):
        save_gguf(tuned, out)
    assert not out.exists()


def test_an_adapter_tied_between_head_and_embedding_still_exports(tmp_path):
    """minlora.tie_weights shares one update: merged, head and embedding stay one tensor."""
    _random_model().save_pretrained(tmp_path / "base")
    model = _adapter(tmp_path / "base", tmp_path / "adapter", tie=True, include_embeddings=True, include_lm_head=True)
    argv = ["export", "--model", tmp_path / "base", "--adapter", tmp_path / "adapter", "--gguf", tmp_path / "m.gguf"]
    assert main([str(a) for a in [*argv, "--gguf-type", "f32"]]) == 0
    minlora.merge_lora(model)
    embd = {t.name: _read_tensor(t) for t in _reader(tmp_path / "m.gguf").tensors}["token_embd.weight"]
    np.testing.assert_allclose(embd, model.lm_head.weight.detach()[:50257].numpy(), rtol=0, atol=1e-6)
    assert not np.allclose(embd, _random_model().lm_head.weight.detach()[:50257].numpy())  # the update is in


# ---------------------------------------------------------------------------- llama.cpp itself
@pytest.fixture(scope="module")
def shakespeare_model(shakespeare_slice) -> GPT:
    """The tiny model after 100 AdamW steps on Tiny Shakespeare: random weights make near-ties
    between logits, where any rounding flips the top token; a trained model has clear winners.
    """
    pytest.importorskip("llama_cpp")  # before the training: only its test needs the model
    if shakespeare_slice is None:
        pytest.skip("the offline data in ../shared/data is needed")
    ids = torch.tensor(get_tokenizer().encode_ordinary(shakespeare_slice.read_text(encoding="utf-8")))
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):
        starts = torch.randint(0, len(ids) - 33, (4,)).tolist()
        x = torch.stack([ids[s : s + 32] for s in starts])
        y = torch.stack([ids[s + 1 : s + 33] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 7.0, loss.item()  # it learnt something (uniform would be ln 50257 = 10.8)
    return model.eval()


# Largest |ours - llama.cpp| over the logits, as a fraction of the largest |logit|, per type.
LOGIT_TOLERANCE = {"f32": 1e-3, "f16": 5e-3, "q8_0": 2e-2}  # measured: 2.6e-5, 2.2e-4, 4.8e-3


@pytest.mark.llama_cpp
def llama_without_extra_buffers(llama_cpp, path: str):
    """llama.cpp's model of `path` without its AMX / repacked CPU weight buffers (docs/deploy.md: with them,
    llama-cpp-python 0.3.36 crashed in decode on AMX CPUs).
    """
    # Llama reads its defaults from the module llama_cpp.llama_cpp, not from the package
    native = llama_cpp.llama_cpp
    defaults = native.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    native.llama_model_default_params = without_extra_buffers
    try:
        return llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, n_threads=1, verbose=False)
    finally:
        native.llama_model_default_params = defaults


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_llama_cpp_runs_the_export_like_we_do(tmp_path, shakespeare_model, dtype):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = save_gguf(shakespeare_model, tmp_path / "m.gguf", dtype=dtype)
    llm = llama_without_extra_buffers(llama_cpp, str(path))
    prompt = "ROMEO:\nWhat light through yonder window breaks? It is the east,"
    ids = get_tokenizer().encode(prompt)
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids  # the embedded tokenizer

    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    with torch.no_grad():
        ours = shakespeare_model(torch.tensor([ids]))[0][0, :, :50257].float()
    err = (theirs - ours).abs().max().item() / ours.abs().max().item()
    assert err < LOGIT_TOLERANCE[dtype], (dtype, err)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))  # the same top-1 token at every position

    llm.reset()
    n = 16
    greedy = shakespeare_model.generate(torch.tensor([ids]), n, temperature=0.0)[0, len(ids) :].tolist()
    generated = []
    for token in llm.generate(ids, temp=0.0, top_k=1):
        generated.append(token)
        if len(generated) == n:
            break
    assert generated == greedy

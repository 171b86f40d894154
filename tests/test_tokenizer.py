"""The GPT-2 tokenizer: round trips, <|endoftext|>, local BPE files, the offline error."""

from __future__ import annotations

import json
import pickle
import urllib.request

import numpy as np
import pytest
import tiktoken
import torch

from gpt2.model.tokenizer import (
    EOT_TOKEN,
    Tokenizer,
    TokenizerNotAvailableError,
    _load_tokenizer,
    get_tokenizer,
)

TRICKY = [
    "Hello, world!",
    "  leading and trailing spaces   ",
    "tabs\tand\n\nnewlines\r\n  \n",
    "I've we'll they're it's I'm you'd WE'LL",
    "numbers 123 4567.89 and 1,000,000",
    "héllo wörld, 世界, emoji 🙂👍🏽 and \u00a0non-breaking",
    "symbols !@#$%^&*()_+-=[]{}|;':\",./<>?`~",
    "",
]


@pytest.fixture
def fresh_cache():
    """get_tokenizer() caches per source setting; start and end these tests with it empty."""
    _load_tokenizer.cache_clear()
    yield
    _load_tokenizer.cache_clear()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return get_tokenizer()


def test_vocabulary_and_round_trip(tok):
    assert tok.eot_token == EOT_TOKEN == 50256
    assert tok.n_vocab == len(tok) == 50257
    assert get_tokenizer() is tok  # cached
    for text in TRICKY:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < 50257 for i in ids)
        assert tok.decode(ids) == text
    # Known ids of GPT-2's BPE ("Hello" = 15496, " world" = 995), checked against tiktoken's own
    # registry encoding rather than typed from memory.
    assert tok.encode("Hello world") == tiktoken.get_encoding("gpt2").encode("Hello world")


def test_endoftext_handling(tok):
    text = "a<|endoftext|>b"
    ids = tok.encode(text)
    assert ids.count(50256) == 1 and tok.decode(ids) == text
    assert tok.encode("<|endoftext|>") == [50256]
    # Read as plain text it is several ordinary tokens, never the special id.
    ordinary = tok.encode_ordinary(text)
    assert 50256 not in ordinary and tok.decode(ordinary) == text
    with pytest.raises(ValueError, match="special token"):
        tok.encode(text, allowed_special=set())
    assert tok.encode_batch(["x<|endoftext|>", "y"]) == [
        tok.encode("x<|endoftext|>"),
        tok.encode("y"),
    ]
    assert tok.encode_ordinary_batch(["x<|endoftext|>"]) == [tok.encode_ordinary("x<|endoftext|>")]


def test_decode_accepts_lists_arrays_tensors(tok):
    ids = tok.encode("To be, or not to be")
    text = tok.decode(ids)
    assert tok.decode(tuple(ids)) == text
    assert tok.decode(np.array(ids, dtype=np.uint16)) == text
    assert tok.decode(np.array(ids, dtype=np.int64)) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.int32)) == text
    assert tok.decode(ids[0]) == tok.decode(torch.tensor(ids[0])) == tok.decode([ids[0]])
    batch = torch.tensor([ids, ids[::-1]])  # (2, T)
    assert tok.decode_batch(batch) == [text, tok.decode(ids[::-1])]
    assert tok.decode_batch(batch.numpy()) == tok.decode_batch([ids, ids[::-1]])


def test_bad_inputs(tok):
    with pytest.raises(ValueError, match="50257"):
        tok.decode([1, 50257])
    with pytest.raises(ValueError, match="-1"):
        tok.decode(np.array([-1]))
    with pytest.raises(TypeError, match="float"):
        tok.decode(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="float"):
        tok.decode(np.array([1.0]))
    with pytest.raises(ValueError, match="decode_batch"):
        tok.decode(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        tok.decode_batch(torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="did you mean encode"):
        tok.decode("hello")
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")
    with pytest.raises(TypeError, match="single str"):
        tok.encode_batch("one text")


def test_from_files_equals_tiktoken(shared_data, tok):
    local = Tokenizer.from_files(shared_data / "gpt2-tokenizer/vocab.bpe", shared_data / "gpt2-tokenizer/encoder.json")
    reference = tiktoken.get_encoding("gpt2")
    text = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:10_000]
    for sample in [text, *TRICKY, "x<|endoftext|>y"]:
        assert local.encode(sample) == reference.encode(sample, allowed_special="all")
        assert local.encode_ordinary(sample) == reference.encode_ordinary(sample)
    assert local.decode(reference.encode(text)) == text
    assert (local.eot_token, local.n_vocab) == (50256, 50257)
    # Picklable (num_workers > 0 in write_shards may ship it to worker processes).
    assert pickle.loads(pickle.dumps(local)).encode(text[:200]) == local.encode(text[:200])
    assert pickle.loads(pickle.dumps(tok)).encode(text[:200]) == local.encode(text[:200])


def test_tokenizer_dir_env_var(shared_data, tmp_path, monkeypatch, fresh_cache):
    # Hugging Face names for the same two files.
    (tmp_path / "merges.txt").symlink_to(shared_data / "gpt2-tokenizer/vocab.bpe")
    (tmp_path / "vocab.json").symlink_to(shared_data / "gpt2-tokenizer/encoder.json")
    monkeypatch.setenv("GPT2_TOKENIZER_DIR", str(tmp_path))
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "cache"))  # empty: the env var wins over it
    local = get_tokenizer()
    assert local.encode("Hello there<|endoftext|>") == tiktoken.get_encoding("gpt2").encode(
        "Hello there<|endoftext|>", allowed_special="all"
    )
    assert get_tokenizer() is local

    monkeypatch.setenv("GPT2_TOKENIZER_DIR", str(tmp_path / "missing"))
    with pytest.raises(TokenizerNotAvailableError, match="GPT2_TOKENIZER_DIR.*vocab.bpe and encoder.json"):
        get_tokenizer()


def test_from_files_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="vocab.bpe"):
        Tokenizer.from_files(tmp_path / "vocab.bpe", tmp_path / "encoder.json")
    # A tiny, deliberately inconsistent pair: the merge "Ġ t" gets rank 256 from vocab.bpe but
    # id 300 in encoder.json.
    single_bytes = [chr(b) for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    single_bytes += [chr(256 + i) for i in range(256 - len(single_bytes))]
    encoder = {ch: i for i, ch in enumerate(single_bytes)}
    encoder["Ġt"] = 300
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\nĠ t\n", encoding="utf-8")
    (tmp_path / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    with pytest.raises(ValueError, match="do not describe the same vocabulary.*first disagreement"):
        Tokenizer.from_files(tmp_path / "vocab.bpe", tmp_path / "encoder.json")
    encoder["Ġt"] = 256  # consistent now, but a 257-token vocabulary is not GPT-2's
    (tmp_path / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    with pytest.raises(ValueError, match="50257"):
        Tokenizer.from_files(tmp_path / "vocab.bpe", tmp_path / "encoder.json")


def test_cache_folder_downloads_once_and_offline_error_says_how(shared_data, tmp_path, monkeypatch, fresh_cache):
    """Without GPT2_TOKENIZER_DIR (nor a tiktoken cache) the files come from <cache>/gpt2-tokenizer,
    downloaded there (sha256-checked) on first use; offline, the error says how to point at local
    files and nothing is left in the cache.
    """
    for name in ("GPT2_TOKENIZER_DIR", "TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "offline"))
    fetched = []

    def no_network(url, timeout):
        fetched.append(url)
        raise OSError(f"network disabled in tests (fetching {url})")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(TokenizerNotAvailableError) as info:
        get_tokenizer()
    assert fetched and fetched[0].startswith("https://")
    for hint in ("GPT2_TOKENIZER_DIR", "vocab.bpe", str(tmp_path / "offline" / "gpt2-tokenizer")):
        assert hint in str(info.value)
    assert not (tmp_path / "offline" / "gpt2-tokenizer").exists()

    # A "server" that has the files: each is fetched once, then read from the cache.
    fetched.clear()

    def serve(url, timeout):
        fetched.append(url)
        return open(shared_data / "gpt2-tokenizer" / url.rsplit("/", 1)[1], "rb")

    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "online"))
    monkeypatch.setattr(urllib.request, "urlopen", serve)
    text = "Hello there<|endoftext|>"
    assert get_tokenizer().encode(text) == tiktoken.get_encoding("gpt2").encode(text, allowed_special="all")
    assert sorted(u.rsplit("/", 1)[1] for u in fetched) == ["encoder.json", "vocab.bpe"]
    assert sorted(p.name for p in (tmp_path / "online" / "gpt2-tokenizer").iterdir()) == ["encoder.json", "vocab.bpe"]
    _load_tokenizer.cache_clear()
    get_tokenizer()
    assert len(fetched) == 2


def test_another_encoding_is_refused_by_the_constructor():
    # a small tiktoken encoding built offline: its ids are not GPT-2's
    other = tiktoken.Encoding(
        name="bytes",
        pat_str=r"\S+|\s+",
        mergeable_ranks={bytes([b]): b for b in range(256)},
        special_tokens={"<|endoftext|>": 256},
    )
    with pytest.raises(ValueError, match="encoding 'bytes' has eot_token=256 and n_vocab=257; GPT-2's BPE has 50256"):
        Tokenizer(other)

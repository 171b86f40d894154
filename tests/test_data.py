"""Data: Tiny Shakespeare download/cache, uint16 shards, and the rank-aware TokenLoader."""

from __future__ import annotations

import io
import itertools
import json
import logging
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from gpt2.data import (
    TokenLoader,
    downloads,
    load_tiny_shakespeare,
    load_tokens,
    tiny_shakespeare_path,
    tokenize_file,
    write_shards,
)
from gpt2.data.sources import split_tokens
from gpt2.files import DownloadError
from gpt2.model.tokenizer import get_tokenizer


@pytest.fixture
def no_network(monkeypatch):
    """Make every urllib download fail, and record what was asked for."""
    urls = []

    def refuse(url, *args, **kwargs):
        urls.append(url)
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    return urls


# ------------------------------------------------------------------------------ Tiny Shakespeare


def test_tiny_shakespeare_env_var(shared_data, monkeypatch, no_network):
    monkeypatch.setenv("GPT2_TINY_SHAKESPEARE", str(shared_data / "tinyshakespeare.txt"))
    assert tiny_shakespeare_path() == shared_data / "tinyshakespeare.txt"
    text = load_tiny_shakespeare()
    assert text.startswith("First Citizen:") and len(text.encode("utf-8")) == 1_115_394
    assert no_network == []

    monkeypatch.setenv("GPT2_TINY_SHAKESPEARE", str(shared_data / "no-such-file.txt"))
    with pytest.raises(FileNotFoundError, match="GPT2_TINY_SHAKESPEARE=.*no-such-file"):
        tiny_shakespeare_path()


def test_tiny_shakespeare_cached_copy(tmp_path, monkeypatch, no_network):
    monkeypatch.delenv("GPT2_TINY_SHAKESPEARE", raising=False)
    (tmp_path / "tinyshakespeare.txt").write_text("cached text", encoding="utf-8")
    assert tiny_shakespeare_path(tmp_path) == tmp_path / "tinyshakespeare.txt"
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path))
    assert load_tiny_shakespeare() == "cached text"
    assert load_tiny_shakespeare(tmp_path / "tinyshakespeare.txt") == "cached text"
    assert no_network == []


def test_tiny_shakespeare_download_failure(tmp_path, monkeypatch, no_network):
    monkeypatch.delenv("GPT2_TINY_SHAKESPEARE", raising=False)
    with pytest.raises(DownloadError, match="GPT2_TINY_SHAKESPEARE") as info:
        tiny_shakespeare_path(tmp_path / "cache")
    assert "URLError" in str(info.value) and "pass the file's path" in str(info.value)
    assert no_network == [downloads.TINY_SHAKESPEARE_URL]
    assert not (tmp_path / "cache" / "tinyshakespeare.txt").exists()


def test_tiny_shakespeare_download_is_checked_and_atomic(shared_data, tmp_path, monkeypatch):
    monkeypatch.delenv("GPT2_TINY_SHAKESPEARE", raising=False)
    payload = {"bytes": b"<html>Rate limited</html>"}
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: io.BytesIO(payload["bytes"]))
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError, match="sha256"):
        tiny_shakespeare_path(cache)
    assert not cache.exists() or list(cache.iterdir()) == []  # nothing half-written is cached

    payload["bytes"] = (shared_data / "tinyshakespeare.txt").read_bytes()
    path = tiny_shakespeare_path(cache)
    assert path == cache / "tinyshakespeare.txt" and path.read_bytes() == payload["bytes"]
    assert [p.name for p in cache.iterdir()] == ["tinyshakespeare.txt"]  # no temporary left


# ------------------------------------------------------------------------------ shards


DOCS = [
    "First Citizen: Before we proceed any further, hear me speak.",
    "All: Speak, speak.",
    "You are all resolved rather to die than to famish?",
    "Resolved. resolved.",
    "First, you know Caius Marcius is chief enemy to the people." * 3,
]


def _expected_stream(docs):
    tok = get_tokenizer()
    return np.concatenate([[tok.eot_token] + tok.encode_ordinary(d) for d in docs]).astype(np.uint16)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_write_shards_round_trip(tmp_path, num_workers):
    expected = _expected_stream(DOCS)
    size = 16
    paths = write_shards(
        iter(DOCS),
        tmp_path,
        prefix="tiny",
        shard_size=size,
        num_workers=num_workers,
        progress=False,
    )
    n_shards = -(-len(expected) // size)
    assert [p.name for p in paths] == ["tiny_val_000000.npy"] + [f"tiny_train_{i:06d}.npy" for i in range(1, n_shards)]
    # Nothing but the shards and their record (no temporaries, no staging folder).
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in paths] + [".gpt2-outputs.json"])
    shards = [load_tokens(p) for p in paths]
    assert all(s.dtype == np.uint16 for s in shards)
    assert [len(s) for s in shards[:-1]] == [size] * (n_shards - 1) and 0 < len(shards[-1]) <= size
    np.testing.assert_array_equal(np.concatenate(shards), expected)
    # Every document begins with <|endoftext|>, the first token of the stream included.
    assert shards[0][0] == 50256 and int((np.concatenate(shards) == 50256).sum()) == len(DOCS)


def test_write_shards_overwrite_and_errors(tmp_path):
    class HugeVocab:
        eot_token = 0

        def encode_ordinary(self, text):
            return [1, 70_000]

    with pytest.raises(ValueError, match="token id 70000 .* does not fit uint16"):
        write_shards(["x"], tmp_path / "huge", prefix="huge", tokenizer=HugeVocab(), progress=False)
    assert not (tmp_path / "huge").exists()  # a failed prepare leaves no folder it made

    first = write_shards(DOCS, tmp_path, prefix="p", shard_size=8, progress=False)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_shards(DOCS, tmp_path, prefix="p", shard_size=8, progress=False)
    # A shorter rewrite removes the shards of the longer first run it did not replace.
    second = write_shards(DOCS[:1], tmp_path, prefix="p", shard_size=8, progress=False, overwrite=True)
    assert len(second) < len(first)
    assert sorted(tmp_path.glob("p_*.npy")) == sorted(second)
    assert TokenLoader(tmp_path, 1, 2).num_shards == len(second)  # the record lists only the new ones

    with pytest.raises(TypeError, match="row\\['text'\\]"):
        write_shards([{"text": "a"}], tmp_path / "rows", prefix="r", progress=False)
    with pytest.raises(TypeError, match="single str"):
        write_shards("one text", tmp_path / "one", prefix="o", progress=False)
    with pytest.raises(ValueError, match="no documents"):
        write_shards([], tmp_path / "empty", prefix="e", progress=False)
    with pytest.raises(ValueError, match="shard_size must be a positive integer, got 0"):
        write_shards(DOCS, tmp_path / "s", prefix="s", shard_size=0, progress=False)
    with pytest.raises(ValueError, match="prefix"):
        write_shards(DOCS, tmp_path / "s", prefix="a/b", progress=False)
    with pytest.raises(ValueError, match="num_workers"):
        write_shards(DOCS, tmp_path / "s", prefix="s", num_workers=-1, progress=False)


def test_tokenize_file_holds_out_what_training_on_the_file_holds_out(shared_data, tmp_path):
    text = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:20_000]
    source = tmp_path / "shakespeare.txt"
    source.write_text(text, encoding="utf-8")
    expected = _expected_stream([text])
    paths = tokenize_file(source, tmp_path / "out", shard_size=2_000, val_fraction=0.1, progress=False)
    n_val = round(0.1 * len(expected))
    # the tokens `gpt2 train --data shakespeare.txt` would hold out (passages spread through the text)
    expected_train, expected_val = split_tokens(expected, 0.1, "x")
    names = [p.name for p in paths]
    assert names[0] == "shakespeare_val_000000.npy"
    assert all(n.startswith("shakespeare_train_") for n in names[1:]) and names[1].endswith("_000001.npy")
    val = load_tokens(paths[0])
    train = np.concatenate([load_tokens(p) for p in paths[1:]])
    assert len(val) == n_val
    np.testing.assert_array_equal(val, expected_val)
    np.testing.assert_array_equal(train, expected_train)
    assert all(len(load_tokens(p)) == 2_000 for p in paths[1:-1])

    # The loader reads the two splits back from the directory.
    assert TokenLoader(tmp_path / "out", 2, 8, split="val").num_tokens == n_val
    assert TokenLoader(tmp_path / "out", 2, 8, split="train").num_tokens == len(train)

    only_train = tokenize_file(source, tmp_path / "all", prefix="all", val_fraction=0, progress=False)
    assert [p.name for p in only_train] == ["all_train_000000.npy"]
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="val_fraction"):
            tokenize_file(source, tmp_path / "bad", val_fraction=bad, progress=False)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hi", encoding="utf-8")
    with pytest.raises(ValueError, match="too few to split"):
        tokenize_file(tiny, tmp_path / "tiny", val_fraction=0.1, progress=False)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        tokenize_file(tmp_path / "missing.txt", tmp_path / "x", progress=False)


def test_load_tokens_formats_and_errors(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    np.save(tmp_path / "a.npy", tokens)
    tokens.tofile(tmp_path / "a.bin")  # nanoGPT's raw uint16 layout
    for name in ("a.npy", "a.bin"):
        loaded = load_tokens(tmp_path / name)
        assert isinstance(loaded, np.memmap) or isinstance(loaded.base, np.memmap)
        np.testing.assert_array_equal(loaded, tokens)
        np.testing.assert_array_equal(load_tokens(tmp_path / name, mmap=False), tokens)
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported token file"):
        load_tokens(tmp_path / "a.txt")
    with pytest.raises(FileNotFoundError, match="nope.npy"):
        load_tokens(tmp_path / "nope.npy")


# ------------------------------------------------------------------------------ the loader

B, T = 2, 4


def _write_npy_shards(directory, lengths, seed=0):
    """Shards of random ids with the given lengths, plus a decoy file of another split."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, n in enumerate(lengths):
        shard = rng.integers(0, 50257, size=n, dtype=np.uint16)
        np.save(directory / f"s_train_{i:06d}.npy", shard)
        shards.append(shard.astype(np.int64))
    np.save(directory / "s_val_000000.npy", rng.integers(0, 50257, size=100, dtype=np.uint16))
    return shards


def _reference_reads(shards, step):
    """(shard, position) of every step, written independently of the loader: the positions of a
    shard are 0, step, 2*step, ... as long as a whole step (+1 target token) fits, then the next
    shard, cycling forever.
    """
    for index in itertools.cycle(range(len(shards))):
        for position in range(0, len(shards[index]) - step, step):
            yield index, position


def test_batches_are_the_expected_slices():
    tokens = np.random.default_rng(0).integers(0, 50257, size=100).astype(np.uint16)
    loader = TokenLoader(torch.from_numpy(tokens.astype(np.int64)), B, T)
    steps_per_pass = (100 - 1) // (B * T)  # 12: the last read starts at 88 and ends at 97 (< 100)
    for step in range(steps_per_pass + 3):  # wraps around to the start
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, T)
        start = (step % steps_per_pass) * B * T
        np.testing.assert_array_equal(x.numpy().ravel(), tokens[start : start + B * T])
        np.testing.assert_array_equal(y.numpy().ravel(), tokens[start + 1 : start + B * T + 1])
    x[0, 0] = -1  # x and y do not share storage
    assert y.min() >= 0
    # A numpy source gives the same batches as the tensor.
    first = TokenLoader(tokens, B, T).next_batch()
    assert torch.equal(first[0], torch.from_numpy(tokens[: B * T].astype(np.int64)).view(B, T))


def test_shard_crossing_and_wrap_around(tmp_path):
    # 49 = 6 steps of 8 tokens + 1 (the last step just fits), 48 = one token short of that,
    # 9 = exactly one step plus the shifted target.
    lengths = [37, 49, 48, 29, 9]
    shards = _write_npy_shards(tmp_path, lengths)
    loader = TokenLoader(tmp_path, B, T, split="train")
    assert loader.num_shards == 5 and loader.num_tokens == sum(lengths)
    reads = _reference_reads(shards, B * T)
    for _ in range(40):  # several passes over all four shards
        index, position = next(reads)
        assert (loader.shard, loader.position) == (index, position)
        x, y = loader.next_batch()
        np.testing.assert_array_equal(x.numpy().ravel(), shards[index][position : position + B * T])
        np.testing.assert_array_equal(y.numpy().ravel(), shards[index][position + 1 : position + B * T + 1])

    loader.reset()
    assert (loader.shard, loader.position) == (0, 0)
    np.testing.assert_array_equal(next(iter(loader))[0].numpy().ravel(), shards[0][: B * T])


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_split_equals_one_rank_with_a_bigger_batch(tmp_path, world_size):
    _write_npy_shards(tmp_path, [100, 61, 250])
    big = TokenLoader(tmp_path, B * world_size, T, split="train")
    ranks = [TokenLoader(tmp_path, B, T, rank=r, world_size=world_size, split="train") for r in range(world_size)]
    assert all(r.tokens_per_step == big.tokens_per_step == B * T * world_size for r in ranks)
    for _ in range(30):  # crosses every shard boundary and wraps around
        x_big, y_big = big.next_batch()
        per_rank = [r.next_batch() for r in ranks]
        assert torch.equal(torch.cat([x for x, _ in per_rank]), x_big)
        assert torch.equal(torch.cat([y for _, y in per_rank]), y_big)
        assert all(r.state_dict() == big.state_dict() for r in ranks)  # position is rank-independent


def test_ranks_cover_the_stream_without_overlap():
    world_size, n = 3, 1000
    tokens = torch.arange(n)  # token value == its position, so reads can be traced back
    ranks = [TokenLoader(tokens, B, T, rank=r, world_size=world_size) for r in range(world_size)]
    steps_per_pass = (n - 1) // ranks[0].tokens_per_step
    seen = [torch.cat([r.next_batch()[0].ravel() for _ in range(steps_per_pass)]) for r in ranks]
    everything = torch.cat(seen)
    assert everything.numel() == everything.unique().numel()  # no token read twice in a pass
    assert torch.equal(everything.sort().values, torch.arange(steps_per_pass * ranks[0].tokens_per_step))
    # rank r reads the r-th B*T block of each step
    assert torch.equal(seen[1][: B * T], torch.arange(B * T, 2 * B * T))


def test_state_dict_resumes_exactly(tmp_path):
    _write_npy_shards(tmp_path, [37, 50, 29])
    for stop_after in (0, 3, 4, 7, 11):  # 4 lands right after a shard switch
        uninterrupted = TokenLoader(tmp_path, B, T, split="train")
        for _ in range(stop_after):
            uninterrupted.next_batch()
        state = json.loads(json.dumps(uninterrupted.state_dict()))
        resumed = TokenLoader(tmp_path, B, T, split="train")
        resumed.load_state_dict(state)
        assert resumed.state_dict() == uninterrupted.state_dict()
        for _ in range(15):
            a, b = uninterrupted.next_batch(), resumed.next_batch()
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # The minimal form from the contract is accepted too.
    loader = TokenLoader(tmp_path, B, T, split="train")
    loader.load_state_dict({"shard": 1, "position": 8})
    assert (loader.shard, loader.position) == (1, 8)


def test_loader_properties_and_single_file_sources(tmp_path):
    _write_npy_shards(tmp_path, [37, 50])
    loader = TokenLoader(tmp_path, B, T, rank=1, world_size=2, split="train")
    assert loader.tokens_per_step == 16 and loader.num_tokens == 87
    # A single .npy file and a raw .bin file are sources too.
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    assert TokenLoader(tmp_path / "tokens.bin", B, T).next_batch()[0].ravel().tolist() == list(range(8))
    single = TokenLoader(tmp_path / "s_train_000001.npy", B, T, split="train")
    assert single.num_tokens == 50


def test_loader_bad_inputs(tmp_path):
    tokens = torch.arange(100)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        TokenLoader(tokens, 0, T)
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got -1"):
        TokenLoader(tokens, B, -1)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 2.0"):
        TokenLoader(tokens, 2.0, T)
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, world_size=2\)"):
        TokenLoader(tokens, B, T, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"rank=-1"):
        TokenLoader(tokens, B, T, rank=-1)
    with pytest.raises(ValueError, match="has 100 tokens, but one step needs 129"):
        TokenLoader(tokens, 4, 8, world_size=4)
    with pytest.raises(TypeError, match="float32"):
        TokenLoader(torch.zeros(100), B, T)
    with pytest.raises(ValueError, match=r"shape \(10, 10\)"):
        TokenLoader(tokens.view(10, 10), B, T)
    with pytest.raises(ValueError, match="in-memory token array has no splits"):
        TokenLoader(tokens, B, T, split="val")
    with pytest.raises(TypeError, match="source must be"):
        TokenLoader([1, 2, 3], B, T)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenLoader(tmp_path / "missing", B, T)

    _write_npy_shards(tmp_path / "shards", [37, 5])
    with pytest.raises(FileNotFoundError, match="no 'test' token files"):
        TokenLoader(tmp_path / "shards", B, T, split="test")
    with pytest.raises(ValueError, match="s_train_000001.npy' has 5 tokens, but one step needs 9"):
        TokenLoader(tmp_path / "shards", B, T, split="train")
    with pytest.raises(ValueError, match="does not match token file"):
        TokenLoader(tmp_path / "shards" / "s_val_000000.npy", B, T, split="train")


def test_load_state_dict_rejects_states_that_do_not_fit(tmp_path):
    _write_npy_shards(tmp_path, [37, 50])
    loader = TokenLoader(tmp_path, B, T, split="train")
    with pytest.raises(ValueError, match=r"shard=2, .*has 2 shard\(s\) \(valid: 0..1\)"):
        loader.load_state_dict({"shard": 2, "position": 0})
    with pytest.raises(ValueError, match="position=50 does not fit.*50 tokens"):
        loader.load_state_dict({"shard": 1, "position": 50})
    with pytest.raises(ValueError, match="position=-8"):
        loader.load_state_dict({"shard": 0, "position": -8})
    with pytest.raises(ValueError, match="saved over 3 shard"):
        loader.load_state_dict({"shard": 0, "position": 0, "num_shards": 3})
    with pytest.raises(ValueError, match="'shard' and 'position'"):
        loader.load_state_dict({"position": 0})
    with pytest.raises(ValueError, match="position must be an integer, got '8'"):
        loader.load_state_dict({"shard": 0, "position": "8"})
    assert (loader.shard, loader.position) == (0, 0)  # failed loads change nothing


def test_a_resumed_run_with_a_bigger_step_moves_on_where_the_step_no_longer_fits(tmp_path, caplog):
    """docs/training.md: another batch size on resume changes the data order, not whether it works.
    A position near a shard's end, where the saved (smaller) step fitted, was an error.
    """
    _write_npy_shards(tmp_path, [37, 50])
    small = TokenLoader(tmp_path, 1, T, split="train")
    state = {"shard": 1, "position": 43, "num_shards": 2}  # 43 + 4 + 1 <= 50: one more small step fits
    small.load_state_dict(state)
    big = TokenLoader(tmp_path, B, T, split="train")  # 43 + 8 + 1 > 50
    with caplog.at_level(logging.WARNING, logger="gpt2.data.loader"):
        big.load_state_dict(state)
    assert (big.shard, big.position) == (0, 0) and "no longer fits after 43: next shard" in caplog.text
    big.next_batch()


@pytest.mark.parametrize("prefix", ["train", "val", "interval", "trainval", "my-train"])
def test_a_shard_prefix_holding_train_or_val_does_not_mix_the_splits(tmp_path, prefix):
    """`gpt2 prepare --input train.txt` writes train_val_000000.npy: the train split used to match
    it too (the validation shard was trained on), and "interval" made every shard a val shard.
    """
    from gpt2.data.sources import training_data

    rng = np.random.default_rng(0)
    for name, n in ((f"{prefix}_val_000000.npy", 100), (f"{prefix}_train_000001.npy", 300)):
        np.save(tmp_path / name, rng.integers(0, 50257, size=n, dtype=np.uint16))
    assert TokenLoader(tmp_path, 2, 8, split="train").num_tokens == 300
    assert TokenLoader(tmp_path, 2, 8, split="val").num_tokens == 100
    train, val = training_data(str(tmp_path), None, 0.1)
    assert TokenLoader(val, 2, 8, split="val").num_tokens == 100  # the folder has a val split


def test_nanogpt_and_llm_c_split_names_are_recognised(tmp_path):
    from gpt2.data.formats import token_files

    names = ["train.bin", "val.bin", "tiny_shakespeare_val.bin", "edufineweb_train_000001.npy", "notes.npy"]
    names += ["validation-00000-of-00001.npy", "train-00000-of-00001.npy", "val0.bin", "shard_train001.npy"]
    names += ["trainset.npy", "data_valid_1.npy"]  # other tools' names (they were all read before)
    for name in names:
        (tmp_path / name).write_bytes(b"")  # the names are what is listed
    val = ["data_valid_1.npy", "tiny_shakespeare_val.bin", "val.bin", "val0.bin", "validation-00000-of-00001.npy"]
    assert [p.name for p in token_files(tmp_path, "val")] == val
    train = [
        "edufineweb_train_000001.npy",
        "shard_train001.npy",
        "train-00000-of-00001.npy",
        "train.bin",
        "trainset.npy",
    ]
    assert [p.name for p in token_files(tmp_path, "train")] == train
    assert len(token_files(tmp_path)) == len(names)


def test_a_huge_shard_size_needs_no_memory_up_front(tmp_path):
    """--shard-size 30e9 allocated a 56 GiB buffer before the first token (MemoryError on a tiny
    input); the buffer now grows with the tokens, and the shards are the same.
    """
    from gpt2.data import write_shards
    from gpt2.data.formats import load_tokens

    class Repeat:  # one document = (its length) tokens, made without a real tokenizer
        eot_token = 7

        def encode_ordinary(self, doc):
            return [int(doc[0])] * int(doc[1:])

    docs = ["1" + str(3_000_000), "2" + str(2_500_000), "3" + str(10)]
    paths = write_shards(
        docs, tmp_path / "big", prefix="x", shard_size=30_000_000_000, tokenizer=Repeat(), progress=False
    )
    tokens = np.concatenate([np.asarray(load_tokens(p)) for p in paths])
    expected = np.concatenate([[7, *([1] * 3_000_000)], [7, *([2] * 2_500_000)], [7, *([3] * 10)]])
    assert len(paths) == 1 and np.array_equal(tokens, expected)


def test_preparing_a_second_prefix_into_a_folder_warns_that_training_reads_both(tmp_path, caplog):
    from gpt2.data import write_shards

    write_shards(["one two three"] * 4, tmp_path, prefix="a", shard_size=8, progress=False)
    with caplog.at_level(logging.WARNING, logger="gpt2.data.prepare"):
        write_shards(["four five"] * 4, tmp_path, prefix="a", shard_size=8, progress=False, overwrite=True)
    assert "also holds other shards" not in caplog.text  # its own shards, replaced
    with caplog.at_level(logging.WARNING, logger="gpt2.data.prepare"):
        write_shards(["four five"] * 4, tmp_path, prefix="b", shard_size=8, progress=False)
    assert "also holds other shards (['a_train_000001.npy'" in caplog.text


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.int32])
def test_a_token_tensor_of_any_integer_dtype_gives_int64_batches(dtype):
    tokens = torch.arange(40).to(dtype)
    x, y = TokenLoader(tokens, 2, 4).next_batch()
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and y[1].tolist() == [5, 6, 7, 8]


def test_a_files_validation_split_samples_the_whole_text():
    """The held-out tokens of a text or token file come from passages spread through it, not from its end
    alone, and so do the first batches a run scores while it trains: validation of a Shakespeare run then
    measures every play, not only the last ones (or the first) the run happens to have read most recently,
    so a longer run scores better instead of rising and falling with where in the text training is.
    """

    tokens = np.arange(100_000, dtype=np.int64)
    train, val = split_tokens(tokens, 0.1, "x")
    assert len(val) == 10_000 and len(train) == 90_000
    # Nothing is in both, nothing is lost, training keeps the text's order.
    assert not np.intersect1d(train, val).size and np.union1d(train, val).size == len(tokens)
    assert (np.diff(train) > 0).all()
    # Every tenth of the text gives the same share of the validation tokens...
    assert np.bincount(val * 10 // len(tokens), minlength=10).tolist() == [1_000] * 10
    # ... and of its first fifth (the batches an in-run validation reads) each tenth gives a share too.
    assert (np.bincount(val[:2_000] * 10 // len(tokens), minlength=10) >= 100).all()
    # A passage is contiguous text: a small file gets fewer, longer ones.
    small_train, small_val = split_tokens(tokens[:1_000], 0.1, "x")
    assert len(small_val) == 100 and (np.diff(np.sort(small_val)) == 1).sum() >= 96
    with pytest.raises(ValueError, match="too few to split with --val-fraction 0.1"):
        split_tokens(tokens[:10], 0.1, "x")
    whole, none = split_tokens(tokens, 0.0, "x")
    assert whole is tokens and none is None

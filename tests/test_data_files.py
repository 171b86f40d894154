"""Bad and ambiguous data files: each gets a clear error naming the file, and llm.c's
headered .bin shards round-trip.
"""

from __future__ import annotations

import io
import sys
import urllib.request

import numpy as np
import pytest
import torch

from gpt2 import GPT, GPTConfig, TrainConfig, Trainer, files
from gpt2.data import (
    TokenLoader,
    iter_jsonl,
    load_tokens,
    prepare,
    read_text,
    tokenize_file,
    write_shards,
    write_tokens,
)
from gpt2.files import download
from gpt2.model.tokenizer import get_tokenizer

B, T = 2, 8


# ------------------------------------------------------------------ llm.c's spec, in numpy


def read_llmc_bin(path) -> np.ndarray:
    """A reader written from llm.c (dev/data/data_common.py, llmc/dataloader.h): 256 int32 of
    header, [0] magic, [1] version, [2] token count, then the tokens.
    """
    raw = path.read_bytes()
    header = np.frombuffer(raw[: 256 * 4], dtype="<i4")
    layouts = {(20240520, 1): "<u2", (20240801, 7): "<u4"}
    dtype = layouts[(int(header[0]), int(header[1]))]
    tokens = np.frombuffer(raw[256 * 4 :], dtype=dtype)
    assert len(tokens) == header[2] > 0
    return tokens


def write_llmc_bin(path, tokens, magic=20240520, version=1, count=None, dtype="<u2") -> None:
    """llm.c's write_datafile, with every field overridable to build broken files."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes())


def test_bin_round_trip_in_llmc_layout(tmp_path):
    small = np.array([50256, 0, 17, 50000, 3], dtype=np.int64)
    big = np.array([0, 70_000, 128_255], dtype=np.int64)  # needs uint32 (a Llama 3 vocabulary)
    for name, ids, magic in (("gpt2.bin", small, 20240520), ("wide.bin", big, 20240801)):
        path = write_tokens(tmp_path / name, ids)
        assert int(np.frombuffer(path.read_bytes()[:4], "<i4")[0]) == magic
        np.testing.assert_array_equal(read_llmc_bin(path), ids)  # llm.c reads ours
        for mmap in (True, False):
            np.testing.assert_array_equal(load_tokens(path, mmap=mmap), ids)
    # ... and we read theirs, of both dtypes.
    write_llmc_bin(tmp_path / "theirs16.bin", small)
    write_llmc_bin(tmp_path / "theirs32.bin", big, magic=20240801, version=7, dtype="<u4")
    np.testing.assert_array_equal(load_tokens(tmp_path / "theirs16.bin"), small)
    np.testing.assert_array_equal(load_tokens(tmp_path / "theirs32.bin"), big)
    with pytest.raises(ValueError, match="does not fit a uint16 .npy"):
        write_tokens(tmp_path / "wide.npy", big)
    with pytest.raises(ValueError, match="must not be empty"):
        write_tokens(tmp_path / "none.bin", np.zeros(0, dtype=np.uint16))
    assert not (tmp_path / "none.bin").exists()


def test_write_shards_in_bin_format(tmp_path):
    docs = ["First Citizen: Before we proceed any further.", "All: Speak, speak."] * 4
    npy = write_shards(docs, tmp_path / "npy", prefix="s", shard_size=16, progress=False)
    bins = write_shards(docs, tmp_path / "bin", prefix="s", shard_size=16, progress=False, file_format="bin")
    assert [p.name for p in bins] == [p.with_suffix(".bin").name for p in npy]
    for a, b in zip(npy, bins):
        np.testing.assert_array_equal(read_llmc_bin(b), np.load(a))
    loaders = [TokenLoader(d, 1, 3, split="train") for d in (tmp_path / "npy", tmp_path / "bin")]
    assert loaders[0].num_tokens == loaders[1].num_tokens
    assert torch.equal(loaders[0].next_batch()[0], loaders[1].next_batch()[0])
    # Rewriting in the other format replaces the old shards instead of mixing them in.
    write_shards(docs, tmp_path / "bin", prefix="s", shard_size=16, progress=False, overwrite=True)
    assert not list((tmp_path / "bin").glob("*.bin"))
    with pytest.raises(ValueError, match="file_format"):
        write_shards(docs, tmp_path / "x", prefix="s", progress=False, file_format="txt")


def test_broken_headered_bin(tmp_path):
    ids = np.arange(1, 101)
    cases = {
        "unknown magic": (dict(magic=12345), "magic 12345"),
        "bad version": (dict(version=2), "version 2"),
        "count too big": (dict(count=150), "truncated: its header says 150"),
        "count too small": (dict(count=50), "longer than its header says"),
        "zero count": (dict(count=0), "longer than its header says"),
        "uint32 magic on uint16 data": (dict(magic=20240801, version=7), "header says 100 uint32"),
    }
    for i, (case, (fields, message)) in enumerate(cases.items()):
        path = tmp_path / f"case{i}.bin"
        write_llmc_bin(path, ids, **fields)
        with pytest.raises(ValueError, match=message) as info:
            load_tokens(path)
        assert str(path) in str(info.value), case
    # Cut short inside the header, and inside the tokens.
    good = write_tokens(tmp_path / "good.bin", ids)
    for cut, message in ((100, "less than the 1024-byte header"), (1024 + 60, "truncated")):
        (tmp_path / "cut.bin").write_bytes(good.read_bytes()[:cut])
        with pytest.raises(ValueError, match=message):
            load_tokens(tmp_path / "cut.bin")


def test_headerless_bin(tmp_path):
    # nanoGPT's train.bin / val.bin: raw uint16, no header. Still read as it always was.
    ids = np.random.default_rng(0).integers(0, 50257, size=500).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    np.testing.assert_array_equal(load_tokens(tmp_path / "train.bin"), ids)
    assert TokenLoader(tmp_path / "train.bin", B, T, vocab_size=50257).num_tokens == 500

    # int32 (or int64) ids written by another tool would read as uint16 with zeros between them.
    for dtype in (np.int32, np.int64):
        path = tmp_path / f"ids_{np.dtype(dtype).name}.bin"
        ids.astype(dtype).tofile(path)
        with pytest.raises(ValueError, match="looks like int32 token ids") as info:
            load_tokens(path)
        assert str(path) in str(info.value) and "np.fromfile" in str(info.value)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="odd number.*gpt2 prepare"):
        load_tokens(tmp_path / "odd.bin")
    # A headerless file of ids beyond the vocabulary (e.g. uint16 data of another tokenizer).
    np.full(64, 60_000, dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match=r"big.bin'.* holds token id 60000"):
        TokenLoader(tmp_path / "big.bin", B, T, vocab_size=50257)


def test_bad_npy(tmp_path):
    bad = {
        "floats.npy": (np.zeros(40), "dtype float64"),
        "bools.npy": (np.ones(40, dtype=bool), "dtype bool"),
        "matrix.npy": (np.zeros((4, 10), dtype=np.uint16), r"shape \(4, 10\)"),
        "objects.npy": (np.array([1, "a"], dtype=object), "could not read"),
    }
    for name, (array, message) in bad.items():
        np.save(tmp_path / name, array, allow_pickle=True)
        with pytest.raises(ValueError, match=message) as info:
            load_tokens(tmp_path / name)
        assert name in str(info.value)
    (tmp_path / "garbage.npy").write_bytes(bytes(range(256)) * 4)
    np.save(tmp_path / "full.npy", np.arange(1000, dtype=np.uint16))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "full.npy").read_bytes()[:900])
    for name in ("garbage.npy", "cut.npy"):
        for mmap in (True, False):
            with pytest.raises(ValueError, match=f"could not read token file .*{name}"):
                load_tokens(tmp_path / name, mmap=mmap)


def test_empty_inputs(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.uint16))
    with pytest.raises(ValueError, match="empty.bin' is empty"):
        load_tokens(tmp_path / "empty.bin")
    with pytest.raises(ValueError, match="empty.npy' holds no tokens"):
        TokenLoader(tmp_path / "empty.npy", B, T)
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(ValueError, match="empty.txt' is empty"):
        tokenize_file(tmp_path / "empty.txt", tmp_path / "out", progress=False)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "notes.txt").write_text("not a shard")
    with pytest.raises(FileNotFoundError, match="no token files"):
        TokenLoader(tmp_path / "shards", B, T)
    np.save(tmp_path / "shards" / "x_train_000001.npy", np.arange(B * T, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"x_train_000001.npy' has 16 tokens, but one step needs 17"):
        TokenLoader(tmp_path / "shards", B, T)


# ------------------------------------------------------------------ text that is not UTF-8


def test_text_that_is_not_utf8(tmp_path):
    garbage = tmp_path / "data.txt"
    garbage.write_bytes(b"hello world\nsecond line\n" + bytes([0xFF, 0xFE, 0x00, 0x81]) + b"tail")
    for call in (
        lambda: read_text(garbage),
        lambda: tokenize_file(garbage, tmp_path / "out", progress=False),
        lambda: write_shards([read_text(garbage)], tmp_path / "out", prefix="p", progress=False),
    ):
        with pytest.raises(ValueError, match=r"data.txt' is not UTF-8 text: byte offset 24 \(line 3\)"):
            call()
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())

    from gpt2.data.sources import text_tokens  # what `gpt2 train --data file.txt` reads

    with pytest.raises(ValueError, match="byte offset 24"):
        text_tokens(garbage)

    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: not UTF-8 text \(byte offset 28"):
        list(iter_jsonl(rows))


# ------------------------------------------------------------------ ids out of range


def test_loader_checks_ids_against_the_vocabulary(tmp_path):
    ids = np.arange(100, dtype=np.int64) % 64
    assert TokenLoader(ids, B, T, vocab_size=64).num_tokens == 100  # all ids < 64: fine
    ids[70] = 64
    with pytest.raises(ValueError, match=r"token array holds token id 64 .*position 70.*64 ids"):
        TokenLoader(ids, B, T, vocab_size=64)
    with pytest.raises(ValueError, match=r"negative id \(-3\)"):
        TokenLoader(np.array([1, 2, -3] * 20), B, T, vocab_size=64)
    np.save(tmp_path / "signed.npy", np.array([1, 2, -3] * 20))
    with pytest.raises(ValueError, match="signed.npy' holds token id -3"):
        TokenLoader(tmp_path / "signed.npy", B, T, vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        TokenLoader(ids, B, T, vocab_size=0)

    # In a shard directory each shard is checked when it is first opened: the bad second shard
    # fails when the loader reaches it, naming the file and the id, before a batch is returned.
    shards = tmp_path / "shards"
    shards.mkdir()
    np.save(shards / "d_train_000001.npy", np.arange(40, dtype=np.uint16))
    np.save(shards / "d_train_000002.npy", np.full(40, 1000, dtype=np.uint16))
    loader = TokenLoader(shards, B, T, vocab_size=512)
    loader.next_batch()
    loader.next_batch()  # moves on to shard 2
    with pytest.raises(ValueError, match=r"d_train_000002.npy' holds token id 1000"):
        loader.next_batch()
    assert TokenLoader(shards, B, T).num_shards == 2  # unchecked without a vocabulary
    with pytest.raises(ValueError, match="holds token id 1000"):
        load_tokens(shards / "d_train_000002.npy", vocab_size=512)


def test_trainer_refuses_ids_beyond_the_model_vocabulary(tmp_path):
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    train = TrainConfig(
        micro_batch_size=B, seq_len=T, max_steps=1, out_dir=None, progress=False, eval_interval=0, plot=False
    )
    ids = np.arange(200, dtype=np.uint16) % 64
    Trainer(GPT(config), train, ids, sinks=[])  # in range: fine
    ids[150] = 64
    np.save(tmp_path / "toks.npy", ids)
    for source in (ids, tmp_path / "toks.npy", TokenLoader(ids, B, T)):
        with pytest.raises(ValueError, match="holds token id 64 .*64 ids"):
            Trainer(GPT(config), train, source, sinks=[])


# ------------------------------------------------------------------ progress


def test_tokenising_in_pieces_matches_one_pass(shared_data, monkeypatch):
    tok = get_tokenizer()
    text = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:30_000]
    text += "\n\n\nword  \n  x\n\ty\n'\ns \n\n"  # runs of whitespace around the cut points
    pieces = list(prepare._text_pieces(text, 500))
    assert len(pieces) > 20 and "".join(pieces) == text
    monkeypatch.setattr(prepare, "_TEXT_CHUNK_CHARS", 500)
    got = prepare.encode_document(text, tok)
    np.testing.assert_array_equal(got, [tok.eot_token] + tok.encode_ordinary(text))


def test_progress_bars_show_on_stderr(tmp_path, monkeypatch, capsys):
    # bars show on a terminal only (a redirected log gets none): be one
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    text = "Speak, speak.\nYou are all resolved rather to die than to famish?\n" * 50
    (tmp_path / "t.txt").write_text(text)
    monkeypatch.setattr(prepare, "_BAR_DELAY_S", 0)
    monkeypatch.setattr(prepare, "_TEXT_CHUNK_CHARS", 100)
    tokenize_file(tmp_path / "t.txt", tmp_path / "out", progress=True)
    assert "tokenising t.txt" in capsys.readouterr().err
    tokenize_file(tmp_path / "t.txt", tmp_path / "out2", progress=False)
    assert capsys.readouterr().err == ""


def test_download_streams_and_checks_length(tmp_path, monkeypatch, capsys):
    payload = bytes(range(256)) * 1000  # several read() chunks

    class Response(io.BytesIO):
        def __init__(self, data, length):
            super().__init__(data)
            self.headers = {"Content-Length": str(length)}

    sizes = {"length": len(payload)}
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: Response(payload, sizes["length"]))
    dest = tmp_path / "cache" / "f.bin"
    download("https://example.invalid/f", dest, what="f", offline_hint="copy it to", progress=False)
    assert dest.read_bytes() == payload
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(files, "_BAR_DELAY_S", 0)
    download("https://example.invalid/f", dest, what="the file", offline_hint="copy it to")
    bar = capsys.readouterr().err  # a byte count with the total from Content-Length
    assert "the file" in bar and "250k" in bar
    sizes["length"] = len(payload) + 10  # the connection dropped early
    with pytest.raises(ConnectionError, match=f"closed after {len(payload)} of"):
        download("https://example.invalid/f", tmp_path / "g.bin", what="f", offline_hint="copy it to", progress=False)
    assert not (tmp_path / "g.bin").exists()


def test_cli_prepare_bin_and_bad_text(tmp_path, capsys):
    from gpt2.cli import main

    text = tmp_path / "story.txt"
    text.write_text("Once upon a time there was a model. " * 40)
    assert (
        main(["prepare", "--input", str(text), "--out-dir", str(tmp_path / "a"), "--format", "bin", "--no-progress"])
        == 0
    )
    shards = sorted((tmp_path / "a").glob("*.bin"))
    assert [p.name for p in shards] == ["story_train_000001.bin", "story_val_000000.bin"]
    tok = get_tokenizer()
    stream = np.concatenate([read_llmc_bin(p) for p in shards])  # train (name sorts first), then val
    np.testing.assert_array_equal(stream, [tok.eot_token] + tok.encode_ordinary(text.read_text()))

    text.write_bytes(b"ok\n\x80\x81")
    capsys.readouterr()
    assert main(["prepare", "--input", str(text), "--out-dir", str(tmp_path / "b"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "story.txt' is not UTF-8 text: byte offset 3" in err and "Traceback" not in err

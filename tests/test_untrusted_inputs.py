"""Files a user hands us that are not what they seem: a safetensors header claiming 2^62 bytes, and
instruction data published as one JSON array (Alpaca's alpaca_data.json, ShareGPT files).
"""

from __future__ import annotations

import json
import struct

import pytest

from gpt2 import GPT
from gpt2.data.instruct import is_instruction_data, read_rows
from gpt2.errors import InvalidValueError
from gpt2.model.checkpoint_files import CheckpointError


def test_a_safetensors_header_claiming_too_much_is_named(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=16, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    weights = folder / "model.safetensors"
    body = weights.read_bytes()
    # the first 8 bytes are the header's length: claim 2^62
    weights.write_bytes(struct.pack("<Q", 1 << 62) + body[8:])
    with pytest.raises(CheckpointError) as caught:
        GPT.from_pretrained(folder)
    message = str(caught.value)
    assert str(weights) in message and "cannot be read" in message and "\n" not in message


ALPACA = [
    {"instruction": "Give the opposite of the word.", "input": "hot", "output": "cold"},
    {"instruction": "What do bees make?", "input": "", "output": "Honey."},
]


def test_a_json_array_of_alpaca_rows_is_read_as_rows(tmp_path):
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps(ALPACA, indent=4))
    assert is_instruction_data(path)
    rows = read_rows(path)
    assert [row[:3] for row in rows] == [
        ("Give the opposite of the word.", "hot", "cold"),
        ("What do bees make?", "", "Honey."),
    ]
    assert rows[1][3] == f"{path}, row 2"


def test_sharegpt_rows_of_one_exchange_are_read_and_longer_ones_refused(tmp_path):
    exchange = [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Red."}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": "a", "conversations": exchange}]))
    assert [row[:3] for row in read_rows(path)] == [("Name a colour.", "", "Red.")]
    path.write_text(json.dumps([{"conversations": exchange + exchange}]))
    with pytest.raises(InvalidValueError, match=r"row 1: 'conversations' must be one human turn then one gpt turn"):
        read_rows(path)


def test_a_json_file_that_is_no_array_is_refused_in_one_line(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ALPACA[0]))
    with pytest.raises(
        InvalidValueError, match=r"must be one JSON array of rows .* got a dict; .* name the file \.jsonl"
    ):
        read_rows(path)


def test_finetune_trains_on_the_rows_of_a_json_array(tmp_path, capsys):
    from gpt2 import GPTConfig
    from gpt2.cli import main

    GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=32)).save_pretrained(tmp_path / "base")
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps(ALPACA * 6))
    quick = "--seq-len 32 --micro-batch-size 2 --max-steps 1 --warmup-steps 1 --eval-interval 0"
    quiet = "--final-eval-batches 1 --num-samples 0 --no-plot --no-progress"
    args = f"finetune --init {tmp_path / 'base'} --data {path} {quick} {quiet} --out-dir {tmp_path / 'run'}"
    code = main(args.split())
    out = capsys.readouterr().out
    assert code == 0, out
    # the rows, not the JSON text: 12 rows, 1 held out
    assert "11 training rows in 11 sequences, 1 validation rows" in out, out

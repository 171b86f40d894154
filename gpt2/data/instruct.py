"""Instruction fine-tuning data: JSON rows -> prompt template -> masked training sequences.

A row is either Alpaca's layout ``{"instruction", "input" (optional), "output"}``, ``{"prompt", "response"}``, or a
ShareGPT row holding one exchange (``{"conversations": [{"from": "human", ...}, {"from": "gpt", ...}]}``); a file may
mix them. A ``.jsonl`` file holds a row per line; a ``.json`` file one JSON array of rows, as Alpaca's
``alpaca_data.json`` and the ShareGPT files are published. Every row is rendered with one plain-text template
(:data:`TEMPLATE`)::

    ### Instruction:
    {instruction}

    ### Input:            <- these two lines (and the blank line after them) only when
    {input}               <- the row has a non-empty input

    ### Response:
    {response}<|endoftext|>

The prompt (up to ``### Response:\\n``) and the response are tokenised separately, so the
boundary is exact and ``gpt2 sample --instruction`` feeds the model the very same prompt tokens.
The loss is on the response tokens and the closing ``<|endoftext|>`` (so the model learns to
stop) only: prompt and padding targets are :data:`gpt2.model.IGNORE_INDEX`.

Each row is one sequence padded to ``seq_len``, or with ``pack=True`` rows are packed greedily, in order, into
``seq_len + 1``-token windows without splitting a row. Packed rows are isolated: batches carry each token's position
within its row and a block-diagonal causal mask (:func:`packed_inputs`), so every row is computed exactly as it would be
alone. The Trainer's loss is the mean over the global batch's scored targets (a batch without any is skipped).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2.data import iter_jsonl
from gpt2.errors import InvalidValueError, MissingFileError
from gpt2.model.config import POSITIVE_INT, check_value
from gpt2.model.gpt import IGNORE_INDEX
from gpt2.model.tokenizer import get_tokenizer

TEMPLATE = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
INPUT_BLOCK = "### Input:\n{input}\n\n"

_LAYOUTS = (
    'Alpaca rows {"instruction", "input" (optional), "output"}, {"prompt", "response"} or ShareGPT '
    '{"conversations": [a human turn, a gpt turn]}'
)
# The fields of each row layout, as (name, required).
_ALPACA_FIELDS = (("instruction", True), ("input", False), ("output", True))
_PROMPT_FIELDS = (("prompt", True), ("response", True))


def is_instruction_data(data: Any) -> bool:
    """``--data`` switches to instruction fine-tuning when it names a ``.jsonl`` or ``.json`` file."""
    # A row per line (.jsonl) or one JSON array of rows (.json).
    return isinstance(data, (str, Path)) and Path(data).suffix.lower() in (".jsonl", ".json")


def render_prompt(instruction: str, input: str = "") -> str:
    """The template up to ``### Response:\\n``: what the model is given at inference."""
    input_block = INPUT_BLOCK.format(input=input) if input else ""
    return TEMPLATE.format(instruction=instruction, input_block=input_block)


def parse_row(row: Any, where: str) -> tuple[str, str, str]:
    """``(instruction, input, response)`` of one JSON row; a ValueError naming ``where`` (file:line)
    and the field for anything else.
    """
    if not isinstance(row, dict):
        raise InvalidValueError(f"{where}: a row must be a JSON object ({_LAYOUTS}), got {type(row).__name__}")
    if "instruction" in row or "output" in row:
        return tuple(_field(row, key, required, where) for key, required in _ALPACA_FIELDS)
    if "prompt" in row or "response" in row:
        # The prompt is the instruction, with no input.
        prompt, response = (_field(row, key, required, where) for key, required in _PROMPT_FIELDS)
        return prompt, "", response
    if "conversations" in row:
        return _exchange(row["conversations"], where)
    found = ", ".join(sorted(row)) or "none"
    raise InvalidValueError(f"{where}: no instruction fields (found: {found}); each row needs {_LAYOUTS}")


def _exchange(turns: Any, where: str) -> tuple[str, str, str]:
    """``(instruction, "", response)`` of a ShareGPT row: one human turn, then one gpt turn. A longer
    conversation is refused rather than cut: the template holds one exchange.
    """
    speakers = []
    if isinstance(turns, list):
        speakers = [turn.get("from") for turn in turns if isinstance(turn, dict)]
    if speakers != ["human", "gpt"] or len(turns) != 2:
        raise InvalidValueError(
            f"{where}: 'conversations' must be one human turn then one gpt turn (the template holds one exchange), "
            f"got the turns {speakers or turns!r:.80}; split longer conversations into rows of one exchange"
        )
    human, gpt = (_field(turn, "value", True, where) for turn in turns)
    return human, "", gpt


def _field(row: dict[str, Any], key: str, required: bool, where: str) -> str:
    """One text field of a row, checked; an absent or null optional field (the input) is empty."""
    if required and key not in row:
        raise InvalidValueError(f"{where}: missing {key!r} ({_LAYOUTS})")
    value = row.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise InvalidValueError(f"{where}: {key!r} must be a string, got {type(value).__name__} ({value!r:.40})")
    if required and not value.strip():
        raise InvalidValueError(f"{where}: {key!r} is empty; give it some text or drop the row")
    return value


def read_rows(path: str | Path) -> list[tuple[str, str, str, str]]:
    """The rows of a ``.jsonl`` or ``.json`` file as ``(instruction, input, response, where)``; ``where`` is
    ``file:line`` (JSONL) or ``file, row N`` (a JSON array).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise MissingFileError(
            f"instruction data {str(path)!r} does not exist (a .jsonl file of {_LAYOUTS}, or a .json array of them)"
        )
    if path.suffix.lower() == ".json":
        located = [(f"{path}, row {i}", row) for i, row in enumerate(_json_array(path), start=1)]
    else:
        located = [(f"{path}:{line}", row) for line, row in iter_jsonl(path)]
    rows = [(*parse_row(row, where), where) for where, row in located]
    if not rows:
        raise InvalidValueError(f"{path}: no rows; it needs {_LAYOUTS}")
    return rows


def _json_array(path: Path) -> list[Any]:
    """The rows of a ``.json`` instruction file: one JSON array (Alpaca's and ShareGPT's published layout)."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidValueError(
            f"{path}: not valid JSON ({e}); a .json instruction file is one array of rows"
        ) from None
    if not isinstance(rows, list):
        raise InvalidValueError(
            f"{path}: a .json instruction file must be one JSON array of rows ({_LAYOUTS}), got a "
            f"{type(rows).__name__}; for a row per line, name the file .jsonl"
        )
    return rows


def tokenize_row(instruction: str, input: str, response: str, tokenizer: Any) -> tuple[list[int], list[bool]]:
    """``(ids, mask)``: the row's tokens and, per token, whether it is a response token (a
    target). The prompt and the response are encoded separately (see the module docstring).
    """
    prompt = tokenizer.encode_ordinary(render_prompt(instruction, input))
    answer = tokenizer.encode_ordinary(response) + [tokenizer.eot_token]
    return prompt + answer, [False] * len(prompt) + [True] * len(answer)


def build_sequences(
    rows: Iterable[tuple[str, str, str, str]], seq_len: int, *, tokenizer: Any, pack: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, y, positions)``: int64 ``(N, seq_len)``, a padded sequence per row or rows packed greedily;
    ``y`` is ``x`` shifted by one with :data:`IGNORE_INDEX` on prompt and padding, ``positions`` each
    token's position within its row (trailing padding counts as one more row).
    """
    eot = tokenizer.eot_token
    windows: list[tuple[list[int], list[bool], list[int]]] = []
    for instruction, input, response, where in rows:
        ids, mask = tokenize_row(instruction, input, response, tokenizer)
        if len(ids) > seq_len + 1:
            raise InvalidValueError(
                f"{where}: the row is {len(ids)} tokens with the template, longer than a sequence (--seq-len {seq_len} "
                f"+ 1 = {seq_len + 1}); raise --seq-len (up to the model's context) or shorten the row"
            )
        if not (pack and windows and len(windows[-1][0]) + len(ids) <= seq_len + 1):
            # A new window: a row is never split.
            windows.append(([], [], []))
        windows[-1][0].extend(ids)
        windows[-1][1].extend(mask)
        windows[-1][2].extend(range(len(ids)))
    # The padding's input is <|endoftext|>.
    x = np.full((len(windows), seq_len), eot, dtype=np.int64)
    y = np.full((len(windows), seq_len), IGNORE_INDEX, dtype=np.int64)
    positions = np.tile(np.arange(seq_len, dtype=np.int64), (len(windows), 1))
    for i, (ids, mask, pos) in enumerate(windows):
        # The positions with a next token.
        n = len(ids) - 1
        x[i, : min(n + 1, seq_len)] = ids[:seq_len]
        y[i, :n] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        positions[i, : min(n + 1, seq_len)] = pos[:seq_len]
        # The padding after them counts as one more row, from position 0.
        positions[i, n + 1 :] -= n + 1
    return x, y, positions


def packed_inputs(positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward keyword arguments that isolate packed rows, from each token's position within
    its row (B, T): ``position_ids`` and a boolean ``attn_mask`` (B, 1, T, T) in which a token sees
    the tokens of its own row up to itself (block-diagonal causal), the mask SDPA takes.
    """
    t = torch.arange(positions.size(1))
    # Where each query's row begins.
    row_start = t - positions  # (B, T)
    key = t[None, None, :]  # (1, 1, T)
    attn_mask = (key >= row_start[:, :, None]) & (key <= t[None, :, None])  # (B, T, T)
    return {"position_ids": positions, "attn_mask": attn_mask[:, None]}


class InstructionLoader:
    """Batches ``(x, y)`` of instruction sequences (packed: ``(x, y, packed_inputs(...))``), with
    the interface of :class:`gpt2.data.TokenLoader` that the Trainer and evaluation use.

    One step of all ranks takes ``batch_size * world_size`` sequences of the epoch's order, rank ``r`` the ``r``-th
    ``batch_size``. With ``shuffle`` (training) each epoch has its permutation from ``(seed, epoch)`` and a last partial
    step is dropped; without (validation) the order is fixed and the last step is padded with all-ignored sequences, so
    a pass scores every row once. The state is ``{epoch, position}``: resuming continues the same order exactly.
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        pack: bool = False,
        shuffle: bool = True,
        seed: int = 1337,
        tokenizer: Any = None,
    ) -> None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
            check_value("InstructionLoader", name, value, POSITIVE_INT)
        if not 0 <= rank < world_size:
            raise InvalidValueError(f"rank={rank} is outside [0, world_size={world_size})")
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.pack, self.shuffle, self.seed = pack, shuffle, seed
        if tokenizer is None:
            tokenizer = get_tokenizer()
        self.pad_id = tokenizer.eot_token
        if isinstance(source, (str, Path)):
            rows = read_rows(source)
        else:
            rows = list(source)
        self.num_rows = len(rows)
        self.x, self.y, self.positions = build_sequences(rows, seq_len, pack=pack, tokenizer=tokenizer)
        self.num_sequences = len(self.x)
        # Training needs a whole step; validation at least one sequence (no rows make none).
        if self.num_sequences < (batch_size * world_size if shuffle else 1):
            raise InvalidValueError(
                f"{self.num_rows} rows make {self.num_sequences} sequences, fewer than one step needs "
                f"(batch_size {batch_size} x world_size {world_size}); use a smaller --micro-batch-size or more rows"
            )
        self.reset()

    def unsharded(self) -> InstructionLoader:
        """The same sequences for one process (rank 0 of 1), at the start: what rank 0 scores
        alone (``evaluate_loss``) after a distributed run.
        """
        view = InstructionLoader.__new__(InstructionLoader)
        view.__dict__.update(self.__dict__, rank=0, world_size=1)
        view.reset()
        return view

    @property
    def steps_per_epoch(self) -> int:
        per_step = self.batch_size * self.world_size
        if self.shuffle:
            # Training drops a last partial step.
            return self.num_sequences // per_step
        # Validation pads its last step, so that a pass scores every row.
        return math.ceil(self.num_sequences / per_step)

    @property
    def num_targets(self) -> int:
        """Response tokens (the loss's tokens) over all sequences."""
        return int((self.y != IGNORE_INDEX).sum())

    def _order_of(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
        return np.arange(self.num_sequences)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict]:
        B = self.batch_size
        start = self._position + self.rank * B
        picked = self._order[start : start + B]
        x = np.full((B, self.seq_len), self.pad_id, dtype=np.int64)
        y = np.full((B, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        positions = np.tile(np.arange(self.seq_len, dtype=np.int64), (B, 1))
        # The rest of the batch (a last padded step) is all-ignored padding.
        x[: len(picked)], y[: len(picked)] = self.x[picked], self.y[picked]
        positions[: len(picked)] = self.positions[picked]
        self._position += B * self.world_size
        if self._position >= self.steps_per_epoch * B * self.world_size:
            # An unshuffled loader stays at epoch 0, so that a pass ends where it began.
            if self.shuffle:
                self._epoch += 1
                self._order = self._order_of(self._epoch)
            self._position = 0
        if self.pack:
            return torch.from_numpy(x), torch.from_numpy(y), packed_inputs(torch.from_numpy(positions))
        return torch.from_numpy(x), torch.from_numpy(y)

    def reset(self) -> None:
        self._epoch, self._position = 0, 0
        self._order = self._order_of(0)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position, "num_sequences": self.num_sequences}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "epoch" not in state or "position" not in state:
            raise InvalidValueError(
                f"instruction loader state must be a dict with 'epoch' and 'position', got {state!r}"
            )
        if state.get("num_sequences", self.num_sequences) != self.num_sequences:
            raise InvalidValueError(
                f"the checkpoint's instruction data had {state['num_sequences']} sequences, this data has "
                f"{self.num_sequences}; resume with the same --data, --seq-len and --pack / --no-pack"
            )
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._order = self._order_of(self._epoch)


# --------------------------------------------------------------------------- for the finetune job
def split_rows(rows: list[Any], val_fraction: float, what: str) -> tuple[list[Any], list[Any]]:
    """The first ``1 - val_fraction`` of the rows for training, the rest (the end) for validation."""
    if not 0 <= val_fraction < 1:
        raise InvalidValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(len(rows) * val_fraction))
    if val_fraction > 0 and n_val == 0:
        # A fraction asks for validation: hold out at least one row.
        n_val = 1
    if n_val and n_val >= len(rows):
        raise InvalidValueError(f"{what} has {len(rows)} rows, too few to hold out --val-fraction {val_fraction}")
    return rows[: len(rows) - n_val], rows[len(rows) - n_val :]


def instruction_loaders(
    data: str,
    val_data: str | None,
    val_fraction: float,
    *,
    batch_size: int,
    seq_len: int,
    pack: bool,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Any, Any, list[Any]]:
    """``(train_loader, val_loader or None, val_rows)`` for ``gpt2 finetune --data x.jsonl``:
    ``--val-data`` (another .jsonl) or the last ``--val-fraction`` of the rows for validation.
    """
    rows = read_rows(data)
    if val_data is not None:
        train_rows, val_rows = rows, read_rows(val_data)
    else:
        train_rows, val_rows = split_rows(rows, val_fraction, data)
    common = dict(rank=rank, world_size=world_size)
    train = InstructionLoader(train_rows, batch_size, seq_len, shuffle=True, seed=seed, pack=pack, **common)
    if not val_rows:
        return train, None, train_rows
    # Validation scores each row alone, as at inference, whatever --pack says: the losses of packed
    # and unpacked runs compare, and evaluation reads plain (x, y) batches.
    return train, InstructionLoader(val_rows, batch_size, seq_len, shuffle=False, **common), val_rows

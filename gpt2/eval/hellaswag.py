"""HellaSwag scored as build-nanogpt (and lm-evaluation-harness's "completion" style) does for a base model: each ending
is appended to the context and scored by its cross-entropy over the *ending tokens only*. ``acc``: the lowest summed
loss wins (favours short endings); ``acc_norm``: the lowest mean loss per token (build-nanogpt's number; GPT-2 124M
scores 0.2955 on val). :class:`HellaSwagCallback` scores it inside ``Trainer.fit`` (``gpt2 train --hellaswag``).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from gpt2.data import iter_jsonl
from gpt2.data.downloads import path_from_env
from gpt2.errors import InvalidValueError, MissingFileError
from gpt2.eval import lockstep
from gpt2.eval.loss import AutocastArg, _autocast_context, _model_device
from gpt2.files import default_cache_dir, download
from gpt2.model.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

# The official data files of the HellaSwag paper (Zellers et al., 2019). "test" has no labels.
HELLASWAG_URLS = {
    split: f"https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
    for split in ("train", "val", "test")
}
HELLASWAG_ENV = "GPT2_HELLASWAG"


def hellaswag_path(split: str = "val", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the HellaSwag ``split`` jsonl: in ``$GPT2_HELLASWAG`` (the val file, or a directory
    of ``hellaswag_<split>.jsonl``), else in ``cache_dir`` (default ``<cache>/hellaswag``), where a
    missing file is downloaded, checked and written atomically.
    """
    if split not in HELLASWAG_URLS:
        raise InvalidValueError(f"unknown HellaSwag split {split!r}; choose one of {sorted(HELLASWAG_URLS)}")
    filename = f"hellaswag_{split}.jsonl"
    override = path_from_env(HELLASWAG_ENV, "hellaswag_val.jsonl or a folder for the HellaSwag files", folder_ok=True)
    if override is not None and override.is_dir():
        path = override / filename
    elif override is not None and split != "val":
        raise InvalidValueError(
            f"${HELLASWAG_ENV}={override} is a file, used for the val split only; for the "
            f"{split!r} split point ${HELLASWAG_ENV} at a directory holding {filename}"
        )
    elif override is not None:
        path = override
    elif cache_dir is not None:
        path = Path(cache_dir).expanduser() / filename
    else:
        path = default_cache_dir() / "hellaswag" / filename
    if path.is_file():
        return path
    download(
        HELLASWAG_URLS[split],
        path,
        what=f"HellaSwag {split}",
        # A proxy or captive portal can answer with HTML: what is not HellaSwag (from its first line) is not cached.
        validate=lambda data: _check_example(json.loads(data.split(b"\n", 1)[0]), "line", 1),
        offline_hint=f"download hellaswag_{split}.jsonl elsewhere and set ${HELLASWAG_ENV} to its path, or copy it to",
    )
    return path


def _check_example(example: Any, where: str, line: int) -> dict[str, Any]:
    """``example`` if it is a HellaSwag example (``where:line`` names it in the error otherwise): at least two
    ``endings``, a ``ctx`` string or ``ctx_a`` and ``ctx_b`` strings (``ctx_b`` may be missing or empty), and a
    ``label`` (:func:`_check_label`).
    """
    at = f"{where}:{line}"
    if not isinstance(example, dict):
        raise InvalidValueError(f"{at}: expected a JSON object, got {type(example).__name__}")
    endings = example.get("endings")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        raise InvalidValueError(
            f"{at}: 'endings' must be a list of at least 2 strings (HellaSwag has 4), got {endings!r}"
        )
    ctx_a, ctx_b = example.get("ctx_a"), example.get("ctx_b") or ""
    if not isinstance(example.get("ctx"), str) and not (isinstance(ctx_a, str) and isinstance(ctx_b, str)):
        raise InvalidValueError(
            f"{at}: no context: expected a 'ctx' string (or 'ctx_a' and 'ctx_b' strings); "
            f"keys present: {sorted(example)}"
        )
    _check_label(example.get("label"), len(endings), at)
    return example


def _check_label(label: Any, n_endings: int, at: str) -> None:
    """The index of an ending, as an int or (HF's copy) a string of digits: "1"; not True, not 1.9."""
    if label is None or label == "":
        raise InvalidValueError(f"{at}: no label (the official test split is unlabelled): score the val split")
    valid = type(label) is int or isinstance(label, str) and label.isdigit()
    if not valid or not 0 <= int(label) < n_endings:
        raise InvalidValueError(f"{at}: 'label' must be an ending's index (0 to {n_endings - 1}), got {label!r}")


def iterate_hellaswag(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The examples of a HellaSwag jsonl file (``ctx`` or ``ctx_a`` + ``ctx_b``, ``endings``,
    ``label``); a malformed line raises ``ValueError`` naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(
            f"HellaSwag file {str(path)!r} does not exist; pass the path of hellaswag_val.jsonl, or download it "
            "with gpt2.hellaswag_path() ('auto' on the command line)"
        )
    for line_no, example in iter_jsonl(path, hint="; is this a HellaSwag jsonl file?"):
        yield _check_example(example, str(path), line_no)


def _context(example: dict[str, Any]) -> str:
    if isinstance(example.get("ctx"), str):
        return example["ctx"]
    # The official files: ctx == ctx_a + " " + ctx_b when ctx_b is non-empty.
    if example.get("ctx_b"):
        return example["ctx_a"] + " " + example["ctx_b"]
    return example["ctx_a"]


def render_example(example: dict[str, Any], tokenizer: Any = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``tokens`` ``(N, T)`` (context + ending i on row i, right-padded with 0), ``mask`` ``(N, T)``
    (1 on the ending tokens, the only ones scored) and the label of one example. Endings are
    encoded with a leading space, as they follow the context's last word in GPT-2's BPE.
    """
    _check_example(example, "example", 0)
    label = int(example["label"])
    if tokenizer is None:
        tokenizer = get_tokenizer()
    ctx_tokens = list(tokenizer.encode(_context(example)))
    if not ctx_tokens:
        raise InvalidValueError("HellaSwag example has an empty context: nothing to condition the endings on")
    rows, masks = [], []
    for ending in example["endings"]:
        end_tokens = list(tokenizer.encode(" " + ending))
        rows.append(torch.tensor(ctx_tokens + end_tokens, dtype=torch.long))
        masks.append(torch.tensor([0] * len(ctx_tokens) + [1] * len(end_tokens), dtype=torch.long))
    return pad_sequence(rows, batch_first=True), pad_sequence(masks, batch_first=True), label


@torch.no_grad()
def ending_losses(
    model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, autocast: AutocastArg = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean cross-entropy of the masked (ending) tokens of each row: two ``(N,)``.

    Rows longer than the model's context keep their last ``block_size`` tokens (the endings
    always fit; the context is cropped on the left, the same for every row).
    """
    block_size = getattr(getattr(model, "config", None), "block_size", None)
    if block_size is not None and tokens.size(1) > block_size:
        drop = tokens.size(1) - block_size
        first_ending = int(mask.argmax(dim=1).min())
        # Cropping would lose the token that predicts the first ending token.
        if drop >= first_ending:
            raise InvalidValueError(
                f"a HellaSwag ending is too long for the model's context (block_size={block_size}, "
                f"row length {tokens.size(1)}, context length {first_ending})"
            )
        tokens, mask = tokens[:, drop:], mask[:, drop:]
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab_size is not None and tokens.device.type == "cpu" and int(tokens.max()) >= vocab_size:
        # Checked here, on the host: the model's forward does not read ids (a GPU sync), and on
        # CUDA an id past the embedding is a device-side assert instead of an error.
        raise InvalidValueError(
            f"the tokenizer produced token id {int(tokens.max())}, but the model has vocab_size={vocab_size}: "
            f"HellaSwag needs a model over the GPT-2 vocabulary (50257 tokens) or a matching tokenizer="
        )
    device = _model_device(model)
    tokens, mask = tokens.to(device), mask.to(device)
    with _autocast_context(autocast, device):
        # GPT's forward returns (logits, loss)
        logits = model(tokens)[0]  # (N, T, V)
    # Position t predicts token t + 1: score each ending token from the logits just before it.
    targets, scored = tokens[:, 1:], mask[:, 1:].float()  # (N, T-1)
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    sum_loss = (losses.view_as(scored) * scored).sum(dim=1)
    return sum_loss, sum_loss / scored.sum(dim=1).clamp(min=1.0)


@torch.no_grad()
def score_hellaswag(
    model: nn.Module,
    path_or_examples: str | os.PathLike[str] | Iterable[dict[str, Any]],
    limit: int | None = None,
    device: torch.device | str | None = None,
    *,
    tokenizer: Any = None,
    autocast: AutocastArg = None,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, float]:
    """HellaSwag accuracy of a causal LM on a jsonl file or example dicts: ``{"acc", "acc_norm", "n"}``.

    ``limit`` scores only the first examples. With ``world_size > 1`` (under ``torch.distributed``) rank ``r`` scores
    examples ``r, r + world_size, ...`` and the counts are summed over ranks, so every rank returns the full result.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidValueError(f"limit must be a positive integer or None, got {limit!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    if world_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError("score_hellaswag with world_size > 1 needs torch.distributed to be initialised")
    if device is not None:
        model = model.to(device)
    if isinstance(path_or_examples, (str, os.PathLike)):
        # The file reader checks each example, naming its line.
        examples = iterate_hellaswag(path_or_examples)
    else:
        examples = (_check_example(example, "example", 0) for example in path_or_examples)
    # [correct by summed loss, correct by mean loss, examples] over this rank's share (every world_size-th from rank)
    counts = torch.zeros(3, dtype=torch.long)

    def score(example: dict[str, Any], counted: bool) -> None:
        tokens, mask, label = render_example(example, tokenizer)
        sum_loss, mean_loss = ending_losses(model, tokens, mask, autocast)
        if counted:
            counts.add_(torch.tensor([int(sum_loss.argmin()) == label, int(mean_loss.argmin()) == label, 1]))

    lockstep.score_share(model, itertools.islice(examples, limit), rank, world_size, score)
    if world_size > 1:
        counts = counts.to(_model_device(model))
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
    correct, correct_norm, n = counts.tolist()
    if n == 0:
        raise InvalidValueError("no HellaSwag example was scored: the file or iterable is empty")
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n}


def resolve_hellaswag(spec: str | None) -> Path | None:
    if spec is None:
        return None
    if spec == "auto":
        return hellaswag_path("val")
    path = Path(spec).expanduser()
    # Every row now (and that the file is there): a bad one would stop training at its first score.
    for _ in iterate_hellaswag(path):
        pass
    return path


class HellaSwagCallback:
    """A Trainer callback: HellaSwag every ``interval`` steps and after the last one, on every
    rank (each scores its share), into the step's record (``hellaswag_acc`` / ``_acc_norm`` /
    ``_n`` in metrics.jsonl, which a resumed run truncates and continues like every metric).
    """

    def __init__(self, path: Path, interval: int, limit: int | None) -> None:
        self.path, self.interval, self.limit = path, interval, limit
        self.last: dict[str, Any] | None = None

    def __call__(self, trainer: Any, record: dict[str, Any]) -> None:
        # The Trainer's rule for evaluations and checkpoints.
        if trainer.due(self.interval):
            result = self.score(trainer)
            record.update(hellaswag_acc=result["acc"], hellaswag_acc_norm=result["acc_norm"], hellaswag_n=result["n"])

    def score(self, trainer: Any) -> dict[str, Any]:
        env = trainer.dist_env
        start = time.time()
        # The raw model, not the compiled one: every example has its own length, which would make
        # torch.compile recompile again and again.
        result = score_hellaswag(
            trainer.model,
            self.path,
            limit=self.limit,
            autocast=trainer.precision.autocast,
            rank=env.rank,
            world_size=env.world_size,
        )
        self.last = {"step": trainer.step, **result}
        # Logging, not print: the command line shows it above the progress bar.
        if trainer.is_main:
            logger.info(
                f"step {trainer.step} | hellaswag acc_norm {result['acc_norm']:.4f} | acc {result['acc']:.4f} | "
                f"{result['n']} examples | {time.time() - start:.1f} s"
            )
        return self.last

"""Hugging Face interop behind ``GPT.from_pretrained`` (:func:`load_pretrained`: hub ids, ``transformers``
directories, and the run / checkpoint directories of ``gpt2 train``: every ``--model``) and
``model.save_pretrained`` (:func:`save_pretrained`). The methods are the public way; the pure state-dict and
config conversion lives in :mod:`gpt2.model.hf_convert`.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from gpt2.errors import Gpt2Error, InvalidValueError, MissingFileError
from gpt2.files import OutputExistsError, replace_atomically
from gpt2.model.checkpoint_files import (
    checkpoints_at,
    first_line,
    load_state_into,
    load_weights,
    non_finite_tensors,
    open_checkpoint,
    refuse_non_finite,
    save_weights,
)
from gpt2.model.config import GPT2_VOCAB_SIZE, GPTConfig
from gpt2.model.hf_convert import config_from_hf, gpt_to_hf_state_dict, hf_config_from_gpt, hf_to_gpt_state_dict
from gpt2.model.tokenizer import ENDOFTEXT, bpe_files
from gpt2.outputs import OutputFolder

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")
# The official GPT-2 checkpoints. Written bare, these names always mean the hub, even where a
# directory of that name exists (this repository's own package directory is called gpt2/);
# write a path ("./gpt2", an absolute path) to load a local directory with such a name.
OFFICIAL_HUB_IDS = frozenset(
    f"{owner}{name}" for owner in ("", "openai-community/") for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
) | {"distilgpt2", "distilbert/distilgpt2"}
_SAFETENSORS = "model.safetensors"
_BIN = "pytorch_model.bin"
# transformers' weights files, whole or sharded, and their index files: an export replaces them all.
_WEIGHTS_NAME = re.compile(r"(model(-\d+-of-\d+)?\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin)(\.index\.json)?")
_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
# How a caller allows replacing what gpt2 did not write (or what changed since), in Python and on the command line.
OVERWRITE_FLAG = "overwrite=True (--overwrite)"


def load_hf_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a ``transformers`` directory: safetensors, else ``.bin`` (plain tensors only, so
    no pickled code runs), each whole or sharded.
    """
    d = Path(directory)
    # Each format whole, else its shards under transformers' index file (the file's name + .index.json).
    for name, load in ((_SAFETENSORS, lambda path: load_weights(path)[0]), (_BIN, _torch_load)):
        if (d / name).is_file():
            return load(d / name)
        if (d / f"{name}.index.json").is_file():
            return _load_sharded(d, f"{name}.index.json", load)
    found = []
    if d.is_dir():
        found = sorted(p.name for p in d.iterdir())
    raise MissingFileError(
        f"no weights in {str(d)!r}: expected {_SAFETENSORS}, {_SAFETENSORS}.index.json, {_BIN} or "
        f"{_BIN}.index.json; found {found}"
    )


class UnsafeCheckpointError(Gpt2Error, ValueError):
    """A ``.bin`` file that holds pickled Python objects besides tensors (refused: unpickling runs code)."""


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch names the first class it refused; its own advice (to unpickle anyway) is never repeated.
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = "objects other than tensors"
        if found:
            what = f"such as {found.group(1)}"
        raise UnsafeCheckpointError(
            f"refused to read {path}: besides tensors it holds pickled Python objects ({what}), and unpickling "
            f"them would run code from the file, so gpt2 reads .bin weights as plain tensors only. Use the model's "
            f"{_SAFETENSORS} instead (hub repos publish one; save_pretrained writes one), placed beside "
            f"{path.name} in {str(path.parent)!r}"
        ) from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidValueError(
            f"{path} is not valid JSON ({first_line(e)}): truncated or overwritten? Restore it from the model's source"
        ) from None


def _load_sharded(d: Path, index_name: str, load) -> dict[str, torch.Tensor]:
    weight_map = _read_json(d / index_name).get("weight_map")
    if not isinstance(weight_map, dict):
        raise InvalidValueError(f"{d / index_name} has no 'weight_map' dict: not a transformers shard index")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        # named as the index's: the loaders' own errors do not say the index lists it
        if not (d / shard).is_file():
            raise MissingFileError(f"shard {shard!r} listed in {index_name} is missing from {str(d)!r}")
        out.update(load(d / shard))
    return out


def resolve_source(name_or_path: str | os.PathLike) -> str | Path:
    """A model name's source: a hub id (``str``) or an existing local path (``Path``). In order: an official name
    (:data:`OFFICIAL_HUB_IDS`) is the hub; an existing path (``~`` expanded) is local; a ``name`` / ``owner/name``
    string that does not read as a local path (:func:`_local_reason`) is a hub id; anything else (and any
    ``PathLike``) is a missing path: FileNotFoundError, naming the closest existing name where one is close.
    """
    if isinstance(name_or_path, str) and name_or_path in OFFICIAL_HUB_IDS:
        return name_or_path
    # os.fspath: a TypeError for anything but a str or a PathLike
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.exists():
        return path
    hub_shaped = isinstance(name_or_path, str) and _HUB_ID.match(name) is not None
    local = _local_reason(name)
    if hub_shaped and not local:
        return name
    why = ""
    if hub_shaped:
        why = f" (read as a path: {local})"
    raise MissingFileError(
        f"{name!r} does not exist: it is neither an existing directory nor a Hugging Face hub id "
        f"(such as 'gpt2' or 'owner/model'){why}; {_path_hint(name)}"
    )


# A name ending so names a file, never a hub repo.
_FILE_SUFFIXES = frozenset({".bin", ".ckpt", ".gguf", ".json", ".pt", ".pth", ".safetensors", ".txt"})


def _local_reason(name: str) -> str:
    """Why a hub-shaped ``name`` still reads as a local path: it ends with a file suffix, or its
    owner part (``runs`` in ``runs/shakespere``) is a local folder. Empty where it does not.
    """
    suffix = Path(name).suffix
    if suffix in _FILE_SUFFIXES:
        return f"it ends with {suffix}"
    owner, separator, _ = name.partition("/")
    if separator and Path(owner).is_dir():
        return f"{owner}/ is a local folder"
    return ""


def _path_hint(name: str) -> str:
    """The missing ``name`` with its first missing part replaced by the closest entry of the
    folder above it ("did you mean ...?"), else advice to check the path.
    """
    parts = Path(name).parts
    # The nearest existing folder above the first missing part.
    missing = 0
    while missing < len(parts) and Path(*parts[: missing + 1]).expanduser().exists():
        missing += 1
    parent = Path(*parts[:missing]).expanduser()
    entries = []
    if parent.is_dir():
        entries = [p.name for p in parent.iterdir()]
    close = difflib.get_close_matches(parts[missing], entries, n=1)
    if not close:
        return "check the path"
    suggestion = Path(*parts[:missing], close[0], *parts[missing + 1 :])
    return f"did you mean {str(suggestion)!r}?"


def _resolve(name_or_path: str | os.PathLike, cache_dir, revision) -> Path:
    """The model's local directory: the path itself or a hub snapshot."""
    source = resolve_source(name_or_path)
    if isinstance(source, str):
        return _download(source, cache_dir, revision)
    spec = os.fspath(name_or_path)
    if source.is_file():
        parent, hint = source.parent, ""
        if (parent / "config.json").is_file() or (parent / "trainer_state.json").is_file():
            hint = f"; pass its directory {str(parent)!r}"
        raise NotADirectoryError(
            f"{spec!r} is a file; a model is a directory: a transformers model (config.json + "
            f"model.safetensors) or a gpt2 checkpoint / run directory{hint}"
        )
    if not (source / "config.json").is_file() and not checkpoints_at(source):
        found = sorted(p.name for p in source.iterdir())[:10]
        hub = ""
        if source.name in OFFICIAL_HUB_IDS:
            hub = f"; for the hub model {source.name!r} write its bare name"
        raise MissingFileError(
            f"{spec!r} holds no model: neither a transformers directory (no config.json) nor a gpt2 checkpoint or "
            f"run directory (no trainer_state.json and weights in it or in its checkpoints/step_*); found {found}{hub}"
        )
    return source


def _from_checkpoint(path: Path, model_class: type[torch.nn.Module]) -> torch.nn.Module:
    """The model of a ``gpt2 train`` checkpoint (or a run's newest intact one), built from its recorded config."""
    # Verified: its files, the safetensors header and size, finite weights.
    data = open_checkpoint(path, trainer_state=False)
    checkpoint, model_config = data.path, data.meta.get("model_config")
    if not isinstance(model_config, dict):
        raise InvalidValueError(
            f"checkpoint {str(checkpoint)!r} does not record its model configuration "
            f"('model_config' in trainer_state.json), so the model cannot be rebuilt from it"
        )
    if data.trainable_only:
        raise InvalidValueError(
            f"checkpoint {str(checkpoint)!r} holds only the trainable (adapter) weights; load the base "
            f"model and pass this run's adapter with --adapter instead"
        )
    # The Trainer wrote it from a GPTConfig, and SHA256SUMS vouches for the file.
    model = model_class(GPTConfig.from_dict(model_config))
    load_state_into(model, data)
    return model


class HubUnreachableError(Gpt2Error, ConnectionError):
    """A hub id that could not be downloaded: offline, no network, or no cached copy."""


def _unreachable_reason(e: Exception) -> str:
    """Offline mode where that is why (huggingface_hub's message says little more), else ``e``'s first line."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    # What huggingface_hub raises offline for a model it has not cached.
    if offline and type(e).__name__ in {"LocalEntryNotFoundError", "OfflineModeIsEnabled"}:
        return "offline mode is on (HF_HUB_OFFLINE=1) and no copy is cached"
    return f"{type(e).__name__}: {first_line(e)}"


def _not_here(repo_id: str) -> str:
    """Where a name read as a hub id was looked for locally first: a mistyped or relative run folder
    (``runs/shakespeare`` from another folder) is then named as missing before the hub is.
    """
    if repo_id in OFFICIAL_HUB_IDS:
        return f"{repo_id!r} is read as a hub id"
    return f"no folder {repo_id!r} exists in {str(Path.cwd())!r}, so it is read as a hub id"


def _download(repo_id: str, cache_dir, revision) -> Path:
    from huggingface_hub import snapshot_download

    # utils: where every huggingface_hub transformers>=4.40 accepts has them (errors only from 0.22 on).
    from huggingface_hub.utils import RepositoryNotFoundError, RevisionNotFoundError

    # Only what loading needs: the config and safetensors weights; .bin only as a fallback for
    # repos that have no safetensors (flax/tf/onnx/tflite files are never fetched).
    try:
        for weights in ("model*.safetensors", "pytorch_model*.bin"):
            # The whole file or its shards, and their index (the pattern's * also matches nothing).
            patterns = ["config.json", weights, f"{weights}.index.json"]
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns))
            if any(folder.glob("model*.safetensors")):
                break
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise MissingFileError(
            f"{_not_here(repo_id)} and the hub has no such (accessible) model repo at revision {revision or 'main'!r}; "
            f"check the name and the revision, or log in (huggingface-cli login) for a gated/private repo"
        ) from e
    except Exception as e:
        # Offline, DNS, proxy, timeouts: all end here, in one message (huggingface_hub's chained
        # tracebacks run to hundreds of lines and say no more).
        raise HubUnreachableError(
            f"could not load {repo_id!r}: {_not_here(repo_id)}, and the Hugging Face hub could not be reached "
            f"({_unreachable_reason(e)}). Either download it once with network access (it is then cached under "
            "$HF_HOME, default ~/.cache/huggingface; point HF_HOME or cache_dir= at an existing cache), or pass the "
            "path of a local directory holding config.json and model.safetensors, e.g. one written by save_pretrained"
        ) from None
    return folder


def load_pretrained(
    name_or_path: str | os.PathLike,
    *,
    pad_vocab_multiple: int = 1,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    dropout: float = 0.0,
    model_class: type[torch.nn.Module],
) -> torch.nn.Module:
    """What :meth:`gpt2.GPT.from_pretrained` runs (call that): a ``model_class(config)`` in eval mode with the
    weights of whatever ``--model`` takes (see :func:`resolve_source`): a hub id, a ``transformers`` directory, or
    a ``gpt2 train`` checkpoint / run directory (built with its recorded config: ``pad_vocab_multiple`` and
    ``dropout`` do not apply). ``dtype`` defaults to float32 (master weights for training).

    The model's ``name_or_path`` is where ``transformers`` loads the same weights from (minlora's PEFT
    export writes it as the adapter's base): the hub id, or the absolute path of the ``transformers``
    directory; None for a ``gpt2 train`` checkpoint, which transformers cannot read.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    directory = _resolve(name_or_path, cache_dir, revision)
    if (directory / "config.json").is_file():
        model = _from_transformers(directory, model_class, pad_vocab_multiple=pad_vocab_multiple, dropout=dropout)
        model.name_or_path = str(directory.resolve())
    else:
        # A checkpoint: built with its own config, padding and all; transformers cannot read it.
        model = _from_checkpoint(directory, model_class)
        model.name_or_path = None
    source = ""
    # A hub id (its snapshot is another folder): transformers loads it by that name.
    if Path(os.fspath(name_or_path)).expanduser() != directory:
        model.name_or_path = str(name_or_path)
        source = f" from {directory}"
    logger.info("loaded %s (%s parameters)%s", name_or_path, f"{model.num_params():,}", source)
    # float32 unless asked: master weights for training, whatever a file stores.
    return model.to(device=device, dtype=dtype or torch.float32).eval()


def _from_transformers(directory: Path, model_class: type[torch.nn.Module], **overrides: Any) -> torch.nn.Module:
    """``model_class`` with the config (``overrides``: our own fields, see :func:`config_from_hf`) and the
    weights of the ``transformers`` directory, as they are stored.
    """
    # a damaged config.json is named by _read_json itself; the config's own values are named here
    hf_config = _read_json(directory / "config.json")
    try:
        config = config_from_hf(hf_config, **overrides)
    except (TypeError, ValueError) as e:
        raise InvalidValueError(f"{directory / 'config.json'}: {e}") from None
    hf_sd = load_hf_state_dict(directory)
    # NaN/inf weights never enter a model.
    refuse_non_finite(non_finite_tensors(hf_sd), f"refusing to load {directory}")
    # Build on the meta device (no memory, no random init), then adopt the loaded tensors.
    with torch.device("meta"):
        model = model_class(config)
    model.load_state_dict(hf_to_gpt_state_dict(hf_sd, config), strict=True, assign=True)
    # The head and the embedding are one tensor, which assign=True made two Parameters: tie them again.
    model.lm_head.weight = model.transformer.wte.weight
    return model


def save_pretrained(
    model: torch.nn.Module,
    directory: str | os.PathLike,
    *,
    safe_serialization: bool = True,
    tokenizer_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (a :class:`gpt2.GPT`: ``GPT.save_pretrained`` passes itself) as a
    ``transformers.GPT2LMHeadModel`` directory; returns its path.

    ``config.json`` plus ``model.safetensors`` (padding stripped, the tied head stored once), or a tensors-only
    ``pytorch_model.bin`` with ``safe_serialization=False``. GPT-2's tokenizer files come along (from
    :func:`gpt2.model.tokenizer.bpe_files`, or ``tokenizer_dir``), so ``AutoTokenizer`` and llama.cpp's converter work
    on the folder; without ``tokenizer_dir``, a model whose vocabulary is not GPT-2's 50257 tokens gets none.

    It writes inside ``directory`` only. Into a folder holding an earlier export, it replaces only that export's
    files, which the folder's record proves gpt2 wrote (:mod:`gpt2.outputs`); a file there of the same name
    that gpt2 did not write, or that changed since, needs ``overwrite=True``. What it wrote is recorded there.
    """
    config = model.config
    # Found before anything is written: an export without its tokenizer would load but decode
    # nothing (transformers then builds a 1-token vocabulary). A model with another vocabulary
    # size (a test toy) has no use for GPT-2's, unless asked for with tokenizer_dir.
    bpe = None
    if tokenizer_dir or config.vocab_size == GPT2_VOCAB_SIZE:
        bpe = bpe_files(tokenizer_dir)
    hf_sd = gpt_to_hf_state_dict(model.state_dict(), config)
    # transformers re-ties lm_head to the embedding on load; safetensors refuses shared tensors.
    del hf_sd["lm_head.weight"]
    # clone(): the vocabulary slice is a view into the padded embedding, and safetensors / a
    # compact .bin need each tensor to own exactly its bytes.
    hf_sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in hf_sd.items()}

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = hf_config_from_gpt(config)
    hf_config["torch_dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    written, stale = _export_files(out, safe_serialization, bpe is not None)
    folder = OutputFolder(out)
    clash = [name for name in [*written, *stale] if not folder.owns(name)]
    if clash and not overwrite:
        raise OutputExistsError(
            f"{out} holds {', '.join(clash)}, which gpt2 did not write there (or which changed since): choose "
            f"another folder, or pass {OVERWRITE_FLAG} to replace them"
        )
    for name in stale:
        (out / name).unlink()
    # Each file is written under a temporary name and renamed into place, weights first: a crash
    # leaves whole files behind, never a truncated one that transformers would fail to read. The
    # safetensors file by the one writer of checkpoints' weights (the user's umask, "format": "pt").
    if safe_serialization:
        save_weights(hf_sd, out / _SAFETENSORS)
    else:
        replace_atomically(out / _BIN, lambda f: torch.save(hf_sd, f))
    config_text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    replace_atomically(out / "config.json", lambda f: f.write(config_text.encode("utf-8")))
    if bpe is not None:
        _write_tokenizer(*bpe, out, config)
    else:
        logger.warning(
            f"no tokenizer files: the model has {config.vocab_size} token ids, GPT-2's tokenizer {GPT2_VOCAB_SIZE}"
        )
    # No log line: the caller says what it wrote (gpt2 export and finetune print one line per export).
    folder.record(written)
    return out


def _export_files(out: Path, safe_serialization: bool, tokenizer: bool) -> tuple[list[str], list[str]]:
    """The names an export into ``out`` writes, and the files there it deletes first."""
    weights = _BIN
    if safe_serialization:
        weights = _SAFETENSORS
    written = [weights, "config.json"]
    # Every other weights file goes: an earlier sharded save's index would win over a new .bin on reload.
    stale = sorted(p.name for p in out.iterdir() if _WEIGHTS_NAME.fullmatch(p.name) and p.name != weights)
    if tokenizer:
        written += _TOKENIZER_FILES
    else:
        # Without a tokenizer of its own, an earlier export's would be loaded with this model.
        stale += [name for name in ("tokenizer.json", *_TOKENIZER_FILES) if os.path.lexists(out / name)]
    return written, stale


def _write_tokenizer(vocab_bpe: Path, encoder_json: Path, out: Path, config: GPTConfig) -> None:
    """GPT-2's BPE files under transformers' names (encoder.json is vocab.json and vocab.bpe is
    merges.txt, byte for byte: OpenAI's release and the hub's gpt2 repo ship the same files), and
    the tokenizer settings of the hub's gpt2: ``<|endoftext|>`` as BOS, EOS and UNK, no padding.
    """
    for src, name in ((encoder_json, "vocab.json"), (vocab_bpe, "merges.txt")):
        replace_atomically(out / name, lambda f, src=src: f.write(src.read_bytes()))
    special = {name: ENDOFTEXT for name in ("bos_token", "eos_token", "unk_token")}
    tok_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": config.block_size, "add_prefix_space": False}
    for name, content in (("tokenizer_config.json", {**tok_config, **special}), ("special_tokens_map.json", special)):
        text = json.dumps(content, indent=2) + "\n"
        replace_atomically(out / name, lambda f, text=text: f.write(text.encode("utf-8")))

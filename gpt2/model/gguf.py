"""A GPT -> one self-contained GGUF file (weights + GPT-2 tokenizer) that llama.cpp runs, written
with llama.cpp's ``gguf`` package under the names its own converter (``convert_hf_to_gguf.py``,
``GPT2Model``) uses, so llama.cpp treats it as a converted ``gpt2``.

The file never holds a value its type cannot: f16 holds magnitudes up to 65504 and q8_0 stores each
32-value block's scale (its largest magnitude / 127) in f16, so beyond that they would write ``inf``.
A matrix with such a weight is written in f32 instead, with a warning naming it: the file's other
matrices keep the asked type, and llama.cpp reads files whose tensors differ in type (norms and
biases are f32 in every file anyway). Refusing would leave no way to export such a model, and
clipping would change it silently.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2.errors import InvalidValueError
from gpt2.files import check_new_file, replace_atomically
from gpt2.model.checkpoint_files import unwrap_model
from gpt2.model.config import GPT2_VOCAB_SIZE, GPTConfig
from gpt2.model.hf import OVERWRITE_FLAG
from gpt2.model.hf_convert import CONV1D_WEIGHTS, gpt_to_hf_state_dict
from gpt2.model.tokenizer import EOT_TOKEN, bpe_files, read_bpe_files

logger = logging.getLogger(__name__)

# The types a file can be written in, each with its gguf.LlamaFileType member: what the file says its matrices are.
GGUF_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0"}


def _gguf_tensors(model: torch.nn.Module, config: GPTConfig) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array: the ``transformers`` state dict (:func:`gpt_to_hf_state_dict`: padding cut
    off, zero biases for ``bias=False``, which llama.cpp's graph needs) under the names llama.cpp's converter gives
    it (gguf's own name map), with the Conv1D weights back in ``nn.Linear``'s (out, in), as llama.cpp keeps them.
    """
    # save_gguf, its caller, says what to install where it is missing.
    import gguf

    hf_sd = gpt_to_hf_state_dict(model.state_dict(), config)
    # The LM head is tied to the embedding: with no output.weight llama.cpp reuses token_embd.
    del hf_sd["lm_head.weight"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, config.n_layer)
    out: dict[str, np.ndarray] = {}
    for key, value in hf_sd.items():
        if key.endswith(CONV1D_WEIGHTS):
            value = value.t()
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        out[name] = value.detach().to("cpu", torch.float32).contiguous().numpy()
    return out


def check_tied_head(model: torch.nn.Module) -> None:
    """GPT-2's transformers and GGUF files hold one tensor for the token embedding and the LM head."""
    if not torch.equal(model.lm_head.weight, model.transformer.wte.weight):
        raise InvalidValueError(
            "the LM head differs from the token embedding (a merged --lora.include-embeddings or "
            "--lora.include-lm-head adapter unties them), but a GPT-2 transformers or GGUF file holds one tensor "
            "for both: keep such an adapter unmerged (gpt2 sample --adapter, gpt2 export --peft-out)"
        )


def _encode(gguf: Any, name: str, data: np.ndarray, kind: Any) -> tuple[np.ndarray, Any]:
    """``(bytes, type)`` of the tensor ``name``: ``data`` in ``kind``, or f16 where q8_0's 32-value
    blocks do not divide its rows, or f32 with a warning where the type cannot hold its values.
    """
    # numpy's overflow warnings are silenced: the warning below names the tensor instead.
    with np.errstate(over="ignore", invalid="ignore"):
        try:
            encoded = gguf.quants.quantize(data, kind)
        except gguf.QuantError:
            # A row length that is not a multiple of q8_0's 32-value block.
            kind = gguf.GGMLQuantizationType.F16
            encoded = gguf.quants.quantize(data, kind)
        # f16 holds |x| <= 65504, and q8_0's f16 block scales |x| / 127 no more: beyond that, inf.
        # f32 holds every finite value (its dequantize is the data itself: no overflow).
        overflow = np.isfinite(data) & ~np.isfinite(gguf.quants.dequantize(encoded, kind))
    if not overflow.any():
        return encoded, kind
    top = float(np.abs(data[overflow]).max())
    logger.warning(
        f"GGUF export: {name} holds values up to {top:.4g}, beyond what {kind.name.lower()} can hold (they would be "
        "written as inf): this tensor is written as f32"
    )
    return data, gguf.GGMLQuantizationType.F32


def save_gguf(model: torch.nn.Module, path: str | os.PathLike, *, dtype: str = "f16", overwrite: bool = False) -> Path:
    """Write ``model`` (a :class:`gpt2.GPT`, adapters merged) as a GGUF file with GPT-2's tokenizer embedded; returns
    its path. ``dtype`` (``f32``, ``f16``, ``q8_0``) is the matrices'; norms and biases stay float32 as in llama.cpp's
    converter, and rows that do not split into q8_0's 32-value blocks fall back to f16.

    An existing ``path`` is replaced only with ``overwrite=True``, and only where it is a regular file
    (:func:`gpt2.files.check_new_file`); nothing is written beside it.
    """
    try:
        import gguf
    except ImportError as e:
        raise ImportError("GGUF export needs the gguf package: pip install gguf (or the gpt2 'gguf' extra)") from e
    model = unwrap_model(model)
    # What a GGUF file of type dtype can hold, checked before anything is written.
    config = getattr(model, "config", None)
    if not isinstance(config, GPTConfig):
        raise TypeError(f"save_gguf expects a gpt2.GPT, got {type(model).__name__}")
    check_tied_head(model)
    if dtype not in GGUF_TYPES:
        raise InvalidValueError(f"GGUF type {dtype!r} is not supported; choose one of {', '.join(GGUF_TYPES)}")
    if config.vocab_size != GPT2_VOCAB_SIZE:
        raise InvalidValueError(
            f"the model has a {config.vocab_size}-token vocabulary; a GGUF file holds GPT-2's {GPT2_VOCAB_SIZE} tokens"
        )
    check_new_file(path, overwrite=overwrite, flag=OVERWRITE_FLAG)
    qtype = getattr(gguf.GGMLQuantizationType, dtype.upper())
    file_type = getattr(gguf.LlamaFileType, GGUF_TYPES[dtype])
    # GPT-2's BPE files, from where gpt2.model.tokenizer.get_tokenizer reads them.
    vocabulary = read_bpe_files(*bpe_files())
    path = Path(path)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(tmp, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT2])
        writer.add_context_length(config.block_size)
        writer.add_embedding_length(config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        writer.add_file_type(file_type)
        # Byte-level BPE, with GPT-2's pre-tokenisation regex.
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        # The tokens in id order, in GPT-2's byte-to-printable-character form: all 50257, <|endoftext|>
        # last (read_bpe_files checked them).
        writer.add_token_list(sorted(vocabulary.encoder, key=vocabulary.encoder.__getitem__))
        # <|endoftext|> is a control token; the other 50256 are ordinary text.
        writer.add_token_types([gguf.TokenType.NORMAL] * EOT_TOKEN + [gguf.TokenType.CONTROL])
        writer.add_token_merges(vocabulary.merges)
        for add_token_id in (writer.add_bos_token_id, writer.add_eos_token_id, writer.add_unk_token_id):
            add_token_id(EOT_TOKEN)
        # GPT-2 prepends nothing, as gpt2 sample does.
        writer.add_add_bos_token(False)
        for name, data in _gguf_tensors(model, config).items():
            # The matrices in the asked type; norms and biases stay float32.
            kind = gguf.GGMLQuantizationType.F32
            if data.ndim == 2:
                kind = qtype
            data, kind = _encode(gguf, name, data, kind)
            writer.add_tensor(name, data, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    path.parent.mkdir(parents=True, exist_ok=True)
    with _quiet_gguf():
        replace_atomically(path, write, to_path=True)
    # Debug only: the caller says what it wrote (gpt2 export prints one line per file).
    logger.debug("wrote %s (%s, %.1f MB)", path, dtype, path.stat().st_size / 1e6)
    return path


@contextlib.contextmanager
def _quiet_gguf() -> Iterator[None]:
    """The gguf package's progress chatter silenced (its info logs name the temporary file): its
    warnings still show.
    """
    gguf_logger = logging.getLogger("gguf")
    level = gguf_logger.level
    gguf_logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        gguf_logger.setLevel(level)

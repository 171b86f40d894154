"""``gpt2 export``: a model (optionally + adapter) -> a transformers directory with its tokenizer,
a GGUF file for llama.cpp, and/or the adapter in PEFT format.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import minlora
from gpt2.cli.common import ModelOptions, check_output_file
from gpt2.cli.layers import Flat, Options, UsageError
from gpt2.model.gguf import check_tied_head, save_gguf
from gpt2.model.hf import resolve_source
from gpt2.outputs import RECORD_FILE

# What an export writes (gpt2.model.hf.save_pretrained, minlora.export_peft_adapter): a folder holding
# only these is an earlier export, which a new one may replace.
MODEL_EXPORT_FILES = {"config.json", "model.safetensors", "pytorch_model.bin", "vocab.json", "merges.txt"}
MODEL_EXPORT_FILES |= {"tokenizer_config.json", "special_tokens_map.json", "generation_config.json", RECORD_FILE}
PEFT_EXPORT_FILES = {"adapter_config.json", "adapter_model.safetensors", "README.md"}


@dataclass
class ExportOptions(Options):
    """gpt2 export: a transformers folder, a GGUF file and/or a PEFT adapter."""

    source: Annotated[ModelOptions, Flat] = field(default_factory=ModelOptions)
    out: str | None = None
    """write a transformers.GPT2LMHeadModel directory here (the adapter merged into the weights)"""
    peft_out: str | None = None
    """write the adapter in PEFT format here (peft.PeftModel loads it on transformers' GPT-2)"""
    tokenizer_dir: str | None = None
    """--out's tokenizer files (encoder.json, vocab.bpe); None = $GPT2_TOKENIZER_DIR, else the tokenizer's cache"""
    gguf: str | None = None
    """write one self-contained GGUF file here for llama.cpp (adapter merged, tokenizer embedded)"""
    gguf_type: Literal["f32", "f16", "q8_0"] = "f16"
    """GGUF weight type: f32, f16 or q8_0 (8-bit blocks; norms and biases stay f32)"""
    overwrite: bool = False
    """write into a non-empty --out / --peft-out (only the export's files change), or replace an existing --gguf file"""


def export(options: ExportOptions) -> int:
    """``gpt2 export``: a model (optionally + adapter) -> the files :class:`ExportOptions` names."""
    if options.out is None and options.peft_out is None and options.gguf is None:
        raise UsageError(
            "nothing to export: give --out DIR (transformers), --gguf FILE (llama.cpp) and/or --peft-out DIR (PEFT)"
        )
    adapter = options.source.adapter
    if options.peft_out is not None and not adapter:
        raise UsageError("--peft-out needs --adapter: only a LoRA adapter can be exported in PEFT format")
    check_export_dirs(options.source.model, ("--out", options.out), ("--peft-out", options.peft_out), options.overwrite)
    if options.gguf is not None:
        # a new file, or an existing one to replace (save_gguf checks it again when it writes)
        check_output_file("--gguf", options.gguf, options.overwrite)
    write_exports(options.source.load(), options)
    return 0


def write_exports(model: Any, options: ExportOptions) -> None:
    """The files ``options`` names, of ``model`` (``options.source.model`` is the PEFT adapter's base): the PEFT
    adapter, then a model with LoRA on it merged into the weights of the transformers folder and the GGUF file.
    ``gpt2 export`` and ``gpt2 finetune`` (its ``--peft-export`` and ``--merge-export``) write them so.
    """
    # an adapter on the model (--adapter, or a LoRA fine-tune): merged into the files that hold the weights
    merge = bool(minlora.lora_sites(model))
    merged = options.out is not None or options.gguf is not None
    # A merged export needs the LM head tied to the embedding: checked before the PEFT export is written.
    if merge and merged:
        check_tied_head(model)
    what = "model"
    if options.peft_out is not None:
        minlora.export_peft_adapter(model, options.peft_out, base_model_name_or_path=peft_base(options.source.model))
        print(f"wrote PEFT adapter {options.peft_out} (load with peft.PeftModel.from_pretrained)")
    # Merged only for the files that hold merged weights: a PEFT adapter alone needs no merge (and
    # merging an adapter on the LM head would warn about the weights it unties).
    if merge and merged:
        minlora.merge_lora(model)
        what = "merged model"
    if options.out is not None:
        model.save_pretrained(options.out, tokenizer_dir=options.tokenizer_dir, overwrite=options.overwrite)
        print(f"wrote {what} {options.out} (load with transformers.GPT2LMHeadModel.from_pretrained)")
    if options.gguf is not None:
        path = save_gguf(model, options.gguf, dtype=options.gguf_type, overwrite=options.overwrite)
        size = f"{path.stat().st_size / 1e6:.1f} MB"
        print(f"wrote {what} {path} ({options.gguf_type}, {size}; run with llama.cpp: llama-cli -m {path})")


def peft_base(model: str) -> str:
    """Where PEFT's AutoPeftModel loads the adapter's base from: the hub id, else the absolute path."""
    source = resolve_source(model)
    if isinstance(source, str):
        return source
    # A gpt2 run or checkpoint folder: transformers cannot read it.
    if not (source / "config.json").is_file():
        print(
            f"note: PEFT's base {source} is a gpt2 run or checkpoint folder, which transformers cannot load; write "
            f"it as one with `gpt2 export --model {shlex.quote(model)} --out DIR` and load the adapter on DIR "
            "(peft.PeftModel.from_pretrained)"
        )
    return str(source.resolve())


def check_export_dirs(model: str, out: tuple[str, str | None], peft: tuple[str, str | None], overwrite: bool) -> None:
    """``out`` (the merged model's flag and folder) and ``peft`` (the PEFT adapter's): folders to export into, not the
    model's (it would be overwritten), not one (transformers would apply the adapter again over merged weights).
    """
    for (flag, folder), own in ((out, MODEL_EXPORT_FILES), (peft, PEFT_EXPORT_FILES)):
        if folder is not None:
            _check_export_dir(flag, folder, own, overwrite)
    given = {flag: Path(folder).expanduser().resolve() for flag, folder in (out, peft) if folder}
    source = resolve_source(model)
    for flag, folder in given.items():
        if isinstance(source, Path) and folder == source.resolve():
            raise UsageError(f"{flag} {folder} is the model's own folder ({model}): give another folder to export into")
    if len(set(given.values())) < len(given):
        raise UsageError(
            f"{' and '.join(given)} are one folder ({out[1]}): transformers would apply the adapter a second time "
            "over the merged weights; give two folders"
        )


def _check_export_dir(flag: str, path: str, own: set[str], overwrite: bool) -> None:
    """Refuse to export into a file, or into a folder holding anything but an earlier export, unless
    ``overwrite`` (which still replaces only the export's own files).
    """
    folder = Path(path).expanduser()
    if not folder.exists():  # a new folder
        return
    if not folder.is_dir():
        raise UsageError(f"{flag} {path} is a file: give a folder (new, or an earlier export)")
    other = sorted(p.name for p in folder.iterdir() if p.name not in own)
    if other and not overwrite:
        raise UsageError(
            f"{flag} {path} is not empty and not an earlier export (it holds {', '.join(other[:5])}"
            f"{' ...' if len(other) > 5 else ''}): give a new or empty folder, or pass --overwrite to write the "
            "export's files into it (nothing else there is touched)"
        )

"""``gpt2 export``: a model (optionally + adapter) -> a transformers directory with its tokenizer,
a GGUF file for llama.cpp, and/or the adapter in PEFT format."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import minlora
from gpt2.cli.common import MODEL_EXPORT_FILES, PEFT_EXPORT_FILES, UsageError, check_export_dir
from gpt2.cli.layers import Options
from gpt2.model.gguf import save_gguf
from gpt2.model.gpt import GPT
from gpt2.model.hf import resolve_source
from gpt2.model.loading import apply_adapter


@dataclass
class ExportOptions(Options):
    """gpt2 export: write a transformers directory, a GGUF file (LoRA merged in) and/or a PEFT adapter."""

    model: str | None = None
    """the model: a checkpoint / run directory of `gpt2 train`, a transformers directory or a hub id"""
    adapter: str | None = None
    """a LoRA adapter to merge in (from `gpt2 finetune`)"""
    out: str | None = None
    """write a transformers.GPT2LMHeadModel directory here (the adapter merged into the weights)"""
    peft_out: str | None = None
    """write the adapter in PEFT format here (peft.PeftModel loads it on transformers' GPT-2)"""
    tokenizer_dir: str | None = None
    """where the tokenizer files --out always gets come from (GPT-2's encoder.json + vocab.bpe); None =
    $GPT2_TOKENIZER_DIR, else the tokenizer's cache"""
    gguf: str | None = None
    """write one self-contained GGUF file here for llama.cpp (adapter merged, tokenizer embedded)"""
    gguf_type: Literal["f32", "f16", "q8_0"] = "f16"
    """GGUF weight type: f32, f16 or q8_0 (8-bit blocks; norms and biases stay f32)"""
    overwrite: bool = False
    """write into a non-empty --out / --peft-out that is not an earlier export, or over a --gguf file that is not
    a GGUF file (only the export's files are replaced)"""


def export(options: ExportOptions) -> int:
    """``gpt2 export``: a model (optionally + adapter) -> a transformers directory, a GGUF file,
    and/or the adapter in PEFT format."""
    if options.out is None and options.peft_out is None and options.gguf is None:
        raise UsageError(
            "nothing to export: give --out DIR (transformers model), --gguf FILE (llama.cpp) "
            "and/or --peft-out DIR (PEFT adapter)"
        )
    if options.peft_out is not None and not options.adapter:
        raise UsageError("--peft-out needs --adapter: only a LoRA adapter can be exported in PEFT format")
    check_export_dir(options.out, "--out", MODEL_EXPORT_FILES, options.overwrite)
    check_export_dir(options.peft_out, "--peft-out", PEFT_EXPORT_FILES, options.overwrite)
    _check_gguf_path(options.gguf, options.overwrite)
    model = GPT.from_pretrained(options.model, device="cpu")
    if options.adapter:
        apply_adapter(model, options.adapter)
        if options.peft_out is not None:
            # PEFT's AutoPeftModel loads the base from here: the hub id, else the absolute path.
            source = resolve_source(options.model)
            base = source if isinstance(source, str) else str(source.resolve())
            minlora.export_peft_adapter(model, options.peft_out, base_model_name_or_path=base)
            print(f"wrote PEFT adapter {options.peft_out} (load with peft.PeftModel.from_pretrained)")
        minlora.merge_lora(model)
    what = "merged model" if options.adapter else "model"
    if options.out is not None:
        model.save_pretrained(options.out, tokenizer_dir=options.tokenizer_dir)
        print(f"wrote {what} {options.out} (load with transformers.GPT2LMHeadModel.from_pretrained)")
    if options.gguf is not None:
        save_gguf(model, options.gguf, dtype=options.gguf_type)
        print(f"wrote {what} {options.gguf} ({options.gguf_type}; run with llama.cpp: llama-cli -m {options.gguf})")
    return 0


def _check_gguf_path(path: str | None, overwrite: bool) -> None:
    """An earlier GGUF file may be replaced; a folder or any other file only with --overwrite (a file)."""
    if path is None or not Path(path).exists():
        return
    if Path(path).is_dir():
        raise UsageError(f"--gguf {path} is a folder: give a file name, e.g. {Path(path) / 'model.gguf'}")
    with open(path, "rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    if not is_gguf and not overwrite:
        raise UsageError(f"--gguf {path} exists and is not a GGUF file: give a new file name, or pass --overwrite")

"""``gpt2 export``: a model (+ adapter) -> a transformers directory and/or a PEFT adapter."""

from __future__ import annotations

import os
from dataclasses import dataclass

import minlora
from gpt2.cli.common import UsageError
from gpt2.cli.layers import Options
from gpt2.model.loading import apply_adapter, load_model


@dataclass
class ExportOptions(Options):
    """gpt2 export: write a transformers directory (LoRA merged in) and/or a PEFT adapter."""

    model: str | None = None
    """the model: a checkpoint / run directory of `gpt2 train`, a transformers directory or a hub id"""
    adapter: str | None = None
    """a LoRA adapter to merge in (from `gpt2 finetune`)"""
    out: str | None = None
    """write a transformers.GPT2LMHeadModel directory here (the adapter merged into the weights)"""
    peft_out: str | None = None
    """write the adapter in PEFT format here (peft.PeftModel loads it on transformers' GPT-2)"""
    tokenizer_dir: str | None = None
    """GPT-2's encoder.json + vocab.bpe, copied into --out so AutoTokenizer loads it too; None =
    $GPT2_TOKENIZER_DIR"""


def export(options: ExportOptions) -> int:
    if options.out is None and options.peft_out is None:
        raise UsageError("nothing to export: give --out DIR (transformers model) and/or --peft-out DIR (PEFT adapter)")
    if options.peft_out is not None and not options.adapter:
        raise UsageError("--peft-out needs --adapter: only a LoRA adapter can be exported in PEFT format")
    model = load_model(options.model, device="cpu")
    if options.adapter:
        apply_adapter(model, options.adapter)
        if options.peft_out is not None:
            minlora.export_peft_adapter(model, options.peft_out)
            print(f"wrote PEFT adapter {options.peft_out} (load with peft.PeftModel.from_pretrained)")
        minlora.merge_lora(model)
    if options.out is not None:
        tokenizer_dir = options.tokenizer_dir or os.environ.get("GPT2_TOKENIZER_DIR") or None
        model.save_pretrained(options.out, tokenizer_dir=tokenizer_dir)
        what = "merged model" if options.adapter else "model"
        print(f"wrote {what} {options.out} (load with transformers.GPT2LMHeadModel.from_pretrained)")
    return 0

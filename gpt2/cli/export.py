"""``gpt2 export``: a checkpoint (optionally + adapter) -> a transformers directory, and/or the
adapter in PEFT format."""

from __future__ import annotations

import os

import minlora
from gpt2.cli.common import MODEL_EXPORT_FILES, PEFT_EXPORT_FILES, UsageError, check_export_dir
from gpt2.cli.options import ExportOptions
from gpt2.model.loading import apply_adapter, load_model


def export(options: ExportOptions) -> int:
    """``gpt2 export``: a checkpoint (optionally + adapter) -> a transformers directory, and/or
    the adapter in PEFT format."""
    if options.out is None and options.peft_out is None:
        raise UsageError("nothing to export: give --out DIR (transformers model) and/or --peft-out DIR (PEFT adapter)")
    if options.peft_out is not None and not options.adapter:
        raise UsageError("--peft-out needs --adapter: only a LoRA adapter can be exported in PEFT format")
    check_export_dir(options.out, "--out", MODEL_EXPORT_FILES, options.overwrite)
    check_export_dir(options.peft_out, "--peft-out", PEFT_EXPORT_FILES, options.overwrite)
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

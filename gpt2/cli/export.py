"""``gpt2 export``: a model (optionally + adapter) -> a transformers directory with its tokenizer,
a GGUF file for llama.cpp, and/or the adapter in PEFT format."""

from __future__ import annotations

import minlora
from gpt2.cli.common import UsageError
from gpt2.cli.options import ExportOptions
from gpt2.model.gguf import save_gguf
from gpt2.model.gpt import GPT
from gpt2.model.hf import resolve_source
from gpt2.model.loading import apply_adapter


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

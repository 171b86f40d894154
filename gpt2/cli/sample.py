"""``gpt2 sample``: stream text from a hub id, a transformers directory, a checkpoint or run
directory of ``gpt2 train``, optionally with a LoRA adapter, optionally as an instruction."""

from __future__ import annotations

import torch

from gpt2.cli.common import check_sampling, instruction_prompt, print_samples
from gpt2.cli.options import SampleOptions
from gpt2.model.loading import apply_adapter, load_model
from gpt2.train.distributed import resolve_device
from gpt2.train.precision import inference_autocast


def sample(options: SampleOptions) -> int:
    check_sampling(options.sampling)
    prompt = instruction_prompt(options.instruct.instruction, options.instruct.input)  # only the response is printed
    device = resolve_device(options.device)
    model = load_model(options.model, device=device)
    if options.adapter:
        apply_adapter(model, options.adapter)
    model.eval()
    if options.compile:
        model = torch.compile(model)
    autocast = inference_autocast(options.precision, device)
    print_samples(model, options.sampling, seed=options.seed, autocast=autocast, prompt=prompt)
    return 0

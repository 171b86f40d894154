"""``gpt2 sample``: stream text from a model, optionally with a LoRA adapter or as an instruction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch

import minlora
from gpt2.cli.common import (
    InstructionOptions,
    ModelOptions,
    SamplingOptions,
    check_sampling,
    instruction_prompt,
    load_for_inference,
    print_samples,
)
from gpt2.cli.layers import Flat, Options
from gpt2.model.quantize import int8_weights
from gpt2.train.config import Precision


@dataclass
class SampleOptions(Options):
    """gpt2 sample: stream text from a model (and a LoRA adapter)."""

    source: Annotated[ModelOptions, Flat] = field(default_factory=ModelOptions)
    sampling: Annotated[SamplingOptions, Flat] = field(default_factory=SamplingOptions)
    instruct: Annotated[InstructionOptions, Flat] = field(default_factory=InstructionOptions)
    seed: int | None = None
    """seed of the sampler, for reproducible samples; None = random"""
    device: str = "auto"
    """auto (this process's CUDA GPU when there is one, else CPU), cpu, cuda or cuda:N"""
    precision: Precision = "auto"
    """autocast for the forward passes; auto = bf16 on GPUs that support it, fp16 on older GPUs, fp32 on any CPU
    (even one with native bf16: decoding reads every weight per token: fp32 is faster)"""
    compile: bool = False
    """torch.compile the model first (pays off for long samples: thousands of tokens on a CPU)"""
    weights: Literal["model", "int8"] = "model"
    """model = the model's own weights; int8 = every weight matrix read in int8, an --adapter merged first
    (CPU, fp32 precision: faster, now and then other tokens; docs/api.md, docs/benchmarks.md)"""


def inductor_options(model: torch.nn.Module) -> dict[str, bool] | None:
    """``torch.compile``'s Inductor options for sampling from ``model``: on the CPU its C++ wrapper, which calls the
    decoding step's kernels without Python in between (faster than the default wrapper at batch 1); Inductor's
    defaults on a GPU.
    """
    if next(model.parameters()).device.type == "cpu":
        return {"cpp_wrapper": True}
    return None


def sample(options: SampleOptions) -> int:
    check_sampling(options.sampling)
    # An instruction's template: only the response is printed.
    prompt = instruction_prompt(options.instruct.instruction, options.instruct.input)
    model, autocast, _ = load_for_inference(options)
    if options.weights == "int8":
        # int8 weights are made from plain weights: an adapter is folded into this process's copy first (merge_lora
        # leaves a model without LoRA as it is)
        minlora.merge_lora(model)
        # the int8 twin samples in place of the model (made here, under the autocast it would run in)
        with autocast():
            model = int8_weights(model)
    if options.compile:
        model = torch.compile(model, options=inductor_options(model))
    print_samples(model, options.sampling, seed=options.seed, autocast=autocast, prompt=prompt)
    return 0

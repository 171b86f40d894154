"""The options of every command, as dataclasses: the one place a command-line flag comes from.

Each command's options are one dataclass below. Library configurations are used as they are:
:class:`gpt2.TrainConfig` (every field is a flag: ``--max-steps``, ``--resume``...) and
:class:`minlora.LoRAConfig` (``--lora.rank``, ``--lora.alpha``...); the rest are the job's own
fields. :mod:`gpt2.cli` turns the fields into flags with tyro (``n_layer`` -> ``--n-layer``, the
docstring under a field -> its ``--help`` line), and recipe / ``--config`` YAML files use the same
names as keys. A field added here (or to TrainConfig / LoRAConfig) is a flag, a YAML key and a
``--help`` line with no other edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

import tyro

from gpt2.model.config import SHAPE_NAMES
from gpt2.train.config import TrainConfig
from minlora import LoRAConfig

# A nested dataclass whose fields are flags of their own (``--max-steps``, not ``--train.max-steps``).
Flat = tyro.conf.OmitArgPrefixes
ShapeName = Literal[SHAPE_NAMES]  # type: ignore[valid-type]
Precision = Literal["auto", "fp32", "tf32", "bf16", "fp16"]


@dataclass
class DataOptions:
    data: str = "shakespeare"
    """training data: a text file, a .npy/.bin token file, a directory of shards (from `gpt2 prepare`), an
    instruction .jsonl (gpt2 finetune) or 'shakespeare' (Tiny Shakespeare, downloaded once and cached)"""
    val_data: str | None = None
    """validation data; None = a shard directory's val shards, or the end of a text / token file"""
    val_fraction: float = 0.1
    """fraction at the end of a text / token file held out for validation"""


@dataclass
class SamplingOptions:
    prompt: str = "Hello, I'm a language model,"
    """text the samples continue; empty = an unconditional sample"""
    num_samples: int = 1
    """how many samples to draw (also -n)"""
    max_new_tokens: int = 100
    """tokens to sample after the prompt"""
    temperature: float = 1.0
    """softmax temperature; 0 = greedy"""
    top_k: int | None = 50
    """sample from the k most likely tokens; None = all"""
    top_p: float | None = None
    """nucleus sampling: the smallest set of tokens with this much probability; None = off"""


@dataclass
class InstructionOptions:
    instruction: str | None = None
    """sample the response to this instruction: the prompt is the instruction template of docs/lora.md
    (gpt2.instruct.TEMPLATE) and only the response is printed"""
    input: str | None = None
    """the optional input of --instruction (the template's '### Input:' part)"""


@dataclass
class LaunchOptions:
    nproc_per_node: int = 1
    """start this many processes on this machine (one per GPU; gloo on CPU), like torchrun --standalone
    --nproc-per-node N; Ctrl-C stops them all with one line"""


@dataclass
class ModelShape:
    model: ShapeName = "mini"
    """model shape: a GPT-2 preset (gpt2 = 124M), mini (4 layers x 128) or tiny (2 x 32)"""
    n_layer: int | None = None
    """override the shape's number of layers"""
    n_head: int | None = None
    """override the shape's number of heads"""
    n_embd: int | None = None
    """override the shape's width"""
    block_size: int | None = None
    """context length of the model; None = --seq-len"""
    dropout: float = 0.0
    """dropout probability"""
    pad_vocab_multiple: int = 1
    """round the vocabulary up to a multiple of this (64: 50257 -> 50304, faster on GPUs)"""
    flash: bool = True
    """scaled_dot_product_attention (flash attention on GPUs); False = explicit softmax attention"""


@dataclass
class TrainOptions:
    """gpt2 train: pretrain a GPT-2 from scratch, then report validation loss and samples."""

    data: Annotated[DataOptions, Flat] = field(default_factory=DataOptions)
    shape: Annotated[ModelShape, Flat] = field(default_factory=ModelShape)
    train: Annotated[TrainConfig, Flat] = field(default_factory=TrainConfig)
    final_eval_batches: int | None = None
    """batches of the final validation loss; None = the whole validation data"""
    hellaswag: str | None = None
    """score HellaSwag (val jsonl path, or 'auto' to download and cache it) during and after training"""
    hellaswag_interval: int = 250
    """HellaSwag every N steps (and at the end); 0 = only at the end"""
    hellaswag_limit: int | None = None
    """score only the first N HellaSwag examples"""
    launch: Annotated[LaunchOptions, Flat] = field(default_factory=LaunchOptions)
    sampling: Annotated[SamplingOptions, Flat] = field(default_factory=SamplingOptions)


@dataclass
class FinetuneOptions:
    """gpt2 finetune: LoRA (or --full) fine-tuning of GPT-2 weights on a text, or on instruction rows
    (--data x.jsonl: Alpaca or prompt/response rows, loss on the responses only; docs/lora.md)."""

    init: str = "gpt2"
    """the weights to start from: a hub id (gpt2, gpt2-medium, ...), a transformers directory, or a
    checkpoint / run directory of `gpt2 train`"""
    data: Annotated[DataOptions, Flat] = field(default_factory=DataOptions)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    train: Annotated[TrainConfig, Flat] = field(default_factory=TrainConfig)
    final_eval_batches: int | None = None
    """batches of the final validation loss; None = the whole validation data"""
    peft_export: str | None = None
    """also write the adapter in PEFT format here"""
    merge_export: str | None = None
    """merge the adapter into the weights and write a transformers directory here"""
    full: bool = False
    """full fine-tuning: train every weight, no LoRA; the run directory then holds the whole model
    (gpt2 sample --model OUT_DIR)"""
    pack: bool = True
    """instruction data (.jsonl): pack rows into each sequence, each isolated (own positions, attention in the row);
    --no-pack: one row per sequence, padded"""
    instruct: Annotated[InstructionOptions, Flat] = field(default_factory=InstructionOptions)
    launch: Annotated[LaunchOptions, Flat] = field(default_factory=LaunchOptions)
    sampling: Annotated[SamplingOptions, Flat] = field(default_factory=SamplingOptions)


@dataclass
class SampleOptions:
    """gpt2 sample: stream text from a model (hub id, transformers dir, checkpoint, + LoRA adapter)."""

    model: str = "gpt2"
    """a hub id (gpt2, gpt2-medium, ...), a transformers directory, or a checkpoint / run directory of
    `gpt2 train`"""
    adapter: str | None = None
    """a LoRA adapter to add: the `adapter` directory `gpt2 finetune` writes, or a PEFT adapter directory"""
    sampling: Annotated[SamplingOptions, Flat] = field(default_factory=SamplingOptions)
    instruct: Annotated[InstructionOptions, Flat] = field(default_factory=InstructionOptions)
    seed: int | None = None
    """seed of the sampler, for reproducible samples; None = random"""
    device: str = "auto"
    """auto (this process's CUDA GPU when there is one, else CPU), cpu, cuda or cuda:N"""
    precision: Precision = "auto"
    """autocast for the forward passes; auto = bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU"""
    compile: bool = False
    """torch.compile the model first (pays off for long samples on a GPU)"""


@dataclass
class PrepareOptions:
    """gpt2 prepare: tokenise documents with GPT-2's BPE into uint16 token shards (build-nanogpt's layout:
    the first shard is the val split, the others train; one text file is split by --val-fraction instead)."""

    input: tuple[str, ...] = ()
    """text files (one document each), .jsonl files (one document per line) or directories of them"""
    dataset: str | None = None
    """a Hugging Face dataset to stream instead (needs `pip install datasets`), e.g. HuggingFaceFW/fineweb-edu"""
    dataset_config: str | None = None
    """the dataset's configuration, e.g. sample-10BT"""
    split: str = "train"
    """the dataset split to read"""
    text_field: str = "text"
    """the field holding the text in jsonl rows / dataset rows"""
    out_dir: str = "data/shards"
    """where the shards go"""
    prefix: str | None = None
    """shard file-name prefix; None = the text file's name, or 'shard'"""
    shard_size: int = 10**8
    """tokens per shard (10^8 = 200 MB, build-nanogpt's size)"""
    val_fraction: float = 0.1
    """for a single text file: the fraction at its end kept for validation"""
    num_workers: int = 0
    """tokeniser processes; 0 = tokenise in this process"""
    max_docs: int | None = None
    """stop after this many documents (for a quick try)"""
    overwrite: bool = False
    """replace shards with the same prefix already in --out-dir"""
    format: Literal["npy", "bin"] = "npy"
    """shard files: npy (numpy), or bin (llm.c's headered layout, which llm.c trains on as is)"""
    progress: bool = True
    """show a progress bar"""


@dataclass
class EvalOptions:
    """gpt2 eval: validation loss / perplexity on token data, and HellaSwag accuracy."""

    model: str = "gpt2"
    """a hub id, a transformers directory, or a checkpoint / run directory of `gpt2 train`"""
    adapter: str | None = None
    """a LoRA adapter to add first"""
    data: str | None = None
    """tokens to score: a shard directory (its --split shards), a .npy/.bin token file, a text file or
    'shakespeare' (texts: their last --val-fraction)"""
    split: str = "val"
    """which shards of a shard directory to score"""
    val_fraction: float = 0.1
    """for a text: score its last fraction, the part `gpt2 train` holds out; 0 = the whole text"""
    batch_size: int = 4
    """sequences per forward pass"""
    seq_len: int | None = None
    """tokens per sequence; None = the model's context, at most 1024"""
    max_batches: int | None = None
    """score at most this many batches; None = all"""
    hellaswag: str | None = None
    """HellaSwag val jsonl to score, or 'auto' to download and cache it ($GPT2_HELLASWAG overrides)"""
    hellaswag_limit: int | None = None
    """score only the first N HellaSwag examples"""
    device: str = "auto"
    """auto (this process's CUDA GPU when there is one, else CPU), cpu, cuda or cuda:N"""
    precision: Precision = "auto"
    """autocast for the forward passes; auto = bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU"""
    output: str | None = None
    """also write the results to this JSON file"""


@dataclass
class ExportOptions:
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
    """where GPT-2's encoder.json + vocab.bpe come from; --out always gets the tokenizer files
    (default: $GPT2_TOKENIZER_DIR, else the tokenizer's cache)"""
    gguf: str | None = None
    """write one self-contained GGUF file here for llama.cpp (adapter merged, tokenizer embedded)"""
    gguf_type: Literal["f32", "f16", "q8_0"] = "f16"
    """GGUF weight type: f32, f16 or q8_0 (8-bit blocks; norms and biases stay f32)"""


@dataclass
class BenchOptions:
    """gpt2 bench: the training speed-up ladder (fp32, tf32, bf16, compile, flash, vocab pad, fused AdamW)."""

    model: ShapeName = "tiny"
    """model shape"""
    batch_size: int = 4
    """sequences per step"""
    seq_len: int = 64
    """tokens per sequence"""
    steps: int = 5
    """timed steps per repeat"""
    repeats: int = 3
    """timed blocks of --steps per rung: the table shows their median and spread"""
    warmup: int = 2
    """untimed steps per rung (compilation happens here)"""
    rungs: str = "fp32,tf32,bf16,compile,flash,vocab_pad,fused_adamw"
    """comma-separated subset of the rungs"""
    device: str = "auto"
    """auto (this process's CUDA GPU when there is one, else CPU), cpu, cuda or cuda:N"""
    compile: bool = False
    """time the compile rung (torch.compile); the GPU recipe turns it on, compiling on a CPU is slow"""
    vocab_size: int | None = 1024
    """override GPT-2's 50257 tokens (smaller keeps CPU runs quick); None = 50257"""
    peak_flops: float | None = None
    """peak FLOP/s for MFU; None = from the GPU name"""
    json: str | None = None
    """also write the results as JSON"""

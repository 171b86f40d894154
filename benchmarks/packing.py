"""Instruction fine-tuning throughput: one row per sequence (padded) against packed rows.

The rows: Alpaca's length spread rebuilt from Tiny Shakespeare. The Tulu paper ("How Far Can
Camels Go?", Wang et al. 2023, table 1) gives Stanford Alpaca's mean prompt length as 27.8
tokens and its mean completion as 64.6 (LLaMA tokens); most rows are short, a few are long. Each
row here draws a prompt and a response length from log-normals with those means (sigma 0.6 for
prompts, 1.0 for responses: a long tail, medians 23 and 39 tokens), gives 40% of the rows an
``input`` (about 40% of Alpaca's rows have one) holding half of the prompt, and fills the fields
with consecutive GPT-2 tokens of Tiny Shakespeare, decoded back to text. Rows longer than a
sequence (with the template) are drawn again.

Three ways of training on the same rows, each through ``Trainer.train_step`` (forward, backward,
AdamW), with the same model and micro-batch:

* ``padded``: one row per sequence, padded to ``seq_len`` (``pack=False``);
* ``packed``: rows packed greedily into each sequence, isolated (``pack=True``: per-row
  ``position_ids`` and a block-diagonal causal ``attn_mask``, SDPA's mask path);
* ``packed-causal``: the same windows with plain causal attention (rows see the rows before
  them; the previous ``pack=True``), to show what the isolation costs.

CPU time of one thread (``time.process_time``), the three interleaved in rounds in one process.
The tokens per second count the rows' own tokens (template, prompt, response), not padding; the
response tokens are the ones scored. Tiny Shakespeare comes from $GPT2_TINY_SHAKESPEARE or the
library's cache (downloaded once). Run from the repository root::

    python benchmarks/packing.py --rows 1000 --seq-len 512 --batch-size 4 --steps 3 --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time

import numpy as np
import torch

from gpt2 import GPT, GPTConfig
from gpt2.data.instruct import InstructionLoader, tokenize_row
from gpt2.data.sources import shakespeare_or_path
from gpt2.model.config import SHAPES
from gpt2.model.tokenizer import get_tokenizer
from gpt2.train.config import TrainConfig
from gpt2.train.precision import describe_machine
from gpt2.train.trainer import Trainer

MODES = ("padded", "packed", "packed-causal")
# Alpaca's mean prompt and completion lengths (tokens).
PROMPT_MEAN, RESPONSE_MEAN = 27.8, 64.6
PROMPT_SIGMA, RESPONSE_SIGMA = 0.6, 1.0


def alpaca_like_rows(n: int, seq_len: int, text: str, tokenizer, seed: int = 0) -> list[tuple[str, str, str, str]]:
    """``n`` rows ``(instruction, input, response, where)`` with Alpaca-like lengths (module docstring)."""
    rng = np.random.default_rng(seed)
    tokens = tokenizer.encode_ordinary(text)
    cursor = 0

    def take(length: int) -> str:
        nonlocal cursor
        if cursor + length > len(tokens):
            cursor = 0
        piece = tokenizer.decode(tokens[cursor : cursor + length]).strip() or "."
        cursor += length
        return piece

    def lognormal(mean: float, sigma: float) -> int:
        return max(1, round(rng.lognormal(math.log(mean) - sigma**2 / 2, sigma)))

    rows = []
    while len(rows) < n:
        prompt, response = lognormal(PROMPT_MEAN, PROMPT_SIGMA), lognormal(RESPONSE_MEAN, RESPONSE_SIGMA)
        # About 40% of Alpaca's rows have an input; here it holds half of the prompt.
        if rng.random() < 0.4:
            instruction, input = take(prompt - prompt // 2), take(prompt // 2)
        else:
            instruction, input = take(prompt), ""
        row = (instruction, input, take(response), f"row {len(rows)}")
        if len(tokenize_row(*row[:3], tokenizer)[0]) <= seq_len + 1:
            rows.append(row)
    return rows


class _Causal:
    """A packed loader's batches without their forward kwargs: plain causal attention."""

    def __init__(self, loader: InstructionLoader) -> None:
        self.loader = loader
        for name in ("batch_size", "seq_len", "rank", "world_size"):
            setattr(self, name, getattr(loader, name))

    def next_batch(self):
        return self.loader.next_batch()[:2]


def run(rows: int, seq_len: int, batch_size: int, steps: int, rounds: int, model: str, seed: int) -> list[dict]:
    torch.set_num_threads(1)
    tokenizer = get_tokenizer()
    text = shakespeare_or_path("shakespeare").read_text(encoding="utf-8")
    data = alpaca_like_rows(rows, seq_len, text, tokenizer, seed)
    lengths = [len(tokenize_row(*row[:3], tokenizer)[0]) for row in data]
    torch.manual_seed(seed)
    base = GPT(GPTConfig(block_size=seq_len, pad_vocab_multiple=64, **SHAPES[model]))
    config = TrainConfig(
        micro_batch_size=batch_size,
        seq_len=seq_len,
        max_steps=10**6,
        warmup_steps=0,
        eval_interval=0,
        out_dir=None,
        progress=False,
        device="cpu",
        precision="fp32",
        plot=False,
    )
    trainers, loaders = {}, {}
    for mode in MODES:
        loader = InstructionLoader(data, batch_size, seq_len, pack=mode != "padded", seed=seed, tokenizer=tokenizer)
        loaders[mode] = loader
        train_data = loader
        if mode == "packed-causal":
            train_data = _Causal(loader)
        trainers[mode] = Trainer(copy.deepcopy(base), config, train_data, sinks=[])
        # A warm-up step, not timed.
        trainers[mode].train_step()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            start = time.process_time()
            for _ in range(steps):
                trainers[mode].train_step()
            times[mode].append((time.process_time() - start) / steps)
    results = []
    for mode in MODES:
        loader, step_s = loaders[mode], statistics.median(times[mode])
        windows_per_second = batch_size / step_s
        results.append(
            {
                "mode": mode,
                "sequences": loader.num_sequences,
                "rows_per_sequence": len(data) / loader.num_sequences,
                "real_fraction": sum(lengths) / (loader.num_sequences * (seq_len + 1)),
                "step_ms": step_s * 1000,
                "rows_per_second": windows_per_second * len(data) / loader.num_sequences,
                "tokens_per_second": windows_per_second * sum(lengths) / loader.num_sequences,
                "response_tokens_per_second": windows_per_second * loader.num_targets / loader.num_sequences,
            }
        )
        trainers[mode].close()
    return results


def format_results(results: list[dict]) -> str:
    lines = [
        "| mode | sequences | rows / sequence | real tokens | ms / step | rows/s | tokens/s | response tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['sequences']:,} | {r['rows_per_sequence']:.2f} | {r['real_fraction']:.0%} | "
            f"{r['step_ms']:,.0f} | {r['rows_per_second']:.1f} | {r['tokens_per_second']:,.0f} | "
            f"{r['response_tokens_per_second']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="mini", choices=list(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(describe_machine())
    results = run(args.rows, args.seq_len, args.batch_size, args.steps, args.rounds, args.model, args.seed)
    print(format_results(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

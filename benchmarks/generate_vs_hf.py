"""Greedy and sampled generation, GPT-2 124M shape with random weights, batch 1: ``gpt2.generate`` (eager and
``torch.compile``d) against ``transformers.GPT2LMHeadModel.generate``, in tokens per second.

Both models hold the same weights (ours converted from the random Hugging Face model), so the
greedy tokens must agree; the script checks it. CPU time on one thread (wall time with
``--threads`` > 1); the implementations alternate round by round in one process. The compiled
model is warmed up (compiled) before timing, and the script reports how many graphs Dynamo built
and whether the timed rounds recompiled.

At batch 1 every token reads every weight once, so the script also times ``F.linear`` of one
token over each of the model's weight matrices (the lm_head included), alternating with the
rounds: the sum is a token's fp32 matmuls with no other work, the ceiling of any generator that
reads the weights in fp32 at this memory bandwidth. Sampling (temperature 1, top-k 50) is timed on
both sides too; its tokens differ (each library draws from its own random stream).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/generate_vs_hf.py [--rounds 3 --tokens 100 --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import transformers

from gpt2.model.config import GPTConfig
from gpt2.model.generate import generate
from gpt2.model.gpt import GPT
from gpt2.model.hf_convert import config_from_hf, hf_to_gpt_state_dict
from gpt2.train.precision import describe_machine


def time_interleaved(runs: dict, rounds: int, clock) -> dict[str, list[float]]:
    """Each run's time in every round, the runs alternating within a round (A B C, A B C, ...)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = clock()
            run()
            times[name].append(clock() - start)
    return times


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--prompt", type=int, default=8, help="prompt length in tokens")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled model (its cold compile)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (> 1: wall time)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()  # the 124M shape
    config: GPTConfig = config_from_hf(hf.config)
    ours = GPT(config).eval()
    ours.load_state_dict(hf_to_gpt_state_dict(hf.state_dict(), config))
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    n = args.tokens

    def hf_generate(**sampling) -> torch.Tensor:
        return hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **sampling)

    weights = [m.weight for m in ours.modules() if isinstance(m, torch.nn.Linear)]  # blocks + lm_head
    inputs = [torch.randn(1, w.size(1)) for w in weights]

    def matmuls_only() -> None:  # one token's matmuls with the weights, n tokens
        for _ in range(n):
            for x, w in zip(inputs, weights, strict=True):
                F.linear(x, w)

    runs = {
        "ours eager": lambda: generate(ours, prompt, n, temperature=0),
        "transformers": lambda: hf_generate(do_sample=False),
        "ours sampled": lambda: generate(ours, prompt, n, temperature=1.0, top_k=50, seed=0),
        "transformers sampled": lambda: hf_generate(do_sample=True, temperature=1.0, top_k=50),
    }
    graphs = ""
    if not args.no_compile:
        from torch._dynamo.utils import counters

        compiled = torch.compile(ours)
        counters.clear()
        start = time.perf_counter()
        first = generate(compiled, prompt, n, temperature=0)
        warm_s = time.perf_counter() - start
        built = counters["stats"]["unique_graphs"]
        counters.clear()
        runs["ours compiled"] = lambda: generate(compiled, prompt, n, temperature=0)
        assert torch.equal(first, runs["ours eager"]())
    with torch.no_grad():
        outputs = {name: run() for name, run in runs.items()}  # warm-up, and the tokens to compare
        runs["matmuls only"] = matmuls_only
        times = time_interleaved(runs, args.rounds, clock)
    if not args.no_compile:
        graphs = (
            f"compiled: first call {warm_s:.1f} s wall (compiling), {built} graph(s) (the decoding step); "
            f"graphs built during the timed calls: {counters['stats']['unique_graphs']}, "
            f"graph breaks: {sum(counters['graph_break'].values())}"
        )
    same = all(torch.equal(out, outputs["transformers"]) for name, out in outputs.items() if "sampled" not in name)
    print(f"{describe_machine()}, transformers {transformers.__version__}, 124M random weights")
    kind = "CPU time, 1 thread" if args.threads == 1 else f"wall time, {args.threads} threads"
    print(f"batch 1, prompt {args.prompt} tokens, {n} new tokens; {kind}, median of {args.rounds} rounds")
    rates = {name: n / statistics.median(ts) for name, ts in times.items()}
    ceiling = rates.pop("matmuls only")
    for name, rate in rates.items():
        # greedy runs against transformers' greedy run, sampled ones against its sampled run
        ref = "transformers sampled" if "sampled" in name else "transformers"
        print(f"{name:<20} {rate:7.1f} tokens/s   {rate / rates[ref]:5.2f}x {ref}")
    print(f"greedy: same tokens as transformers: {same}")
    gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    print(
        f"fp32 matmuls alone: {ceiling:.1f} tokens/s = {ceiling / rates['transformers']:.2f}x transformers "
        f"({gb:.2f} GB of fp32 weights per token at {gb * ceiling:.1f} GB/s)"
    )
    if graphs:
        print(graphs)


if __name__ == "__main__":
    main()

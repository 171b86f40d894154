"""Greedy generation, GPT-2 124M shape with random weights, batch 1: ``gpt2.generate`` (eager and
``torch.compile``d) against ``transformers.GPT2LMHeadModel.generate``, in tokens per second.

Both models hold the same weights (ours converted from the random Hugging Face model), so the
greedy tokens must agree; the script checks it. CPU time on one thread; the implementations
alternate round by round in one process. The compiled model is warmed up (compiled) before
timing, and the script reports how many graphs Dynamo built and whether the timed rounds
recompiled.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/generate_vs_hf.py [--rounds 3 --tokens 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from gpt2.model.config import GPTConfig
from gpt2.model.generate import generate
from gpt2.model.gpt import GPT
from gpt2.model.hf_convert import config_from_hf, hf_to_gpt_state_dict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--prompt", type=int, default=8, help="prompt length in tokens")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled model (its cold compile)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()  # the 124M shape
    config: GPTConfig = config_from_hf(hf.config)
    ours = GPT(config).eval()
    ours.load_state_dict(hf_to_gpt_state_dict(hf.state_dict(), config))
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    n = args.tokens

    def hf_generate() -> torch.Tensor:
        return hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    runs = {"ours eager": lambda: generate(ours, prompt, n, temperature=0), "transformers": hf_generate}
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
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.process_time()
                run()
                times[name].append(time.process_time() - start)
    if not args.no_compile:
        graphs = (
            f"compiled: first call {warm_s:.1f} s wall (compiling), {built} graphs (prefill + decode step); "
            f"graphs built during the timed calls: {counters['stats']['unique_graphs']}, "
            f"graph breaks: {sum(counters['graph_break'].values())}"
        )
    same = all(torch.equal(out, outputs["transformers"]) for out in outputs.values())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, 1 thread, 124M random weights")
    print(f"greedy, batch 1, prompt {args.prompt} tokens, {n} new tokens; CPU time, median of {args.rounds} rounds")
    hf_rate = n / statistics.median(times["transformers"])
    for name, ts in times.items():
        rate = n / statistics.median(ts)
        print(f"{name:<14} {rate:7.1f} tokens/s   {rate / hf_rate:5.2f}x transformers")
    print(f"same tokens as transformers: {same}")
    if graphs:
        print(graphs)


if __name__ == "__main__":
    main()

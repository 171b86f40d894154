"""Greedy generation, batch 1, against llama.cpp on the same weights: ``gpt2.generate`` (fp32, and int8
weights) and llama-cpp-python (f32 and q8_0 GGUF files written by ``gpt2.model.gguf.save_gguf``), in
tokens per second, at the 4 x 128 shape and at GPT-2 124M, with random weights.

One thread, CPU time of the process (``time.process_time``: other processes on a shared machine do not
count), the runs alternating round by round (A B C D, A B C D, ...); each run is a 8-token prompt and
``--tokens`` new tokens, prompt included in the time (both sides). Medians with the spread of the rounds.
The int8 runs make the model's int8 twin at every call (its int8 weights are kept while the weights' values do
not change), inside the timed call.
llama.cpp is skipped, with a note, when llama-cpp-python is not installed. ``--compile`` adds
``torch.compile(model)`` twice: with Inductor's default (Python) wrapper and with ``cpp_wrapper=True``, whose
wrapper calls the graph's kernels from C++, and the int8 twin of a compiled model (compiled too); the compile time
of each first call is printed, not counted.

``--agreement N`` also counts how many greedy tokens int8 weights change against fp32: N random prompts of
8 tokens, ``--tokens`` new tokens each, at 124M random weights, and at a trained model (``--trained DIR``, a
checkpoint or run directory of ``gpt2 train``, or a transformers directory) prompted with 8-token windows of the
last tenth of ``--text`` (e.g. Tiny Shakespeare); per position (the first divergence changes what follows) and
with fp32's tokens as the context of both (teacher forcing: per token).

    PYTHONPATH=. python benchmarks/generate_vs_llamacpp.py [--rounds 5 --tokens 100 --compile]
        [--agreement 20 --trained DIR --text tinyshakespeare.txt]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpt2.model.config import GPTConfig
from gpt2.model.generate import generate
from gpt2.model.gguf import save_gguf
from gpt2.model.gpt import GPT
from gpt2.model.quantize import int8_weights
from gpt2.train.precision import describe_machine

SHAPES = {
    "4x128": dict(n_layer=4, n_head=4, n_embd=128),
    "124M": dict(n_layer=12, n_head=12, n_embd=768),
}
PROMPT_TOKENS = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=100, help="new tokens per run")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile(model), plain and with cpp_wrapper (after compiling)",
    )
    parser.add_argument("--agreement", type=int, default=0, help="prompts for the int8-vs-fp32 token count (0: skip)")
    parser.add_argument("--trained", default=None, help="a trained model for --agreement (a gpt2 train run dir)")
    parser.add_argument("--text", default=None, help="text whose last tenth prompts --trained (default: random ids)")
    return parser.parse_args()


def random_model(shape: str) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(block_size=1024, vocab_size=50257, **SHAPES[shape])
    return GPT(config).eval()


def llama_runs(model: GPT, folder: Path, prompt: list[int], n: int) -> dict[str, Callable[[], list[int]]]:
    """llama.cpp greedy runs of ``model`` exported as f32 and q8_0 GGUF files, or none (a note says why)."""
    try:
        import llama_cpp
    except ImportError as error:
        print(f"  llama.cpp: skipped (llama-cpp-python cannot be imported: {error}; pip install llama-cpp-python)")
        return {}
    runs = {}
    for dtype in ("f32", "q8_0"):
        path = save_gguf(model, folder / f"model-{dtype}.gguf", dtype=dtype)
        llm = llama_cpp.Llama(str(path), n_ctx=256, n_batch=256, n_threads=1, n_threads_batch=1, verbose=False, seed=0)
        runs[f"llama.cpp {dtype}"] = _llama_greedy(llm, prompt, n)
    return runs


def _llama_greedy(llm, prompt: list[int], n: int) -> Callable[[], list[int]]:
    def run() -> list[int]:
        # from an empty cache each time: the prompt is evaluated in every run, as ours is
        llm.reset()
        tokens = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            tokens.append(token)
            if len(tokens) == n:
                return tokens
        return tokens

    return run


def our_runs(model: GPT, prompt: list[int], n: int, compiled: bool) -> dict[str, Callable[[], list[int]]]:
    ids = torch.tensor([prompt])

    def run(target: torch.nn.Module, **kwargs) -> Callable[[], list[int]]:
        return lambda: generate(target, ids, n, temperature=0, **kwargs)[0, PROMPT_TOKENS:].tolist()

    start = time.process_time()
    int8_weights(model)
    print(f"  int8 weights made in {time.process_time() - start:.1f} s CPU (kept while the weights do not change)")
    runs = {"ours fp32": run(model)}
    if compiled:
        # Inductor's default Python wrapper, then its C++ wrapper (the graph's kernels called from C++)
        for name, options in (("ours fp32 compiled", None), ("ours fp32 cpp_wrapper", {"cpp_wrapper": True})):
            compiled_model = torch.compile(model, options=options)
            start = time.perf_counter()
            runs[name] = run(compiled_model)
            runs[name]()
            print(f"  {name}: first call {time.perf_counter() - start:.0f} s wall (compiling)")
    runs["ours int8"] = run(model, weights="int8")
    if compiled:
        # the int8 twin of a compiled model comes compiled (torch.compile's defaults; its products stay fbgemm's)
        start = time.perf_counter()
        runs["ours int8 compiled"] = run(compiled_model, weights="int8")
        runs["ours int8 compiled"]()
        print(f"  ours int8 compiled: first call {time.perf_counter() - start:.0f} s wall (compiling)")
    return runs


def time_interleaved(runs: dict[str, Callable[[], list[int]]], rounds: int) -> dict[str, list[float]]:
    """Each run's CPU time in every round; warns when a run used more CPU than wall time (a second thread)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start, wall = time.process_time(), time.perf_counter()
            run()
            cpu, wall = time.process_time() - start, time.perf_counter() - wall
            times[name].append(cpu)
            if cpu > 1.1 * wall:
                print(f"  note: {name} used {cpu / wall:.2f}x its wall time in CPU: more than one thread ran")
    return times


def bench_shape(shape: str, args: argparse.Namespace, folder: Path) -> None:
    model = random_model(shape)
    n = args.tokens
    prompt = torch.randint(0, 50257, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()
    print(f"\n{shape} ({model.num_params() / 1e6:.1f}M parameters, random weights); {load()}")
    runs = {**our_runs(model, prompt, n, args.compile), **llama_runs(model, folder, prompt, n)}
    # warm-up, and each run's tokens
    tokens = {name: run() for name, run in runs.items()}
    times = time_interleaved(runs, args.rounds)
    rates = {name: [n / t for t in ts] for name, ts in times.items()}
    medians = {name: statistics.median(r) for name, r in rates.items()}
    for name, r in rates.items():
        line = f"  {name:<24} {medians[name]:7.1f} tokens/s  [{min(r):.1f}..{max(r):.1f}]"
        for ref in ("llama.cpp f32", "llama.cpp q8_0"):
            if ref in medians and not name.startswith("llama"):
                line += f"  {medians[name] / medians[ref]:5.2f}x {ref}"
        print(line)
    print(f"  after the rounds: {load()}")
    reference = tokens["ours fp32"]
    for name, out in tokens.items():
        same = sum(a == b for a, b in zip(out, reference, strict=True))
        print(f"  {name:<24} {same:3d}/{n} tokens as ours fp32")


def load() -> str:
    """The machine's load averages (1, 5, 15 minutes): other processes on a shared machine slow the rounds."""
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def prompts_of(model: GPT, count: int, text: str | None) -> torch.Tensor:
    """``(count, PROMPT_TOKENS)`` ids: windows spread over the last tenth of ``text``, else random ids."""
    if text is None:
        return torch.randint(
            0, model.config.vocab_size, (count, PROMPT_TOKENS), generator=torch.Generator().manual_seed(2)
        )
    from gpt2.model.tokenizer import get_tokenizer

    ids = get_tokenizer().encode(Path(text).read_text())
    tail = ids[len(ids) * 9 // 10 :]
    step = (len(tail) - PROMPT_TOKENS) // count
    return torch.tensor([tail[i * step : i * step + PROMPT_TOKENS] for i in range(count)])


def agreement(model: GPT, ids: torch.Tensor, n: int, label: str) -> None:
    """How many greedy tokens int8 weights change against fp32 (see the module's docstring)."""
    prompts = ids.size(0)
    n = min(n, model.config.block_size - PROMPT_TOKENS)
    fp32 = generate(model, ids, n, temperature=0)
    int8 = generate(model, ids, n, temperature=0, weights="int8")
    same = (fp32 == int8)[:, PROMPT_TOKENS:]
    first = [int(row.logical_not().nonzero()[0]) if not row.all() else n for row in same]
    with torch.no_grad():
        # fp32's tokens as the context of both: the argmax of every next token
        ref = model(fp32[:, :-1])[0][:, PROMPT_TOKENS - 1 :].argmax(-1)
        got = int8_weights(model)(fp32[:, :-1])[0][:, PROMPT_TOKENS - 1 :].argmax(-1)
    forced = (ref == got).float().mean().item()
    print(
        f"  {label}: {int(same.sum())}/{same.numel()} greedy tokens as fp32 ({prompts} prompts x {n}); "
        f"first change at token {statistics.median(first):.0f} (median; {sum(f == n for f in first)} of {prompts} "
        f"never change); with fp32's context {forced:.2%} of next tokens agree"
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(describe_machine())
    print(
        f"greedy, batch 1, {PROMPT_TOKENS}-token prompt + {args.tokens} new tokens; CPU time, 1 thread; "
        f"median of {args.rounds} interleaved rounds [min..max]"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            bench_shape(shape, args, Path(tmp))
    if args.agreement:
        print("\nint8 weights against fp32, greedy:")
        model = random_model("124M")
        agreement(model, prompts_of(model, args.agreement, None), args.tokens, "124M random weights")
        if args.trained:
            trained = GPT.from_pretrained(args.trained).eval()
            ids = prompts_of(trained, args.agreement, args.text)
            agreement(trained, ids, args.tokens, f"trained {args.trained}")


if __name__ == "__main__":
    main()

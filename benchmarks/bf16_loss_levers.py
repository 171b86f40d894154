"""The bf16 loss path's levers against the path before them: CPU seconds of a bf16 forward and backward, one thread.

The levers (gpt2/model/gpt.py), each named for ``--old``, which switches the ones it names back (all by default):

- ``tied``: the tied token embedding's gradient added into the head's by rows (``index_add_``), in place of a dense
  embedding gradient summed with it;
- ``kept``: the head's weight-gradient product written into a kept bf16 buffer, in place of a fresh one per chunk;
- ``aligned``: bf16 logits rows 64 bytes apart (32 bytes before);
- ``rows``: the logits kept in bf16 and their fp32 softmax made two rows at a time, in place of the whole chunk's
  fp32 logits (a copy, the softmax, the row weights, a copy back);
- ``transposed``: the head's weight gradient made as ``(xd.T @ g).T``, in place of ``g.T @ xd`` (oneDNN's product
  with a transposed left operand).

The two run interleaved, round after round, in one process, after one warm-up round each; CPU time of this thread,
so other processes on the machine weigh less than on the wall clock. It also prints how far the two gradients are
apart. ``python benchmarks/bf16_loss_levers.py`` times GPT-2 124M at B=4, T=256.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from gpt2 import GPT, GPTConfig
from gpt2.model import gpt as gpt_module
from gpt2.train.precision import describe_machine

LEVERS = ("tied", "kept", "aligned", "rows", "transposed")


@contextlib.contextmanager
def old_path(levers: tuple[str, ...] = LEVERS) -> Iterator[None]:
    """The loss as it was before the ``levers`` named (see the module's docstring)."""
    real_buffer = gpt_module._logits_buffer

    def fresh_product(name, rows, cols, device, dtype=torch.float32):
        if name == "low_weight_grad":
            return torch.empty(rows, cols, dtype=dtype, device=device)
        return real_buffer(name, rows, cols, device, dtype)

    def plain_weight_grad(dw, g, xc, xd, wr, first):
        if g.dtype == dw.dtype:
            dw.addmm_(g.T, xc * wr, beta=int(not first))
            return
        buffer = gpt_module._logits_buffer("low_weight_grad", *dw.shape, dw.device, g.dtype)
        product = torch.mm(g.T, xd, out=buffer[:, : dw.size(1)])
        if first:
            dw.copy_(product)
        else:
            dw.add_(product)

    with _patched() as patch:
        if "kept" in levers:
            patch(gpt_module, "_logits_buffer", fresh_product)
        if "aligned" in levers:
            patch(gpt_module, "LOW_LOGITS_ROW_ALIGN", 8)
        if "tied" in levers:
            patch(GPT, "_tied_grad", lambda self, targets: None)
        if "rows" in levers:
            # the whole chunk's fp32 logits, the path a GPU takes
            patch(gpt_module, "_bf16_loss_and_grad", gpt_module._loss_and_grad)
        if "transposed" in levers:
            patch(gpt_module, "_add_weight_grad", plain_weight_grad)
        yield


@contextlib.contextmanager
def _patched() -> Iterator:
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def step(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> float:
    """CPU seconds of one bf16 forward and backward (the Trainer's contexts: one cast per weight per step)."""
    model.zero_grad(set_to_none=True)
    start = time.thread_time()
    with torch.autocast("cpu", enabled=False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets)[1]
        loss.backward()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--old", default=",".join(LEVERS), help=f"the levers switched back, of {', '.join(LEVERS)}")
    args = parser.parse_args()
    levers = tuple(args.old.split(","))
    if not set(levers) <= set(LEVERS):
        parser.error(f"--old takes levers of {', '.join(LEVERS)}, got {args.old!r}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), vocab_size=args.vocab)
    model = GPT(config).train()
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(idx, -1, 1)
    seconds: dict[str, list[float]] = {"old": [], "new": []}
    grads = {}
    for round_ in range(args.rounds + 1):
        for name in seconds:
            with old_path(levers) if name == "old" else contextlib.nullcontext():
                spent = step(model, idx, targets)
            if round_ == 0:
                grads[name] = [p.grad.clone() for p in model.parameters()]
            else:
                seconds[name].append(spent)
    print(describe_machine("cpu", 1))
    print(
        f"{args.layers} layers x {args.width}, vocab {args.vocab}, B={args.batch} T={args.seq_len}: bf16 forward + "
        f"backward, CPU seconds, {args.rounds} interleaved rounds after a warm-up; old: {', '.join(levers)} undone"
    )
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.3f} s, min {min(values):.3f}, max {max(values):.3f}")
    ratio = statistics.median(seconds["new"]) / statistics.median(seconds["old"])
    print(f"new / old (medians): {ratio:.3f}")
    apart = max(
        float((new - old).abs().max() / old.abs().max().clamp(min=1e-30))
        for new, old in zip(grads["new"], grads["old"])
    )
    print(f"gradients apart: {apart:.1e} of each tensor's largest entry")


if __name__ == "__main__":
    main()

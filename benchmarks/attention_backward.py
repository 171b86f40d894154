"""Causal attention forward + backward on the CPU: torch's flash kernel against gpt2's bf16 backward, the math path
and a chunked one.

One thread, CPU time (``time.process_time``), the variants interleaved round by round, the GPT-2 124M attention
shape (12 heads of 64) at B=4, T=256 by default, in bf16 (autocast's dtype for the attention inputs) and fp32:

- ``flash``: ``F.scaled_dot_product_attention(..., is_causal=True)`` under ``sdpa_kernel(FLASH_ATTENTION)``;
- ``ours`` (bf16 only): what a bf16 ``gpt2.GPT`` trains with on a CPU up to T=1024, flash's forward and a backward
  that computes the scores again with batched bf16 products, the queries in blocks that skip the keys after them
  (``gpt2.model.gpt._CpuCausalAttention``);
- ``math``: the same call under ``sdpa_kernel(MATH)`` (the (T, T) scores materialised, softmax, product);
- ``chunked``: the queries in blocks of ``--chunk`` rows, each block a math-path call against the keys up to its
  end (causal), so no block sees the (T, T) matrix whole.

Each variant's gradients are compared with the flash path's in float64 on the same inputs (relative error,
``|grad - exact| / |exact|`` over each whole tensor).

    PYTHONPATH=. python benchmarks/attention_backward.py [--rounds 7] [--batch 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt2.model.gpt import _CpuCausalAttention
from gpt2.train.precision import describe_machine


def flash(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def math_path(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def chunked(q, k, v, chunk: int):
    T = q.size(-2)
    outs = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        # the block's queries see the keys up to their own position
        mask = torch.ones(end - start, end, dtype=torch.bool, device=q.device).tril(start)
        with sdpa_kernel(SDPBackend.MATH):
            outs.append(F.scaled_dot_product_attention(q[..., start:end, :], k[..., :end, :], v[..., :end, :], mask))
    return torch.cat(outs, dim=-2)


def relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return ((value.double() - exact).norm() / exact.norm()).item()


def step_seconds(fn, q, k, v, grad) -> float:
    for t in (q, k, v):
        t.grad = None
    start = time.process_time()
    fn(q, k, v).backward(grad)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(describe_machine("cpu", 1))
    shape = (args.batch, args.heads, args.seq_len, args.head_size)
    print(f"causal attention, (B, heads, T, head size) = {shape}, forward + backward, CPU s, {args.rounds} rounds")
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(3))
        grad = torch.randn(shape, generator=gen).to(dtype)
        variants = {"flash": flash, "math": math_path, "chunked": lambda q, k, v: chunked(q, k, v, args.chunk)}
        if dtype == torch.bfloat16:
            variants["ours"] = _CpuCausalAttention.apply
        reference = flash(q, k, v).float()
        exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
        flash(*exact).backward(grad.double())
        for name, fn in variants.items():
            # one untimed forward + backward (the warm-up): its output and gradients against flash's and the exact ones
            for t in (q, k, v):
                t.grad = None
            out = fn(q, k, v)
            out.backward(grad)
            diff = (out.detach().float() - reference).abs().max().item()
            errors = [f"{relative_error(t.grad, e.grad):.1e}" for t, e in zip((q, k, v), exact)]
            print(f"{str(dtype)[6:]:9} {name:8} max |out - flash| {diff:.2e}, grads' error dq dk dv {' '.join(errors)}")
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(step_seconds(fn, q, k, v, grad))
        flash_median = statistics.median(times["flash"])
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{str(dtype)[6:]:9} {name:8} {median * 1000:8.1f} ms  {median / flash_median:.2f}x flash")


if __name__ == "__main__":
    main()

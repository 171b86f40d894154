"""Computed (not measured) peak GPU memory per rank for GPT-2 124M-1.5B under DDP and FSDP, with and without
activation checkpointing: the table in docs/distributed.md. The CPU measurements that check its shape are
benchmarks/fsdp_memory.py's.

The model is counted as this library trains it: fp32 weights (the optimizer's master copy), fp32 gradients and
AdamW's two fp32 moments, 16 bytes a parameter; bf16 compute (autocast, or FSDP's bf16 gather); flash attention
(no T x T attention matrix kept) and the chunked loss (no full logits kept). Per process:

- DDP: 16 P bytes of model state, plus DDP's gradient buckets (~4 P bytes of fp32 gradients in flight: counted
  as 25 MB buckets, negligible) and the activations.
- FSDP over N processes: 16 P / N bytes of shards, plus the unsharded weights (bf16) and gradients (fp32) of
  the unit being run and of the one prefetched: 2 x (2 + 4) bytes x the largest unit (one transformer block,
  or the root: embeddings and head).
- Activations, per layer and sequence of T tokens of width C: about 34 T C bytes in bf16 (Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models", 2022: 34 s b h plus 5 a s^2 b for the attention
  matrix, which flash attention does not keep). With activation checkpointing each block keeps its input
  (2 T C bytes) and one block at a time recomputes its 34 T C.

Real runs add the CUDA context and allocator slack (about 0.5-1 GB) and, with torch.compile, less activation
memory (fused element-wise kernels keep fewer intermediates): read the table as a guide to what fits, then use
``--micro-batch-size auto``.

    python benchmarks/memory_table.py                       # micro-batch 16 x 1024 (the GPU recipes' T)
    python benchmarks/memory_table.py --micro-batch 8 --processes 2 8
"""

from __future__ import annotations

import argparse

GIB = 1024**3
PRESETS = {
    "124M": dict(n_layer=12, n_embd=768),
    "355M": dict(n_layer=24, n_embd=1024),
    "774M": dict(n_layer=36, n_embd=1280),
    "1.5B": dict(n_layer=48, n_embd=1600),
}
VOCAB, CONTEXT = 50304, 1024


def parameters(n_layer: int, n_embd: int) -> tuple[int, int, int]:
    """(all parameters, one block's, the root unit's: token and position embeddings, tied head, last LayerNorm)."""
    block = 12 * n_embd**2 + 13 * n_embd
    root = VOCAB * n_embd + CONTEXT * n_embd + 2 * n_embd
    return n_layer * block + root, block, root


def per_rank_bytes(
    n_layer: int, n_embd: int, batch: int, seq: int, processes: int | None, checkpointing: bool
) -> float:
    """Peak bytes on one process: model state (DDP when ``processes`` is None, else FSDP over that many) plus
    activations.
    """
    total, block, root = parameters(n_layer, n_embd)
    if processes is None:
        state = 16 * total
    else:
        state = 16 * total / processes + 2 * (2 + 4) * max(block, root)
    per_layer = 34 * batch * seq * n_embd
    if checkpointing:
        activations = n_layer * 2 * batch * seq * n_embd + per_layer
    else:
        activations = n_layer * per_layer
    return state + activations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    columns = [("DDP", None)] + [(f"FSDP x{n}", n) for n in args.processes]
    header = ["model", "params"]
    for name, _ in columns:
        header += [name, f"{name} + AC"]
    # computed from the shapes, not measured: the machine is named all the same, as by every benchmark
    from gpt2.train.precision import describe_machine

    print(f"{describe_machine()} (computed, not measured on it)")
    print(f"computed peak GiB per GPU, micro-batch {args.micro_batch} x {args.seq_len}, bf16 compute, fp32 AdamW")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for model, shape in PRESETS.items():
        total = parameters(**shape)[0]
        row = [model, f"{total / 1e6:,.0f}M"]
        for _, processes in columns:
            for checkpointing in (False, True):
                size = per_rank_bytes(
                    **shape, batch=args.micro_batch, seq=args.seq_len, processes=processes, checkpointing=checkpointing
                )
                row.append(f"{size / GIB:.1f}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

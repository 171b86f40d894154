"""Make the figures of docs/precision.md: fp32 vs bf16 vs fp16 (loss-scaled) loss curves, and
where GPT-2's gradients fall in fp16's range with and without loss scaling.

Trains the same small GPT (same seed, same batches) on Tiny Shakespeare once per precision with
the Trainer, on whatever device is there (a CPU is enough: a few minutes), then writes

    <out>/precision_loss_curves.png   training loss per step; the fp16 run's loss scale
    <out>/fp16_gradient_range.png     histogram of |gradient| against fp16's limits
    <out>/precision_curves.json       the numbers behind both

To keep a CPU run short the text's GPT-2 token ids are renumbered to the ~11.5k ids Tiny
Shakespeare actually uses (the output layer shrinks 4x); the precision effects do not depend on
the vocabulary size.

    python examples/precision_curves.py                          # runs/precision_curves, 150 steps
    python examples/precision_curves.py --out docs/figures       # update the figures of the docs
    python examples/precision_curves.py --steps 300 --out /tmp/figures --precisions fp32,bf16
    python examples/precision_curves.py --replot docs/figures/precision_curves.json --out docs/figures

``--replot JSON`` redraws the loss-curve figure from a saved precision_curves.json without
training (the gradient histogram needs the gradients themselves, so it is not redrawn).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpt2 import GPT, GPTConfig
from gpt2.data import tiny_shakespeare_path
from gpt2.data.sources import text_tokens
from gpt2.train.config import TrainConfig
from gpt2.train.distributed import resolve_device
from gpt2.train.precision import POLICY_NAMES
from gpt2.train.trainer import Trainer

# fp16's limits (IEEE half precision): largest finite value, smallest normal, smallest subnormal.
FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
FP16_MIN_NORMAL = float(torch.finfo(torch.float16).tiny)  # 6.1e-5
FP16_MIN_SUBNORMAL = 2.0**-24  # 6.0e-8: anything smaller rounds to zero
COLORS = {"fp32": "#1f77b4", "bf16": "#2ca02c", "fp16": "#d62728", "tf32": "#9467bd"}
# The runs' losses agree to ~0.01, so colour alone leaves one visible curve: each precision also
# gets its own line style and marker, and a second panel shows the difference from fp32.
STYLES = {"fp32": ("-", "o"), "bf16": ("--", "s"), "fp16": (":", "^"), "tf32": ("-.", "D")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out",
        default="runs/precision_curves",
        help="output directory (default: runs/precision_curves; docs/figures updates the docs' figures)",
    )
    p.add_argument(
        "--replot",
        default=None,
        metavar="JSON",
        help="redraw precision_loss_curves.png from this precision_curves.json instead of training",
    )
    p.add_argument("--precisions", default="fp32,bf16,fp16", help="comma-separated runs (default: fp32,bf16,fp16)")
    p.add_argument("--steps", type=int, default=150, help="training steps per run (default: 150)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    p.add_argument("--n-layer", type=int, default=2, help="layers (default: 2)")
    p.add_argument("--n-embd", type=int, default=64, help="width (default: 64)")
    p.add_argument("--max-lr", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--seed", type=int, default=1337, help="seed of weights and data order (default: 1337)")
    return p.parse_args(argv)


def compact_tokens() -> tuple[np.ndarray, int]:
    """Tiny Shakespeare's GPT-2 tokens renumbered 0..V-1 (V = the ids that occur)."""
    tokens = text_tokens(tiny_shakespeare_path())
    used, compact = np.unique(tokens, return_inverse=True)
    return compact.astype(np.int64), len(used)


def train(precision: str, tokens: np.ndarray, vocab: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(
        GPTConfig(block_size=args.seq_len, vocab_size=vocab, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    )
    config = TrainConfig(
        micro_batch_size=args.batch_size,
        seq_len=args.seq_len,
        max_steps=args.steps,
        warmup_steps=max(1, args.steps // 10),
        max_lr=args.max_lr,
        precision=precision,
        device=args.device,
        out_dir=None,
        progress=False,
        eval_interval=0,
        seed=args.seed,
    )
    start = time.time()
    print(f"{precision}: training {args.steps} steps ...", flush=True)
    with Trainer(model, config, tokens, sinks=[ProgressLines(precision, args.steps)]) as trainer:
        history = trainer.fit()
        seconds = time.time() - start
        grads = gradient_sample(trainer) if precision == "fp32" else None
    print(
        f"{precision}: final loss {history[-1]['loss']:.4f}, {seconds:.0f} s, "
        f"{sum(r['skipped'] for r in history)} skipped steps",
        flush=True,
    )
    return {
        "precision": precision,
        "loss": [r["loss"] for r in history],
        "loss_scale": [r.get("loss_scale") for r in history],
        "skipped": [bool(r["skipped"]) for r in history],
        "seconds": seconds,
        "gradients": grads,
    }


class ProgressLines:
    """A Trainer sink: one line at most every ``every`` seconds (and at the last step), so a slow
    run (fp16 autocast on a CPU: minutes) is never silent for long.
    """

    def __init__(self, name: str, steps: int, every: float = 5.0):
        self.name, self.steps, self.every = name, steps, every
        self.start = self.last = time.time()

    def log(self, record: dict) -> None:
        now = time.time()
        if now - self.last >= self.every or record["step"] == self.steps:
            self.last = now
            per_step = (now - self.start) / record["step"]
            print(
                f"  {self.name}: step {record['step']}/{self.steps}, loss {record['loss']:.4f}, {per_step:.2f} s/step",
                flush=True,
            )


def gradient_sample(trainer: Trainer) -> np.ndarray:
    """|gradient| of every weight after one more fp32 backward on the next batch."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    x, y = trainer.train_loader.next_batch()
    _, loss = model(x.to(trainer.device), y.to(trainer.device))
    loss.backward()
    grads = torch.cat([p.grad.detach().abs().flatten().float().cpu() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grads[grads > 0].numpy()


def plot_losses(runs: list[dict], path: Path) -> None:
    """Loss per step (each precision its own colour, line style and marker), the difference from
    fp32 (the curves themselves overlap), and the fp16 run's loss scale.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp32 = next((r for r in runs if r["precision"] == "fp32"), None)
    others = [r for r in runs if r is not fp32]
    fp16 = next((r for r in runs if r["precision"] == "fp16"), None)
    panels = ["loss"] + (["diff"] if fp32 is not None and others else []) + (["scale"] if fp16 else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    axes = dict(zip(panels, axes[0]))

    def style(run: dict, n: int) -> dict:
        line, marker = STYLES.get(run["precision"], ("-", "x"))
        every = max(1, n // 10)
        offset = runs.index(run) * every // len(runs)  # staggered, so overlapping curves show every marker
        return dict(
            color=COLORS.get(run["precision"]),
            linestyle=line,
            marker=marker,
            markevery=(offset, every),
            markersize=5,
            linewidth=1.4,
            label=run["precision"],
        )

    ax = axes["loss"]
    for run in runs:
        steps = np.arange(1, len(run["loss"]) + 1)
        ax.plot(steps, run["loss"], **style(run, len(steps)))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(
        f"same model, same batches: {', '.join(r['precision'] for r in runs)}\n(the curves lie on top of each other)",
        fontsize=10,
    )
    ax.legend()
    ax.grid(alpha=0.3)
    if "diff" in axes:
        ax = axes["diff"]
        base = np.asarray(fp32["loss"], dtype=float)
        for run in others:
            n = min(len(base), len(run["loss"]))
            diff = np.asarray(run["loss"][:n], dtype=float) - base[:n]
            ax.plot(np.arange(1, n + 1), diff, **{**style(run, n), "label": f"{run['precision']} - fp32"})
        ax.axhline(0.0, color=COLORS["fp32"], linewidth=1, label="fp32 (0)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss difference from fp32")
        ax.set_title("the same runs, minus the fp32 loss")
        ax.legend()
        ax.grid(alpha=0.3)
    if fp16:
        ax = axes["scale"]
        scale = [s if s is not None else math.nan for s in fp16["loss_scale"]]
        steps = np.arange(1, len(scale) + 1)
        ax.step(steps, np.log2(scale), where="post", color=COLORS["fp16"], label="fp16 loss scale")
        skipped = [s for s, k in zip(steps, fp16["skipped"]) if k]
        if skipped:
            ax.scatter(
                skipped,
                np.log2([scale[s - 1] for s in skipped]),
                marker="x",
                color="black",
                label=f"skipped steps ({len(skipped)})",
                zorder=3,
            )
        ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel("log2(loss scale)")
        ax.set_title("fp16: GradScaler's loss scale")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_gradients(grads: np.ndarray, scale: float, path: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = np.log10(grads)
    scaled = logs + math.log10(scale)
    bins = np.linspace(min(logs.min(), -12), max(scaled.max(), 6), 120)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.hist(logs, bins=bins, alpha=0.6, color="#1f77b4", label="|gradient|")
    ax.hist(scaled, bins=bins, alpha=0.6, color="#d62728", label=f"|gradient| x {scale:g} (loss scale)")
    for value, name in (
        (FP16_MIN_SUBNORMAL, "fp16: 0 below"),
        (FP16_MIN_NORMAL, "fp16 min normal"),
        (FP16_MAX, "fp16 max"),
    ):
        ax.axvline(math.log10(value), color="black", linestyle="--", linewidth=1)
        ax.text(math.log10(value), ax.get_ylim()[1] * 0.95, f" {name}", rotation=90, va="top", fontsize=8)
    ax.set_xlabel("log10 |value|")
    ax.set_ylabel("gradient entries")
    ax.set_title("where the gradients fall in fp16's range")
    ax.legend(loc="center left")  # the left half of the plot is empty: the labels of the limits are at the top
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return {
        "entries": int(grads.size),
        "below_fp16_subnormal": float((grads < FP16_MIN_SUBNORMAL).mean()),
        "below_fp16_normal": float((grads < FP16_MIN_NORMAL).mean()),
        "scaled_below_fp16_subnormal": float((grads * scale < FP16_MIN_SUBNORMAL).mean()),
        "scaled_below_fp16_normal": float((grads * scale < FP16_MIN_NORMAL).mean()),
        "scaled_above_fp16_max": float((grads * scale > FP16_MAX).mean()),
        "loss_scale": scale,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # bad values (--steps 0, --precisions fp8, cuda without CUDA): one line, exit 2
        return _main(args)
    except ValueError as e:
        print(f"precision_curves.py: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"--precisions: unknown {unknown}; choose from {', '.join(POLICY_NAMES)}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        source = Path(args.replot)
        if not source.is_file():
            print(
                f"error: --replot {source}: no such file (a precision_curves.json written by this script)",
                file=sys.stderr,
            )
            return 2
        runs = json.loads(source.read_text())["runs"]
        plot_losses(runs, out / "precision_loss_curves.png")
        print(f"wrote {out / 'precision_loss_curves.png'} (from {source})")
        return 0
    tokens, vocab = compact_tokens()
    print(
        f"Tiny Shakespeare: {len(tokens):,} tokens over {vocab:,} distinct ids; {args.steps} steps per run", flush=True
    )
    runs = [train(p, tokens, vocab, args) for p in precisions]
    plot_losses(runs, out / "precision_loss_curves.png")
    summary = {
        "args": vars(args),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu",
        "runs": [{k: v for k, v in r.items() if k != "gradients"} for r in runs],
    }
    fp32 = next((r for r in runs if r["gradients"] is not None), None)
    if fp32 is not None:
        fp16 = next((r for r in runs if r["precision"] == "fp16"), None)
        scale = next((s for s in (fp16 or {}).get("loss_scale", []) if s), 65536.0)  # GradScaler's initial scale
        summary["gradients"] = plot_gradients(fp32["gradients"], scale, out / "fp16_gradient_range.png")
    (out / "precision_curves.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name in ("precision_loss_curves.png", "fp16_gradient_range.png", "precision_curves.json"):
        if (out / name).exists():
            print(f"wrote {out / name} ({(out / name).stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

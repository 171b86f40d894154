"""One training step: ``gpt2.GPT`` + our AdamW against build-nanogpt's loop, side by side.

build-nanogpt's ``train_gpt2.py`` is re-implemented here from its published loop (not copied):
its model (fused qkv, ``F.scaled_dot_product_attention(is_causal=True)``, tanh GELU, tied
embeddings, a 50304-wide vocabulary and ``F.cross_entropy`` over the whole ``(B*T, 50304)``
logits), its AdamW (decay 0.1 on every 2-D tensor, betas (0.9, 0.95), eps 1e-8, lr 6e-4) and its
step (zero_grad, forward under autocast, backward, clip the norm at 1.0, set the lr, step).
Ours: :class:`gpt2.GPT` (vocab 50257 padded to 50304, the chunked loss) and
:func:`gpt2.train.optim.build_optimizer` with the same settings. Both eager, same shape (4 layers,
128 wide, 4 heads, B=8, T=128), same batch; fp32 and bf16 autocast. CPU time on one thread,
the two implementations interleaved round by round in one process.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/step_vs_nanogpt.py [--rounds 5 --steps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from gpt2.train.config import TrainConfig
from gpt2.train.optim import build_optimizer
from gpt2.train.precision import describe_machine

LAYERS, WIDTH, HEADS, BATCH, SEQ, VOCAB = 4, 128, 4, 8, 128, 50257
LR = 6e-4


# ------------------------------------------------------------------ build-nanogpt, re-implemented
class PeerAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.c_proj.SCALE_INIT = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class PeerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = PeerAttention()
        self.c_fc, self.c_proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.c_proj.SCALE_INIT = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PeerGPT(nn.Module):
    def __init__(self, vocab: int = 50304) -> None:  # build-nanogpt trains with the padded 50304
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.h = nn.ModuleList(PeerBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                std = 0.02 * ((2 * LAYERS) ** -0.5 if hasattr(m, "SCALE_INIT") else 1.0)
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def peer_optimizer(model: nn.Module) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)  # fused only on CUDA


# ------------------------------------------------------------------ the two steps
def make_step(model: nn.Module, optimizer: torch.optim.Optimizer, autocast: bool):
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = LR
        optimizer.step()
        return loss.item()

    return step


def build(which: str, autocast: bool):
    torch.manual_seed(0)
    if which == "ours":
        config = GPTConfig(
            n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, block_size=SEQ, vocab_size=VOCAB, pad_vocab_multiple=64
        )
        model = GPT(config).train()
        optimizer = build_optimizer(model, TrainConfig(max_lr=LR, weight_decay=0.1, decay_embeddings=True))
    else:
        model = PeerGPT().train()
        optimizer = peer_optimizer(model)
    return make_step(model, optimizer, autocast)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation per round")
    parser.add_argument(
        "--precisions",
        default="fp32,bf16",
        help="comma-separated, of fp32 and bf16 (bf16 is emulated, and very slow, on CPUs without AMX or AVX512-BF16)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    print(f"{describe_machine()}; {LAYERS} layers x {WIDTH} wide, B={BATCH} T={SEQ}, CPU time per step")
    header = ("precision", "ours ms", "nanogpt ms", "ours/nanogpt", "loss ours", "loss nanogpt")
    print("{:<9} {:>9} {:>11} {:>13} {:>10} {:>13}".format(*header))
    for precision in args.precisions.split(","):
        steps = {name: build(name, precision == "bf16") for name in ("ours", "nanogpt")}
        times: dict[str, list[float]] = {name: [] for name in steps}
        losses = {name: math.nan for name in steps}
        for step in steps.values():  # warm-up: first-call allocations, optimizer state
            step(x, y)
        for _ in range(args.rounds):
            for name, step in steps.items():
                start = time.process_time()
                for _ in range(args.steps):
                    losses[name] = step(x, y)
                times[name].append((time.process_time() - start) / args.steps * 1e3)
        ours, peer = statistics.median(times["ours"]), statistics.median(times["nanogpt"])
        print(
            f"{precision:<9} {ours:>9.1f} {peer:>11.1f} {ours / peer:>12.3f}x "
            f"{losses['ours']:>10.4f} {losses['nanogpt']:>13.4f}"
        )


if __name__ == "__main__":
    main()

"""The library-level DDP tests' jobs, all run in ONE torchrun launch per test session.

Starting torchrun costs three Python interpreters importing torch plus a gloo rendezvous: more
than the jobs themselves at these sizes. So the ``dist_reports`` fixture in conftest.py launches

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_dist_worker.py OUT

once; each job writes ``OUT/<job>/report_rank<r>.json`` (or the error it raised, so a failing
job fails only its own test). The tests call the same job functions in-process for the
one-process reference:

- ``train``: a tiny GPT trained by the Trainer (tests/test_distributed.py); the same global batch
  of 128 tokens per step either way: 2 sequences x 16 tokens x 4 micro-steps on one process, or
  x 2 micro-steps x 2 processes.
- ``final_eval``: the final validation report, split across ranks (tests/test_final_eval.py).
- ``lora``: a LoRA GPT trained by the Trainer, its adapter saved (tests/test_minlora_train.py).
- ``locked``: out_dir locked by another process: every rank must raise, none may wait for rank
  0 forever (tests/test_run_lock.py).
- ``instruct``: instruction rows of very uneven response lengths, unpacked and packed (rows
  isolated): the loss is the mean over the global batch's response tokens, so 2 ranks x 2
  micro-steps equal 1 rank x 4 (tests/test_distributed.py).
- ``activation_checkpointing``: ``train`` with the blocks recomputed in the backward: the same
  losses as ``train`` (tests/test_distributed.py).
- ``muon``: ``train`` with the Muon optimizer (tests/test_muon.py).
- ``recovery``: a diverging run that recovers: every rank takes the same decision
  (tests/test_recovery.py).

The worker creates the process group itself, so the Trainers join it instead of creating and
destroying one each.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from gpt2 import GPT, GPTConfig
from gpt2.train.config import RecoveryConfig, TrainConfig
from gpt2.train.distributed import destroy_process_group
from gpt2.train.trainer import Trainer


def _write(out_dir: str, report: dict) -> dict:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, f"report_rank{report['rank']}.json").write_text(json.dumps(report))
    return report


# --------------------------------------------------------------------------- train
MICRO_BATCH, SEQ_LEN, TOTAL_BATCH, MAX_STEPS = 2, 16, 128, 4


def train(out_dir: str, **overrides) -> dict:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = GPT(GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=4, n_embd=32))
    tokens = torch.randint(0, 128, (4096,), generator=torch.Generator().manual_seed(1))
    # Validation reads eval_steps micro-batches on every process: 4 in all, either way.
    eval_steps = 4 // int(os.environ.get("WORLD_SIZE", "1"))
    config = TrainConfig(
        micro_batch_size=MICRO_BATCH,
        seq_len=SEQ_LEN,
        total_batch_size=TOTAL_BATCH,
        max_steps=MAX_STEPS,
        warmup_steps=1,
        max_lr=1e-3,
        eval_interval=2,
        eval_steps=eval_steps,
        checkpoint_interval=2,
        out_dir=out_dir,
        progress=False,
        device="cpu",
        precision="fp32",
        plot=False,
        **overrides,
    )
    with Trainer(model, config, tokens[:3072], tokens[3072:], sinks=[]) as trainer:
        history = trainer.fit()
        report = {
            "rank": trainer.dist_env.rank,
            "world_size": trainer.dist_env.world_size,
            "grad_accum_steps": trainer.grad_accum_steps,
            "losses": [r["loss"] for r in history],
            "grad_norms": [r["grad_norm"] for r in history],
            "val_losses": [r.get("val_loss") for r in history],
        }
    # Every rank writes its own report (the Trainer itself writes only on rank 0).
    return _write(out_dir, report)


# --------------------------------------------------------------------------- final_eval
EVAL_B, EVAL_T = 2, 16
VAL_BATCHES = 5  # odd: under 2 ranks one scores 3 batches and the other 2


def final_eval(out_dir: str) -> dict:
    """No training: the same weights on every rank, so the final report must give the
    one-process loss whatever the number of ranks.
    """
    from gpt2.cli.common import SamplingOptions, final_report

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=4, n_embd=32))
    n = 2048 + VAL_BATCHES * EVAL_B * EVAL_T + 1
    tokens = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(1))
    train_tokens, val = tokens[:2048], tokens[2048:]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # out_dir: final_report writes results.json there (rank 0); not the default ./out
    config = TrainConfig(
        micro_batch_size=EVAL_B,
        seq_len=EVAL_T,
        total_batch_size=EVAL_B * EVAL_T * world_size,
        max_steps=1,
        eval_interval=0,
        progress=False,
        device="cpu",
        precision="fp32",
        plot=False,
        out_dir=str(Path(out_dir) / "run"),
    )
    no_samples = SamplingOptions(num_samples=0)
    with Trainer(model, config, train_tokens, val, sinks=[]) as trainer:
        forwards = []
        hook = trainer.model.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
        full = final_report(trainer, val, no_samples, final_eval_batches=None)
        hook.remove()
        report = {
            "rank": trainer.dist_env.rank,
            "full": full,
            "full_forwards": len(forwards),  # the batches this rank scored
            "capped": final_report(trainer, val, no_samples, final_eval_batches=3),
            # Trainer.evaluate on a val set shorter than steps: every rank stops at the same batch
            "evaluate": trainer.evaluate(steps=50),
        }
    return _write(out_dir, report)


# --------------------------------------------------------------------------- lora
def lora(out_dir: str) -> dict:
    """Train a LoRA GPT with the Trainer and save its adapter. Same global batch either way:
    128 tokens per step = 2 sequences x 16 tokens x 4 micro-steps on one process, or x 2
    micro-steps x 2 processes.
    """
    from minlora.adapters import save_adapter
    from minlora.config import LoRAConfig
    from minlora.model import add_lora
    from minlora.utils import mark_only_lora_as_trainable

    torch.manual_seed(0)  # same base weights and initial LoRA factors on every rank
    model = GPT(GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=32))
    add_lora(model, LoRAConfig(rank=4, alpha=8, include_lm_head=True))
    mark_only_lora_as_trainable(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    config = TrainConfig(
        micro_batch_size=2,
        seq_len=16,
        total_batch_size=128,
        max_steps=3,
        max_lr=1e-2,
        precision="fp32",
        device="cpu",
        out_dir=None,
        eval_interval=0,
        progress=False,
    )
    cyclic = torch.arange(4096) % 24  # a sequence a LoRA learns in a few steps
    with Trainer(model, config, cyclic) as trainer:
        losses = [r["loss"] for r in trainer.fit()]
        rank = trainer.dist_env.rank
    save_adapter(model, Path(out_dir) / f"rank{rank}")
    frozen_ok = all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    return _write(out_dir, {"rank": rank, "losses": losses, "frozen_ok": frozen_ok})


# --------------------------------------------------------------------------- locked
def _hold_lock(out_dir: str, ready) -> None:
    from gpt2.train import rundir

    rundir.RunLock(out_dir).acquire()
    ready.set()
    time.sleep(300)


def locked(out_dir: str) -> dict:
    """out_dir is held by another process (see __main__): rank 0 finds it locked, and rank 1
    must raise too instead of waiting for rank 0 forever.
    """
    from gpt2.train.rundir import RunDirLockedError

    rank = int(os.environ.get("RANK", "0"))
    cfg = TrainConfig(
        micro_batch_size=2,
        seq_len=16,
        max_steps=2,
        out_dir=out_dir,
        progress=False,
        plot=False,
        device="cpu",
        precision="fp32",
    )
    try:
        Trainer(
            GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)),
            cfg,
            torch.zeros(1024, dtype=torch.long),
            sinks=[],
        )
        refused = None
    except RunDirLockedError as e:
        refused = str(e)
    return _write(str(Path(out_dir).parent), {"rank": rank, "refused": refused})


# --------------------------------------------------------------------------- instruct
class ByteTokenizer:
    """UTF-8 bytes as token ids, <|endoftext|> = 256: instruction data for a 257-token model."""

    eot_token = 256

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode())


def uneven_rows(n: int, seed: int = 0) -> list[tuple[str, str, str, str]]:
    """``n`` instruction rows whose responses are 1 to 60 bytes long (mostly short)."""
    g = torch.Generator().manual_seed(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs", "far", "away"]
    rows = []
    for i in range(n):
        pick = torch.randint(0, len(words), (40,), generator=g).tolist()
        length = 1 + int(60 * torch.rand((), generator=g) ** 3)  # cubed: most short, a long tail
        response = " ".join(words[j] for j in pick)[:length]
        rows.append((f"Say {words[pick[0]]} {i}.", words[pick[1]] if i % 3 else "", response, f"row{i}"))
    return rows


def instruct(out_dir: str) -> dict:
    """The same global batch of 8 sequences per step: 2 per micro-step x 4 micro-steps on one
    process, or x 2 micro-steps x 2 processes; unpacked and packed.
    """
    from gpt2.data.instruct import InstructionLoader

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    report: dict = {"rank": rank}
    for pack in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=128, vocab_size=257, n_layer=2, n_head=4, n_embd=32))
        loader = InstructionLoader(
            uneven_rows(96), 2, 128, rank=rank, world_size=world_size, pack=pack, tokenizer=ByteTokenizer()
        )
        config = TrainConfig(
            micro_batch_size=2,
            seq_len=128,
            total_batch_size=2 * 128 * 4,
            max_steps=3,
            warmup_steps=1,
            max_lr=1e-3,
            eval_interval=0,
            out_dir=None,
            progress=False,
            device="cpu",
            precision="fp32",
            plot=False,
        )
        with Trainer(model, config, loader, sinks=[]) as trainer:
            history = trainer.fit()
        report[f"pack={pack}"] = {
            "losses": [r["loss"] for r in history],
            "grad_norms": [r["grad_norm"] for r in history],
            "scored_tokens": [r["scored_tokens"] for r in history],
            "weights": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
        }
    return _write(out_dir, report)


# --------------------------------------------------------------------------- recovery
class _Messages(logging.Handler):
    """The messages of the records it sees."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def recovery(out_dir: str) -> dict:
    """A run that diverges at a constant max_lr=3 (tests/test_recovery.py): every rank judges the
    all-reduced loss, so they recover at the same step to the same state. The same global batch
    of 128 tokens per step either way: 2 x 32 tokens x 2 micro-steps on one process, or x 1
    micro-step x 2 processes.
    """
    sys.path.insert(0, str(Path(__file__).parent))
    from _tiny_run import DIVERGING_TOKENS, diverging_config

    handler = _Messages()
    logging.getLogger("gpt2").addHandler(handler)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    config = diverging_config(
        micro_batch_size=2,
        total_batch_size=128,
        max_steps=8,
        warmup_steps=0,
        min_lr=3.0,
        recovery=RecoveryConfig(lr_factor=0.01),
        checkpoint_interval=3,
        out_dir=out_dir,
    )
    try:
        with Trainer(model, config, DIVERGING_TOKENS, sinks=[]) as trainer:
            trainer.fit()
            rank, recoveries = trainer.dist_env.rank, trainer.recovery.recoveries
    finally:
        logging.getLogger("gpt2").removeHandler(handler)
    recovery_lines = [m for m in handler.messages if "recovery " in m]
    return _write(out_dir, {"rank": rank, "recoveries": recoveries, "recovery_lines": recovery_lines})


def muon(out_dir: str) -> dict:
    """``train`` with Muon for the blocks' matrices (tests/test_muon.py)."""
    return train(out_dir, optimizer="muon", muon_lr=0.02)


def activation_checkpointing(out_dir: str) -> dict:
    """``train`` with activation checkpointing: DDP's gradient hooks fire in the recomputing backward
    (tests/test_distributed.py).
    """
    return train(out_dir, activation_checkpointing=True)


JOBS = {
    "train": train,
    "final_eval": final_eval,
    "lora": lora,
    "locked": locked,
    "instruct": instruct,
    "muon": muon,
    "activation_checkpointing": activation_checkpointing,
    "recovery": recovery,
}


if __name__ == "__main__":
    torch.set_num_threads(1)  # two processes on a small CPU: do not oversubscribe it
    out = Path(sys.argv[1])
    holder = None
    if os.environ.get("RANK") == "0":
        # Another process holds the "locked" job's out_dir, from before the group exists (forked:
        # no interpreter start-up). The barrier of init_process_group orders it before rank 1.
        ready = mp.get_context("fork").Event()
        holder = mp.get_context("fork").Process(
            target=_hold_lock, args=(str(out / "locked" / "run"), ready), daemon=True
        )
        holder.start()
        assert ready.wait(60), "the lock holder did not start"
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    try:
        for name, job in JOBS.items():
            target = out / name / "run" if name == "locked" else out / name
            try:
                job(str(target))
            except BaseException:
                _write(str(out / name), {"rank": rank, "error": traceback.format_exc()})
    finally:
        if holder is not None:
            holder.kill()
            holder.join()
        # With a barrier first: a rank tearing gloo down while the other still talks to it can
        # abort ("terminate called without an active exception"); see gpt2.distributed.
        destroy_process_group(wait_for_all=True)

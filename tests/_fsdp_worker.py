"""The FSDP tests' jobs, all run in ONE 2-process torchrun launch (see tests/test_fsdp.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_fsdp_worker.py OUT REFERENCE

``REFERENCE`` is the run directory of the one-process reference (``train(..., world_size 1)``, made by the test
before the launch): one job resumes its regular checkpoint under FSDP. Each job writes
``OUT/<job>/report_rank<r>.json`` (or the error it raised, so a failing job fails only its own test). The global
batch is the same either way: 2 sequences x 16 tokens x 4 micro-steps on one process, x 2 micro-steps x 2
processes; the loss and gradient norm of every step must match the one-process run's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

import minlora
from gpt2 import GPT, GPTConfig
from gpt2.train.config import TrainConfig
from gpt2.train.distributed import destroy_process_group
from gpt2.train.trainer import Trainer

MICRO_BATCH, SEQ_LEN, TOTAL_BATCH, MAX_STEPS = 2, 16, 128, 5
# checkpoints at steps 3 and 5: the resume jobs start from step 3
CHECKPOINT_INTERVAL = 3


def tiny_model(lora: bool = False) -> GPT:
    # the same initial weights on every rank and in the one-process reference
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=4, n_embd=32))
    if lora:
        minlora.add_lora(model)
        minlora.mark_only_lora_as_trainable(model)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4096,), generator=torch.Generator().manual_seed(1))


def train(out_dir: str, *, lora: bool = False, **overrides) -> dict:
    """Train the tiny model from step 0 (or ``resume``) to MAX_STEPS; the losses, grad norms and, on rank 0,
    the sum of the whole trained weights (from ``Trainer.full_model``, a collective under FSDP).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    settings = dict(
        micro_batch_size=MICRO_BATCH,
        seq_len=SEQ_LEN,
        total_batch_size=TOTAL_BATCH,
        max_steps=MAX_STEPS,
        warmup_steps=1,
        # small enough that AdamW's normalised steps do not magnify the reduction-order differences
        # of near-zero gradients (a bias's) beyond 1e-5 in 5 steps
        max_lr=1e-3,
        grad_clip=0.5,
        eval_interval=0,
        # validation reads eval_steps micro-batches on every process: 4 in all, either way
        eval_steps=4 // world_size,
        checkpoint_interval=CHECKPOINT_INTERVAL,
        keep_last_checkpoints=0,
        out_dir=out_dir,
        progress=False,
        device="cpu",
        precision="fp32",
        plot=False,
        save_trainable_only=lora,
    )
    settings.update(overrides)
    data = tokens()
    with Trainer(tiny_model(lora), TrainConfig(**settings), data[:3072], data[3072:], sinks=[]) as trainer:
        start = trainer.step
        history = trainer.fit()
        val_loss = trainer.evaluate()
        whole = trainer.full_model()
        report = {
            "rank": trainer.dist_env.rank,
            "world_size": trainer.dist_env.world_size,
            "sharded": trainer.sharded,
            "start": start,
            "losses": [r["loss"] for r in history],
            "grad_norms": [r["grad_norm"] for r in history],
            "val_loss": val_loss,
        }
        if whole is not None:
            report["weight_sums"] = {name: float(t.double().sum()) for name, t in whole.state_dict().items()}
            report["tied"] = whole.transformer.wte.weight is whole.lm_head.weight
    return _write(out_dir, report)


def interrupted(out_dir: str) -> dict:
    """SIGTERM reaches rank 1 during step 2: every rank stops after that step, and the sharded checkpoint of it
    is saved by all of them.
    """
    from gpt2.train.recovery import TrainingInterrupted

    def signal_rank_1(trainer: Trainer, record: dict) -> None:
        if trainer.dist_env.rank == 1 and record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    data = tokens()
    config = TrainConfig(
        micro_batch_size=MICRO_BATCH,
        seq_len=SEQ_LEN,
        total_batch_size=TOTAL_BATCH,
        max_steps=MAX_STEPS,
        eval_interval=0,
        checkpoint_interval=0,
        out_dir=out_dir,
        progress=False,
        device="cpu",
        precision="fp32",
        plot=False,
        strategy="fsdp",
    )
    report = {"rank": int(os.environ["RANK"]), "stopped": None}
    with Trainer(tiny_model(), config, data, sinks=[], callbacks=[signal_rank_1]) as trainer:
        try:
            trainer.fit()
        except TrainingInterrupted as e:
            report["stopped"] = {"step": e.step, "checkpoint": str(e.checkpoint)}
    return _write(out_dir, report)


def save_fails(out_dir: str) -> dict:
    """Rank 0's part of a sharded save fails (disk full while writing SHA256SUMS): every rank must raise, none
    may train on, and nothing of the checkpoint may be left.
    """
    import errno

    from gpt2.train import checkpoint as ckpt

    rank = int(os.environ["RANK"])
    real = ckpt._write_digests

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 0:
        ckpt._write_digests = disk_full
    error = None
    try:
        train(out_dir, strategy="fsdp", max_steps=1, checkpoint_interval=1)
    except Exception as e:  # noqa: BLE001 - the error is the report
        error = f"{type(e).__name__}: {e}"
    finally:
        ckpt._write_digests = real
    left = (
        sorted(p.name for p in Path(out_dir, "checkpoints").iterdir()) if Path(out_dir, "checkpoints").is_dir() else []
    )
    return _write(out_dir, {"rank": rank, "raised": error, "left": left})


def shards_fail(out_dir: str) -> dict:
    """The disk fills up while rank 1 writes its shards (inside torch.distributed.checkpoint): every rank raises
    the one-line CheckpointSaveError, and nothing of the checkpoint is left.
    """
    import errno

    import safetensors.torch

    rank = int(os.environ["RANK"])
    real = safetensors.torch.save

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 1:
        safetensors.torch.save = disk_full
    error = None
    try:
        train(out_dir, strategy="fsdp", max_steps=1, checkpoint_interval=1)
    except BaseException as e:  # noqa: BLE001 - the error is the report (a raw CheckpointException is one)
        error = {"type": type(e).__name__, "module": type(e).__module__, "message": str(e)}
    finally:
        safetensors.torch.save = real
    left = sorted(p.name for p in Path(out_dir, "checkpoints").iterdir())
    return _write(out_dir, {"rank": rank, "raised": error, "left": left})


def diverges(out_dir: str) -> dict:
    """max_lr 1000 under FSDP: the run diverges again after its one recovery; the error may name only a checkpoint
    whose next step had a good loss.
    """
    from gpt2.train.config import RecoveryConfig
    from gpt2.train.recovery import TrainingDivergedError

    config = dict(strategy="fsdp", max_lr=1000.0, max_steps=16, checkpoint_interval=1)
    error = None
    try:
        train(out_dir, **config, recovery=RecoveryConfig(max_recoveries=1))
    except TrainingDivergedError as e:
        error = {"message": str(e), "last_checkpoint": str(e.last_checkpoint)}
    return _write(out_dir, {"rank": int(os.environ["RANK"]), "raised": error})


def _write(out_dir: str, report: dict) -> dict:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, f"report_rank{report['rank']}.json").write_text(json.dumps(report))
    return report


def jobs(out: Path, reference: Path) -> dict:
    """Each job: its name -> a call writing into ``out/<name>``, in the order they run."""
    fsdp_step3 = out / "fsdp" / "checkpoints" / "step_000003"
    reference_step3 = reference / "checkpoints" / "step_000003"
    return {
        "fsdp": lambda: train(str(out / "fsdp"), strategy="fsdp"),
        # the same world size: exact resume of the sharded checkpoint
        "fsdp_resume": lambda: train(str(out / "fsdp_resume"), strategy="fsdp", resume=str(fsdp_step3)),
        # FSDP -> DDP: the shards load whole into each DDP process
        "fsdp_to_ddp": lambda: train(str(out / "fsdp_to_ddp"), strategy="ddp", resume=str(fsdp_step3)),
        # one process -> FSDP on two: the regular checkpoint's whole tensors are sharded on loading
        "single_to_fsdp": lambda: train(str(out / "single_to_fsdp"), strategy="fsdp", resume=str(reference_step3)),
        "lora_fsdp": lambda: train(str(out / "lora_fsdp"), strategy="fsdp", lora=True),
        # each FSDP block recomputed in the backward (its weights gathered again for it)
        "fsdp_ac": lambda: train(str(out / "fsdp_ac"), strategy="fsdp", activation_checkpointing=True),
        "interrupted": lambda: interrupted(str(out / "interrupted")),
        "save_fails": lambda: save_fails(str(out / "save_fails")),
        "shards_fail": lambda: shards_fail(str(out / "shards_fail")),
        "diverges": lambda: diverges(str(out / "diverges")),
    }


if __name__ == "__main__":
    # two processes on a small CPU: do not oversubscribe it
    torch.set_num_threads(1)
    out, reference = Path(sys.argv[1]), Path(sys.argv[2])
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    try:
        for name, job in jobs(out, reference).items():
            try:
                job()
            except BaseException:
                _write(str(out / name), {"rank": rank, "error": traceback.format_exc()})
    finally:
        destroy_process_group(wait_for_all=True)

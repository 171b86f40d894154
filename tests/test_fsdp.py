"""strategy="fsdp": FSDP2 on 2 gloo processes trains as one process does, and its sharded checkpoints load
anywhere: on the same world size (exact resume), into DDP, into one process, into GPT.from_pretrained and the
command line. The 2-process jobs run in one torchrun launch (tests/_fsdp_worker.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tiny_run import plant_payload

from gpt2 import GPT
from gpt2.model.checkpoint_files import (
    DIGEST_FILE,
    SHARDS_DIR,
    WEIGHTS_FILE,
    CheckpointError,
    open_checkpoint,
    read_checkpoint,
)
from gpt2.train.checkpoint import load_checkpoint
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer

pytestmark = pytest.mark.dist

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "_fsdp_worker.py"
TOL = 1e-4
# each process's shards: one safetensors file (torch.distributed.checkpoint's Hugging Face storage)
SHARD_FILES = ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]


def _worker():
    spec = importlib.util.spec_from_file_location("_fsdp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process references (in this process), then every 2-process job in one torchrun launch."""
    worker = _worker()
    root = tmp_path_factory.mktemp("fsdp")
    reference = worker.train(str(root / "reference"))
    reference_lora = worker.train(str(root / "reference_lora"), lora=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
    cmd += [str(WORKER), str(root / "jobs"), str(root / "reference")]
    proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    return {"root": root, "reference": reference, "reference_lora": reference_lora, "proc": proc}


def _reports(runs, job: str) -> list[dict]:
    """Both ranks' reports of ``job``; fails with the job's own error (or torchrun's output)."""
    reports = []
    for rank in (0, 1):
        path = runs["root"] / "jobs" / job / f"report_rank{rank}.json"
        if not path.is_file():
            proc = runs["proc"]
            pytest.fail(f"no report from rank {rank} of {job} (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        report = json.loads(path.read_text())
        assert "error" not in report, report["error"]
        reports.append(report)
    return reports


def _close(a, b, tol=TOL):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= tol * max(1.0, abs(y)), (a, b)


def test_fsdp_trains_as_one_process(runs):
    reference = runs["reference"]
    for report in _reports(runs, "fsdp"):
        assert report["sharded"] and report["world_size"] == 2
        _close(report["losses"], reference["losses"])
        # gradient clipping over the sharded gradients: the one-process global norm
        _close(report["grad_norms"], reference["grad_norms"])
        _close([report["val_loss"]], [reference["val_loss"]])
    # Trainer.full_model gathers the shards on rank 0: the one-process weights
    sums = _reports(runs, "fsdp")[0]["weight_sums"]
    assert sums.keys() == reference["weight_sums"].keys()
    # the embedding and the head are one parameter in the whole model too
    assert _reports(runs, "fsdp")[0]["tied"]
    _close([sums[k] for k in sorted(sums)], [reference["weight_sums"][k] for k in sorted(sums)])


def test_fsdp_with_activation_checkpointing_trains_as_one_process(runs):
    reference = runs["reference"]
    for report in _reports(runs, "fsdp_ac"):
        _close(report["losses"], reference["losses"])
        _close(report["grad_norms"], reference["grad_norms"])


def test_fsdp_checkpoint_is_sharded_and_checksummed(runs):
    step = runs["root"] / "jobs" / "fsdp" / "checkpoints" / "step_000005"
    shards = sorted(p.name for p in (step / SHARDS_DIR).iterdir())
    assert shards == SHARD_FILES
    assert not (step / WEIGHTS_FILE).exists()
    listed = {line.split()[1] for line in (step / DIGEST_FILE).read_text().splitlines()}
    assert {f"{SHARDS_DIR}/{name}" for name in shards} <= listed
    meta = json.loads((step / "trainer_state.json").read_text())
    assert meta["format_version"] == 3 and meta["strategy"] == "fsdp" and meta["world_size"] == 2


def test_sharded_checkpoint_resumes_exactly_on_the_same_world_size(runs):
    fsdp = _reports(runs, "fsdp")[0]
    for report in _reports(runs, "fsdp_resume"):
        assert report["start"] == 3
        _close(report["losses"], fsdp["losses"][3:], tol=1e-6)


def test_sharded_checkpoint_resumes_under_ddp(runs):
    reference = runs["reference"]
    for report in _reports(runs, "fsdp_to_ddp"):
        assert not report["sharded"] and report["start"] == 3
        _close(report["losses"], reference["losses"][3:])


def test_one_process_checkpoint_resumes_under_fsdp(runs):
    reference = runs["reference"]
    for report in _reports(runs, "single_to_fsdp"):
        assert report["sharded"] and report["start"] == 3
        _close(report["losses"], reference["losses"][3:])


def test_a_stop_signal_saves_the_sharded_checkpoint_of_that_step(runs):
    for report in _reports(runs, "interrupted"):
        assert report["stopped"] is not None and report["stopped"]["step"] == 2
        assert report["stopped"]["checkpoint"].endswith("step_000002")
    step = runs["root"] / "jobs" / "interrupted" / "checkpoints" / "step_000002"
    assert read_checkpoint(step, trainer_state=True, weights=False).meta["step"] == 2


def test_a_failed_sharded_save_stops_every_rank_and_leaves_nothing(runs):
    rank0, rank1 = _reports(runs, "save_fails")
    assert rank0["raised"].startswith("CheckpointSaveError: could not save checkpoint step_000001")
    assert "No space left on device" in rank0["raised"] and "nothing of it was kept" in rank0["raised"]
    assert rank1["raised"].startswith("CheckpointSaveError: could not save checkpoint step_000001")
    assert rank1["raised"].endswith("(raised on rank 0)")
    assert rank0["left"] == rank1["left"] == []


def test_disk_full_while_writing_shards_is_one_line_on_every_rank(runs):
    """torch.distributed.checkpoint's CheckpointException (each rank's traceback) becomes the one-line
    CheckpointSaveError on both ranks, with the disk-full advice.
    """
    for report in _reports(runs, "shards_fail"):
        raised = report["raised"]
        assert raised["type"] == "CheckpointSaveError" and "\n" not in raised["message"], raised
        assert raised["message"].startswith("could not save checkpoint step_000001")
        assert "No space left on device" in raised["message"] and "free some space on that disk" in raised["message"]
        assert report["left"] == []


@pytest.mark.parametrize(
    "planted", ["trainer_state.json", "trainer_state.safetensors", *SHARD_FILES, ".metadata", "all"]
)
def test_a_pickle_planted_in_a_sharded_checkpoint_never_runs(runs, tmp_path, planted):
    step = tmp_path / "step_000005"
    shutil.copytree(runs["root"] / "jobs" / "fsdp" / "checkpoints" / "step_000005", step)
    marker = tmp_path / "payload-ran"
    files = ["trainer_state.json", "trainer_state.safetensors", *SHARD_FILES, ".metadata"]
    for name in files if planted == "all" else [planted]:
        # torch.distributed.checkpoint's own reader unpickled shards/.metadata
        plant_payload(step, name if name.startswith("trainer_state") else f"{SHARDS_DIR}/{name}", marker)
    model = _worker().tiny_model()
    loads = [
        lambda: read_checkpoint(step),
        lambda: load_checkpoint(step, model, torch.optim.AdamW(model.parameters()), restore_rng=True),
    ]
    if planted != "trainer_state.safetensors":
        loads.append(lambda: GPT.from_pretrained(step))
    for load in loads:
        with pytest.raises(CheckpointError) as info:
            load()
        assert "\n" not in str(info.value) and (planted if planted != "all" else "trainer_state") in str(info.value)
    assert not marker.exists()


def test_a_diverged_fsdp_run_names_no_checkpoint_that_was_not_followed_by_a_good_step(runs):
    for report in _reports(runs, "diverges"):
        raised = report["raised"]
        assert raised is not None and raised["last_checkpoint"] == "None", raised
        assert "No checkpoint of this run is known good" in raised["message"] and "lower max_lr" in raised["message"]


def test_sharded_checkpoint_resumes_on_one_process(runs, tmp_path):
    step3 = runs["root"] / "jobs" / "fsdp" / "checkpoints" / "step_000003"
    report = _worker().train(str(tmp_path / "run"), resume=str(step3))
    assert report["start"] == 3
    _close(report["losses"], runs["reference"]["losses"][3:])


def test_lora_under_fsdp_matches_one_process(runs):
    reference = runs["reference_lora"]
    for report in _reports(runs, "lora_fsdp"):
        _close(report["losses"], reference["losses"])
    sums = _reports(runs, "lora_fsdp")[0]["weight_sums"]
    _close([sums[k] for k in sorted(sums)], [reference["weight_sums"][k] for k in sorted(sums)])
    # adapter-only: the shards hold the trainable weights alone
    step = runs["root"] / "jobs" / "lora_fsdp" / "checkpoints" / "step_000005"
    data = read_checkpoint(step, trainer_state=False)
    assert data.trainable_only and data.weights and all("lora" in name for name in data.weights)


def test_from_pretrained_reads_a_sharded_checkpoint_in_one_process(runs):
    fsdp = GPT.from_pretrained(runs["root"] / "jobs" / "fsdp")
    reference = GPT.from_pretrained(runs["root"] / "reference")
    for (name, a), (_, b) in zip(fsdp.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_export_reads_a_sharded_checkpoint(runs, tmp_path):
    from transformers import GPT2LMHeadModel

    from gpt2.cli import main

    out = tmp_path / "hf"
    assert main(["export", "--model", str(runs["root"] / "jobs" / "fsdp"), "--out", str(out)]) in (0, None)
    exported = GPT2LMHeadModel.from_pretrained(out)
    reference = GPT.from_pretrained(runs["root"] / "reference")
    x = torch.randint(0, 128, (1, 16))
    torch.testing.assert_close(exported(x).logits, reference(x)[0], atol=1e-4, rtol=0)


def test_damaged_shard_is_caught_and_the_older_checkpoint_used(runs, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(runs["root"] / "jobs" / "fsdp" / "checkpoints", run / "checkpoints")
    shard = run / "checkpoints" / "step_000005" / SHARDS_DIR / SHARD_FILES[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{SHARD_FILES[1]} does not match its sha256"):
        read_checkpoint(run / "checkpoints" / "step_000005")
    found = open_checkpoint(run, trainer_state=False)
    assert found.path.name == "step_000003"
    assert "skipping damaged checkpoint" in caplog.text
    # a shard that is gone
    (run / "checkpoints" / "step_000003" / SHARDS_DIR / SHARD_FILES[0]).unlink()
    with pytest.raises(CheckpointError, match=f"{SHARD_FILES[0]} is missing"):
        read_checkpoint(run / "checkpoints" / "step_000003")


def test_fsdp_refuses_muon_in_one_line(monkeypatch):
    from gpt2.errors import InvalidValueError
    from gpt2.train import fsdp

    with pytest.raises(InvalidValueError, match="Muon orthogonalises each whole weight matrix"):
        fsdp.refuse_unsupported(TrainConfig(strategy="fsdp", optimizer="muon"))
    with pytest.raises(InvalidValueError, match="micro_batch_size='auto' is refused"):
        fsdp.refuse_unsupported(TrainConfig(strategy="fsdp", micro_batch_size="auto"))


def test_fsdp_with_one_process_trains_unsharded(tmp_path, caplog):
    worker = _worker()
    caplog.set_level("INFO")
    with Trainer(
        worker.tiny_model(),
        TrainConfig(
            strategy="fsdp", max_steps=1, micro_batch_size=2, seq_len=16, out_dir=None, progress=False, device="cpu"
        ),
        worker.tokens(),
        sinks=[],
    ) as trainer:
        assert not trainer.sharded
        assert trainer.full_model() is trainer.model
    assert "nothing to shard" in caplog.text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_node_launch_of_the_docs(strategy, tmp_path, shakespeare_file):
    """docs/distributed.md's two "nodes" on one machine (c10d rendezvous on 127.0.0.1, gloo), run together as
    printed but for a free port, fewer steps and a tiny batch; with FSDP as printed and with DDP.
    """
    from _doc_commands import doc_commands

    lines = [
        c.text for c in doc_commands(REPO_ROOT / "docs" / "distributed.md") if "--nnodes 2 --nproc_per_node 1" in c.text
    ]
    assert len(lines) == 2 and "--node_rank 0" in lines[0] and "--node_rank 1" in lines[1]
    port = _free_port()
    quiet = "--seq-len 32 --micro-batch-size 2 --warmup-steps 1 --eval-interval 0 --final-eval-batches 1"
    quiet += " --max-new-tokens 4 --no-plot --no-progress"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "GPT2_TINY_SHAKESPEARE": str(shakespeare_file),
        "OMP_NUM_THREADS": "1",
    }
    procs = []
    for line in lines:
        line = line.removesuffix("&").strip().replace("127.0.0.1:29511", f"127.0.0.1:{port}")
        line = line.replace("--max-steps 20", "--max-steps 2").replace("--strategy fsdp", f"--strategy {strategy}")
        words = line.split()
        assert words[0] == "torchrun"
        cmd = [sys.executable, "-m", "torch.distributed.run", *words[1:], *quiet.split()]
        procs.append(
            subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-3000:]
    results = json.loads((tmp_path / "runs" / "two-nodes" / "results.json").read_text())
    assert results["step"] == 2
    step = tmp_path / "runs" / "two-nodes" / "checkpoints" / "step_000002"
    meta = json.loads((step / "trainer_state.json").read_text())
    assert meta["world_size"] == 2 and meta["strategy"] == strategy
    assert (step / SHARDS_DIR / SHARD_FILES[1]).is_file() == (strategy == "fsdp")


def test_overwrite_removes_a_sharded_run_and_keeps_the_rest(runs, tmp_path):
    """The run's record vouches for the shards through their checkpoint's SHA256SUMS: --overwrite removes them
    (and nothing it did not write: the worker's report files stay).
    """
    run = tmp_path / "run"
    shutil.copytree(runs["root"] / "jobs" / "fsdp", run)
    worker = _worker()
    report = worker.train(str(run), overwrite=True, max_steps=1, checkpoint_interval=0)
    assert report["start"] == 0
    assert not (run / "checkpoints" / "step_000003").exists()
    assert not (run / "checkpoints" / "step_000005").exists()
    assert (run / "checkpoints" / "step_000001" / WEIGHTS_FILE).is_file()
    assert (run / "report_rank1.json").is_file()


_NON_PERSISTENT_BUFFER_JOB = """
import torch, torch.distributed as dist, torch.nn as nn
from gpt2.train import fsdp
from gpt2.train.precision import resolve_precision
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
model = nn.Sequential(nn.Linear(4, 4))
model.register_buffer("mask", torch.arange(4.0), persistent=False)
twin = fsdp.empty_twin(model)
fsdp.shard_model(model, torch.device("cpu"), resolve_precision("fp32", "cpu"))
whole = fsdp.gather_into_twin(model, twin, True)
assert torch.equal(whole.mask, torch.arange(4.0)), whole.mask
dist.destroy_process_group()
print("ok")
"""


def test_the_whole_model_keeps_a_non_persistent_buffer(tmp_path):
    # no state dict holds it: the sharded model's own (unsharded) copy is taken
    code = _NON_PERSISTENT_BUFFER_JOB.format(store=tmp_path / "store")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]

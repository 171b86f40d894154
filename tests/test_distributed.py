"""DDP: torchrun environment parsing, helpers, and 2 gloo processes == 1 process."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import dist_job

from gpt2.model.checkpoint_files import load_weights
from gpt2.train import distributed


def test_env_from_environ_reads_torchrun_variables():
    env = distributed.env_from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})
    assert (env.rank, env.local_rank, env.world_size) == (3, 1, 4)
    assert env.is_distributed and not env.is_main
    single = distributed.env_from_environ({})
    assert (single.rank, single.world_size) == (0, 1) and single.is_main and not single.is_distributed


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK < WORLD_SIZE"),
        ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK='zero' is not an integer"),
        ({"WORLD_SIZE": "0"}, "inconsistent"),
    ],
)
def test_env_from_environ_rejects_inconsistent_values(environ, match):
    with pytest.raises(ValueError, match=match):
        distributed.env_from_environ(environ)


def test_single_process_helpers_are_no_ops():
    env = distributed.DistributedEnv()
    assert distributed.init_process_group(env, torch.device("cpu")) is False  # nothing to join
    t = torch.tensor([1.0, 3.0])
    assert distributed.all_reduce_mean(t) is t and t.tolist() == [1.0, 3.0]
    # no_sync only means something for a DDP module
    with distributed.no_sync(nn.Linear(2, 2), skip_sync=True):
        pass
    assert distributed.resolve_device("auto", env).type == ("cuda" if torch.cuda.is_available() else "cpu")
    for device in ("gpu0", ""):
        with pytest.raises(ValueError, match="unknown device"):
            distributed.resolve_device(device, env)
    assert distributed.all_reduce_int(5, "sum") == 5


@pytest.mark.slow
@pytest.mark.dist
def test_two_gloo_processes_match_one_process(tmp_path, dist_run):
    """Same global batch (128 tokens/step): 2 ranks x 2 micro-steps vs 1 rank x 4 micro-steps."""
    ranks = dist_run.reports("train")
    ddp_dir, single_dir = dist_run.out / "train", tmp_path / "single"
    single = dist_job("train", single_dir)
    assert [r["world_size"] for r in ranks] == [2, 2] and single["world_size"] == 1
    assert [r["grad_accum_steps"] for r in ranks] == [2, 2] and single["grad_accum_steps"] == 4

    # Every rank logs the loss averaged over all ranks: identical on both.
    assert ranks[0]["losses"] == ranks[1]["losses"]
    # Summation order differs (all-reduce vs local accumulation): equal up to float rounding.
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(ranks[0][key]), torch.tensor(single[key]), rtol=1e-5, atol=1e-6)
    vals = [(a, b) for a, b in zip(ranks[0]["val_losses"], single["val_losses"]) if a is not None or b is not None]
    assert len(vals) == 2 and all(a is not None and b is not None for a, b in vals)
    torch.testing.assert_close(torch.tensor(vals)[:, 0], torch.tensor(vals)[:, 1], rtol=1e-5, atol=1e-6)

    # Only rank 0 wrote the run's files: one metrics line per step, and the same final weights.
    assert len((ddp_dir / "metrics.jsonl").read_text().splitlines()) == len(single["losses"])
    ddp_weights, _ = load_weights(ddp_dir / "checkpoints" / "step_000004" / "model.safetensors")
    single_weights, _ = load_weights(single_dir / "checkpoints" / "step_000004" / "model.safetensors")
    assert ddp_weights.keys() == single_weights.keys()
    for name in ddp_weights:
        torch.testing.assert_close(ddp_weights[name], single_weights[name], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.dist
def test_two_gloo_processes_with_activation_checkpointing_match_without(dist_run):
    """The ``train`` job with the blocks recomputed in the backward: the same losses, gradient norms and
    validation losses as without, on both ranks.
    """
    plain, checkpointed = dist_run.reports("train"), dist_run.reports("activation_checkpointing")
    for rank in (0, 1):
        # no validation at some steps: None, as nan
        for key in ("losses", "grad_norms", "val_losses"):
            got, want = ([float("nan") if v is None else v for v in r[rank][key]] for r in (checkpointed, plain))
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6, equal_nan=True)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("pack", [False, True])
def test_two_gloo_processes_match_one_process_on_uneven_instruction_rows(tmp_path, dist_run, pack):
    """Token-exact loss across ranks: the 2 ranks' micro-batches hold different numbers of
    response tokens, yet the loss, gradient norm and weights are those of one process.
    """
    ranks = [r[f"pack={pack}"] for r in dist_run.reports("instruct")]
    single = dist_job("instruct", tmp_path)[f"pack={pack}"]
    assert ranks[0]["scored_tokens"] == ranks[1]["scored_tokens"] == single["scored_tokens"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(ranks[0][key]), torch.tensor(single[key]), rtol=1e-5, atol=1e-6)
    for rank in ranks:
        for name, values in single["weights"].items():
            torch.testing.assert_close(torch.tensor(rank["weights"][name]), torch.tensor(values), rtol=1e-4, atol=1e-6)


def test_a_torch_without_distributed_is_named_when_world_size_is_above_one(monkeypatch):
    monkeypatch.setattr(distributed.dist, "is_available", lambda: False)
    env = distributed.env_from_environ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(RuntimeError, match="this PyTorch build has no torch.distributed support"):
        distributed.init_process_group(env, torch.device("cpu"))

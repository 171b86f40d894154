"""micro_batch_size="auto" (gpt2.train.batch_finder): which sizes are tried and in which order, agreement between
processes, out-of-memory errors (a faked CUDA one; the CPU's address-space limit for real, in a subprocess so that a
failure cannot take the test process down), the Trainer's resume, and the command line.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn

from gpt2 import GPT
from gpt2.cli import main
from gpt2.data import TokenLoader
from gpt2.train.batch_finder import (
    MAX_AUTO_SEQUENCES,
    Trial,
    candidate_sizes,
    describe,
    is_out_of_memory,
    search,
    sizes_the_data_holds,
    trials_on,
)
from gpt2.train.config import TrainConfig, grad_accum_steps
from gpt2.train.distributed import DistributedEnv
from gpt2.train.trainer import Trainer


def _config(**overrides) -> TrainConfig:
    base = dict(micro_batch_size="auto", seq_len=16, max_steps=4, out_dir=None, progress=False, eval_interval=0)
    return TrainConfig(**{**base, **overrides})


def _fits_below(threshold: int):
    """A trial function: sizes up to ``threshold`` fit; it records what it was asked."""
    asked: list[int] = []

    def fits(size: int) -> bool:
        asked.append(size)
        return size <= threshold

    fits.asked = asked
    return fits


# --------------------------------------------------------------------------- the search itself
def test_the_sizes_divide_the_batch_or_are_powers_of_two():
    assert candidate_sizes(12) == [1, 2, 3, 4, 6, 12]
    assert candidate_sizes(1) == [1]
    assert candidate_sizes(7) == [1, 7]
    assert candidate_sizes(None) == [2**k for k in range(11)] and candidate_sizes(None)[-1] == MAX_AUTO_SEQUENCES
    assert candidate_sizes(None, cap=100) == [1, 2, 4, 8, 16, 32, 64]


def test_doubling_then_backing_off():
    fits = _fits_below(40)
    size, trials = search(candidate_sizes(None), fits)
    assert size == 32 and fits.asked == [1, 2, 4, 8, 16, 32, 64]
    # Divisors of 48: after 16 fails, the gap between 8 and 16 is halved: 12 fits.
    fits = _fits_below(13)
    size, trials = search(candidate_sizes(48), fits)
    assert size == 12 and fits.asked == [1, 2, 4, 8, 16, 12]
    assert describe(trials) == "1, 2, 4, 8, 16 out of memory, 12"
    # Everything fits: the largest size, which keeps total_batch_size with no accumulation.
    fits = _fits_below(10**6)
    assert search(candidate_sizes(24), fits)[0] == 24 and fits.asked == [1, 2, 4, 8, 24]
    # Nothing fits: one trial.
    assert search(candidate_sizes(24), _fits_below(0)) == (None, [Trial(1, False)])


@pytest.mark.parametrize("per_process", [None, 1, 6, 24, 36, 97, 128, 360, 1000])
def test_the_search_finds_the_largest_size_that_fits_in_few_trials(per_process):
    sizes = candidate_sizes(per_process)
    for threshold in range(0, sizes[-1] + 2):
        fits = _fits_below(threshold)
        size, trials = search(sizes, fits)
        fitting = [s for s in sizes if s <= threshold]
        assert size == (fitting[-1] if fitting else None), threshold
        # each size at most once: log2(largest) doublings at most, then log2(len(sizes)) bisections at most
        assert len(set(fits.asked)) == len(fits.asked) <= sizes[-1].bit_length() + len(sizes).bit_length()
        assert [t.size for t in trials] == fits.asked


def test_every_process_ends_on_the_size_that_fits_on_all_of_them():
    """Two 'processes' (threads) with different memory search in lock step; the agreement is all_reduce MIN."""
    barrier, answers = threading.Barrier(2), [None, None]
    seen: list[list[int]] = [[], []]

    def all_reduce_min(rank: int, fitted: bool) -> bool:
        answers[rank] = fitted
        barrier.wait()
        agreed = min(answers)
        barrier.wait()
        return bool(agreed)

    results: list = [None, None]

    def rank_main(rank: int, threshold: int) -> None:
        fits = _fits_below(threshold)
        results[rank] = search(candidate_sizes(96), fits, lambda fitted: all_reduce_min(rank, fitted))
        seen[rank] = fits.asked

    threads = [threading.Thread(target=rank_main, args=(r, t)) for r, t in ((0, 40), (1, 13))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results[0] == results[1] and results[0][0] == 12
    assert seen[0] == seen[1]


WORKER = """
import os, sys
import torch.distributed as dist
from gpt2.train import distributed
from gpt2.train.batch_finder import candidate_sizes, search
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
threshold = (40, 13)[rank]
agree = lambda fitted: bool(distributed.all_reduce_int(int(fitted), "min"))
size, trials = search(candidate_sizes(96), lambda s: s <= threshold, agree)
print(size, distributed.all_reduce_int(10 + rank, "min"))
dist.destroy_process_group()
"""


def test_all_reduce_min_over_two_gloo_processes(tmp_path):
    store = tmp_path / "store"
    workers = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(store)], stdout=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    outputs = [w.communicate(timeout=120)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0]
    assert [o.split() for o in outputs] == [["12", "10"], ["12", "10"]]


# --------------------------------------------------------------------------- out of memory
def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    cpu = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 64"
    assert is_out_of_memory(RuntimeError(cpu))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))


class _OutOfMemoryAbove(nn.Module):
    """A model whose forward raises CUDA's out-of-memory error for more than ``threshold`` sequences."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold, self.weight = threshold, nn.Parameter(torch.ones(4))
        self.sizes: list[int] = []

    def forward(self, x, y):
        self.sizes.append(x.size(0))
        if x.size(0) > self.threshold:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return None, (self.weight.sum() * x.float().mean())


def test_a_cuda_out_of_memory_error_is_caught_and_backed_off():
    model = _OutOfMemoryAbove(threshold=20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with trials_on(model, optimizer, _no_autocast, torch.device("cpu"), 8) as fits:
        assert fits is not None
        size, trials = search(candidate_sizes(None), fits)
    assert size == 16 and describe(trials) == "1, 2, 4, 8, 16, 32 out of memory"
    # the warm-up (1 sequence of a few tokens), then the trials
    assert model.sizes == [1, 1, 2, 4, 8, 16, 32]
    # nothing left behind: no gradient, no optimizer state, the weights and the learning rate as they were
    assert model.weight.grad is None and not optimizer.state and torch.equal(model.weight, torch.ones(4))
    assert optimizer.param_groups[0]["lr"] == 1e-3


def test_another_error_in_a_trial_is_raised():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(1))

        def forward(self, x, y):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    model = Broken()
    trials = trials_on(model, torch.optim.AdamW(model.parameters()), _no_autocast, torch.device("cpu"), 4)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with trials:
            pass


def _no_autocast():
    return torch.autocast("cpu", enabled=False)


# --------------------------------------------------------------------------- the CPU's memory limit, for real
# Each scenario: GiB above what the process holds when it starts, and total_batch_size (0: None).
# "none left": 100 MiB below what it holds (10 MiB was within what the allocator may hand back meanwhile).
SCENARIOS = {"plenty": (4.0, 8 * 64), "tight": (0.06, 0), "none left": (-0.1, 8 * 64)}
LIMITED = """
import json, logging, math, resource, sys, torch
from gpt2 import GPT, GPTConfig
from gpt2.train.batch_finder import GIB, NoMicroBatchFitsError, memory_now
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
# enough for 1024 sequences of 64 tokens: memory, not the data, limits the size
tokens = torch.randint(0, 128, (1024 * 64 + 1,), generator=torch.Generator().manual_seed(1))
for name, (extra, total) in json.loads(sys.argv[1]).items():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=32))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    config = TrainConfig(micro_batch_size="auto", seq_len=64, total_batch_size=total or None, max_steps=1,
                         memory_limit_gb=memory_now()[1] / GIB + extra, device="cpu", precision="fp32",
                         out_dir=None, progress=False, eval_interval=0, seed=7)
    limit = resource.getrlimit(resource.RLIMIT_AS)
    # the Trainer seeds torch with config.seed before the search, which must leave that state alone
    rng = torch.manual_seed(7).get_state()
    print("SCENARIO", name, flush=True)
    try:
        trainer = Trainer(model, config, tokens, sinks=[])
    except NoMicroBatchFitsError as e:
        print(json.dumps({"error": str(e), "limit_restored": resource.getrlimit(resource.RLIMIT_AS) == limit}))
        continue
    print(json.dumps({
        "size": trainer.config.micro_batch_size,
        "accumulation": trainer.grad_accum_steps,
        "limit_restored": resource.getrlimit(resource.RLIMIT_AS) == limit,
        "weights_kept": all(torch.equal(weights[k], v) for k, v in model.state_dict().items()),
        "no_grads": all(p.grad is None for p in model.parameters()),
        "no_optimizer_state": not trainer.optimizer.state,
        "rng_kept": torch.equal(torch.get_rng_state(), rng),
        "finite_loss": math.isfinite(trainer.fit()[0]["loss"]),
    }), flush=True)
"""
# What the search must leave as a run with a number given would have it.
LEFT_AS_IT_WAS = ("limit_restored", "weights_kept", "no_grads", "no_optimizer_state", "rng_kept", "finite_loss")


@pytest.fixture(scope="module")
def limited() -> dict[str, tuple[dict, str]]:
    """Each scenario's result and log lines: the Trainer with micro_batch_size="auto" under a CPU memory limit, all
    in one subprocess (the search lowers its address-space limit: a failure cannot take the tests down).
    """
    done = subprocess.run(
        [sys.executable, "-c", LIMITED, json.dumps(SCENARIOS)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = {}
    for part in done.stdout.split("SCENARIO ")[1:]:
        name, *lines, result = part.strip().splitlines()
        results[name] = (json.loads(result), "\n".join(lines))
    return results


def test_cpu_memory_limit_plenty_takes_the_whole_per_process_batch(limited):
    result, log = limited["plenty"]
    assert result["size"] == 8 and result["accumulation"] == 1, log
    assert "micro-batch size auto: 8 sequences of 64 tokens fit in" in log and "(tried 1, 2, 4, 8)" in log
    assert {k: result[k] for k in LEFT_AS_IT_WAS} == dict.fromkeys(LEFT_AS_IT_WAS, True)


def test_cpu_memory_limit_backs_off_and_leaves_the_run_as_it_was(limited):
    """1024 sequences of 64 tokens take far more than 60 MiB above what the process holds; a smaller size fits."""
    result, log = limited["tight"]
    assert 1 <= result["size"] < 1024 and result["accumulation"] == 1, log
    assert "out of memory" in log and f"micro-batch size auto: {result['size']} sequences of 64 tokens" in log
    assert {k: result[k] for k in LEFT_AS_IT_WAS} == dict.fromkeys(LEFT_AS_IT_WAS, True)


def test_cpu_memory_limit_below_what_the_process_holds(limited):
    result, log = limited["none left"]
    assert result["limit_restored"], log
    assert "error" in result, (result, log)
    # nothing fits: not the model's gradients and optimizer state, or not one sequence besides them
    assert "fit" in result["error"] and "in TrainConfig.memory_limit_gb=" in result["error"], result["error"]


# --------------------------------------------------------------------------- configuration and the Trainer
def test_the_sizes_leave_one_step_in_the_data():
    env = DistributedEnv()
    train, val = torch.zeros(1000, dtype=torch.long), torch.zeros(300, dtype=torch.long)
    # 999 shifted tokens hold 62 sequences of 16; 299 hold 18
    assert sizes_the_data_holds(candidate_sizes(None), [("train", train)], 16, env) == [1, 2, 4, 8, 16, 32]
    assert sizes_the_data_holds(candidate_sizes(None), [("train", train), ("val", val)], 16, env)[-1] == 16
    assert sizes_the_data_holds(candidate_sizes(48), [("train", train), ("val", None)], 16, env)[-1] == 48
    # two processes read twice the tokens per step
    assert sizes_the_data_holds(candidate_sizes(None), [("train", train)], 16, DistributedEnv(0, 0, 2))[-1] == 16
    with pytest.raises(ValueError, match="one step needs 1025"):
        sizes_the_data_holds(candidate_sizes(None), [("train", train)], 1024, env)
    loader = TokenLoader(train, 2, 16)
    with pytest.raises(ValueError, match="micro_batch_size='auto' chooses the batch size, so the Trainer builds"):
        sizes_the_data_holds(candidate_sizes(None), [("train", loader)], 16, env)


@pytest.mark.parametrize("bad", ["big", 0, -1, 2.5, True, "4", None])
def test_bad_micro_batch_sizes_are_one_line_errors(bad):
    with pytest.raises(ValueError, match=r"^TrainConfig\.micro_batch_size must be a positive integer or 'auto', got"):
        _config(micro_batch_size=bad)


def test_auto_is_checked_against_total_batch_size_and_has_no_accumulation_yet():
    config = _config(total_batch_size=16 * 6)
    assert config.micro_batch_size == "auto" and config.to_dict()["micro_batch_size"] == "auto"
    with pytest.raises(ValueError, match="no accumulation steps until the Trainer has found the size"):
        grad_accum_steps(config, world_size=1)
    with pytest.raises(ValueError, match=r"total_batch_size=100 tokens is not divisible by seq_len x world_size"):
        _config(total_batch_size=100)


def test_auto_on_a_cpu_needs_a_memory_limit(tiny_config):
    with pytest.raises(ValueError, match=r"needs memory_limit_gb \(--memory-limit-gb GiB"):
        Trainer(GPT(tiny_config), _config(device="cpu"), torch.zeros(1024, dtype=torch.long), sinks=[])


def test_a_resumed_run_takes_the_size_its_checkpoint_recorded(tiny_config, tmp_path, caplog):
    """No search (so no memory_limit_gb needed) and the same data order: the losses of an uninterrupted run."""
    tokens = torch.randint(0, 128, (4096,), generator=torch.Generator().manual_seed(1))
    common = dict(seq_len=16, total_batch_size=16 * 8, max_steps=4, device="cpu", checkpoint_interval=2, plot=False)

    def model() -> GPT:
        torch.manual_seed(0)
        return GPT(tiny_config)

    full = Trainer(model(), _config(micro_batch_size=4, out_dir=str(tmp_path / "full"), **common), tokens, sinks=[])
    expected = [r["loss"] for r in full.fit()]
    full.close()
    cut = tmp_path / "cut"
    first = Trainer(model(), _config(micro_batch_size=4, out_dir=str(cut), **common), tokens, sinks=[])
    first.fit(until_step=2)
    first.close()
    with caplog.at_level(logging.INFO, logger="gpt2"):
        resumed = Trainer(model(), _config(out_dir=str(cut), resume="auto", **common), tokens, sinks=[])
    assert resumed.config.micro_batch_size == 4 and resumed.grad_accum_steps == 2 and resumed.step == 2
    assert "micro-batch size auto: 4 sequences of 16 tokens as recorded in" in caplog.text
    assert [r["loss"] for r in resumed.fit()] == expected[2:]
    resumed.close()


# --------------------------------------------------------------------------- the command line
def test_cli_auto_prints_the_size_it_chose(shakespeare_file, tmp_path):
    """In a subprocess: the search lowers the process's address-space limit for a moment."""
    argv = [
        *("train", "--data", shakespeare_file, "--model", "tiny", "--seq-len", "32", "--device", "cpu"),
        *("--micro-batch-size", "auto", "--memory-limit-gb", "8", "--total-batch-size", str(16 * 32)),
        *("--max-steps", "1", "--eval-steps", "1", "--final-eval-batches", "1", "--num-samples", "0"),
        *("--no-progress", "--no-plot", "--out-dir", tmp_path / "run"),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "gpt2", *map(str, argv)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "micro-batch size auto: 16 sequences of 32 tokens fit in 8 GiB (memory_limit_gb) (tried 1, 2, 4, 8, 16); "
        "accumulation 1 micro-step per step"
    ) in done.stdout
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["config"]["micro_batch_size"] == 16


def test_cli_refuses_auto_on_a_cpu_without_a_limit(shakespeare_file, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--data", shakespeare_file, "--model", "tiny", "--seq-len", "32", "--device", "cpu"]
    code = main([*map(str, argv), "--micro-batch-size", "auto", "--no-progress", "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--memory-limit-gb" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize(
    "value,words",
    [
        ("big", "--micro-batch-size: expected an integer or auto, got 'big'"),
        ("0", "TrainConfig.micro_batch_size must be a positive integer or 'auto', got 0"),
        ("-1", "TrainConfig.micro_batch_size must be a positive integer or 'auto', got -1"),
    ],
)
def test_cli_bad_micro_batch_sizes_are_one_line(capsys, tmp_path, value, words):
    code = main(["train", "--micro-batch-size", value, "--device", "cpu", "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    config = tmp_path / "options.yaml"
    config.write_text(f"micro_batch_size: {value}\n")
    code = main(["train", "--config", str(config), "--device", "cpu", "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and value in err and len(err.strip().splitlines()) == 1, err


def test_auto_in_a_config_file_and_print_config(capsys, tmp_path):
    config = tmp_path / "options.yaml"
    config.write_text("micro_batch_size: auto\nmemory_limit_gb: 2.5\n")
    assert main(["train", "--config", str(config), "--device", "cpu", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "micro_batch_size: auto" in out and "memory_limit_gb: 2.5" in out


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_trials_on_a_real_model_move_no_weight(tiny_config, optimizer):
    """The optimizer step that allocates the state (learning rate 0, zero gradients) leaves every weight as it was."""
    from gpt2.train.optim import build_optimizer

    torch.manual_seed(0)
    model = GPT(tiny_config)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer, max_lr=1e-2, weight_decay=0.5, out_dir=None))
    lrs = [group["lr"] for group in opt.param_groups]
    with trials_on(model, opt, _no_autocast, torch.device("cpu"), 16) as fits:
        assert fits is not None and len(opt.state) == sum(len(g["params"]) for g in opt.param_groups)
        assert fits(2) and fits(4)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert [group["lr"] for group in opt.param_groups] == lrs


def test_finetune_refuses_auto_with_instruction_rows(capsys, tmp_path):
    argv = ["finetune", "--init", "gpt2", "--data", "examples/data/instructions.jsonl", "--micro-batch-size", "auto"]
    code = main([*argv, "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "with instruction rows (.jsonl) give a number" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_memory_limit_gb_on_a_gpu_is_named_as_ignored(caplog):
    from gpt2.train.batch_finder import _limit_bytes

    config = TrainConfig(micro_batch_size="auto", memory_limit_gb=4.0, device="cpu", out_dir=None)
    with caplog.at_level(logging.WARNING, logger="gpt2.train.batch_finder"):
        assert _limit_bytes(config, torch.device("cuda")) is None
    assert "memory_limit_gb applies on a CPU; on cuda its own memory is the limit" in caplog.text

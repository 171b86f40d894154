"""Shared test set-up: offline data from ../shared/data, no network, tiny configs."""

from __future__ import annotations

import collections
import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("GPT2_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))

# Never touch the network from tests: the Hugging Face hub and the tokenizer read local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# tiktoken's own `gpt2` encoding is the tests' independent reference for the tokenizer.
if (SHARED_DATA / "tiktoken-cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED_DATA / "tiktoken-cache"))
if (SHARED_DATA / "gpt2-tokenizer").is_dir():
    os.environ.setdefault("GPT2_TOKENIZER_DIR", str(SHARED_DATA / "gpt2-tokenizer"))
if (SHARED_DATA / "tinyshakespeare.txt").is_file():
    os.environ.setdefault("GPT2_TINY_SHAKESPEARE", str(SHARED_DATA / "tinyshakespeare.txt"))

# Under pytest-xdist (test.sh runs one worker per core) every worker and every process a test starts
# gets one intra-op thread: a second one per process would only oversubscribe the shared cores.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    THREADS = 1
else:
    THREADS = max(1, min(2, os.cpu_count() or 1))
torch.set_num_threads(THREADS)

# A shell without job control starts a background job (`bash test.sh &` in a script) with SIGINT and
# SIGQUIT ignored, and the runs the stop-signal tests start would inherit that: they would not stop
# on Ctrl-C. The tests expect what a terminal gives.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, test.sh hands the workers whole files in collection order
    (--dist loadfile --no-loadscope-reorder): the files with the most slow or multi-process tests
    first, so that none of the long ones starts last while the other workers sit idle. Within a
    file, and among files of equal weight, the order stays.
    """
    if not XDIST_WORKER:
        return
    weight = collections.Counter(
        item.path for item in items if any(item.iter_markers("slow")) or any(item.iter_markers("dist"))
    )
    items.sort(key=lambda item: -weight[item.path])


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def shakespeare_slice(tmp_path_factory) -> Path | None:
    """The first 64 KB of Tiny Shakespeare (~16k tokens, a 17th of the file): plenty for the few
    steps of the CLI and example runs, and a 17th of the tokenising per run.
    """
    full = os.environ.get("GPT2_TINY_SHAKESPEARE")
    if not full or not Path(full).is_file():
        return None
    path = tmp_path_factory.mktemp("shakespeare") / "tinyshakespeare.txt"
    path.write_text(Path(full).read_text(encoding="utf-8")[:65536], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def shakespeare_file(shakespeare_slice) -> Path:
    """The slice as a text file for `--data`; skips where the offline data is missing."""
    if shakespeare_slice is None or not os.environ.get("GPT2_TOKENIZER_DIR"):
        pytest.skip("the offline data in ../shared/data is needed")
    return shakespeare_slice


@pytest.fixture(scope="module")
def small_shakespeare(shakespeare_slice):
    """Point $GPT2_TINY_SHAKESPEARE (the `shakespeare` data source) at the slice for one test
    module (not globally: tests/test_data.py checks the real file).
    """
    if shakespeare_slice is None:
        yield None
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPT2_TINY_SHAKESPEARE", str(shakespeare_slice))
        yield shakespeare_slice


@pytest.fixture
def tiny_config():
    """A 2-layer, 32-wide GPT over a 128-token vocabulary: fast on a 2-core CPU."""
    from gpt2 import GPTConfig

    return GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture
def all_threads():
    """For the few tests on 124M shapes: every intra-op thread the process has (see _one_thread;
    one under xdist, where the other workers use the other cores).
    """


@pytest.fixture(autouse=True)
def _one_thread(request):
    """Tiny models: a second intra-op thread costs more in synchronisation than it saves, and far
    more when other processes share the cores (a parallel region waits for a descheduled
    thread). Only tests that ask for `all_threads` (124M shapes) keep them all.
    """
    threads = torch.get_num_threads()
    if "all_threads" not in request.fixturenames:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[True, False], ids=["native-bf16", "emulated-bf16"])
def native_bf16(request, monkeypatch) -> bool:
    """This CPU as one that multiplies bf16 natively, then as one that does not ($GPT2_CPU_NATIVE_BF16, which
    gpt2.torch_compat.cpu_native_bf16 reads): a test that takes it runs under both answers on any machine.
    """
    monkeypatch.setenv("GPT2_CPU_NATIVE_BF16", str(int(request.param)))
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def signal_after_step(monkeypatch, step: int, signum: int) -> None:
    """Every Trainer in this process gets signal ``signum`` once its step ``step`` is done, as from
    another process but at a known point: a run in this process stands in for one started in a new
    interpreter (seconds of start-up each) where only the signal's handling is under test.
    """
    from gpt2.train.trainer import Trainer

    train_step = Trainer.train_step

    def then_signal(self):
        record = train_step(self)
        if self.step == step:
            signal.raise_signal(signum)
        return record

    monkeypatch.setattr(Trainer, "train_step", then_signal)


def forked(target, *args) -> multiprocessing.Process:
    """``target(*args)`` started in a forked child of this process: another process (its own pid,
    locks and signals) with this one's modules already imported, so no interpreter start-up
    (seconds with torch). ``join()`` it, then ``exitcode``: 0, 1 after an exception, -N after
    signal N.
    """
    process = multiprocessing.get_context("fork").Process(target=target, args=args, daemon=True)
    process.start()
    return process


@pytest.fixture
def keep_sigint():
    """A stopped command-line run ignores Ctrl-C from then on (the process is about to exit): the
    test process gets its own handler back.
    """
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


# --------------------------------------------------------------------------- one torchrun launch
class DistRun:
    """The reports of tests/_dist_worker.py's jobs from one 2-process torchrun launch."""

    def __init__(self, out: Path, proc):
        self.out, self.proc = out, proc

    def reports(self, job: str) -> list[dict]:
        assert self.proc.returncode == 0, f"torchrun failed:\n{self.proc.stdout[-3000:]}\n{self.proc.stderr[-3000:]}"
        reports = [json.loads((self.out / job / f"report_rank{r}.json").read_text()) for r in (0, 1)]
        for report in reports:
            assert "error" not in report, f"job {job!r} failed on rank {report['rank']}:\n{report['error']}"
        return reports


def session_root(tmp_path_factory) -> Path:
    """A folder shared by every pytest-xdist worker of this session (the session's own basetemp
    without xdist): what one worker makes there, the others find.
    """
    root = tmp_path_factory.getbasetemp()
    if XDIST_WORKER:
        root = root.parent
    return root


@pytest.fixture(scope="session")
def dist_run(tmp_path_factory) -> DistRun:
    """All library-level DDP jobs (tests/_dist_worker.py) in ONE torchrun launch of 2 gloo
    processes: interpreter start-up and rendezvous cost more than the jobs themselves. Under
    pytest-xdist the first worker that needs it launches it; the others wait for it and read it.
    """
    from filelock import FileLock

    root = session_root(tmp_path_factory)
    out, record = root / "dist", root / "dist" / "torchrun.json"
    with FileLock(str(root / "dist.lock")):
        if not record.is_file():
            proc = _launch_dist_worker(out)
            done = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            record.write_text(json.dumps(done))
    done = json.loads(record.read_text())
    return DistRun(out, subprocess.CompletedProcess(["torchrun"], **done))


def _launch_dist_worker(out: Path) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--standalone",
        str(Path(__file__).parent / "_dist_worker.py"),
        str(out),
    ]
    return subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def dist_job(name: str, out_dir: Path) -> dict:
    """Run one of tests/_dist_worker.py's jobs in this process (the one-process reference)."""
    spec = importlib.util.spec_from_file_location("_dist_worker", Path(__file__).parent / "_dist_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker.JOBS[name](str(out_dir))


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    """A randomly initialised transformers GPT-2 (real key names and Conv1D layout, tiny shapes)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """A finished 4-step tiny run with checkpoints at steps 2 and 4; tests damage copies (``run``)."""
    from _tiny_run import tiny_config as config
    from _tiny_run import tiny_model, tiny_tokens

    from gpt2.train.trainer import Trainer

    out = tmp_path_factory.mktemp("finished") / "run"
    with Trainer(tiny_model(), config(out), tiny_tokens(), sinks=[]) as trainer:
        trainer.fit()
    return out


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    """A copy of ``finished_run`` of this test's own."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out

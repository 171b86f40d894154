"""Every shell command the docs show runs.

The ```bash / ```sh / ```console blocks of README.md and the guides run in order, in a work folder
laid out like the repository root (`examples/`, `scripts/` and `../shared/data` resolve as in a
checkout), as in a shell with the project's environment activated (tests/_doc_commands.py says
how each is run). README.md, its Python snippet, the quickstart, the LoRA guide and the deploy
guide share ONE folder and run in that order, as a newcomer follows them: each later command
meets the runs the earlier ones left behind. The other guides run in folders of their own.

The tables below list each document's commands in order, and for each what the test does:
`Run` it as printed with the flags in `shrink` replaced (a tiny model, a few steps) and those
in `append` added; `Instead` runs another command in its place; `Skip` says why it is not run.
Each replaced text must be in the command and each appended flag must not, and a table must
list exactly its document's commands: a doc edit that breaks a command, or adds one, breaks
this test.

Offline stand-ins, set up once: the hub id `gpt2` is a tiny random GPT-2 (2 layers, 32 wide,
GPT-2's vocabulary) in a temporary Hugging Face cache; `my_text.txt`, `my_corpus.txt` and
`corpus/` are the first 64 KB of Tiny Shakespeare (the `shakespeare` data source too), and
`my_instructions.jsonl` is examples/data/instructions.jsonl.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub.constants
import pytest
from _doc_commands import doc_commands, run_command
from conftest import SHARED_DATA
from test_readme import README_SHRINK, readme_blocks

from gpt2 import GPT, GPTConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    """Run the command that starts with `starts`, shrunk: each `shrink` text replaced, `append` added."""

    starts: str
    shrink: dict[str, str] = field(default_factory=dict)
    append: str = ""
    expect: str = ""
    """text its output must hold"""
    creates: tuple[str, ...] = ()
    """paths it must leave behind"""
    marks: tuple[str, ...] = ()
    """pytest marks of its test"""


@dataclass(frozen=True)
class Instead:
    """Run `command` in place of the one that starts with `starts`."""

    starts: str
    command: str
    why: str


@dataclass(frozen=True)
class Snippet:
    """Run the README's Python block under the heading `heading`, shrunk: each `shrink` text replaced."""

    heading: str
    shrink: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Skip:
    """Do not run the command that starts with `starts`, for the reason `why`."""

    starts: str
    why: str


# The model of `gpt2 train`: 2 layers, 32 wide, 32-token sequences, 2 per batch.
TINY = "--model tiny --seq-len 32 --micro-batch-size 2"
# The two "nodes" of docs/distributed.md must run at the same time: tests/test_fsdp.py runs them so.
TWO_NODES = "the two lines run together: tests/test_fsdp.py::test_two_node_launch_of_the_docs"
# After the few steps of a run: one validation batch, 4 sampled tokens, no plot (matplotlib) and no bars.
QUIET = "--warmup-steps 1 --eval-interval 0 --final-eval-batches 1 --max-new-tokens 4 --no-plot --no-progress"
TINY_RUN = f"gpt2 train {TINY} --max-steps 2 {QUIET}"
# `bash run.sh` as a newcomer's guides meet it: its run in runs/shakespeare, continued (or re-reported) when
# run again as run.sh does with no arguments; a 64-token context, as the instruction rows of the LoRA guide need.
RUN_SH_TINY = f"{TINY_RUN} --block-size 64 --out-dir runs/shakespeare --resume auto"
# `gpt2 bench`: one timed step of a tiny model.
BENCH = "--model tiny --steps 1 --warmup 0 --repeats 1 --batch-size 2 --seq-len 16"
# The instruction-tuning commands of the LoRA guide, on two micro-batches of two rows.
FINETUNE_SHRINK = {"--micro-batch-size 8": "--micro-batch-size 2", "--max-steps 150": "--max-steps 2"}

RUN_SH = (
    "run.sh itself is run by tests/test_first_run.py (its training and the commands it prints) and "
    "tests/test_readme.py (its arguments); here a tiny run stands in for the runs/shakespeare it makes"
)
TEST_SH = "test.sh runs the test suite, this file included"
LLAMA_CLI = "needs llama.cpp's llama-cli; tests/test_gguf.py runs such a file in llama-cpp-python where it is installed"

TABLES: dict[str, list[Run | Instead | Skip]] = {
    "README.md": [
        Instead("bash run.sh", RUN_SH_TINY, RUN_SH),
        Skip("bash test.sh", TEST_SH),
        Snippet("gpt2 in ten lines", shrink=README_SHRINK),
    ],
    "docs/quickstart.md": [
        Instead("bash run.sh", RUN_SH_TINY, RUN_SH),
        Skip("bash test.sh", TEST_SH),
        Run("python scripts/seed_cache.py ../shared/data", expect="cached", creates=("cache/tinyshakespeare.txt",)),
        Run(
            "python examples/sample.py --model runs/shakespeare",
            shrink={"-n 3": "-n 1"},
            append="--max-new-tokens 4",
            expect="ROMEO:",
        ),
        Run(
            "python examples/pretrain_shakespeare.py --max-steps 1600 --out-dir runs/shakespeare-2",
            shrink={"--max-steps 1600": "--max-steps 2"},
            append=f"{TINY} {QUIET}",
            creates=("runs/shakespeare-2/checkpoints/step_000002",),
        ),
        Run(
            "python examples/pretrain_shakespeare.py --max-steps 1600 --out-dir runs/shakespeare-2 --resume auto",
            shrink={"--max-steps 1600": "--max-steps 3"},
            append=f"{TINY} {QUIET}",
            creates=("runs/shakespeare-2/checkpoints/step_000003",),
        ),
        Run(
            "python examples/pretrain_shakespeare.py --max-steps 600 --out-dir runs/shakespeare-3 --print-config",
            shrink={"--max-steps 600": f"--max-steps 2 {TINY} {QUIET}"},
            creates=("my_run.yaml",),
        ),
        Run(
            "python examples/pretrain_shakespeare.py --config my_run.yaml", creates=("runs/shakespeare-3/results.json",)
        ),
        Run(
            "python examples/finetune_lora.py --init gpt2 --data my_text.txt --precision bf16",
            append=f"--seq-len 32 --micro-batch-size 2 --max-steps 2 {QUIET}",
            creates=("runs/lora/adapter", "runs/lora/merged/model.safetensors", "runs/lora/peft/adapter_config.json"),
        ),
        Run("python examples/sample.py --model gpt2 --adapter runs/lora/adapter", append="--max-new-tokens 4"),
        Run("gpt2 eval --model runs/shakespeare --data shakespeare", append="--max-batches 2", expect="val loss"),
        Skip("gpt2 eval --model gpt2 --hellaswag auto", "needs the network: it downloads the HellaSwag validation set"),
        Skip("gpt2 eval --model gpt2 --data data/edu_fineweb10B", "needs the FineWeb-edu shards of prepare_fineweb.py"),
        Skip("python examples/prepare_fineweb.py", "needs the network and hours: it downloads FineWeb-edu sample-10BT"),
        Skip("torchrun --standalone --nproc_per_node 8 examples/train_gpt2_124m.py", "needs 8 GPUs and FineWeb-edu"),
        Run("python examples/benchmark.py", append=f"{BENCH} --rungs fp32", expect="| fp32 |"),
    ],
    "docs/lora.md": [
        # a 64-token context: the instruction rows need the finetune recipe's --seq-len 64
        Instead("bash run.sh", RUN_SH_TINY, RUN_SH),
        Run(
            "python examples/finetune_lora.py --init runs/shakespeare --data examples/data/instructions.jsonl --full",
            shrink=FINETUNE_SHRINK,
            append=QUIET,
            creates=("runs/instruct/checkpoints/step_000002",),
        ),
        Run("python -m gpt2 sample --model runs/instruct --instruction", append="--max-new-tokens 4"),
        Run(
            "python -m gpt2 finetune --init runs/shakespeare --data examples/data/instructions.jsonl",
            shrink=FINETUNE_SHRINK,
            append=QUIET,
            creates=("runs/instruct-lora/adapter",),
        ),
        Run(
            "python -m gpt2 sample --model runs/shakespeare --adapter runs/instruct-lora/adapter",
            append="--max-new-tokens 4",
        ),
        Run(
            "gpt2 finetune --init gpt2 --data my_instructions.jsonl --seq-len 512",
            shrink={"--seq-len 512": "--seq-len 64"},
            append=f"--micro-batch-size 2 --max-steps 2 {QUIET}",
            creates=("runs/gpt2-instruct/adapter",),
        ),
        Run("gpt2 sample --model gpt2 --adapter runs/gpt2-instruct/adapter", append="--max-new-tokens 4"),
        Run(
            "gpt2 finetune --init runs/shakespeare --data examples/data/instructions.jsonl",
            shrink=FINETUNE_SHRINK,
            append=QUIET,
            creates=("runs/instruct-dora/adapter",),
        ),
        Skip(
            "python examples/benchmark_lora.py --model gpt2",
            "needs a GPU: on a CPU, torch.compile and bf16 steps of the 124M shape take many minutes",
        ),
        Run(
            "python examples/benchmark_lora.py --model tiny --device cpu",
            shrink={"--steps 5": "--steps 1", "--repeats 3": "--repeats 1"},
            append="--batch-size 1 --seq-len 16 --warmup 0",
            expect="| peft |",
        ),
    ],
    "docs/deploy.md": [
        Run(
            "gpt2 finetune --init gpt2 --data my_instructions.jsonl --lora.use-dora",
            append=f"--micro-batch-size 2 --max-steps 2 {QUIET}",
            creates=("runs/chat/adapter",),
        ),
        Run("gpt2 sample --model gpt2 --adapter runs/chat/adapter", append="--max-new-tokens 4"),
        Run(
            "gpt2 export --model gpt2 --adapter runs/chat/adapter",
            creates=(
                "runs/chat/chat-q8_0.gguf",
                "runs/chat/hf/model.safetensors",
                "runs/chat/peft/adapter_config.json",
            ),
        ),
        Skip("llama-cli -m runs/chat/chat-q8_0.gguf", LLAMA_CLI),
    ],
    "docs/distributed.md": [
        Skip("torchrun --standalone --nproc_per_node 8 examples/train_gpt2_124m.py", "needs 8 GPUs and FineWeb-edu"),
        Run(
            "torchrun --standalone --nproc_per_node 2 examples/pretrain_shakespeare.py --model tiny --device cpu",
            append=f"--seq-len 32 --micro-batch-size 2 --max-steps 2 {QUIET}",
            creates=("runs/shakespeare/results.json",),
            # three Python processes (torchrun and two workers) and a gloo rendezvous: 20 s and more
            marks=("slow", "dist"),
        ),
        Run(
            "torchrun --standalone --nproc_per_node 2 -m gpt2 train --recipe shakespeare --model tiny --device cpu "
            "--strategy fsdp",
            shrink={"--max-steps 20": "--max-steps 2"},
            append=f"--seq-len 32 --micro-batch-size 2 {QUIET}",
            creates=("runs/fsdp/checkpoints/step_000002/shards/shard-00002-model-00001-of-00001.safetensors",),
            marks=("slow", "dist"),
        ),
        Skip("torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0", "needs two machines with 8 GPUs each"),
        Skip("torchrun --nnodes 2 --nproc_per_node 8 --node_rank 1", "needs two machines with 8 GPUs each"),
        Skip("torchrun --nnodes 2 --nproc_per_node 1 --node_rank 0", TWO_NODES),
        Skip("torchrun --nnodes 2 --nproc_per_node 1 --node_rank 1", TWO_NODES),
    ],
    "docs/training.md": [
        Skip("pip install 'gpt2-minlora[tensorboard]'", "needs the network; the test environment has the extras"),
        Run(
            "gpt2 train --recipe shakespeare --log-to tensorboard --out-dir runs/shk",
            append=f"{TINY} --max-steps 2 {QUIET}",
            creates=("runs/shk/tensorboard",),
        ),
        Skip(
            "tensorboard --logdir runs/shk/tensorboard",
            "a web server that runs until stopped; the line above made its folder",
        ),
        Run(
            "gpt2 train --data my_corpus.txt --out-dir runs/mine",
            append=f"{TINY} --max-steps 2 {QUIET}",
            creates=("runs/mine/results.json",),
        ),
        Run("gpt2 prepare --input corpus/ --out-dir data/mine --shard-size 10000000", creates=("data/mine",)),
        Run(
            "gpt2 train --data data/mine --model gpt2 --seq-len 1024 --micro-batch-size 16",
            shrink={
                "--model gpt2": "--model tiny",
                "--seq-len 1024": "--seq-len 32",
                "--micro-batch-size 16": "--micro-batch-size 2",
            },
            append=f"--max-steps 2 {QUIET}",
            creates=("runs/mine-124m/results.json",),
        ),
    ],
}


def apply(step: Run, text: str) -> str:
    """The command `text` shrunk as `step` says; each replacement must apply, no appended flag may be there."""
    for old, new in step.shrink.items():
        assert old in text, f"{old!r} is no longer in `{text}`: update the table"
        text = text.replace(old, new)
    words = shlex.split(text)
    for flag in shlex.split(step.append):
        assert not (flag.startswith("-") and flag in words), f"{flag} is in `{text}` already: shrink it instead"
    if not step.append:
        return text
    if " > " in text:
        command, _, target = text.partition(" > ")
        return f"{command} {step.append} > {target}"
    return f"{text} {step.append}"


@pytest.mark.parametrize("doc", TABLES)
def test_each_table_lists_its_documents_commands(doc):
    commands = doc_commands(REPO_ROOT / doc)
    table = [step for step in TABLES[doc] if not isinstance(step, Snippet)]
    for command, step in zip(commands, table):
        assert command.text.startswith(step.starts), f"{doc}:{command.line} `{command.text}` is not `{step.starts}...`"
        if isinstance(step, Run):
            apply(step, command.text)
    unlisted = [command.text for command in commands[len(table) :]]
    assert not unlisted, f"{doc}: commands the table does not list: {unlisted}"
    assert len(table) == len(commands), f"{doc}: the table lists {len(table) - len(commands)} commands too many"


@pytest.fixture(scope="session")
def fake_hub(tmp_path_factory) -> Path:
    """A Hugging Face cache in which the hub id `gpt2` is a tiny random GPT-2 with GPT-2's vocabulary."""
    cache = tmp_path_factory.mktemp("hf-hub")
    revision = "0" * 40
    repo = cache / "models--gpt2"
    GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=2, n_head=2, n_embd=32)).save_pretrained(
        repo / "snapshots" / revision
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return cache


class DocRun:
    """One document's commands, run in order in a work folder laid out like the repository root."""

    def __init__(self, doc: str, root: Path, shakespeare: Path):
        self.doc, self.commands, self.table = doc, doc_commands(REPO_ROOT / doc), TABLES[doc]
        self.folder = root / "repo"
        self.done = 0
        self.failure = ""
        if self.folder.exists():
            # a later document of the newcomer's path: the folder the earlier ones left
            return
        self.folder.mkdir()
        (root / "home").mkdir()
        (root / "shared").mkdir()
        (root / "shared" / "data").symlink_to(SHARED_DATA, target_is_directory=True)
        for name in ("examples", "scripts"):
            (self.folder / name).symlink_to(REPO_ROOT / name, target_is_directory=True)
        for name in ("my_text.txt", "my_corpus.txt", "corpus/part_1.txt"):
            (self.folder / name).parent.mkdir(exist_ok=True)
            shutil.copy(shakespeare, self.folder / name)
        shutil.copy(REPO_ROOT / "examples" / "data" / "instructions.jsonl", self.folder / "my_instructions.jsonl")

    def run_through(self, index: int) -> None:
        """Run the commands up to `index` not run yet (the later ones build on the earlier)."""
        while self.done <= index:
            if self.failure:
                pytest.fail(f"an earlier command failed: {self.failure}")
            self.failure = self._run(self.done)
            self.done += 1
        if self.failure and self.done == index + 1:
            pytest.fail(self.failure)

    def _run(self, index: int) -> str:
        step = self.table[index]
        if isinstance(step, Snippet):
            return _run_snippet(step)
        command = self.commands[index]
        if isinstance(step, Skip):
            return ""
        text = step.command if isinstance(step, Instead) else apply(step, command.text)
        code, output = run_command(text)
        where = f"{self.doc}:{command.line} `{text}`"
        if code != 0:
            return f"{where}: exit {code}\n{output[-3000:]}"
        if isinstance(step, Run):
            if step.expect not in output:
                return f"{where}: {step.expect!r} is not in its output\n{output[-3000:]}"
            missing = [path for path in step.creates if not (self.folder / path).exists()]
            if missing:
                return f"{where}: it made no {missing}\n{output[-3000:]}"
        return ""


def _run_snippet(step: Snippet) -> str:
    """The README's Python block under `step.heading`, shrunk, run in this process in the current folder."""
    code = readme_blocks()[step.heading]
    for old, new in step.shrink.items():
        if old not in code:
            return f"README.md `{step.heading}`: {old!r} is no longer in its code: update the table"
        code = code.replace(old, new)
    try:
        exec(compile(code, "README.md", "exec"), {})
    except Exception as e:
        return f"README.md `{step.heading}`: {type(e).__name__}: {e}"
    return ""


# The documents a newcomer reads in this order, run in one folder (README's Python snippet after its commands).
NEWCOMER_PATH = ("README.md", "docs/quickstart.md", "docs/lora.md", "docs/deploy.md")


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory, shakespeare_file, small_shakespeare) -> dict[str, DocRun]:
    """A DocRun per document, the newcomer's path sharing one folder; `small_shakespeare` points the
    `shakespeare` data source at the slice.
    """
    newcomer = tmp_path_factory.mktemp("newcomer")
    runs = {}
    for doc in TABLES:
        root = newcomer
        if doc not in NEWCOMER_PATH:
            root = tmp_path_factory.mktemp(Path(doc).stem)
        runs[doc] = DocRun(doc, root, shakespeare_file)
    return runs


STEPS = [
    pytest.param(
        doc, index, id=f"{doc}[{index}]", marks=[getattr(pytest.mark, mark) for mark in getattr(step, "marks", ())]
    )
    for doc, table in TABLES.items()
    for index, step in enumerate(table)
]


@pytest.mark.parametrize(("doc", "index"), STEPS)
def test_doc_command(doc, index, doc_runs, fake_hub, monkeypatch):
    doc_run = doc_runs[doc]
    step = TABLES[doc][index]
    if isinstance(step, Skip):
        command = doc_run.commands[index]
        pytest.skip(f"{doc}:{command.line} `{command.text}`: {step.why}")
    monkeypatch.chdir(doc_run.folder)
    monkeypatch.setenv("HOME", str(doc_run.folder.parent / "home"))
    monkeypatch.setenv("GPT2_CACHE_DIR", str(doc_run.folder / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(fake_hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(fake_hub))
    doc_run.run_through(index)

"""The README's code runs as written (shrunk to a few steps, a tiny model instead of hub weights)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gpt2
from gpt2 import GPT, GPTConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


def readme_blocks() -> dict[str, str]:
    """The README's python blocks, keyed by the heading above each."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    blocks = {}
    for section in text.split("\n## ")[1:]:
        heading, _, body = section.partition("\n")
        code = re.search(r"```python\n(.*?)```", body, flags=re.S)
        if code:
            blocks[heading.strip()] = code.group(1)
    return blocks


# The README's training snippet shrunk to a 2-layer, 32-wide model, 3 steps, 2 validation batches.
README_SHRINK = {
    "n_layer=4, n_head=4, n_embd=128": "n_layer=2, n_head=2, n_embd=32",
    "max_steps=200": "max_steps=3, eval_steps=2",
    "warmup_steps=20": "warmup_steps=1",
    "micro_batch_size=16": "micro_batch_size=2",
    "total_batch_size=16 * 128": "total_batch_size=2 * 128",
}


@pytest.fixture
def offline_pretrained(monkeypatch):
    """GPT.from_pretrained("gpt2") without the hub: a tiny GPT over the real GPT-2 vocabulary."""

    def tiny(name_or_path, **kwargs):
        assert name_or_path == "gpt2"
        return GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32))

    monkeypatch.setattr(GPT, "from_pretrained", classmethod(lambda cls, name, **kw: tiny(name, **kw)))


def test_gpt2_example_runs(tmp_path, monkeypatch, capsys, offline_pretrained, shared_data, small_shakespeare):
    """Shrunk to a 2-layer, 32-wide model, 3 steps, 2 validation batches (not 20 of the 4-layer,
    128-wide model over GPT-2's vocabulary), on the 64 KB slice of Tiny Shakespeare.
    """
    monkeypatch.chdir(tmp_path)
    code = readme_blocks()["gpt2 in ten lines"]
    for old, new in README_SHRINK.items():
        assert old in code, old
        code = code.replace(old, new)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert (tmp_path / "runs" / "shakespeare-python" / "metrics.jsonl").is_file()
    assert isinstance(namespace["gpt"], gpt2.GPT)
    # the sample is printed as text, not as a tensor of token ids
    text = gpt2.get_tokenizer().decode(namespace["ids"][0])
    assert capsys.readouterr().out.endswith(f"\n{text}\n") and "tensor(" not in text


def test_minlora_example_runs(tmp_path, monkeypatch, offline_pretrained):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_blocks()["minlora in ten lines"], "README.md", "exec"), namespace)
    for path in ("adapter", "peft_adapter/adapter_model.safetensors", "merged/model.safetensors"):
        assert (tmp_path / path).exists(), path
    assert not any("parametrizations" in k for k in namespace["model"].state_dict())


def test_run_sh_hands_its_arguments_to_the_example_and_reruns_continue(tmp_path):
    """`bash run.sh ARGS`: setup.sh gets no extras (it once read ARGS as its own and pip failed),
    the example gets ARGS; with no arguments it continues the run in runs/shakespeare.
    """
    import shutil
    import subprocess

    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO_ROOT / "run.sh", tmp_path / "run.sh")
    log = tmp_path / "log"
    # stand-ins for the install and for python, recording what each was given
    (tmp_path / "scripts" / "setup.sh").write_text(f'echo "setup:$#:${{1:-}}" >> {log}\nPYTHON={tmp_path}/python\n')
    (tmp_path / "python").write_text(f'#!/bin/sh\necho "python:$*" >> {log}\n')
    (tmp_path / "python").chmod(0o755)
    for args in (["--max-steps", "3", "--help"], []):
        subprocess.run(["bash", str(tmp_path / "run.sh"), *args], check=True, timeout=30)
    assert log.read_text().splitlines() == [
        "setup:1:",
        "python:examples/pretrain_shakespeare.py --max-steps 3 --help",
        "setup:1:",
        "python:examples/pretrain_shakespeare.py --resume auto",
    ]

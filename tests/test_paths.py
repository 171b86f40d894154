"""Model names vs paths: bare official GPT-2 names are the hub, any other existing path is local.

Everything runs in a temporary working directory that holds a ``gpt2/`` folder, as the root of
this repository's checkout does (the package). The hub download is replaced by a fake, so no
test touches the network; each test checks whether the hub was asked and for which id.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt2 import GPT, GPTConfig
from gpt2.model import hf
from gpt2.train.checkpoint import save_checkpoint

TINY = GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture
def model() -> GPT:
    return GPT(TINY).eval()


@pytest.fixture
def hub(tmp_path, monkeypatch, model):
    """A fake hub serving one tiny transformers directory; ``hub.calls`` lists the ids asked for."""
    snapshot = hf.save_pretrained(model, tmp_path / "hub_snapshot")

    class Hub:
        calls: list[str] = []

    def fake_download(repo_id, cache_dir, revision):
        Hub.calls.append(repo_id)
        return snapshot

    monkeypatch.setattr(hf, "_download", fake_download)
    return Hub


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """The working directory: a repository checkout with its gpt2/ package folder."""
    root = tmp_path / "checkout"
    (root / "gpt2").mkdir(parents=True)
    (root / "gpt2" / "__init__.py").write_text("")
    monkeypatch.chdir(root)
    return root


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    idx = torch.randint(0, TINY.vocab_size, (1, 8))
    torch.testing.assert_close(a(idx)[0], b(idx)[0])


@pytest.mark.parametrize("name", ["gpt2", "openai-community/gpt2", "gpt2-xl", "distilgpt2"])
def test_official_names_mean_the_hub_even_where_a_folder_has_that_name(checkout, hub, model, name):
    (checkout / "openai-community" / "gpt2").mkdir(parents=True)
    (checkout / "gpt2-xl").mkdir()
    (checkout / "distilgpt2").mkdir()
    _same_weights(GPT.from_pretrained(name), model)
    _same_weights(GPT.from_pretrained(name), model)
    _same_weights(GPT.from_pretrained(name), model)  # sample --model, finetune --init, eval, export
    assert hub.calls == [name] * 3


@pytest.mark.parametrize("spelling", ["./gpt2", "gpt2/", "{cwd}/gpt2"])
def test_a_path_spelling_is_local(checkout, hub, spelling):
    spec = spelling.format(cwd=checkout)
    for load in (GPT.from_pretrained,):
        with pytest.raises(
            FileNotFoundError,
            match=r"holds no model: .*no config\.json.*trainer_state\.json.*checkpoints/.*write its bare name",
        ):
            load(spec)
    with pytest.raises(FileNotFoundError, match=r"holds no model"):
        GPT.from_pretrained(Path("gpt2"))  # a Path is always a path
    assert hub.calls == []


def test_other_existing_names_are_local_never_the_hub(checkout, hub):
    (checkout / "my-model").mkdir()  # shaped like a hub id, but it exists here
    for load in (GPT.from_pretrained,):
        with pytest.raises(FileNotFoundError, match=r"'my-model' holds no model"):
            load("my-model")
    assert hub.calls == []


@pytest.mark.parametrize("spec", ["./no/such/model", "{cwd}/missing", "runs/a/b", "~/no-such-dir-gpt2-test"])
def test_missing_paths_say_does_not_exist_not_hub_errors(checkout, hub, spec):
    spec = spec.format(cwd=checkout)
    for load in (GPT.from_pretrained,):
        with pytest.raises(
            FileNotFoundError, match=r"does not exist: it is neither an existing directory nor a Hugging Face hub id"
        ):
            load(spec)
    assert hub.calls == []


def test_hub_shaped_names_that_do_not_exist_locally_go_to_the_hub(checkout, hub):
    GPT.from_pretrained("someone/tiny-gpt2")
    assert hub.calls == ["someone/tiny-gpt2"]


def test_transformers_directory_without_weights(checkout, hub, model):
    d = hf.save_pretrained(model, checkout / "export")
    _same_weights(GPT.from_pretrained("export"), model)
    (d / "model.safetensors").unlink()
    for load in (GPT.from_pretrained,):
        with pytest.raises(FileNotFoundError, match=r"no weights in .*export.*expected model\.safetensors"):
            load("export")
    assert hub.calls == []


def test_run_and_checkpoint_directories(checkout, hub, model):
    run = checkout / "runs" / "tiny"
    step = save_checkpoint(run / "checkpoints", 3, model, metadata={"model_config": TINY.to_dict()})
    for spec in ("runs/tiny", str(run / "checkpoints"), str(step)):
        _same_weights(GPT.from_pretrained(spec), model)
        _same_weights(GPT.from_pretrained(spec), model)  # the one entry point takes every --model source
    (run / "checkpoints" / step.name / "model.safetensors").unlink()
    from gpt2.model.checkpoint_files import CheckpointError

    with pytest.raises(CheckpointError, match="no intact checkpoint.*model.safetensors is missing"):
        GPT.from_pretrained("runs/tiny")
    assert hub.calls == []


def test_a_file_is_not_a_model(checkout, hub, model):
    d = hf.save_pretrained(model, checkout / "export")
    with pytest.raises(NotADirectoryError, match=r"is a file; a model is a directory.*pass its directory '.*export'"):
        GPT.from_pretrained(str(d / "model.safetensors"))
    with pytest.raises(NotADirectoryError, match=r"is a file; a model is a directory.*pass its directory"):
        GPT.from_pretrained(d / "config.json")
    assert hub.calls == []

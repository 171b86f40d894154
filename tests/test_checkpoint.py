"""Checkpoints: safetensors with tied weights, weights_only state, RNG, atomic save, pruning."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch
from _tiny_run import plant_payload
from safetensors import safe_open

from gpt2 import GPT
from gpt2.model.checkpoint_files import (
    CheckpointError,
    NonFiniteWeightsError,
    find_latest_checkpoint,
    load_state,
    load_weights,
    read_checkpoint,
)
from gpt2.train import checkpoint as ckpt


@pytest.fixture
def model(tiny_config):
    torch.manual_seed(0)
    return GPT(tiny_config)


def _optimizer_with_state(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    model(x, x)[1].backward()
    opt.step()
    return opt


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_round_trip_stores_tied_weight_once_and_reties_it(model, tiny_config, tmp_path):
    opt = _optimizer_with_state(model)
    path = ckpt.save_checkpoint(tmp_path, 7, model, opt, metadata={"note": "hi"})
    assert path == tmp_path / "step_000007" and ckpt.is_complete(path)
    with safe_open(str(path / ckpt.WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
        aliases = json.loads(f.metadata()["aliases"])
    # The token embedding and the LM head are one tensor: stored under one name, the other an alias.
    tied = {"transformer.wte.weight", "lm_head.weight"}
    assert len(keys & tied) == 1 and set(aliases) == tied - keys
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in keys)

    torch.manual_seed(1)
    fresh = GPT(tiny_config)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    meta = ckpt.load_checkpoint(path, fresh, fresh_opt)
    assert meta["step"] == 7 and meta["note"] == "hi"
    assert _same_weights(model, fresh)
    assert fresh.transformer.wte.weight is fresh.lm_head.weight  # still tied after loading
    a, b = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(a[i]["exp_avg"], b[i]["exp_avg"]) for i in a)


def test_trainer_state_is_safetensors_and_json(model, tmp_path):
    opt = _optimizer_with_state(model)
    scaler = torch.amp.GradScaler("cpu")
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, scaler)
    # the tensors in the body, everything else as JSON in the header: nothing to unpickle
    with safe_open(str(path / ckpt.STATE_FILE), "pt") as f:
        tree = json.loads(f.metadata()["state"])
        assert all(f.get_tensor(name).numel() for name in f.keys())
    assert set(tree) == {"optimizer", "scaler", "rng"}
    assert tree["scaler"]["scale"] == scaler.get_scale()
    state = load_state(path / ckpt.STATE_FILE)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert state["optimizer"]["param_groups"][0]["betas"] == list(opt.param_groups[0]["betas"])
    json.loads((path / ckpt.META_FILE).read_text())  # plain JSON


@pytest.mark.parametrize("name", [ckpt.WEIGHTS_FILE, ckpt.STATE_FILE, ckpt.META_FILE, "all"])
def test_a_pickle_planted_in_a_checkpoint_never_runs(model, tmp_path, name):
    opt, scaler, meta = (
        _optimizer_with_state(model),
        torch.amp.GradScaler("cpu"),
        {"model_config": model.config.to_dict()},
    )
    path = ckpt.save_checkpoint(tmp_path / "run", 1, model, opt, scaler, meta)
    marker = tmp_path / "payload-ran"
    planted = [ckpt.WEIGHTS_FILE, ckpt.STATE_FILE, ckpt.META_FILE] if name == "all" else [name]
    for file in planted:
        plant_payload(path, file, marker)
    fresh = GPT(model.config)
    with pytest.raises(CheckpointError) as info:
        ckpt.load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()), scaler, restore_rng=True)
    message = str(info.value)
    assert "\n" not in message and all(f"{file} " in message for file in planted)
    if ckpt.STATE_FILE in planted:
        # named as a pickle, never suggested to be unpickled
        assert "trainer_state.safetensors holds pickled Python objects, which gpt2 never loads" in message
    # sampling reads the weights and the JSON (not the optimizer state)
    if name == ckpt.STATE_FILE:
        GPT.from_pretrained(path)
    else:
        with pytest.raises(CheckpointError, match=planted[0]):
            GPT.from_pretrained(path)
    assert not marker.exists()


def test_rng_state_round_trip():
    state = ckpt.capture_rng_state()
    first = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    ckpt.restore_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]


def test_refuses_non_finite_weights(model, tmp_path):
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=r"step 3.*h\.0\.mlp\.c_fc\.weight"):
        ckpt.save_checkpoint(tmp_path, 3, model)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary directory


def test_crash_during_save_keeps_the_previous_checkpoint(model, tiny_config, tmp_path, monkeypatch):
    opt = _optimizer_with_state(model)
    good = ckpt.save_checkpoint(tmp_path, 10, model, opt)
    good_weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def crash(*args, **kwargs):  # the weights file is already written when this runs
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "replace_atomically", crash)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 20, model, opt)
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010"]  # no debris
    assert find_latest_checkpoint(tmp_path) == good
    fresh = GPT(tiny_config)
    ckpt.load_checkpoint(tmp_path, fresh, torch.optim.AdamW(fresh.parameters()))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in good_weights.items())


def test_keep_last_and_incomplete_directories(model, tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, model, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    # A directory that is not a complete checkpoint (e.g. copied by hand, half of it) is ignored.
    (tmp_path / "step_000009").mkdir()
    (tmp_path / "step_000009" / ckpt.WEIGHTS_FILE).write_bytes(b"")
    assert find_latest_checkpoint(tmp_path).name == "step_000004"
    with pytest.raises(CheckpointError, match="trainer_state.json is missing"):
        ckpt.load_checkpoint(tmp_path / "step_000009", model)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.load_checkpoint(tmp_path / "missing", model)
    # Saving a step again replaces it (swapped out, then renamed into place).
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    ckpt.save_checkpoint(tmp_path, 4, model, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    weights, _ = load_weights(tmp_path / "step_000004" / ckpt.WEIGHTS_FILE)
    assert torch.equal(weights["lm_head.weight"], model.lm_head.weight)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_pruning_keeps_a_users_file_inside_an_old_checkpoint_and_names_it(model, tmp_path, caplog):
    """--keep-last-checkpoints deleted whole checkpoint folders, a user's notes inside them included."""
    ckpt.save_checkpoint(tmp_path, 1, model)
    notes = tmp_path / "step_000001" / "notes.txt"
    notes.write_text("lr too high from here")
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        ckpt.save_checkpoint(tmp_path, 2, model, keep_last=1)
    assert notes.read_text() == "lr too high from here"
    assert sorted(p.name for p in (tmp_path / "step_000001").iterdir()) == ["notes.txt"]
    assert "kept" in caplog.text and str(notes) in caplog.text
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000002"]
    # Saving a step again keeps a user's file in the copy it replaces too.
    (tmp_path / "step_000002" / "notes.txt").write_text("mine")
    ckpt.save_checkpoint(tmp_path, 2, model, keep_last=1)
    kept = [p for p in tmp_path.rglob("notes.txt") if p.parent.name != "step_000001"]
    assert [p.read_text() for p in kept] == ["mine"]


def test_compiled_model_is_saved_under_its_raw_names(model, tmp_path):
    compiled = torch.compile(model)  # wrapping does not compile anything until it is called
    assert ckpt.unwrap_model(compiled) is model
    path = ckpt.save_checkpoint(tmp_path, 1, compiled)
    weights, _ = load_weights(path / ckpt.WEIGHTS_FILE)
    assert set(weights) == set(model.state_dict())


def test_trainable_only_saves_just_the_trainable_parameters(model, tiny_config, tmp_path):
    for p in model.parameters():
        p.requires_grad_(False)
    model.transformer.ln_f.weight.requires_grad_(True)
    model.lm_head.weight.requires_grad_(True)  # tied: saved once, restored under both names
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(2.0)
    path = ckpt.save_checkpoint(tmp_path, 5, model, trainable_only=True)
    weights, _ = load_weights(path / ckpt.WEIGHTS_FILE)
    assert set(weights) == {"transformer.ln_f.weight", "lm_head.weight", "transformer.wte.weight"}
    assert read_checkpoint(path).trainable_only

    torch.manual_seed(0)
    base = GPT(tiny_config)  # the same frozen base, but without the trained values
    ckpt.load_checkpoint(path, base)
    assert torch.equal(base.transformer.ln_f.weight, torch.full_like(base.transformer.ln_f.weight, 2.0))
    assert _same_weights(base, model)

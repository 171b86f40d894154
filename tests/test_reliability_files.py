"""Damaged checkpoints found by their digests, state that does not
fit, adapter checkpoints on another base, files the user owns, input files that are not what they
claim, and the permissions of what is written. Each case ends in one named error or in success.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from _tiny_run import tiny_config, tiny_model, tiny_tokens

import minlora
from gpt2.cli import main
from gpt2.model.checkpoint_files import (
    DIGEST_FILE,
    CheckpointError,
    NonFiniteWeightsError,
    load_state,
    load_weights,
    read_checkpoint,
    save_state,
    sha256_file,
)
from gpt2.model.gpt import GPT
from gpt2.outputs import RECORD_FILE
from gpt2.train import checkpoint as ckpt
from gpt2.train import rundir
from gpt2.train.trainer import Trainer

_config, _model, _tokens = tiny_config, tiny_model, tiny_tokens


def _tree(path: Path) -> dict[str, bytes | None]:
    """Every entry under ``path`` with its bytes (None for directories)."""
    return {str(p.relative_to(path)): None if p.is_dir() else p.read_bytes() for p in sorted(path.rglob("*"))}


def _flip_tensor_byte(file: Path, name: str = "transformer.h.0.mlp.c_fc.weight") -> None:
    """Flip an exponent bit of the first float32 of tensor ``name`` inside the data: the header,
    the size and every value stay valid and finite (0.02 becomes ~1e-21), only the content differs.
    """
    data = bytearray(file.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8 : 8 + header_len])[name]["data_offsets"][0]
    data[8 + header_len + begin + 3] ^= 0x20
    file.write_bytes(bytes(data))


def _refresh_sums(checkpoint: Path) -> None:
    """Re-sign every file of a checkpoint (after a deliberate edit)."""
    names = [line.split(maxsplit=1)[1] for line in (checkpoint / DIGEST_FILE).read_text().splitlines()]
    (checkpoint / DIGEST_FILE).write_text("".join(f"{sha256_file(checkpoint / n)}  {n}\n" for n in names))


def _rewrite_state(checkpoint: Path, change) -> None:
    """Change trainer_state.safetensors and re-sign it, as a consistent but foreign checkpoint would be."""
    state = load_state(checkpoint / ckpt.STATE_FILE)
    change(state)
    save_state(state, checkpoint / ckpt.STATE_FILE)
    sums = [
        line
        if not line.endswith(ckpt.STATE_FILE)
        else f"{sha256_file(checkpoint / ckpt.STATE_FILE)}  {ckpt.STATE_FILE}"
        for line in (checkpoint / DIGEST_FILE).read_text().splitlines()
    ]
    (checkpoint / DIGEST_FILE).write_text("\n".join(sums) + "\n")


# ------------------------------------------------------------------------------ 1. content digests


def test_flipped_byte_inside_a_tensor_is_damage_and_never_reaches_a_new_checkpoint(run, finished_run, caplog):
    newest = run / "checkpoints" / "step_000004"
    _flip_tensor_byte(newest / ckpt.WEIGHTS_FILE)
    load_weights(newest / ckpt.WEIGHTS_FILE)  # structurally still a valid file
    with pytest.raises(CheckpointError, match="model.safetensors does not match its sha256") as info:
        ckpt.load_checkpoint(newest, _model())
    assert info.value.problems == [(str(newest / ckpt.WEIGHTS_FILE), info.value.problems[0][1])]
    # resume='auto' falls back to step 2 and redoes steps 3-4: the new step 4 is the uninterrupted one's
    with Trainer(_model(), _config(run, resume="auto"), _tokens(), sinks=[]) as trainer:
        assert trainer.step == 2
        trainer.fit()
    assert "skipping damaged checkpoint" in caplog.text and "sha256" in caplog.text
    redone, _ = load_weights(newest / ckpt.WEIGHTS_FILE)
    clean, _ = load_weights(finished_run / "checkpoints" / "step_000004" / ckpt.WEIGHTS_FILE)
    # (bit for bit with one thread; two threads may round differently, far below the flipped 0.02)
    assert max((redone[k] - clean[k]).abs().max().item() for k in clean) < 1e-5


def test_flipped_byte_in_the_json_or_optimizer_state_is_damage(run):
    newest = run / "checkpoints" / "step_000004"
    meta = (newest / ckpt.META_FILE).read_text()
    (newest / ckpt.META_FILE).write_text(meta.replace('"world_size": 1', '"world_size": 7'))  # still valid JSON
    with pytest.raises(CheckpointError, match="trainer_state.json does not match its sha256"):
        read_checkpoint(newest)
    older = run / "checkpoints" / "step_000002"
    data = bytearray((older / ckpt.STATE_FILE).read_bytes())
    data[len(data) // 2] ^= 0x20  # inside the tensor data: safetensors accepts it
    (older / ckpt.STATE_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="trainer_state.safetensors"):
        read_checkpoint(older)
    read_checkpoint(older, trainer_state=False)  # the weights alone are intact: sampling works


def test_a_checkpoint_without_its_digests_is_damaged(run):
    newest = run / "checkpoints" / "step_000004"
    (newest / DIGEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="SHA256SUMS is missing"):
        read_checkpoint(newest)


# ------------------------------------------------------------------------------ 3. state that does not fit


def test_optimizer_state_that_does_not_fit_is_named_and_weights_only_resumes(run, caplog):
    frozen = _model()
    frozen.transformer.wpe.weight.requires_grad_(False)  # one parameter fewer in the optimizer
    with pytest.raises(ckpt.CheckpointMismatchError, match="resume_weights_only=True") as info:
        Trainer(frozen, _config(run, resume=str(run / "checkpoints" / "step_000004")), _tokens(), sinks=[])
    assert "optimizer" in str(info.value) and "\n" not in str(info.value)
    # resume='auto': every checkpoint is skipped the same way, then the same way out
    with pytest.raises(CheckpointError, match="resume-weights-only"):
        Trainer(frozen, _config(run, resume="auto"), _tokens(), sinks=[])
    with Trainer(frozen, _config(run, resume="auto", resume_weights_only=True), _tokens(), sinks=[]) as trainer:
        assert trainer.step == 4 and trainer.optimizer.state_dict()["state"] == {}
        weights, _ = load_weights(run / "checkpoints" / "step_000004" / ckpt.WEIGHTS_FILE)
        assert torch.equal(trainer.model.lm_head.weight, weights["lm_head.weight"])


def test_optimizer_state_of_other_shapes_falls_back_like_damage(run, caplog):
    def reshape(state):
        first = next(iter(state["optimizer"]["state"].values()))
        first["exp_avg"] = torch.zeros(3, 3)

    _rewrite_state(run / "checkpoints" / "step_000004", reshape)
    newest = str(run / "checkpoints" / "step_000004")
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"exp_avg of transformer\.\S+ is \[3, 3\]"):
        Trainer(_model(), _config(run, resume=newest), _tokens(), sinks=[])
    with Trainer(_model(), _config(run, resume="auto"), _tokens(), sinks=[]) as trainer:
        assert trainer.step == 2
    assert "which does not fit this run" in caplog.text and "exp_avg" in caplog.text


def test_resume_auto_into_a_run_of_another_model_says_so_and_touches_nothing(run, caplog):
    # A wider model: its weights do not fit the checkpoints (and so neither could its optimizer
    # state); resume='auto' (the shakespeare recipes' default) must say the run is another model's.
    torch.manual_seed(0)
    other = GPT(dataclasses.replace(_model().config, n_embd=32))
    before = _tree(run)
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"weights of another model \(transformer.*own out_dir"):
        Trainer(other, _config(run, resume="auto"), _tokens(), sinks=[])
    assert "which does not fit this run" in caplog.text and "damaged" not in caplog.text
    assert _tree(run) == before


def test_scaler_state_that_does_not_fit_is_named(run):
    _rewrite_state(run / "checkpoints" / "step_000004", lambda s: s.update(scaler={"scale": float("nan")}))
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    with pytest.raises(ckpt.CheckpointMismatchError, match="loss-scaler state"):
        ckpt.load_checkpoint(run / "checkpoints" / "step_000004", _model(), scaler=scaler)


# ------------------------------------------------------------------------------ 8. adapter checkpoints


def _lora_model(seed: int, **lora) -> GPT:
    config = _model().config
    torch.manual_seed(seed)
    model = GPT(config)
    minlora.add_lora(model, minlora.LoRAConfig(**lora))
    minlora.mark_only_lora_as_trainable(model)
    return model


def test_adapter_only_checkpoint_onto_another_base_is_named_with_a_way_to_accept_it(tmp_path):
    out = tmp_path / "lora"
    with Trainer(_lora_model(0), _config(out, save_trainable_only=True), _tokens(), sinks=[]) as trainer:
        trainer.fit()
    meta = json.loads((out / "checkpoints" / "step_000004" / ckpt.META_FILE).read_text())
    assert meta["base_fingerprint"] == minlora.base_fingerprint(_lora_model(0))
    with Trainer(_lora_model(0), _config(out, resume="auto", save_trainable_only=True), _tokens(), sinks=[]) as t:
        assert t.step == 4
    with pytest.raises(minlora.AdapterBaseMismatchError, match="allow_base_mismatch=True"):
        Trainer(_lora_model(1), _config(out, resume="auto", save_trainable_only=True), _tokens(), sinks=[])
    accepted = _config(out, resume="auto", save_trainable_only=True, allow_base_mismatch=True)
    with Trainer(_lora_model(1), accepted, _tokens(), sinks=[]) as trainer:
        assert trainer.step == 4
    # A base record without its LoRA scalings cannot be verified: it does not fit (no reader of older records).
    meta_file = out / "checkpoints" / "step_000004" / ckpt.META_FILE
    meta = json.loads(meta_file.read_text())
    old = {k: v for k, v in meta.items() if k != "lora_scaling"} | {"base_fingerprint": "0" * 64}
    meta_file.write_text(json.dumps(old))
    _refresh_sums(meta_file.parent)
    with Trainer(_lora_model(0), _config(out, resume="auto", save_trainable_only=True), _tokens(), sinks=[]) as t:
        assert t.step == 2
    meta_file.write_text(json.dumps(meta))
    _refresh_sums(meta_file.parent)
    # Another alpha (or rsLoRA) scales the same factors differently: it continued silently before.
    for lora in (dict(alpha=32), dict(use_rslora=True)):
        with pytest.raises(
            ckpt.CheckpointMismatchError, match=r"another LoRA alpha or rsLoRA setting \(scaling \[2\.0\]"
        ):
            Trainer(_lora_model(0, **lora), _config(out, resume="auto", save_trainable_only=True), _tokens(), sinks=[])


# ------------------------------------------------------------------------------ 7. the user's files


def test_files_the_user_put_in_out_dir_are_refused_and_never_replaced(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(rundir.RunDirNotEmptyError, match=r"gpt2 did not write \(notes.txt\).*overwrite=True"):
        Trainer(_model(), _config(out), _tokens(), sinks=[])
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written, lock given back
    with Trainer(_model(), _config(out, max_steps=2, overwrite=True), _tokens(), sinks=[]) as trainer:
        trainer.fit()
    assert (out / "notes.txt").read_text() == "mine"
    assert "checkpoints" in json.loads((out / RECORD_FILE).read_text())
    # The user's own results.json where a run writes one: refused even with overwrite.
    user = tmp_path / "user"
    user.mkdir()
    (user / "results.json").write_text('{"mine": 1}')
    for overwrite in (False, True):
        refused = r"results.json.*did not write|did not write \(results.json"
        with pytest.raises(rundir.RunDirNotEmptyError, match=refused):
            Trainer(_model(), _config(user, overwrite=overwrite), _tokens(), sinks=[])
    assert (user / "results.json").read_text() == '{"mine": 1}'
    # overwrite deletes what gpt2 wrote (the manifest says what), and keeps the rest
    with Trainer(_model(), _config(out, max_steps=1, overwrite=True), _tokens(), sinks=[]) as trainer:
        assert not (out / "checkpoints").exists() and (out / "notes.txt").exists()


def test_a_failed_resume_leaves_out_dir_exactly_as_it_was(run, tmp_path):
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / "step_000002" / ckpt.STATE_FILE).write_bytes(b"junk")
    before = _tree(run)
    # overwrite would delete step 4 (newer than the resumed step 2), but resuming step 2 fails first
    older = str(run / "checkpoints" / "step_000002")
    with pytest.raises(CheckpointError, match="trainer_state.safetensors"):
        Trainer(_model(), _config(run, resume=older, overwrite=True), _tokens(), sinks=[])
    assert _tree(run) == before
    fresh = tmp_path / "new"  # a new out_dir resuming from a damaged checkpoint: not even created
    with pytest.raises(CheckpointError):
        Trainer(_model(), _config(fresh, resume=older), _tokens(), sinks=[])
    assert not fresh.exists()


def _gpt2(capsys, *args: str) -> subprocess.CompletedProcess:
    """`gpt2 ARGS` through the command line's main() in this process, as tests/test_cli.py runs it
    (an interpreter start per call would cost more than the checks; the installed entry point is
    started once there): the exit code and what it printed.
    """
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["gpt2", *args], code, out, err)


def test_out_dir_that_is_a_file_is_one_error_before_any_work(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    for out in ("taken", "taken/run"):
        proc = _gpt2(capsys, "train", "--out-dir", str(tmp_path / out), "--data", str(tmp_path / "no-such.txt"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.count("\n") == 1 and "is a file" in proc.stderr
        assert "no-such.txt" not in proc.stderr  # refused before the data was even looked at


def test_export_into_a_folder_that_is_not_an_earlier_export_is_refused(run, tmp_path, capsys):
    target = tmp_path / "export"
    target.mkdir()
    (target / "thesis.tex").write_text("mine")
    proc = _gpt2(capsys, "export", "--model", str(run), "--out", str(target))
    assert proc.returncode == 2 and "not an earlier export" in proc.stderr and "--overwrite" in proc.stderr
    assert sorted(p.name for p in target.iterdir()) == ["thesis.tex"]
    assert _gpt2(capsys, "export", "--model", str(run), "--out", str(target), "--overwrite").returncode == 0
    assert (target / "thesis.tex").read_text() == "mine" and (target / "model.safetensors").is_file()
    # an earlier export is replaced without --overwrite
    (target / "thesis.tex").unlink()
    assert _gpt2(capsys, "export", "--model", str(run), "--out", str(target)).returncode == 0


# ------------------------------------------------------------------------------ 4, 9. Hugging Face folders


def _hf_folder(path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=16, vocab_size=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


class _Payload:  # any object torch.load(weights_only=True) refuses to unpickle
    pass


def test_a_bin_with_pickled_objects_is_refused_in_our_words(tmp_path):
    folder = _hf_folder(tmp_path / "hf")
    from safetensors.torch import load_file

    sd = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**sd, "extra": _Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError) as info:
        GPT.from_pretrained(folder)
    message = str(info.value)
    assert "pytorch_model.bin" in message and "_Payload" in message and "model.safetensors" in message
    # none of torch's own advice: never to unpickle a file one does not trust
    assert "Re-running" not in message and "\n" not in message and "weights_only" not in message


def test_non_finite_weights_in_a_hf_folder_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _hf_folder(tmp_path / "hf")
    sd = load_file(folder / "model.safetensors")
    sd["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("inf")
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeightsError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight"):
        GPT.from_pretrained(folder)


# ------------------------------------------------------------------------------ 10. input files


def test_input_files_that_are_not_what_they_claim_are_one_line(tmp_path, capsys):
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "folder.yaml").mkdir()
    cases = {
        "binary.yaml": "not a text file",
        "folder.yaml": "cannot read it (Is a directory)",
        "missing.yaml": "cannot read it (No such file or directory)",
    }
    for name, words in cases.items():
        proc = _gpt2(capsys, "train", "--config", str(tmp_path / name), "--max-steps", "1")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert words in proc.stderr and name in proc.stderr and proc.stderr.count("\n") == 1
    folder = _hf_folder(tmp_path / "hf")
    config = (folder / "config.json").read_text()
    hf_cases = {
        config[: len(config) // 2]: "is not valid JSON",
        json.dumps({k: v for k, v in json.loads(config).items() if k != "n_embd"}): "no 'n_embd'",
    }
    for text, words in hf_cases.items():
        (folder / "config.json").write_text(text)
        proc = _gpt2(capsys, "sample", "--model", str(folder), "--max-new-tokens", "1")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        # the file is named once, not once by the reader and again by the loader
        assert words in proc.stderr and proc.stderr.count(str(folder / "config.json")) == 1, proc.stderr


# ------------------------------------------------------------------------------ 12. the umask


def test_written_files_get_the_users_umask(run, tmp_path):
    old = os.umask(0o027)
    try:
        path = ckpt.save_checkpoint(tmp_path / "ckpts", 1, _model(), torch.optim.AdamW(_model().parameters()))
        _model().save_pretrained(tmp_path / "export")
    finally:
        os.umask(old)
    files = [*path.iterdir(), *(tmp_path / "export").iterdir()]
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(0o640) for f in files}

"""Instruction fine-tuning (gpt2.instruct): template, exact loss masks, row errors, the loader's
batches and resume, learning a small handmade set, and `gpt2 finetune --data x.jsonl` /
`gpt2 sample --instruction` end to end.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import minlora
from gpt2 import GPT, GPTConfig
from gpt2.cli import main
from gpt2.data.instruct import (
    InstructionLoader,
    build_sequences,
    instruction_loaders,
    read_rows,
    render_prompt,
    tokenize_row,
)
from gpt2.eval.loss import evaluate_loss
from gpt2.model.gpt import IGNORE_INDEX
from gpt2.model.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data" / "instructions.jsonl"
ALPACA = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
NO_INPUT = {"instruction": "Name a colour.", "output": "Green."}
PROMPT = {"prompt": "Say hi.", "response": "Hi there!"}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


# --------------------------------------------------------------------------- template and masks
def test_template_renders_both_layouts(tmp_path):
    rows = read_rows(write_jsonl(tmp_path / "d.jsonl", [ALPACA, NO_INPUT, PROMPT, {**NO_INPUT, "input": ""}]))
    assert [r[:3] for r in rows] == [
        ("Add the numbers.", "2 and 3", "5"),
        ("Name a colour.", "", "Green."),
        ("Say hi.", "", "Hi there!"),
        ("Name a colour.", "", "Green."),
    ]
    assert rows[0][3].endswith("d.jsonl:1")
    assert render_prompt(*rows[0][:2]) == "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
    assert render_prompt("Say hi.") == "### Instruction:\nSay hi.\n\n### Response:\n"  # no input block


def _expected(rows, tok, seq_len, pack):
    """Windows built independently of build_sequences: concatenated (ids, mask) per sequence."""
    windows = []
    for row in rows:
        ids, mask = tokenize_row(*row[:3], tok)
        if pack and windows and len(windows[-1][0]) + len(ids) <= seq_len + 1:
            windows[-1] = (windows[-1][0] + ids, windows[-1][1] + mask)
        else:
            windows.append((ids, mask))
    return windows


@pytest.mark.parametrize("pack", [False, True])
def test_targets_are_ignored_exactly_on_prompt_and_padding(tmp_path, tok, pack):
    rows = read_rows(write_jsonl(tmp_path / "d.jsonl", [ALPACA, NO_INPUT, PROMPT, ALPACA, PROMPT]))
    seq_len = 48
    x, y, positions = build_sequences(rows, seq_len, pack=pack, tokenizer=tok)
    windows = _expected(rows, tok, seq_len, pack)
    assert x.shape == y.shape == (len(windows), seq_len)
    assert (len(windows) < len(rows)) == pack  # these short rows pack two or more per window
    for i, (ids, mask) in enumerate(windows):
        n = len(ids) - 1
        assert x[i, :n].tolist() == ids[:n]
        assert (x[i, n + 1 :] == tok.eot_token).all()  # padding input
        # each row's positions restart at 0; the padding after the rows counts from 0 as one more row
        lengths = [len(tokenize_row(*r[:3], tok)[0]) for r in rows]
        expected_positions = [p for length in lengths for p in range(length)]
        m = min(n + 1, seq_len)
        assert positions[i, :m].tolist() == expected_positions[sum(len(w[0]) for w in windows[:i]) :][:m]
        assert positions[i, m:].tolist() == list(range(seq_len - m))
        for t in range(seq_len):
            if t < n and mask[t + 1]:  # the next token is a response token (or the closing <|endoftext|>)
                assert y[i, t] == ids[t + 1]
            else:  # prompt or padding
                assert y[i, t] == IGNORE_INDEX
    # each row's response is its own tokens plus <|endoftext|>; nothing of the prompt is a target
    targets = [int(t) for t in y.ravel() if t != IGNORE_INDEX]
    expected = [t for row in rows for t in tok.encode_ordinary(row[2]) + [tok.eot_token]]
    assert targets == expected


def test_loss_and_evaluation_average_over_response_tokens_only(tmp_path, tok):
    rows = read_rows(write_jsonl(tmp_path / "d.jsonl", [ALPACA, NO_INPUT, PROMPT]))
    loader = InstructionLoader(rows, 2, 40, shuffle=False, tokenizer=tok)
    model = GPT(GPTConfig(block_size=40, n_layer=1, n_head=2, n_embd=16)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in (loader.next_batch(), loader.next_batch()):  # the second is one row + an all-ignored row
            logits, _ = model(x)
            keep = y != IGNORE_INDEX
            total += torch.nn.functional.cross_entropy(logits[keep], y[keep], reduction="sum").item()
            count += int(keep.sum())
        assert count == loader.num_targets
        result = evaluate_loss(model, loader, 2, 40)
        _, loss = model(x, y)  # a batch whose second row is all padding: still a finite mean
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(total / count, rel=1e-5)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("flash", [True, False])
def test_packed_rows_are_isolated_each_scores_as_if_alone(tok, flash):
    """A packed window's logits and loss equal those of its rows run one by one (SDPA with the
    block-diagonal mask, and the written-out attention); plain causal attention would not.
    """
    rows = read_rows(DATA)
    seq_len = 96
    loader = InstructionLoader(rows, 4, seq_len, pack=True, shuffle=False, tokenizer=tok)
    vocab = _compact([loader])
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=seq_len, vocab_size=vocab, n_layer=2, n_head=2, n_embd=32, flash=flash)).eval()
    x, y, kwargs = loader.next_batch()
    groups: list[list[int]] = []  # the row lengths of each window: greedy, in order, never split
    for length in (len(tokenize_row(*row[:3], tok)[0]) for row in rows):
        if groups and sum(groups[-1]) + length <= seq_len + 1:
            groups[-1].append(length)
        else:
            groups.append([length])
    with torch.no_grad():
        logits, loss_sum = model(x, **kwargs)[0], model(x, y, reduction="sum", **kwargs)[1]  # logits None with y
        causal_logits, _ = model(x)  # not isolated: rows see the rows before them
        alone_sum, rows_seen = torch.zeros(()), 0
        for i, lengths in enumerate(groups[:4]):
            start = 0
            for length in lengths:
                end = min(start + length, seq_len)  # a full window's last token is only a target
                row_x, row_y = x[i : i + 1, start:end], y[i : i + 1, start:end]
                row_logits, row_loss = model(row_x)[0], model(row_x, row_y, reduction="sum")[1]
                torch.testing.assert_close(logits[i, start:end], row_logits[0], rtol=1e-5, atol=1e-5)
                if start > 0:
                    assert not torch.allclose(causal_logits[i, start:end], row_logits[0], atol=1e-3)
                    rows_seen += 1
                alone_sum += row_loss
                start += length
    assert rows_seen >= 4  # several windows hold more than one row
    torch.testing.assert_close(loss_sum, alone_sum, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "line, message",
    [
        ('{"instruction": "a", "output": "b"', "not valid JSON"),
        ('["a", "b"]', "must be a JSON object"),
        ('{"text": "hello"}', "no instruction fields (found: text)"),
        ('{"instruction": "a"}', "missing 'output'"),
        ('{"prompt": "a"}', "missing 'response'"),
        ('{"instruction": "a", "output": 3}', "'output' must be a string, got int"),
        ('{"instruction": "a", "input": ["x"], "output": "b"}', "'input' must be a string, got list"),
        ('{"instruction": "  ", "output": "b"}', "'instruction' is empty"),
    ],
)
def test_bad_rows_name_the_file_line_and_field(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [ALPACA, line])
    with pytest.raises(ValueError, match="bad.jsonl:2") as e:
        read_rows(path)
    assert message in str(e.value)


def test_empty_file_missing_file_and_a_row_longer_than_the_context(tmp_path, tok):
    with pytest.raises(ValueError, match="no rows"):
        read_rows(write_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_rows(tmp_path / "nope.jsonl")
    long = {"instruction": "Repeat.", "output": "word " * 50}
    rows = read_rows(write_jsonl(tmp_path / "long.jsonl", [ALPACA, long]))
    n = len(tokenize_row(*rows[1][:3], tok)[0])
    with pytest.raises(ValueError, match=rf"long.jsonl:2: the row is {n} tokens .*--seq-len 32 .*raise --seq-len"):
        build_sequences(rows, 32, tokenizer=tok)
    build_sequences(rows, n - 1, tokenizer=tok)  # exactly seq_len + 1 tokens fits


def test_too_few_rows_for_a_step_and_val_split(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ALPACA, NO_INPUT, PROMPT, ALPACA, NO_INPUT])
    with pytest.raises(ValueError, match="fewer than one step"):
        InstructionLoader(path, 8, 40)
    train, val, val_rows = instruction_loaders(str(path), None, 0.2, batch_size=2, seq_len=40, pack=False, seed=1)
    assert (train.num_rows, val.num_rows) == (4, 1) and val_rows[0][0] == NO_INPUT["instruction"]
    other = write_jsonl(tmp_path / "v.jsonl", [PROMPT, PROMPT])
    train, val, _ = instruction_loaders(str(path), str(other), 0.2, batch_size=2, seq_len=40, pack=True, seed=1)
    assert train.num_rows == 5 and val.num_rows == 2


# --------------------------------------------------------------------------- the loader
def test_loader_shards_ranks_shuffles_epochs_and_resumes_exactly(tok):
    rows = read_rows(DATA)
    one = InstructionLoader(rows, 4, 40, seed=3, tokenizer=tok)
    ranks = [InstructionLoader(rows, 2, 40, seed=3, rank=r, world_size=2, tokenizer=tok) for r in range(2)]
    seen = []
    for _ in range(one.steps_per_epoch):
        x, y = one.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
        seen.extend(map(tuple, x.tolist()))
    assert len(set(seen)) == len(seen) == one.steps_per_epoch * 4  # no row twice within an epoch
    epoch2 = [one.next_batch()[0] for _ in range(one.steps_per_epoch)]
    assert one.state_dict()["epoch"] == 2
    assert [tuple(r) for b in epoch2 for r in b.tolist()] != seen  # a new order each epoch

    a = InstructionLoader(rows, 4, 40, seed=3, tokenizer=tok)
    for _ in range(7):  # into the second epoch
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = InstructionLoader(rows, 4, 40, seed=3, tokenizer=tok)
    b.load_state_dict(state)
    for _ in range(8):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # validation order: fixed, one pass covers every sequence once (the last step padded with
    # all-ignored sequences) and ends where it began; unsharded() is the whole data for rank 0
    val = [InstructionLoader(rows[:7], 2, 40, rank=r, world_size=2, shuffle=False, tokenizer=tok) for r in range(2)]
    got = [v.next_batch() for _ in range(2) for v in val]
    assert val[0].state_dict() == {"epoch": 0, "position": 0, "num_sequences": 7}
    xs = torch.cat([x for x, _ in got])
    assert torch.equal(xs[:7], torch.from_numpy(val[0].x)) and (xs[7] == tok.eot_token).all()
    assert int((torch.cat([y for _, y in got]) != IGNORE_INDEX).sum()) == val[0].num_targets
    alone = val[1].unsharded()
    assert (alone.rank, alone.world_size, alone.steps_per_epoch) == (0, 1, 4)
    assert result_of(alone) == result_of(InstructionLoader(rows[:7], 2, 40, shuffle=False, tokenizer=tok))
    with pytest.raises(ValueError, match="same --data, --seq-len and --pack"):
        InstructionLoader(rows, 4, 40, pack=True, tokenizer=tok).load_state_dict(state)


def result_of(loader):
    return [tuple(t.ravel().tolist()) for _ in range(loader.steps_per_epoch) for t in loader.next_batch()]


# --------------------------------------------------------------------------- learning
def _compact(loaders):
    """Remap the token ids the data uses to 0..V-1 (in place), so a model with a V-token output
    layer learns them: the real 50257-way layer makes each step ~50x slower on a shared CPU, and
    what is tested here is the masked loss, not the vocabulary.
    """
    used = np.unique(np.concatenate([np.concatenate([l.x.ravel(), l.y[l.y != IGNORE_INDEX]]) for l in loaders]))
    lookup = {int(t): i for i, t in enumerate(used)}
    remap = np.vectorize(lambda t: lookup.get(int(t), t))
    for loader in loaders:
        loader.x = remap(loader.x)
        loader.y = np.where(loader.y == IGNORE_INDEX, IGNORE_INDEX, remap(loader.y))
        loader.pad_id = lookup[int(loader.pad_id)]
    return len(used)


def _train(model, loader, steps, lr):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        x, y = loader.next_batch()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return evaluate_loss(model, _eval_view(loader), loader.batch_size, loader.seq_len)["loss"]


def _eval_view(loader):
    """The same sequences, in order and once each (for the final response loss)."""
    view = InstructionLoader.__new__(InstructionLoader)
    view.__dict__.update(loader.__dict__, shuffle=False, steps_per_epoch=-(-loader.num_sequences // loader.batch_size))
    view.reset()
    return view


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_tiny_model_learns_the_handmade_set(tok, mode):
    torch.manual_seed(0)
    loader = InstructionLoader(read_rows(DATA), 12, 36, seed=0, tokenizer=tok)
    vocab = _compact([loader])
    model = GPT(GPTConfig(block_size=36, vocab_size=vocab, n_layer=2, n_head=2, n_embd=64))
    before = evaluate_loss(model, _eval_view(loader), 12, 36)["loss"]
    if mode == "lora":  # on a random base LoRA needs the head too, and a high rank
        minlora.add_lora(model, lora_config=minlora.LoRAConfig(rank=16, alpha=32, include_lm_head=True))
        minlora.mark_only_lora_as_trainable(model)
    after = _train(model, loader, 120, 3e-3)
    assert before > 4.0
    assert after < (0.1 if mode == "full" else 0.3), (before, after)


# --------------------------------------------------------------------------- the command line
TINY = [
    "--seq-len",
    "40",
    "--micro-batch-size",
    "4",
    "--warmup-steps",
    "1",
    "--eval-steps",
    "1",
    "--num-samples",
    "1",
    "--max-new-tokens",
    "4",
    "--no-progress",
    "--no-plot",
    "--log-interval",
    "1",
]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A 1-step tiny run of `gpt2 train` (a run directory, as `bash run.sh` writes one)."""
    if not os.environ.get("GPT2_TINY_SHAKESPEARE"):
        pytest.skip("Tiny Shakespeare not available offline (../shared/data)")
    out = tmp_path_factory.mktemp("base") / "run"
    text = out.parent / "text.txt"  # a slice of Tiny Shakespeare: quick to tokenise
    text.write_text(Path(os.environ["GPT2_TINY_SHAKESPEARE"]).read_text()[:20000])
    assert (
        main(
            [
                "train",
                "--model",
                "tiny",
                "--data",
                str(text),
                *TINY,
                "--max-steps",
                "1",
                "--num-samples",
                "0",
                "--final-eval-batches",
                "1",
                "--out-dir",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_cli_finetune_jsonl_full_then_sample_instruction(base_run, tmp_path, capsys):
    out = tmp_path / "full"
    code = main(
        [
            "finetune",
            "--init",
            str(base_run),
            "--data",
            str(DATA),
            "--full",
            *TINY,
            "--max-steps",
            "2",
            "--out-dir",
            str(out),
        ]
    )
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "22 training rows" in stdout and "2 validation rows" in stdout and "full fine-tuning" in stdout
    assert int(re.search(r"22 training rows in (\d+) sequences", stdout)[1]) < 22  # packed by default
    results = json.loads((out / "results.json").read_text())
    assert results["step"] == 2 and 0 < results["val_tokens"] < 40  # the two held-out responses only
    state = json.loads(next((out / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["data"]["train"]["position"] == 8 and not state.get("trainable_only")
    # the whole model is in the run directory: sample from it with the template
    code = main(
        [
            "sample",
            "--model",
            str(out),
            "--instruction",
            "Add the two numbers.",
            "--input",
            "1 and 2",
            "--max-new-tokens",
            "5",
            "--seed",
            "1",
        ]
    )
    stdout = capsys.readouterr().out
    # the sample shows what was asked, the response after it
    assert code == 0 and "### Instruction:\nAdd the two numbers.\n\n### Input:\n1 and 2\n\n### Response:\n" in stdout


def test_cli_finetune_jsonl_lora_resume_and_errors(base_run, tmp_path, capsys):
    out = tmp_path / "lora"
    args = ["finetune", "--init", str(base_run), "--data", str(DATA), "--no-pack", *TINY, "--out-dir", str(out)]
    assert main([*args, "--max-steps", "1"]) == 0
    assert main([*args, "--max-steps", "2", "--resume", "auto"]) == 0
    capsys.readouterr()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the second run continued the first (it trained step 2 only)
    state = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["data"]["train"]["epoch"] == 0 and state["data"]["train"]["position"] == 8
    assert (out / "adapter").exists()
    assert (
        main(
            [
                "sample",
                "--model",
                str(base_run),
                "--adapter",
                str(out / "adapter"),
                "--instruction",
                "Say hello in Spanish.",
                "--max-new-tokens",
                "3",
            ]
        )
        == 0
    )
    capsys.readouterr()
    bad = write_jsonl(tmp_path / "bad.jsonl", [ALPACA, {"instruction": "x", "output": 5}])
    assert main(["finetune", "--init", str(base_run), "--data", str(bad), *TINY, "--out-dir", str(tmp_path / "b")]) == 2
    assert "bad.jsonl:2: 'output' must be a string" in capsys.readouterr().err
    assert (
        main(
            [
                "finetune",
                "--init",
                str(base_run),
                "--data",
                str(DATA),
                *TINY,
                "--seq-len",
                "16",
                "--out-dir",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    assert "raise --seq-len" in capsys.readouterr().err
    assert main(["sample", "--model", str(base_run), "--input", "x"]) == 2
    assert "--input goes with --instruction" in capsys.readouterr().err


@pytest.fixture
def packing_benchmark(small_shakespeare, monkeypatch):
    if small_shakespeare is None:
        pytest.skip("Tiny Shakespeare not available offline (../shared/data)")
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is not installed
    import benchmarks.packing

    return benchmarks.packing


def test_packing_benchmark_rows_follow_alpacas_lengths(packing_benchmark, small_shakespeare, tok):
    bench = packing_benchmark
    rows = bench.alpaca_like_rows(400, 512, small_shakespeare.read_text(), tok)
    responses = [len(tok.encode_ordinary(r[2])) for r in rows]
    prompts = [len(tok.encode_ordinary(r[0] + r[1])) for r in rows]
    assert np.mean(responses) == pytest.approx(bench.RESPONSE_MEAN, rel=0.2)  # decoding + re-encoding moves a few
    assert np.mean(prompts) == pytest.approx(bench.PROMPT_MEAN, rel=0.2)
    assert np.median(responses) < np.mean(responses) < max(responses) / 3  # mostly short, a long tail
    assert 0.3 < np.mean([bool(r[1]) for r in rows]) < 0.5  # about 40% have an input


@pytest.mark.slow
def test_packing_benchmark_runs_and_packs(packing_benchmark):
    results = {r["mode"]: r for r in packing_benchmark.run(40, 256, 2, 1, 1, "tiny", 0)}
    assert (
        results["padded"]["sequences"] == 40 > results["packed"]["sequences"] == results["packed-causal"]["sequences"]
    )
    assert results["packed"]["rows_per_sequence"] > 1.5
    assert "| packed |" in packing_benchmark.format_results(list(results.values()))

"""gpt2.eval: validation loss / perplexity and HellaSwag scoring on handmade examples."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2 import GPT, DownloadError, GPTConfig
from gpt2.eval.hellaswag import (
    HELLASWAG_URLS,
    ending_losses,
    hellaswag_path,
    iterate_hellaswag,
    render_example,
    score_hellaswag,
)
from gpt2.eval.loss import evaluate_loss


# --------------------------------------------------------------------------- helpers
class WordTokenizer:
    """A whitespace tokenizer over a fixed word list, so tests know every token id."""

    def __init__(self, words: list[str]) -> None:
        self.ids = {w: i for i, w in enumerate(words)}

    def encode(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]


class BigramLM(nn.Module):
    """A language model whose next-token distribution depends only on the current token:
    logits[b, t] = log_probs[idx[b, t]]. With log-probabilities as logits, the cross-entropy
    of a token is exactly -log p, so the expected HellaSwag losses are known in closed form.
    """

    def __init__(self, log_probs: torch.Tensor, block_size: int = 64) -> None:
        super().__init__()
        self.table = nn.Parameter(log_probs.clone())
        self.config = GPTConfig(block_size=block_size, vocab_size=log_probs.size(0), n_layer=1, n_head=1, n_embd=8)

    def forward(self, idx, targets=None):
        return self.table[idx], None  # (B, T, V), GPT's (logits, loss) signature


WORDS = ["<pad>", "the", "cat", "sat", "on", "mat", "dog", "flew", "moon", "a", "red", "hat", "sky"]


def _bigram(pairs: dict[tuple[str, str], float], words=WORDS) -> torch.Tensor:
    """(V, V) log-probabilities: each listed pair gets its probability, the rest of the row's
    mass is spread evenly over the other tokens.
    """
    V = len(words)
    ix = {w: i for i, w in enumerate(words)}
    probs = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        fixed = {ix[b]: p for (w, b), p in pairs.items() if ix[w] == a}
        rest = (1.0 - sum(fixed.values())) / (V - len(fixed))
        probs[a] = rest
        for b, p in fixed.items():
            probs[a, b] = p
    return probs.log().float()


def _example(ctx: str, endings: list[str], label: int, **extra) -> dict:
    return {"ctx": ctx, "endings": endings, "label": label, **extra}


def _write_jsonl(path: Path, examples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


# --------------------------------------------------------------------------- HellaSwag
def test_render_example_layout():
    tok = WordTokenizer(WORDS)
    ex = _example("the cat", ["sat on the mat", "flew", "sat", "on a red hat"], label=0)
    tokens, mask, label = render_example(ex, tok)
    assert label == 0
    assert tokens.shape == mask.shape == (4, 2 + 4)
    assert tokens.dtype == torch.long
    for i, ending in enumerate(ex["endings"]):
        ids = tok.encode("the cat " + ending)
        assert tokens[i, : len(ids)].tolist() == ids
        assert mask[i].tolist() == [0, 0] + [1] * (len(ids) - 2) + [0] * (6 - len(ids))


def test_render_example_builds_ctx_from_ctx_a_and_ctx_b():
    tok = WordTokenizer(WORDS)
    official = {"ctx_a": "the cat", "ctx_b": "sat", "endings": ["on", "flew"], "label": "1"}
    tokens, mask, label = render_example(official, tok)
    assert label == 1  # Hugging Face copies store labels as strings
    assert tokens[0].tolist()[:4] == tok.encode("the cat sat on")
    assert mask[0].tolist() == [0, 0, 0, 1]


def test_picks_the_ending_the_model_makes_likely():
    # The model knows "cat sat", "sat on", "on the", "the mat"; every other pair is unlikely.
    pairs = {("cat", "sat"): 0.9, ("sat", "on"): 0.9, ("on", "the"): 0.9, ("the", "mat"): 0.5, ("the", "cat"): 0.4}
    model = BigramLM(_bigram(pairs))
    tok = WordTokenizer(WORDS)
    examples = [
        _example("the cat", ["flew", "sat on the mat", "moon sky", "dog a red hat"], label=1),
        _example("the cat sat", ["red hat", "flew", "on the mat", "dog"], label=2),
        _example("the", ["cat sat", "moon moon", "sky dog", "a red"], label=0),
    ]
    result = score_hellaswag(model, examples, tokenizer=tok)
    assert result == {"acc": 1.0, "acc_norm": 1.0, "n": 3}
    # With the right answers moved, the same model scores 0.
    wrong = [dict(e, label=(e["label"] + 1) % 4) for e in examples]
    assert score_hellaswag(model, wrong, tokenizer=tok) == {"acc": 0.0, "acc_norm": 0.0, "n": 3}


def test_ending_losses_match_closed_form_and_acc_vs_acc_norm():
    # A long ending whose tokens are each fairly likely (p=0.6) against a one-token ending with
    # p=0.3: the sum prefers the short one (1.20 < 4 * 0.51), the per-token mean the long one.
    pairs = {("cat", "sat"): 0.6, ("sat", "on"): 0.6, ("on", "a"): 0.6, ("a", "hat"): 0.6, ("cat", "flew"): 0.3}
    model = BigramLM(_bigram(pairs))
    tok = WordTokenizer(WORDS)
    ex = _example("the cat", ["sat on a hat", "flew", "moon", "sky"], label=0)
    tokens, mask, _ = render_example(ex, tok)
    sum_loss, mean_loss = ending_losses(model, tokens, mask)
    expected_sum = torch.tensor([4 * -math.log(0.6), -math.log(0.3)])
    torch.testing.assert_close(sum_loss[:2], expected_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean_loss[:2], torch.tensor([-math.log(0.6), -math.log(0.3)]), rtol=1e-5, atol=1e-5)
    result = score_hellaswag(model, [ex], tokenizer=tok)
    assert result["acc"] == 0.0 and result["acc_norm"] == 1.0


def test_gpt_scores_equal_per_ending_reference(tiny_config):
    """Batched, padded scoring of a real GPT equals scoring each ending alone, unpadded."""
    model = GPT(tiny_config).eval()
    g = torch.Generator().manual_seed(1)

    class IdTokenizer:
        def encode(self, text):
            return [int(t) for t in text.split()]

    def rand(n):
        return " ".join(str(int(t)) for t in torch.randint(1, tiny_config.vocab_size, (n,), generator=g))

    ex = _example(rand(7), [rand(3), rand(9), rand(1), rand(5)], label=2)
    tokens, mask, _ = render_example(ex, IdTokenizer())
    sum_loss, mean_loss = ending_losses(model, tokens, mask)
    ctx = IdTokenizer().encode(ex["ctx"])
    for i, ending in enumerate(ex["endings"]):
        ids = torch.tensor([ctx + IdTokenizer().encode(ending)])
        logits, _ = model(ids)
        logp = F.log_softmax(logits[0, :-1].double(), dim=-1)
        targets = ids[0, 1:]
        nll = -logp[torch.arange(len(targets)), targets][len(ctx) - 1 :]
        assert sum_loss[i].item() == pytest.approx(nll.sum().item(), rel=1e-4)
        assert mean_loss[i].item() == pytest.approx(nll.mean().item(), rel=1e-4)


def test_long_context_is_cropped_to_block_size():
    pairs = {("cat", "sat"): 0.9, ("sat", "on"): 0.9}
    model = BigramLM(_bigram(pairs), block_size=6)
    tok = WordTokenizer(WORDS)
    ex = _example("a red hat a red hat the cat", ["sat on", "flew moon"], label=0)  # 8 + 2 > 6
    assert score_hellaswag(model, [ex], tokenizer=tok)["acc_norm"] == 1.0
    too_long = _example("the cat", ["sat on the mat a red hat", "flew"], label=0)
    with pytest.raises(ValueError, match="too long for the model's context"):
        score_hellaswag(model, [too_long], tokenizer=tok)


def test_file_scoring_limit_and_gpt2_tokenizer(tmp_path, shared_data):
    """The jsonl path, the ``limit`` and the real GPT-2 tokenizer (leading-space endings)."""
    from gpt2.model.tokenizer import get_tokenizer

    tok = get_tokenizer()
    ex = {
        "ind": 24,
        "activity_label": "Roof shingle removal",
        "ctx_a": "A man is sitting on a roof.",
        "ctx_b": "he",
        "ctx": "A man is sitting on a roof. he",
        "split": "val",
        "split_type": "indomain",
        "label": 3,
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
        "source_id": "activitynet~v_-JhWjGDPHMY",
    }
    path = _write_jsonl(tmp_path / "hs.jsonl", [ex] * 3)
    tokens, mask, label = render_example(ex, tok)
    ctx_len = len(tok.encode(ex["ctx"]))
    assert label == 3 and int(mask[:, :ctx_len].sum()) == 0
    assert tokens[3, ctx_len:][mask[3, ctx_len:].bool()].tolist() == tok.encode(" " + ex["endings"][3])
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=16))
    result = score_hellaswag(model, path, limit=2)
    assert result["n"] == 2 and result["acc"] in (0.0, 1.0) and result["acc_norm"] in (0.0, 1.0)


def test_file_format_errors(tmp_path):
    good = _example("the cat", ["sat", "flew"], 0)
    with pytest.raises(FileNotFoundError, match="hellaswag_path"):
        list(iterate_hellaswag(tmp_path / "missing.jsonl"))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(iterate_hellaswag(bad_json))
    no_endings = _write_jsonl(tmp_path / "e.jsonl", [{"ctx": "the", "label": 0}])
    with pytest.raises(ValueError, match=r"e.jsonl:1: 'endings' must be a list"):
        list(iterate_hellaswag(no_endings))
    no_ctx = _write_jsonl(tmp_path / "c.jsonl", [{"endings": ["a", "b"], "label": 0}])
    with pytest.raises(ValueError, match="no context"):
        list(iterate_hellaswag(no_ctx))
    tok = WordTokenizer(WORDS)
    with pytest.raises(ValueError, match="no label"):
        render_example({"ctx": "the", "endings": ["cat", "dog"], "label": ""}, tok)
    with pytest.raises(ValueError, match=r"'label' must be an ending's index \(0 to 1\), got 5"):
        render_example(_example("the", ["cat", "dog"], 5), tok)
    # each wrong row is named by file and line when the file is read (before any scoring)
    wrong = [("label", 5), ("label", True), ("label", 1.9), ("label", None), ("ctx_b", 5)]
    for n, (key, value) in enumerate(wrong):
        row = {"ctx_a": "the", "ctx_b": "", "endings": ["cat", "dog"], "label": 0, key: value}
        path = _write_jsonl(tmp_path / f"w{n}.jsonl", [good, row])
        with pytest.raises(ValueError, match=rf"w{n}.jsonl:2: (no label|'label' must be|no context)"):
            list(iterate_hellaswag(path))
    assert int(next(iterate_hellaswag(_write_jsonl(tmp_path / "s.jsonl", [{**good, "label": "1"}])))["label"]) == 1
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    model = BigramLM(_bigram({}))
    with pytest.raises(ValueError, match="empty"):
        score_hellaswag(model, empty, tokenizer=tok)
    with pytest.raises(ValueError, match="limit"):
        score_hellaswag(model, [good], limit=0, tokenizer=tok)


def test_hellaswag_path_downloads_once_and_caches(tmp_path, monkeypatch):
    """The download path, run against a file:// URL (tests never touch the network)."""
    source = _write_jsonl(tmp_path / "remote.jsonl", [_example("the cat", ["sat", "flew"], 0)])
    monkeypatch.delenv("GPT2_HELLASWAG", raising=False)
    monkeypatch.setitem(HELLASWAG_URLS, "val", source.as_uri())
    cache = tmp_path / "cache"
    path = hellaswag_path("val", cache_dir=cache)
    assert path == cache / "hellaswag_val.jsonl" and path.read_text() == source.read_text()
    assert [p.name for p in cache.iterdir()] == ["hellaswag_val.jsonl"]  # no temp file left
    source.unlink()  # a second call must use the cache, not the URL
    assert hellaswag_path("val", cache_dir=cache) == path

    # Offline: a clear error that says what to do, and nothing half-written in the cache.
    monkeypatch.setitem(HELLASWAG_URLS, "train", (tmp_path / "nowhere.jsonl").as_uri())
    with pytest.raises(ConnectionError, match="GPT2_HELLASWAG"):
        hellaswag_path("train", cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == ["hellaswag_val.jsonl"]

    # Something that is not HellaSwag (an HTML error page) is not cached.
    html = tmp_path / "page.html"
    html.write_text("<html>rate limited</html>\n")
    monkeypatch.setitem(HELLASWAG_URLS, "test", html.as_uri())
    with pytest.raises(DownloadError, match="is not HellaSwag test"):
        hellaswag_path("test", cache_dir=cache)
    assert not (cache / "hellaswag_test.jsonl").exists()

    with pytest.raises(ValueError, match="unknown HellaSwag split"):
        hellaswag_path("validation")


def test_hellaswag_path_env_override(tmp_path, monkeypatch):
    f = _write_jsonl(tmp_path / "my_val.jsonl", [_example("the", ["cat", "dog"], 0)])
    monkeypatch.setenv("GPT2_HELLASWAG", str(f))
    assert hellaswag_path("val") == f
    with pytest.raises(ValueError, match="val split only"):
        hellaswag_path("train")
    monkeypatch.setenv("GPT2_HELLASWAG", str(tmp_path))
    _write_jsonl(tmp_path / "hellaswag_train.jsonl", [_example("the", ["cat", "dog"], 1)])
    assert hellaswag_path("train") == tmp_path / "hellaswag_train.jsonl"
    monkeypatch.setenv("GPT2_HELLASWAG", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="is not hellaswag_val.jsonl or a folder"):
        hellaswag_path("val")


# --------------------------------------------------------------------------- validation loss
def test_evaluate_loss_equals_mean_of_batch_losses(tiny_config, tmp_path):
    model = GPT(tiny_config)
    tokens = torch.randint(0, tiny_config.vocab_size, (5 * 2 * 16 + 7,))  # 5 full batches + a tail
    B, T = 2, 16
    expected = []
    with torch.no_grad():
        for i in range(5):
            chunk = tokens[i * B * T : (i + 1) * B * T + 1]
            expected.append(model(chunk[:-1].view(B, T), chunk[1:].view(B, T))[1].item())
    model.train()
    result = evaluate_loss(model, tokens, batch_size=B, seq_len=T)
    assert model.training  # restored
    assert result["tokens"] == 5 * B * T  # one pass, never wrapping around to a batch twice
    assert result["loss"] == pytest.approx(sum(expected) / 5, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)

    # The same from a token file, and max_batches caps the pass.
    path = tmp_path / "val.npy"
    np.save(path, tokens.numpy().astype(np.uint16))
    capped = evaluate_loss(model, path, batch_size=B, seq_len=T, max_batches=2)
    assert capped["tokens"] == 2 * B * T
    assert capped["loss"] == pytest.approx(sum(expected[:2]) / 2, rel=1e-5)
    # bf16 autocast on CPU: close to fp32.
    low = evaluate_loss(model, path, batch_size=B, seq_len=T, autocast=torch.bfloat16)
    assert low["loss"] == pytest.approx(result["loss"], rel=0.05)


def test_evaluate_loss_errors(tiny_config):
    model = GPT(tiny_config)
    with pytest.raises(ValueError, match="max_batches"):
        evaluate_loss(model, torch.zeros(100, dtype=torch.long), 2, 8, max_batches=0)
    with pytest.raises(ValueError, match="tokens"):
        evaluate_loss(model, torch.zeros(10, dtype=torch.long), 2, 8)
    with pytest.raises(FileNotFoundError):
        evaluate_loss(model, "/nonexistent/val.bin", 2, 8)


def test_evaluating_a_loader_leaves_it_where_it_was(tiny_config):
    """evaluate_loss reset the caller's loader: one used for training (a callback scoring the train
    loss, or one loader passed as train and val data) replayed its batches afterwards.
    """
    from gpt2 import TrainConfig, Trainer
    from gpt2.data import TokenLoader

    tokens = torch.randint(0, tiny_config.vocab_size, (2000,), generator=torch.Generator().manual_seed(0))
    loader = TokenLoader(tokens, 2, 8)
    for _ in range(5):
        loader.next_batch()
    before = loader.state_dict()
    result = evaluate_loss(GPT(tiny_config), loader, 2, 8, max_batches=3)
    assert result["tokens"] == 3 * 2 * 8 and loader.state_dict() == before
    with pytest.raises(ValueError, match="the loader reads batches of 2 x 8, not 4 x 16"):
        evaluate_loss(GPT(tiny_config), loader, 4, 16)

    def losses(val_data):
        torch.manual_seed(0)
        config = TrainConfig(micro_batch_size=2, seq_len=8, max_steps=6, eval_interval=2, eval_steps=2, out_dir=None)
        train = TokenLoader(tokens, 2, 8)
        with Trainer(GPT(tiny_config), config, train, train if val_data else None, sinks=[]) as trainer:
            return [r["loss"] for r in trainer.fit()]

    assert losses(val_data=True) == losses(val_data=False)  # the evaluations did not rewind training


def test_hellaswag_rejects_token_ids_beyond_the_model_vocabulary(tiny_config):
    """The forward reads no id values (no GPU sync), so ids are checked on the host first."""
    model = GPT(tiny_config)  # 128 tokens
    words = WORDS + [f"w{i}" for i in range(200)]  # "w199" has id 212
    example = _example("the cat", ["sat", "w199", "flew", "moon"], label=0)
    with pytest.raises(ValueError, match=r"token id 212, but the model has vocab_size=128"):
        score_hellaswag(model, [example], tokenizer=WordTokenizer(words))


def test_evaluate_loss_checks_token_ids_before_the_model(tiny_config):
    """forward does not check ids (that would sync the GPU); the evaluation's loader does, on the CPU."""
    from gpt2 import evaluate_loss

    model = GPT(tiny_config)  # vocabulary of 128
    tokens = (np.arange(400) % 200).astype(np.uint16)
    with pytest.raises(ValueError, match="vocabulary"):
        evaluate_loss(model, tokens, 2, 16)


# --------------------------------------------------------------------------- non-finite loss
def test_gpt2_eval_of_a_broken_model_exits_non_zero_naming_it(tmp_path, capsys):
    """A model whose loss is NaN (here a NaN final layer norm) is never reported as a number
    with exit 0: one line naming the model directory, exit 2 (a bad input). Run through the
    command line's main() in this process.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2.cli import main

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=32))
    with torch.no_grad():
        hf.transformer.ln_f.weight[0] = float("nan")
    model_dir = tmp_path / "broken-model"
    hf.save_pretrained(model_dir)
    tokens = tmp_path / "val.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 50257, 200, dtype=np.uint16))
    args = ["--model", str(model_dir), "--data", str(tokens), "--seq-len", "16", "--batch-size", "2", "--device", "cpu"]
    capsys.readouterr()  # transformers' own bar of save_pretrained
    code = main(["eval", *args])
    stdout, stderr = capsys.readouterr()
    assert code == 2, stderr
    # stderr could also hold a progress bar ("eval: 2batch [...]", erased when done)
    lines = [line for line in re.split(r"[\r\n]", stderr) if line.strip() and not line.startswith("eval:")]
    assert len(lines) == 1 and lines[0].startswith("gpt2 eval: error: "), stderr
    assert str(model_dir) in lines[0] and "nan" in lines[0]
    assert "val loss" not in stdout


def test_trainer_evaluation_of_a_non_finite_model_raises_naming_the_run(tmp_path):
    """Trainer.evaluate and the end-of-training evaluation (gpt2.cli.common.val_loss, what
    `gpt2 train` reports) refuse a NaN loss with an error naming the run directory.
    """
    from gpt2 import TrainConfig
    from gpt2.cli.common import val_loss
    from gpt2.eval.loss import NonFiniteLossError
    from gpt2.train.trainer import Trainer

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32))
    tokens = torch.randint(0, 64, (400,))
    config = TrainConfig(micro_batch_size=2, seq_len=16, max_steps=1, out_dir=str(tmp_path / "run"), progress=False)
    with Trainer(model, config, tokens, tokens, sinks=[]) as trainer:
        assert math.isfinite(trainer.evaluate())
        with torch.no_grad():
            model.lm_head.weight[3, 0] = float("inf")
        with pytest.raises(NonFiniteLossError, match=r"model being trained \(out_dir .*run, step 0\).* (nan|inf)"):
            trainer.evaluate()
        with pytest.raises(NonFiniteLossError, match=r"model trained in .*run \(step 0\)"):
            val_loss(trainer, tokens, max_batches=2)


def test_a_loader_without_state_dict_is_named_not_an_attribute_error(tiny_config):
    class OnlyBatches:
        batch_size, seq_len = 2, 8

        def next_batch(self):
            return torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)

    model = GPT(tiny_config)
    with pytest.raises(TypeError, match="a loader to evaluate needs reset.*OnlyBatches has no reset, state_dict"):
        evaluate_loss(model, OnlyBatches(), 2, 8, max_batches=1)

"""What a newcomer meets on the way from `bash run.sh` on: an empty answer said as such, an instruction
shown with its sample, and a run folder named from the wrong folder reported as a missing folder first.
"""

from __future__ import annotations

import pytest
import torch

from gpt2 import GPT, GPTConfig
from gpt2.cli import main
from gpt2.cli.common import EMPTY_SAMPLE
from gpt2.errors import Gpt2Error
from gpt2.model.tokenizer import EOT_TOKEN


@pytest.fixture(scope="module")
def ends_at_once(tmp_path_factory):
    """A tiny GPT-2 whose every next token is <|endoftext|>: the final LayerNorm outputs a constant vector,
    which the (tied) embedding row of <|endoftext|> matches best.
    """
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=32))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight[EOT_TOKEN].fill_(1.0)
    folder = tmp_path_factory.mktemp("eot") / "model"
    model.save_pretrained(folder)
    return folder


def test_an_empty_answer_is_said_and_the_instruction_shown(ends_at_once, capsys):
    code = main(
        [
            "sample",
            "--model",
            str(ends_at_once),
            "--instruction",
            "Give the opposite of the word.",
            "--input",
            "hot",
            "--temperature",
            "0",
            "--max-new-tokens",
            "5",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "### Instruction:\nGive the opposite of the word.\n\n### Input:\nhot\n\n### Response:\n" in out
    assert EMPTY_SAMPLE in out


def test_a_run_folder_missing_here_is_said_before_the_hub(tmp_path, monkeypatch):
    # `cd /tmp && gpt2 sample --model runs/shakespeare`: no such folder in /tmp, the hub is offline
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Gpt2Error) as caught:
        GPT.from_pretrained("runs/shakespeare")
    message = str(caught.value)
    assert f"no folder 'runs/shakespeare' exists in {str(tmp_path)!r}" in message
    assert message.index("no folder") < message.index("hub")

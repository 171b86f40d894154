"""gpt2: a reusable GPT-2 library.

The model (124M to 1.5B presets), generation with a KV cache, Hugging Face weight loading and
export, the GPT-2 tokenizer, token shards and a rank-aware loader (:mod:`gpt2.data`), and a
``Trainer`` with every speed-up of the GPT-2 reproductions.
``from gpt2 import GPT, GPTConfig, Trainer, TrainConfig``.

One way to do each thing, as methods: ``GPT.from_pretrained`` loads, ``model.generate`` /
``model.stream`` decode, ``model.save_pretrained`` exports, and ``trainer.save_checkpoint`` /
``trainer.load_checkpoint`` save and restore a run.
"""

from gpt2.errors import Gpt2Error, InvalidValueError, MissingFileError
from gpt2.eval.hellaswag import hellaswag_path, score_hellaswag
from gpt2.eval.loss import evaluate_loss
from gpt2.files import DownloadError
from gpt2.model.checkpoint_files import CheckpointMismatchError, NonFiniteWeightsError, find_latest_checkpoint
from gpt2.model.config import PRESETS, GPTConfig
from gpt2.model.generate import KVCache, pad_prompts, sample_next
from gpt2.model.gpt import GPT
from gpt2.model.hf import load_hf_state_dict
from gpt2.model.hf_convert import config_from_hf, gpt_to_hf_state_dict, hf_config_from_gpt, hf_to_gpt_state_dict
from gpt2.model.tokenizer import EOT_TOKEN, Tokenizer, TokenizerNotAvailableError, get_tokenizer
from gpt2.train.config import RecoveryConfig, TrainConfig
from gpt2.train.metrics import ConsoleSink, JSONLSink, RunOutputError
from gpt2.train.optim import build_optimizer, lr_at
from gpt2.train.precision import PrecisionPolicy, resolve_precision
from gpt2.train.trainer import Trainer, TrainingDivergedError

__all__ = [
    # errors: every one gpt2 raises on purpose is a Gpt2Error
    "Gpt2Error",
    "InvalidValueError",
    "MissingFileError",
    # model and generation
    "GPT",
    "GPTConfig",
    "PRESETS",
    "KVCache",
    "sample_next",
    "pad_prompts",
    # Hugging Face interop
    "hf_to_gpt_state_dict",
    "gpt_to_hf_state_dict",
    "config_from_hf",
    "hf_config_from_gpt",
    "load_hf_state_dict",
    "CheckpointMismatchError",
    # tokenizer and downloads
    "Tokenizer",
    "get_tokenizer",
    "EOT_TOKEN",
    "TokenizerNotAvailableError",
    "DownloadError",
    # training
    "Trainer",
    "RecoveryConfig",
    "TrainConfig",
    "TrainingDivergedError",
    "RunOutputError",
    "PrecisionPolicy",
    "resolve_precision",
    "build_optimizer",
    "lr_at",
    "find_latest_checkpoint",
    "NonFiniteWeightsError",
    "ConsoleSink",
    "JSONLSink",
    # evaluation
    "evaluate_loss",
    "score_hellaswag",
    "hellaswag_path",
]
__version__ = "0.1.0"

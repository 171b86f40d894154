"""gpt2: a reusable GPT-2 library.

The model (124M to 1.5B presets), generation with a KV cache, Hugging Face weight loading and
export, the GPT-2 tokenizer, token shards and a rank-aware loader, and a ``Trainer`` with every
speed-up of the GPT-2 reproductions. ``from gpt2 import GPT, GPTConfig, Trainer, TrainConfig``.
"""

from .checkpoint import NonFiniteWeightsError, find_latest_checkpoint, load_checkpoint, save_checkpoint
from .config import PRESETS, GPTConfig, TrainConfig
from .data import (
    DownloadError,
    TokenLoader,
    load_tiny_shakespeare,
    load_tokens,
    tiny_shakespeare_path,
    tokenize_file,
    write_shards,
)
from .eval import evaluate_loss
from .hellaswag import hellaswag_path, score_hellaswag
from .generate import KVCache, generate, pad_prompts, sample_next, stream
from .hf import (
    CheckpointMismatchError,
    config_from_hf,
    from_pretrained,
    gpt_to_hf_state_dict,
    hf_config_from_gpt,
    hf_to_gpt_state_dict,
    load_hf_state_dict,
    save_pretrained,
)
from .metrics import ConsoleSink, JSONLSink
from .model import GPT
from .optim import build_optimizer, lr_at
from .precision import PrecisionPolicy, resolve_precision
from .tokenizer import EOT_TOKEN, Tokenizer, TokenizerNotAvailableError, get_tokenizer
from .trainer import Trainer, TrainingDivergedError

__all__ = [
    # model and generation
    "GPT", "GPTConfig", "PRESETS", "KVCache", "generate", "stream", "sample_next", "pad_prompts",
    # Hugging Face interop
    "from_pretrained", "save_pretrained", "hf_to_gpt_state_dict", "gpt_to_hf_state_dict",
    "config_from_hf", "hf_config_from_gpt", "load_hf_state_dict", "CheckpointMismatchError",
    # tokenizer and data
    "Tokenizer", "get_tokenizer", "EOT_TOKEN", "TokenizerNotAvailableError", "TokenLoader",
    "tiny_shakespeare_path", "load_tiny_shakespeare", "tokenize_file", "write_shards", "load_tokens",
    "DownloadError",
    # training
    "Trainer", "TrainConfig", "TrainingDivergedError", "PrecisionPolicy", "resolve_precision",
    "build_optimizer", "lr_at", "save_checkpoint", "load_checkpoint", "find_latest_checkpoint",
    "NonFiniteWeightsError", "ConsoleSink", "JSONLSink",
    # evaluation
    "evaluate_loss", "score_hellaswag", "hellaswag_path",
]
__version__ = "0.1.0"

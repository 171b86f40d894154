"""The jobs behind the command line and the example scripts: one function per command, each
taking its options dataclass from :mod:`gpt2.jobs.options`."""

from __future__ import annotations

import argparse
from typing import Any

from .options import (BenchOptions, EvalOptions, ExportOptions, FinetuneOptions, PrepareOptions, SampleOptions,
                      TrainOptions)

# TEMPORARY (until the job bodies take their options dataclass): the flat attribute names the
# jobs in gpt2.recipes read.
_LORA_NAMES = {"rank": "lora_rank", "alpha": "lora_alpha", "dropout": "lora_dropout",
               "target_modules": "lora_targets", "include_lm_head": "lora_head",
               "include_embeddings": "lora_embeddings"}


def _legacy(options: Any) -> argparse.Namespace:
    from ..cli.layers import option_fields

    values = {}
    for path, key, _ in option_fields(type(options)):
        value = options
        for name in path:
            value = getattr(value, name)
        name = path[-1]
        if path[0] == "lora":
            if name not in _LORA_NAMES:
                continue
            name = _LORA_NAMES[name]
            if name == "lora_targets":
                value = list(value or ())
        values[name] = list(value) if isinstance(value, tuple) and name == "input" else value
    values["on_cuda"] = __import__("gpt2.cli", fromlist=["_on_cuda"])._on_cuda(values.get("device"))
    return argparse.Namespace(**values)


def _job(name: str):
    def run(options: Any) -> Any:
        from .. import recipes

        return getattr(recipes, name)(_legacy(options))

    run.__name__ = name
    return run


train_job = _job("train_job")
finetune_job = _job("finetune_job")
sample_job = _job("sample_job")
prepare_job = _job("prepare_job")
eval_job = _job("eval_job")
export_job = _job("export_job")
bench_job = _job("bench_job")


def check_options(command: str, options: Any) -> None:
    """Build what a ``train`` / ``finetune`` job builds from its options, to fail before any
    worker process starts."""
    from .. import recipes

    recipes.check_options(command, _legacy(options))

"""The private ``torch.nn.utils.parametrize`` names minlora relies on, in one place.

* ``_inject_property(module, name)`` puts the ``module.<name>`` property on a parametrized module's
  class; minlora gives each LoRA layer a class of its own and must re-create that property on it.
* ``_cache_enabled`` is true inside ``with parametrize.cached():``; the fast forward steps aside then.

If a torch release renames them, importing minlora fails here, naming the missing one.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

REQUIRED_NAMES = ("_inject_property", "_cache_enabled")


def missing_names() -> list[str]:
    return [name for name in REQUIRED_NAMES if not hasattr(parametrize, name)]


if missing_names():
    raise ImportError(
        f"minlora needs torch.nn.utils.parametrize.{', '.join(missing_names())}, which torch {torch.__version__} "
        f"does not have; install a torch 2.x release minlora is tested with, or report this torch version"
    )

inject_property = parametrize._inject_property


def parametrize_cache_enabled() -> bool:
    return bool(parametrize._cache_enabled)  # a nesting counter, read each call (a module global)

"""The private ``torch.nn.utils.parametrize`` names minlora relies on, in one place: a torch release
that renames one fails here, at import, naming it.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize


def missing_names() -> list[str]:
    return [name for name in ("_inject_property", "_cache_enabled") if not hasattr(parametrize, name)]


if missing_names():
    raise ImportError(
        f"minlora needs torch.nn.utils.parametrize.{', '.join(missing_names())}, which torch {torch.__version__} "
        f"does not have; install a torch 2.x release minlora is tested with, or report this torch version"
    )

# puts the `module.<name>` property on a parametrized module's class (minlora gives each its own class)
inject_property = parametrize._inject_property


def parametrize_cache_enabled() -> bool:
    # true inside `parametrize.cached()`; a counter, so it is read at each call
    return bool(parametrize._cache_enabled)

"""The private ``torch.nn.utils.parametrize`` names minlora relies on, in one place.

minlora uses two names that are not part of torch's public API:

* ``parametrize._inject_property(module, tensor_name)``: puts the ``module.<tensor_name>``
  property on a parametrized module's class. minlora gives each LoRA layer a class of its own
  (fast forward, deepcopy, pickling) and must re-create that property on it.
* ``parametrize._cache_enabled``: true inside ``with parametrize.cached():``; the fast LoRA
  forward steps aside then so the cached merged weight is used.

Both have been stable across torch 2.x. If a torch release
renames them, importing minlora fails here with a message naming the missing one, rather than an
``AttributeError`` deep inside a forward; ``tests/test_minlora_compat.py`` checks them on the
installed torch.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

__all__ = ["inject_property", "parametrize_cache_enabled", "REQUIRED_NAMES", "missing_names"]

# Names minlora needs from torch.nn.utils.parametrize.
REQUIRED_NAMES = ("_inject_property", "_cache_enabled")


def missing_names() -> list[str]:
    """The required private names this torch lacks (empty when minlora can run)."""
    return [name for name in REQUIRED_NAMES if not hasattr(parametrize, name)]


_missing = missing_names()
if _missing:
    raise ImportError(
        f"minlora needs torch.nn.utils.parametrize.{', '.join(_missing)}, which torch {torch.__version__} "
        f"does not have; install a torch version minlora supports (the 2.x releases it is tested "
        f"with) or report this torch version to the minlora maintainers"
    )

inject_property = parametrize._inject_property


def parametrize_cache_enabled() -> bool:
    """True inside ``torch.nn.utils.parametrize.cached()`` (read each call: it is a module global)."""
    return bool(parametrize._cache_enabled)  # a nesting counter in torch

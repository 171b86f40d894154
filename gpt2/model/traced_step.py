"""The decoding step of generation on the CPU, traced once by TorchScript and run by its interpreter.

An eager decoding step at batch 1 spends much of its time in Python, not in arithmetic: about 25 operations
and a dozen module calls per layer, each a trip through Python and the dispatcher, for matrices of one row.
:class:`DecodingSteps` records the step's operations once (``torch.jit.trace``, a fraction of a second) and
later steps run them from C++, with the same kernels in the same order: the same hidden states bit for bit,
so the same tokens. Measured (docs/benchmarks.md, "Generation vs llama.cpp"): 1.2x tokens/s at 4 x 128 and
about 1.05x at GPT-2 124M, batch 1, one thread.

A trace replays the operations of the step it recorded, with the model's live parameters (weights changed in
place, by an optimizer or through ``.data``, are read as they are now). What a trace cannot follow, Python
decisions, is fixed in its key or checked before each call: the batch size, the cache's length, padded
prompts or not, the parameters themselves (a parameter replaced by another tensor), and the modules, which
must be this package's own (a subclass's forward, a parametrization such as LoRA, or a hook would run Python
the trace does not replay: such models decode eagerly). Compiled models keep their compiled step.

TorchScript is deprecated (torch 2.13 warns) but still there; where tracing fails or ``torch.jit`` is gone,
generation decodes eagerly, with the same tokens.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn as nn

from gpt2 import torch_compat

if TYPE_CHECKING:  # pragma: no cover
    from gpt2.model.generate import KVCache
    from gpt2.model.gpt import GPT

ModuleType = TypeVar("ModuleType", bound=type)

# Eager decoding steps of one kind (model, batch size, cache length, padded or not), over all calls, after which
# that step is traced: tracing and the interpreter's first two (optimising) runs cost about 0.4 s at 4 x 128 and
# 0.5-1.1 s at 124M, what 100-250 traced steps save, so only a step that keeps being used is traced. None: never
# trace nor replay (every step eager, e.g. to compare or to debug).
TRACE_AFTER_STEPS: int | None = 128
# traces kept per model (batch sizes, cache lengths, padded or not), the least recently used dropped first
MAX_TRACES = 4


# torch's own modules a GPT is made of; replayable adds this package's
_REPLAYABLE: set[type] = {nn.ModuleDict, nn.ModuleList, nn.Linear, nn.LayerNorm, nn.Embedding, nn.Dropout, nn.GELU}


def replayable(module_type: ModuleType) -> ModuleType:
    """Class decorator: ``module_type``'s forward (not its subclasses') makes no Python decision that
    :func:`_signature` does not see (its plain-typed attributes, its parameters), so a trace of a decoding step
    through it replays it. This package's GPT modules and ``Int8Linear`` are.
    """
    _REPLAYABLE.add(module_type)
    return module_type


class _ModelTraces:
    """A model's traced steps by key, the eager steps counted by key, and what the traces assume."""

    def __init__(self, signature: tuple[Any, ...]) -> None:
        self.signature = signature
        # key -> _Replay, or None where tracing failed (not tried again)
        self.traces: dict[tuple[Any, ...], _Replay | None] = {}
        self.eager_steps: dict[tuple[Any, ...], int] = {}


# model -> its _ModelTraces
_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DecodingSteps:
    """The traced decoding steps one generation call may use: :meth:`replay` gives the step for a cache, or None
    (decode eagerly), and counts the eager steps. The model is checked once, when the call starts (see the
    module's docstring).
    """

    def __init__(self, model: GPT, batch: int, padded: bool) -> None:
        self.model, self.batch, self.padded = model, batch, padded
        self.traces: _ModelTraces | None = None
        if TRACE_AFTER_STEPS is None:
            return
        signature = _signature(model)
        if signature is None:
            return
        kept = _TRACES.get(model)
        if kept is None or kept.signature != signature:
            # the traces of other parameters would keep those alive: drop them all
            kept = _TRACES[model] = _ModelTraces(signature)
        self.traces = kept

    def replay(self, cache: KVCache) -> _Replay | None:
        """The traced step for ``cache`` (traced now if this step has run eagerly ``TRACE_AFTER_STEPS`` times), or
        None: then the caller decodes eagerly, and that step is counted.

        Call the step as ``step(ids, cache, position_ids, attn_mask)``: it writes the new keys and values into the
        cache and returns the hidden states ``(B, 1, C)``, as the eager step would.
        """
        if self.traces is None:
            return None
        key = (self.batch, cache.max_len, self.padded)
        traces = self.traces.traces
        if key in traces:
            # most recently used last
            traces[key] = traces.pop(key)
            return traces[key]
        seen = self.traces.eager_steps.get(key, 0)
        if seen < TRACE_AFTER_STEPS:
            self.traces.eager_steps[key] = seen + 1
            return None
        traces[key] = _Replay.of(self.model, cache, self.batch, self.padded)
        while len(traces) > MAX_TRACES:
            traces.pop(next(iter(traces)))
        return traces[key]


class _Replay:
    """A traced step, called with the cache object (the trace takes its tensors)."""

    def __init__(self, traced: Any, padded: bool) -> None:
        self.traced = traced
        self.padded = padded

    @classmethod
    def of(cls, model: GPT, cache: KVCache, batch: int, padded: bool) -> _Replay | None:
        """``model``'s step traced on copies of ``cache``'s tensors (tracing runs the step, which writes
        into the cache), or None where TorchScript fails.
        """
        pos = cache.pos.clone()
        keys = [k.clone() for k in cache.k]
        values = [v.clone() for v in cache.v]
        ids = torch.zeros(batch, 1, dtype=torch.long, device=cache.pos.device)
        inputs: tuple[Any, ...] = (ids, pos, keys, values)
        if padded:
            position_ids = torch.zeros(batch, 1, dtype=torch.long, device=ids.device)
            attn_mask = torch.ones(batch, 1, 1, cache.max_len, dtype=torch.bool, device=ids.device)
            inputs += (position_ids, attn_mask)
        try:
            with warnings.catch_warnings():
                # torch.jit.trace is deprecated; TracerWarnings flag Python values the trace fixes, which the key holds
                warnings.simplefilter("ignore")
                traced = torch.jit.trace(_Step(model, type(cache)), inputs, check_trace=False)
        except Exception:
            return None
        return cls(traced, padded)

    def __call__(
        self, ids: torch.Tensor, cache: KVCache, position_ids: torch.Tensor | None, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        if self.padded:
            return self.traced(ids, cache.pos, cache.k, cache.v, position_ids, attn_mask)
        return self.traced(ids, cache.pos, cache.k, cache.v)


class _Step(nn.Module):
    """What is traced: one decoding step of ``model`` over a KV cache given as its tensors."""

    def __init__(self, model: GPT, cache_type: type[KVCache]) -> None:
        super().__init__()
        self.model = model
        self.cache_type = cache_type

    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cache = self.cache_type.of_tensors(pos, keys, values)
        return self.model(ids, kv_cache=cache, position_ids=position_ids, attn_mask=attn_mask, head=False)[0]


def _signature(model: nn.Module) -> tuple[Any, ...] | None:
    """What a trace of ``model``'s step assumes: every module's type and settings (its attributes of plain types:
    ``flash``, ``n_head``, ``eps``...) and every parameter and buffer (identity, storage, dtype, shape); or None
    where a trace would not replay the step (a module that is not this package's or torch's own, a hook, a tensor
    not on the CPU, a compiled model, autocast).
    """
    if torch_compat.is_compiled(model) or torch.is_autocast_enabled("cpu"):
        return None
    modules = []
    for module in model.modules():
        if type(module) not in _REPLAYABLE or torch_compat.has_hooks(module):
            return None
        modules.append((type(module), _settings(module)))
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return (*modules, *((id(t), t.data_ptr(), t.dtype, t.shape) for t in tensors))


# the attribute types whose values a forward may branch on, and a trace would fix
_SETTING_TYPES = (bool, int, float, str, tuple, type(None))


def _settings(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """``module``'s public attributes of plain types (``training`` included), by name."""
    return tuple(
        (name, value)
        for name, value in vars(module).items()
        if not name.startswith("_") and isinstance(value, _SETTING_TYPES)
    )

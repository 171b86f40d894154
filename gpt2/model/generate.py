"""Sampling from a GPT: temperature, top-k, top-p, greedy, EOS, batched prompts, and a KV cache
(decoding one token is one (B, 1) forward, with the same tokens as without the cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpt2.errors import InvalidValueError
from gpt2.model.config import Range, check_value, rounded_up
from gpt2.model.quantize import int8_weights
from gpt2.model.tokenizer import get_tokenizer
from gpt2.torch_compat import uncompiled

if TYPE_CHECKING:  # pragma: no cover
    from gpt2.model.gpt import GPT


class KVCache:
    """Keys and values of every layer in static buffers of ``max_len`` positions.

    The write position is a tensor (``pos``), never a Python int, and every step attends over the
    whole buffer with a mask built from ``pos``: every decoding step has the same shapes and graph,
    so ``torch.compile`` compiles it once. A forward calls :meth:`step`, then each layer :meth:`update`.
    Buffers are made at a layer's first update in the keys' dtype (bf16/fp16 under autocast), as
    zeros so masked-out slots never hold NaN.
    """

    def __init__(self, n_layer: int, max_len: int, device: torch.device | str | None = None) -> None:
        # max_len is checked by the forward that gets the cache (room for the new tokens, at most block_size)
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.max_len = max_len
        # positions cached so far
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        # where update writes: the current step's positions
        self.index: torch.Tensor | None = None

    def step(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a forward over ``T`` new tokens: their absolute positions ``(T,)`` (where the
        layers' updates write) and the ``(T, max_len)`` boolean causal mask (True = may attend).
        """
        self.index = self.pos + torch.arange(T, device=self.pos.device)
        self.pos += T
        return self.index, torch.arange(self.max_len, device=self.pos.device) <= self.index[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` ``(B, nh, T, hs)`` at the positions of :meth:`step`; return the whole buffers
        ``(B, nh, max_len, hs)``.
        """
        B, nh, _, hs = k.shape
        if self.k[layer] is None:
            self.k[layer] = k.new_zeros(B, nh, self.max_len, hs)
            self.v[layer] = v.new_zeros(B, nh, self.max_len, hs)
        cache_k, cache_v = self.k[layer], self.v[layer]
        if cache_k.shape[:2] != (B, nh) or cache_k.size(3) != hs or cache_k.dtype != k.dtype:
            raise RuntimeError(
                f"KV cache of layer {layer} holds {tuple(cache_k.shape)} {cache_k.dtype}, got new keys "
                f"{tuple(k.shape)} {k.dtype}: one cache serves one batch, start a new KVCache"
            )
        cache_k.index_copy_(2, self.index, k)
        cache_v.index_copy_(2, self.index, v)
        return cache_k, cache_v

    @classmethod
    def for_model(cls, model: GPT, max_len: int | None = None) -> KVCache:
        """An empty cache for ``model``, holding up to ``max_len`` (default ``block_size``) positions."""
        return cls(model.config.n_layer, max_len or model.config.block_size, model.device)


# The KV cache's length is rounded up to a multiple of this (at most block_size): calls whose prompt plus new tokens
# fall in one window share one compiled decoding step. The masked slots change no
# bit of the outputs (the attention's softmax adds exact zeros for them) and cost at most 63 masked keys a step.
CACHE_LENGTH_MULTIPLE = 64


# The rules of the sampling arguments, checked in one place: SamplingConfig.
SAMPLING_RULES = {
    "temperature": Range(low=0),
    "top_k": Range(low=1, integer=True, optional=True),
    "top_p": Range(low=0, low_open=True, high=1, optional=True),
}


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is picked: ``temperature`` (0 is greedy), ``top_k``, ``top_p``; checked when
    made. numpy numbers are taken (as Python ones); NaN, bools and strings are not. An invalid value
    raises a ValueError naming it, e.g. ``generate.top_k must be a positive integer (or None), got 0``.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        for name, rule in SAMPLING_RULES.items():
            # frozen: the checked (normalised) value is set the way dataclasses set fields
            object.__setattr__(self, name, check_value("generate", name, getattr(self, name), rule))

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """:func:`sample_next` with these settings (checked once, when this was made)."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        logits = _scaled_logits(logits, self.temperature)
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # (B, V)
        if self.top_p is not None and self.top_p < 1.0:
            sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
            # A token stays if the mass of the tokens ranked before it is still below top_p, so the
            # most likely token is always kept and the kept mass is the first to reach top_p.
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row from ``logits`` ``(B, V)``; greedy (argmax) when temperature is 0.
    ``top_k`` keeps ties with the k-th token; both filters apply after the temperature, as in
    Hugging Face's samplers.
    """
    return SamplingConfig(temperature, top_k, top_p).sample(logits, generator)


def _scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in fp32 (bf16 logits have ~3 significant digits, too coarse for
    softmax tails), for every temperature > 0 and every finite logit.

    A temperature so small (1e-40) or logits so large (near fp32's limit) that the quotient overflows
    would make the softmax NaN; then each row's distances from its largest logit are divided in
    float64 instead: the same softmax, which for such a temperature picks the largest logit
    (greedy, ties shared). Non-finite logits (NaN, +inf, a row with no finite logit) are refused.
    """
    logits = logits.float()
    scaled = logits / temperature
    # One host sync per token: the common case is this one check.
    if torch.isfinite(scaled.amax(dim=-1)).all():
        return scaled
    top = logits.amax(dim=-1, keepdim=True)
    if not torch.isfinite(top).all():
        raise InvalidValueError(
            "the model's logits hold NaN or +inf (or a row with no finite logit), so no token can be "
            "sampled: the weights or the input are broken (check the model with a forward pass)"
        )
    return ((logits.double() - top) / temperature).float()


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts of different lengths: ``(ids, attention_mask)``, both ``(B, T)``. Left, so
    every row's next token is sampled from the last column; pad positions are masked out.
    """
    if isinstance(prompts, torch.Tensor) or len(prompts) == 0:
        raise InvalidValueError("prompts must be a non-empty list of token-id lists")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise InvalidValueError(f"every prompt needs at least one token; prompts {empty} are empty")
    pad_id = check_value("pad_prompts", "pad_id", pad_id, Range(low=0, integer=True))
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, T - len(p) :] = True
    return ids, mask


def stream(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    attention_mask: torch.Tensor | None = None,
    weights: str = "model",
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, ``(B,)``, one step at a time.

    ``idx`` ``(B, T)`` holds the prompts; ``attention_mask`` ``(B, T)`` marks real prompt tokens
    (True) in left-padded batched prompts (see :func:`pad_prompts`), which then give the same
    tokens as each prompt alone. Rows that have emitted ``eos_token_id`` keep emitting it; the
    iteration stops once every row has. ``temperature=0`` is greedy. Past ``block_size`` tokens
    the context is cropped to the last ``block_size`` (nanoGPT's behaviour). Arguments are checked
    when this is called, not at the first ``next``. Of ``torch.compile(model)`` or ``model.compile()``
    only the decoding step runs compiled, one graph for every token (one dynamic graph more after
    another cache length); the prompt's forward (one per call, a new shape per length) runs uncompiled.
    On the CPU ``torch.compile(model, options={"cpp_wrapper": True})`` (Inductor's wrapper in C++) decodes
    faster than the default wrapper; compiling pays only after thousands of tokens (docs/benchmarks.md).

    ``weights``: ``"model"`` (the default) computes with the model's own weights; ``"int8"`` reads every
    weight matrix in int8 on the CPU (faster, other tokens: see :mod:`gpt2.model.quantize`), through an int8
    twin made from the model as it is at this call (its hooks, modules, settings and weights); of a compiled
    model the twin decodes compiled too (the same tokens as the eager twin).
    """
    check_idx(idx)
    V = model.config.vocab_size
    # numpy numbers are taken (as Python ones); NaN, bools and strings are not
    max_new_tokens = check_value("generate", "max_new_tokens", max_new_tokens, Range(low=0, integer=True))
    sampling = SamplingConfig(temperature, top_k, top_p)
    eos_token_id = check_value(
        "generate", "eos_token_id", eos_token_id, Range(0, V, high_open=True, optional=True, integer=True)
    )
    seed = check_value("generate", "seed", seed, Range(integer=True, optional=True))
    if seed is not None and generator is not None:
        raise InvalidValueError("pass either seed or generator, not both")
    _check_prompt_ids(idx, V)
    device = model.device
    idx = idx.to(device).long()
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != idx.shape:
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
            raise InvalidValueError(f"attention_mask must be a tensor of idx's shape {tuple(idx.shape)}, got {got}")
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        if not bool(attention_mask[:, -1].all()):
            raise InvalidValueError(
                "prompts must be left-padded: the last position of every row must be a real token "
                "(attention_mask True); build them with gpt2.pad_prompts"
            )
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    if weights == "int8":
        model = int8_weights(model)
    elif weights != "model":
        raise InvalidValueError(
            f"generate.weights must be 'model' (the model's own weights) or 'int8' (every weight matrix "
            f"read in int8, on the CPU), got {weights!r}"
        )
    return _stream(model, idx, max_new_tokens, sampling, generator, eos_token_id, use_cache, attention_mask)


def check_index_tensor(name: str, value: Any) -> None:
    """A TypeError naming ``name`` unless ``value`` is an integer tensor (torch.long, or int32)."""
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.long, torch.int32):
        got = getattr(value, "dtype", type(value).__name__)
        raise TypeError(f"{name} must be an integer tensor (torch.long) of token ids, got {got}; convert with .long()")


def check_idx(idx: Any, block_size: int | None = None) -> None:
    """The token ids ``(B, T)`` of a forward (at most ``block_size`` long) or of prompts (cropped by generation):
    types and shapes only, no device sync.
    """
    check_index_tensor("idx", idx)
    if idx.dim() != 2:
        raise InvalidValueError(
            f"idx must have shape (batch, sequence), got shape {tuple(idx.shape)}; for a single sequence use idx[None]"
        )
    if idx.size(0) == 0 or idx.size(1) == 0:
        raise InvalidValueError(
            f"idx is empty (shape {tuple(idx.shape)}): need at least one token per row (e.g. <|endoftext|>, id 50256 "
            f"for GPT-2)"
        )
    if block_size is not None and block_size < idx.size(1):
        raise InvalidValueError(
            f"sequence length {idx.size(1)} exceeds the model's context (block_size={block_size}); "
            f"crop the input to the last {block_size} tokens"
        )


def _check_prompt_ids(idx: torch.Tensor, vocab_size: int) -> None:
    """The forward does not check id values (that would stall the GPU on every call), and on CUDA an
    id out of range is a device-side assert that kills the process: the prompt is checked once, here.
    """
    lo, hi = torch.stack([idx.min(), idx.max()]).tolist()
    if lo < 0 or hi >= vocab_size:
        bad = [int(i) for i in idx.flatten().tolist() if not 0 <= i < vocab_size][:5]
        raise InvalidValueError(
            f"prompt token ids must be in [0, {vocab_size}) (the model's vocab_size), got {bad} "
            f"(min {lo}, max {hi}); was the prompt encoded with another tokenizer?"
        )


def _stream(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    eos_token_id: int | None,
    use_cache: bool,
    attention_mask: torch.Tensor | None,
) -> Iterator[torch.Tensor]:
    was_training = model.training
    # no dropout while sampling; the caller's mode is restored below
    model.eval()
    # The prompt's forward runs uncompiled (see stream); it allocates the cache's buffers too.
    prefill = uncompiled(model)
    try:
        block_size = model.config.block_size
        # The cache holds what this call can reach (fewer keys to attend over than a full context), rounded up
        cache_len = min(block_size, rounded_up(idx.size(1) + max_new_tokens, CACHE_LENGTH_MULTIPLE))
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        cache: KVCache | None = None
        # everything in the context so far (prompt + generated), (B, t); its padding mask None or (B, t)
        tokens, mask = idx, attention_mask
        for _ in range(max_new_tokens):
            # Inference mode, not only no_grad: the step's tensors get no version counters or autograd
            # metadata (measurably faster at batch 1). The token is yielded outside it, as a
            # normal tensor that the caller may modify in place.
            with torch.inference_mode():
                if tokens.size(1) > block_size:
                    # nanoGPT's crop: the last block_size tokens (and their mask)
                    tokens = tokens[:, -block_size:]
                    if mask is not None:
                        mask = mask[:, -block_size:]
                    # Positions are learned and absolute: after a crop every token sits one position
                    # earlier, so the cached keys are stale and the window is recomputed.
                    cache = None
                if cache is not None:
                    # (B, 1), the newest token: a copy, as a view's stride would grow (a recompile each step)
                    step_ids = tokens[:, -1:].clone(memory_format=torch.contiguous_format)
                    hidden = _forward(model, step_ids, cache, mask)
                else:
                    if use_cache:
                        cache = KVCache.for_model(model, cache_len)
                    hidden = _forward(prefill, tokens, cache, mask)
                # (B, C): the last position's hidden states. The head reads them alone: the prompt's other
                # positions are never sampled (a 1,000-token prompt at 124M would cost 77 GFLOP and 200 MB more).
                hidden = hidden[:, -1]
                nxt = sampling.sample(model.logits(hidden), generator)
                if eos_token_id is not None:
                    # Finished rows keep emitting EOS, so the output stays rectangular.
                    nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                    done = done | (nxt == eos_token_id)
                tokens = torch.cat([tokens, nxt[:, None]], dim=1)
                if mask is not None:
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            yield nxt.clone()
            if eos_token_id is not None and bool(done.all()):
                return
    finally:
        model.train(was_training)


def _forward(model: GPT, ids: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None) -> Any:
    """One forward for generation: the last LayerNorm's output ``(B, T, C)`` (the head is applied after). With
    padding ``mask`` ``(B, t)`` (cached + new tokens), positions count real tokens only and attention skips pad
    keys, so a padded prompt yields what it would unpadded. The mask spans the cache's whole buffer, so its shape
    is the same at every decoding step.
    """
    position_ids, attn_mask = None, None
    if mask is not None:
        T, t = ids.size(1), mask.size(1)
        # keys attended over
        S = cache.max_len if cache is not None else t
        # (B, T), not a view: see _stream
        position_ids = (mask.long().cumsum(dim=1)[:, t - T :] - 1).clamp(min=0)
        # (B, S): slots not written yet are False
        keys = torch.nn.functional.pad(mask, (0, S - t))
        causal = torch.ones(T, S, dtype=torch.bool, device=ids.device).tril(diagonal=t - T)  # (T, S)
        # A pad query sees no real key before it; an all-False row would make softmax NaN, so every
        # query may see itself (pad positions' outputs are never used).
        own = torch.zeros(T, S, dtype=torch.bool, device=ids.device)
        own[torch.arange(T), torch.arange(t - T, t)] = True
        attn_mask = (causal[None, None] & keys[:, None, None, :]) | own[None, None]  # (B, 1, T, S)
    return model(ids, kv_cache=cache, position_ids=position_ids, attn_mask=attn_mask, head=False)[0]


def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """Prompt plus up to ``max_new_tokens`` sampled tokens, ``(B, T + n)``; keyword arguments as in
    :func:`stream` (with ``eos_token_id``, ``n`` is smaller when every row finished early).
    """
    new = [column[:, None] for column in stream(model, idx, max_new_tokens, **kwargs)]
    return torch.cat([idx.to(model.device).long(), *new], dim=1)


def stream_text(
    model: Any, prompt: str, max_new_tokens: int, *, stop_at_eot: bool = True, autocast: Any = None, **kwargs: Any
) -> Iterator[str]:
    """Yield the text of one sample piece by piece; an empty ``prompt`` starts from ``<|endoftext|>``.
    ``autocast`` is a zero-argument callable returning the context to sample in, or None; the
    other keyword arguments (``temperature``, ``top_k``, ``top_p``, ``generator``) as in :func:`stream`.
    """
    tokenizer = get_tokenizer()
    eot = tokenizer.eot_token
    ids = tokenizer.encode(prompt) if prompt else [eot]
    eos = eot if stop_at_eot else None
    if autocast is None:
        autocast = contextlib.nullcontext
    produced: list[int] = []
    shown = ""
    with autocast():
        # gpt2.stream rather than model.stream: a torch.compile'd model then runs compiled.
        tokens = stream(model, torch.tensor([ids], dtype=torch.long), max_new_tokens, eos_token_id=eos, **kwargs)
        # each column is (1,)
        for column in tokens:
            token = int(column[0])
            if stop_at_eot and token == eot:
                break
            produced.append(token)
            text = tokenizer.decode(produced)
            # A token may end inside a multi-byte UTF-8 character: hold it back until it is whole.
            if text.endswith("\ufffd"):
                continue
            yield text[len(shown) :]
            shown = text
    text = tokenizer.decode(produced)
    if len(text) > len(shown):
        yield text[len(shown) :]

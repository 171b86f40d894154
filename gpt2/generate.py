"""Sampling from a GPT: temperature, top-k, top-p, greedy, EOS, batched prompts, a KV cache.

The KV cache is preallocated per layer for the whole generation, so decoding one token costs one
(B, 1) forward instead of re-running the whole prefix. Generation with and without the cache gives
identical tokens (tested).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .model import GPT


class KVCache:
    """Keys and values of every layer, preallocated to ``max_len`` positions.

    The model calls :meth:`update` once per layer with the new keys/values and :meth:`advance`
    once per forward, so all layers of a forward see the same ``length`` (the number of cached
    positions before that forward).
    """

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (batch_size, n_head, max_len, head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.size(2)
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} positions > capacity {self.max_len}")
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    @classmethod
    def for_model(cls, model: GPT, batch_size: int, max_len: int | None = None) -> "KVCache":
        cfg = model.config
        p = model.lm_head.weight
        dtype = torch.get_autocast_dtype(p.device.type) if torch.is_autocast_enabled(p.device.type) else p.dtype
        return cls(cfg.n_layer, batch_size, cfg.n_head, max_len or cfg.block_size, cfg.head_dim, p.device, dtype)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row from ``logits`` ``(B, V)``; greedy (argmax) when temperature is 0."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        # Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p
        # (the most likely token is always kept).
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each token
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def _check_args(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float,
                top_k: int | None, top_p: float | None) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32):
        raise ValueError(
            "idx must be a (batch, sequence) tensor of token ids (torch.long); "
            "for one prompt use torch.tensor([ids])"
        )
    if idx.size(1) == 0:
        raise ValueError("the prompt is empty: generation needs at least one token to condition on")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts of different lengths: ``(ids, attention_mask)``, both ``(B, T)``."""
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, T - len(p) :] = True
    return ids, mask


@torch.no_grad()
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
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, ``(B,)``, one step at a time.

    ``attention_mask`` ``(B, T)`` marks real prompt tokens (True) in left-padded batched prompts
    (see :func:`pad_prompts`). Rows that have emitted ``eos_token_id`` keep emitting it; the
    iteration stops once every row has. ``seed`` (or a ``torch.Generator``) makes sampling
    reproducible; ``temperature=0`` is greedy.
    """
    _check_args(model, idx, max_new_tokens, temperature, top_k, top_p)
    if generator is None and seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        yield from _stream(model, idx.to(model.device).long(), max_new_tokens, temperature, top_k,
                           top_p, eos_token_id, generator, use_cache, attention_mask)
    finally:
        model.train(was_training)


def _stream(model, idx, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator,
            use_cache, attention_mask) -> Iterator[torch.Tensor]:
    block_size = model.config.block_size
    B = idx.size(0)
    device = idx.device
    if attention_mask is not None:
        if attention_mask.shape != idx.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal idx shape {tuple(idx.shape)}")
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        if not bool(attention_mask[:, -1].all()):
            raise ValueError("prompts must be left-padded: the last position of every row must be a real token")
    done = torch.zeros(B, dtype=torch.bool, device=device)
    cache: KVCache | None = None
    tokens = idx  # everything so far (prompt + generated), (B, t)
    mask = attention_mask  # None or (B, t)
    for _ in range(max_new_tokens):
        if tokens.size(1) > block_size:  # keep the last block_size tokens (nanoGPT's crop)
            tokens = tokens[:, -block_size:]
            mask = mask[:, -block_size:] if mask is not None else None
            cache = None  # positions shifted: the cache no longer matches, rebuild it
        if use_cache and cache is not None:
            step_ids = tokens[:, -1:]
        else:
            step_ids = tokens
            cache = KVCache.for_model(model, B) if use_cache else None
        logits = _forward(model, step_ids, cache, mask)
        nxt = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done = done | (nxt == eos_token_id)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        yield nxt
        if eos_token_id is not None and bool(done.all()):
            return


def _forward(model: GPT, ids: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
    """One forward for generation. With padding ``mask`` ``(B, t)``, positions count real tokens
    only and attention skips pad keys, so a padded prompt yields what it would unpadded."""
    if mask is None:
        return model(ids, kv_cache=cache)[0]
    T = ids.size(1)
    S = mask.size(1)  # keys visible after this forward (cache + new)
    position_ids = (mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, S - T :]  # (B, T)
    causal = torch.ones(T, S, dtype=torch.bool, device=ids.device).tril(diagonal=S - T)
    attn_mask = causal[None, None] & mask[:, None, None, :]  # (B, 1, T, S)
    # A fully padded query row (a pad position attending nothing) would give NaN: let it see itself.
    diag = torch.zeros(T, S, dtype=torch.bool, device=ids.device)
    diag[torch.arange(T), torch.arange(S - T, S)] = True
    attn_mask = attn_mask | diag[None, None]
    return model(ids, kv_cache=cache, position_ids=position_ids, attn_mask=attn_mask)[0]


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """Prompt plus up to ``max_new_tokens`` sampled tokens, ``(B, T + n)``.

    Keyword arguments as in :func:`stream`: ``temperature`` (0 = greedy), ``top_k``, ``top_p``,
    ``eos_token_id``, ``seed`` / ``generator``, ``use_cache``, ``attention_mask``.
    """
    new = list(stream(model, idx, max_new_tokens, **kwargs))
    idx = idx.to(model.device).long()
    if not new:
        return idx
    return torch.cat([idx, torch.stack(new, dim=1)], dim=1)

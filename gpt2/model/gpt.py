"""The GPT-2 model under GPT-2's module names (``transformer.h.0.attn.c_attn``, ``lm_head``), so
state dicts and LoRA targets read as in nanoGPT and ``transformers``; every projection is a plain
``nn.Linear``, which ``minlora`` parametrizes without touching this file.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from gpt2 import torch_compat
from gpt2.errors import InvalidValueError
from gpt2.model import hf
from gpt2.model.config import GPTConfig, rounded_up
from gpt2.model.generate import KVCache, check_idx, check_index_tensor
from gpt2.model.generate import generate as _generate
from gpt2.model.generate import stream as _stream

# Target value that the loss skips (nanoGPT's convention; Hugging Face uses -100).
IGNORE_INDEX = -1


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.flash = config.flash
        # q, k, v for all heads in one matmul, as in GPT-2's checkpoint layout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True  # type: ignore[attr-defined]
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, kv_cache: KVCache | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # c_attn's output is [q | k | v], each n_embd wide and made of n_head slices of head_dim: views
        # (B, nh, T, hs). Split before the heads, the flash backward's gradients are (B, T, C) views and
        # only the split's concatenation copies them (unbind's stack then a reshape copied twice). Plain
        # view ops, not einops.rearrange: the same views at half the cost per call (decoding calls it 4x a layer).
        q, k, v = (t.unflatten(-1, (self.n_head, -1)).transpose(1, 2) for t in self.c_attn(x).chunk(3, -1))
        if kv_cache is not None:
            # (B, nh, L, hs): the whole static buffer
            k, v = kv_cache.update(self.layer_idx, k, v)
        # Without a mask queries and keys start at the same position (training, a prompt with no
        # cache); a cache or padded prompts always come with an explicit boolean mask.
        is_causal = attn_mask is None
        dropout_p = self.dropout if self.training else 0.0
        if self.flash and is_causal and dropout_p == 0.0 and _cpu_attention_backward(q):
            y = _CpuCausalAttention.apply(q, k, v)
        else:
            attend = F.scaled_dot_product_attention if self.flash else _manual_attention
            y = attend(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
        # (B, T, C): heads side by side again
        y = y.transpose(1, 2).flatten(2)
        return self.resid_dropout(self.c_proj(y))


def _manual_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool, dropout_p: float
) -> torch.Tensor:
    """Attention written out (materialises the (T, S) score matrix): the pre-flash baseline."""
    T, S = q.size(-2), k.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, S)
    if is_causal:
        attn_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    if attn_mask is not None:
        att = att.masked_fill(~attn_mask, float("-inf"))
    # softmax in fp32
    att = F.softmax(att.float(), dim=-1).to(q.dtype)
    att = F.dropout(att, p=dropout_p, training=dropout_p > 0)
    return att @ v  # (B, nh, T, hs)


# The longest sequence whose bf16 attention backward on a CPU is :class:`_CpuCausalAttention`'s. Its forward +
# backward took 0.65x flash's at T=256, 0.54x at T=512, 0.78x (0.69-1.03x) at T=1024 and 1.3x at T=2048
# (docs/benchmarks.md, "bf16 training step").
CPU_ATTENTION_BACKWARD_MAX_T = 1024
# Its queries go in blocks of this many rows: a block sees the keys up to its own end, so most (query, key) pairs
# above the diagonal are never computed.
ATTENTION_BACKWARD_QUERY_ROWS = 128
# The most bytes one of its bf16 (heads, rows, keys) blocks takes.
ATTENTION_BACKWARD_BLOCK_BYTES = 16 * 2**20


def _cpu_attention_backward(q: torch.Tensor) -> bool:
    """Whether the causal attention of ``q`` is :class:`_CpuCausalAttention`'s: bf16 on a CPU, T at most
    :data:`CPU_ATTENTION_BACKWARD_MAX_T`, with a backward to come (eager: a compiled graph makes its own backward).
    """
    training = torch.is_grad_enabled() and q.requires_grad
    short = q.size(-2) <= CPU_ATTENTION_BACKWARD_MAX_T
    return training and short and q.is_cpu and q.dtype == torch.bfloat16 and not torch.compiler.is_compiling()


class _CpuCausalAttention(torch.autograd.Function):
    """Causal attention of bf16 ``(B, nh, T, hs)`` on a CPU: torch's flash kernel forward, and a backward that
    computes the scores again with batched bf16 products, then the softmax's gradient in one fused pass.

    torch's CPU flash backward runs no faster in bf16 than in fp32: at the 124M shape (B=4, T=256) flash's forward +
    backward took 1.5x this one's (docs/benchmarks.md, "bf16 training step"). The gradients differ from the flash
    backward's in rounding only: the scores are rounded to bf16 before their softmax, as under autocast's plain
    attention, and dk and dv add up their query blocks' shares in bf16; the forward is flash's.
    """

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        T, hs = q.shape[-2:]
        scale = 1.0 / math.sqrt(hs)
        # (B * nh, T, hs): a copy of the views into c_attn's output
        q3, k3, v3, g3 = (t.flatten(0, 1) for t in (q, k, v, grad))
        dq, dk, dv = (torch.empty_like(t) for t in (q3, k3, v3))
        # 0 on and below the diagonal, -inf above: the causal mask, added by the scores' product
        mask = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
        rows = min(ATTENTION_BACKWARD_QUERY_ROWS, T)
        heads = max(1, ATTENTION_BACKWARD_BLOCK_BYTES // (rows * T * q.element_size()))
        # The last block of queries first: it sees every key, and writes dk and dv whole; the others add to the
        # keys up to their own end.
        starts = range(0, T, rows)[::-1]
        with torch.autocast(q.device.type, enabled=False):
            for first in range(0, q3.size(0), heads):
                h = slice(first, first + heads)
                for start in starts:
                    end = min(start + rows, T)
                    qb, gb, kb, vb = q3[h, start:end], g3[h, start:end], k3[h, :end], v3[h, :end]
                    # the attention weights again: the scaled, masked scores in bf16, their softmax accumulated in fp32
                    p = torch.baddbmm(mask[start:end, :end], qb, kb.transpose(1, 2), alpha=scale).softmax(-1)
                    # the scores' gradient, then the queries' and keys' through the scale
                    ds = torch_compat.softmax_backward(torch.bmm(gb, vb.transpose(1, 2)), p)
                    # beta=0 ignores what dq and dk held (NaNs too); alpha scales within the product, no pass of its own
                    dq[h, start:end].baddbmm_(ds, kb, beta=0, alpha=scale)
                    if end == T:
                        torch.bmm(p.transpose(1, 2), gb, out=dv[h])
                        dk[h].baddbmm_(ds.transpose(1, 2), qb, beta=0, alpha=scale)
                    else:
                        dv[h, :end].baddbmm_(p.transpose(1, 2), gb)
                        dk[h, :end].baddbmm_(ds.transpose(1, 2), qb, alpha=scale)
        return dq.view_as(q), dk.view_as(k), dv.view_as(v)


class TanhGelu(nn.GELU):
    """GPT-2's GELU, ``nn.GELU(approximate="tanh")``. bf16 activations on a CPU (autocast's), from
    :data:`GELU_TABLE_MIN` values on, are looked up in tables of every bf16 value's GELU and derivative instead: the
    same values, bit for bit, as torch's bf16 kernels (which compute in fp32, as the tables were), forward in 0.51x
    their time and backward in 0.76x at the 124M shape (docs/benchmarks.md, "bf16 training step").
    """

    def __init__(self) -> None:
        super().__init__(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tables = x.dtype == torch.bfloat16 and x.is_cpu and x.numel() >= GELU_TABLE_MIN
        if tables and not torch.compiler.is_compiling():
            return _Bf16TableGelu.apply(x)
        return super().forward(x)


# Fewer bf16 values than this keep torch's kernel: the tables' fixed cost (about 12 us a call) is more than they save
# below about 12,000 values (decoding one token at 124M: 3,072 values, 21 us against torch's 9).
GELU_TABLE_MIN = 16384

# Elements per table lookup: a piece's int32 indices and fp32 derivatives (256 KB each) stay in the core's cache.
# A whole tensor at once took 2x the time in the training step (its indices a fresh 12 MB block).
GELU_TABLE_CHUNK = 65536


@functools.cache
def _gelu_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """The tanh GELU of every bf16 value (bf16) and its derivative (fp32), indexed by the value's 16 bits, from
    torch's own fp32 GELU and its backward's kernel. No autograd: they may first be made inside an activation-
    checkpointed block, where a saved tensor would be one the recomputation does not save.
    """
    # normal tensors even when first made under inference mode: a later training step uses them too
    with torch.inference_mode(False), torch.autocast("cpu", enabled=False):
        bits = torch.arange(2**16, dtype=torch.int32, device="cpu").to(torch.uint16)
        x = bits.view(torch.bfloat16).float()
        values = F.gelu(x, approximate="tanh").to(torch.bfloat16)
        return values, torch_compat.tanh_gelu_backward(torch.ones_like(x), x)


def _gelu_pieces(x: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """Each :data:`GELU_TABLE_CHUNK`-element piece of bf16 ``x`` in row-major order: its slice of the flattened
    tensor, and its values' table indices (int32, written into one buffer for all pieces).
    """
    bits = x.view(torch.uint16).reshape(-1)
    indices = torch.empty(min(GELU_TABLE_CHUNK, bits.numel()), dtype=torch.int32, device="cpu")
    for start in range(0, bits.numel(), GELU_TABLE_CHUNK):
        part = slice(start, start + GELU_TABLE_CHUNK)
        yield part, indices[: bits[part].numel()].copy_(bits[part])


class _Bf16TableGelu(torch.autograd.Function):
    """:class:`TanhGelu` of a bf16 CPU tensor by table lookups (:func:`_gelu_tables`)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        values, _ = _gelu_tables()
        y = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        flat = y.view(-1)
        for part, indices in _gelu_pieces(x):
            torch.index_select(values, 0, indices, out=flat[part])
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        _, slopes = _gelu_tables()
        grad = grad.reshape(-1)
        dx = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        flat = dx.view(-1)
        # fp32 pieces: grad * slope is rounded to bf16 once, as in torch's bf16 GELU backward
        slope, product = torch.empty(2, min(GELU_TABLE_CHUNK, x.numel()), device="cpu")
        for part, indices in _gelu_pieces(x):
            n = indices.numel()
            torch.index_select(slopes, 0, indices, out=slope[:n])
            flat[part] = product[:n].copy_(grad[part]).mul_(slope[:n])
        return dx


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = TanhGelu()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True  # type: ignore[attr-defined]
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, kv_cache: KVCache | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2. ``forward(idx, targets=None) -> (logits, loss)``; see :meth:`forward`."""

    # set_activation_checkpointing switches it on
    activation_checkpointing: bool = False

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        self.config = config
        V = config.padded_vocab_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(V, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, V, bias=False)
        # Weight tying (GPT-2, "Using the Output Embedding to Improve Language Models"): the token
        # embedding and the LM head are one tensor.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 initialisation: N(0, 0.02) for weights and embeddings, zero biases; projections that
        # write into the residual stream are scaled by 1/sqrt(2 * n_layer) because each of the
        # n_layer blocks adds two such contributions and the stream's variance would grow with depth.
        std = 0.02
        if isinstance(module, nn.Linear):
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        reduction: str = "mean",
        head: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(logits, loss)``: logits ``(B, T, vocab_size)`` without ``targets``; with ``targets``
        ``(B, T)`` the fp32 cross-entropy (``"mean"`` over scored targets or ``"sum"``; targets equal
        to ``IGNORE_INDEX`` are not scored) and ``None`` for the logits, which are never built whole
        (:func:`linear_cross_entropy`) unless the LM head is parametrized (e.g. LoRA). ``head=False``
        returns the last LayerNorm's output ``(B, T, n_embd)`` in place of the logits (no targets).

        ``kv_cache``, ``position_ids`` ``(T,)`` or ``(B, T)`` and a boolean ``attn_mask``
        broadcastable to ``(B, n_head, T, S)`` (True = may attend) serve generation and packed
        rows. Types and shapes are checked, values only on the CPU (a device sync on a GPU): ids must
        lie in ``[0, vocab_size)`` (generate and the data loader check), targets too or be -1 (else a NaN loss).
        """
        if not torch.compiler.is_compiling():
            self._check_inputs(idx, targets, kv_cache, position_ids, reduction, head)
        position_ids, attn_mask = _positions_and_mask(idx, kv_cache, position_ids, attn_mask)
        tied = self._tied_grad(targets)
        if tied is None:
            tok_emb = self.transformer.wte(idx)  # (B, T, C)
        else:
            tok_emb = _TiedEmbedding.apply(idx, self.transformer.wte.weight, tied)
        pos_emb = self.transformer.wpe(position_ids)  # (T, C) or (B, T, C)
        x = self.transformer.drop(tok_emb + pos_emb)
        # Only a training forward whose graph is kept saves activations worth dropping; decoding with a
        # cache writes into it, which a recomputation would repeat.
        recompute = self.activation_checkpointing and self.training and kv_cache is None and torch.is_grad_enabled()
        for block in self.transformer.h:
            if recompute:
                # Each block keeps only its input; the backward runs it again, with the RNG state of the
                # first run (dropout draws the same masks). Non-reentrant: works with DDP and torch.compile.
                x = checkpoint(block, x, None, attn_mask, use_reentrant=False)
            else:
                x = block(x, kv_cache, attn_mask)
        x = self.transformer.ln_f(x)
        if not head:
            return x, None
        return self._logits_and_loss(x, targets, reduction, tied)

    def _tied_grad(self, targets: torch.Tensor | None) -> _TiedGrad | None:
        """Where the loss and the token embedding give the tied weight one gradient tensor (a loss with a gradient
        on the plain tied weight, neither module parametrized nor hooked, not compiling), the link between them.
        """
        wte, head = self.transformer.wte, self.lm_head
        # first, as reading a parametrized module's weight would build it (LoRA's W + BA)
        if parametrize.is_parametrized(wte) or parametrize.is_parametrized(head):
            return None
        if targets is None or not torch.is_grad_enabled() or not head.weight.requires_grad:
            return None
        if wte.weight is not head.weight or torch.compiler.is_compiling() or torch_compat.has_hooks(wte):
            return None
        return _TiedGrad()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states ``x`` ``(..., n_embd)``, the last LayerNorm's output (``forward(idx,
        head=False)``): logits ``(..., vocab_size)``. Generation applies it to the last position alone.
        """
        # Padded rows are not tokens: drop them so they are never sampled. (A parametrized head, e.g. LoRA on
        # it, is called as a module, so its own fast forward runs.)
        return self.lm_head(x)[..., : self.config.vocab_size]

    def _logits_and_loss(
        self, x: torch.Tensor, targets: torch.Tensor | None, reduction: str, tied: _TiedGrad | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The LM head on the last LayerNorm's output ``x``, and the loss when there are targets."""
        V = self.config.vocab_size
        if targets is not None and not parametrize.is_parametrized(self.lm_head):
            return None, linear_cross_entropy(x, self.lm_head.weight, targets, V, reduction, tied=tied)
        logits = self.logits(x)  # (B, T, vocab_size)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(
            logits.float().reshape(-1, V), targets.reshape(-1).long(), ignore_index=IGNORE_INDEX, reduction=reduction
        )
        return logits, loss

    def _check_inputs(
        self, idx: Any, targets: Any, kv_cache: Any, position_ids: Any, reduction: str, head: bool
    ) -> None:
        """The arguments of :meth:`forward`: types and shapes only (Python-side, no device sync)."""
        if targets is not None and not head:
            raise InvalidValueError("head=False gives no loss: pass no targets")
        if reduction not in ("mean", "sum"):
            raise InvalidValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        check_idx(idx, self.config.block_size)
        T = idx.size(1)
        # The cache's filling is not read: that would be a device sync.
        if kv_cache is not None and not T <= kv_cache.max_len <= self.config.block_size:
            raise InvalidValueError(
                f"a KV cache of {kv_cache.max_len} positions for {T} new ones: it needs room for them and no more "
                f"than the model's context ({self.config.block_size}); use KVCache.for_model(model)"
            )
        if position_ids is not None:
            check_index_tensor("position_ids", position_ids)
            if position_ids.shape not in ((T,), idx.shape):
                raise InvalidValueError(
                    f"position_ids must have shape ({T},) or {tuple(idx.shape)}, got {tuple(position_ids.shape)}"
                )
        if targets is not None:
            check_index_tensor("targets", targets)
            if targets.shape != idx.shape:
                raise InvalidValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
            # their values, on the CPU
            check_targets(targets, self.config.vocab_size)

    def set_activation_checkpointing(self, enabled: bool = True) -> GPT:
        """Activation checkpointing: a training forward keeps only each block's input and the backward
        recomputes the block (about a third more compute for far less activation memory; same losses and
        gradients, dropout included). Evaluation, ``no_grad`` and generation are unaffected. Returns the model.
        """
        self.activation_checkpointing = bool(enabled)
        return self

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (shared tensors once). ``non_embedding`` drops the position embedding
        (the token embedding is tied to the LM head and counts as its weight).
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward) from the PaLM appendix B estimate:
        6 * N for the matmuls with the weights plus 12 * L * H * Q * T for attention.
        """
        cfg = self.config
        T = seq_len or cfg.block_size
        N = self.num_params(non_embedding=True)
        return 6 * N + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
        """Sample ``max_new_tokens`` after ``idx``; see :func:`gpt2.model.generate.generate`."""
        return _generate(self, idx, max_new_tokens, **kwargs)

    def stream(self, idx: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> Iterator[torch.Tensor]:
        """Yield each new token column ``(B,)`` as it is sampled; see :func:`gpt2.model.generate.stream`."""
        return _stream(self, idx, max_new_tokens, **kwargs)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **kwargs: Any) -> GPT:
        """``cls`` with the weights of a hub id, ``transformers`` directory or ``gpt2 train`` checkpoint;
        see :func:`gpt2.model.hf.load_pretrained`.
        """
        return hf.load_pretrained(name_or_path, model_class=cls, **kwargs)

    def save_pretrained(self, directory: str | os.PathLike, **kwargs: Any) -> Path:
        """Write a ``transformers.GPT2LMHeadModel`` directory; see :func:`gpt2.model.hf.save_pretrained`."""
        return hf.save_pretrained(self, directory, **kwargs)

    def peft_adapter_layout(self) -> dict[str, Any]:
        """How this model differs from its ``GPT2LMHeadModel`` twin, for minlora's PEFT export/import:
        padded vocabulary rows, and the twin's ``Conv1D`` layers (PEFT's ``fan_in_fan_out=True``).
        """
        return {
            "vocab_size": self.config.vocab_size,
            "padded_vocab_modules": ["transformer.wte", "lm_head"],
            "fan_in_fan_out": True,
        }


# Rows of logits per chunk of the loss: (1024, 50304) fp32 logits are 200 MB, against 3.3 GB for a
# whole (16, 1024) batch; larger chunks were no faster on CPU (docs/benchmarks.md).
LOSS_CHUNK_ROWS = 1024


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    reduction: str = "mean",
    chunk_rows: int = LOSS_CHUNK_ROWS,
    tied: _TiedGrad | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight)[..., :vocab_size].float(), targets, ignore_index=IGNORE_INDEX)``
    (value and gradients, autocast too: matmuls in its dtype, softmax in fp32) without the whole logits. With
    ``tied``, ``weight``'s gradient is handed to the token embedding's backward (:class:`_TiedEmbedding`).
    """
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    # Inside the autograd.Function's forward grad mode is off: which gradients are needed is decided here.
    grad_mode = torch.is_grad_enabled()
    grads = (grad_mode and x.requires_grad, grad_mode and weight.requires_grad)
    args = (vocab_size, reduction == "mean", chunk_rows, dtype, grads, tied)
    return _LinearCrossEntropy.apply(x, weight, targets, *args)


def _positions_and_mask(
    idx: torch.Tensor, kv_cache: KVCache | None, position_ids: torch.Tensor | None, attn_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The position ids and attention mask of a forward over ``idx``: the caller's, else the cache's,
    else ``0..T-1`` and no mask (causal attention).
    """
    T = idx.size(1)
    if kv_cache is not None:
        # Positions and the causal mask come from the cache's position tensor, so a compiled
        # decoding step has the same graph at every token; built once, not in every layer.
        positions, causal = kv_cache.step(T)
        if position_ids is None:
            position_ids = positions
        if attn_mask is None:
            attn_mask = causal
    elif position_ids is None:
        position_ids = torch.arange(T, dtype=torch.long, device=idx.device)
    return position_ids, attn_mask


def check_targets(targets: torch.Tensor, vocab_size: int) -> None:
    """CPU targets must be token ids or IGNORE_INDEX (not -100); on a GPU (no sync here) the loss is NaN."""
    if targets.device.type != "cpu":
        return
    wrong = (targets < IGNORE_INDEX) | (targets >= vocab_size)
    if wrong.any():
        raise InvalidValueError(
            f"targets must be token ids in [0, {vocab_size}) or {IGNORE_INDEX} (not scored), got "
            f"{int(targets[wrong][0])}; the ignore index is {IGNORE_INDEX} here (-100 in Hugging Face)"
        )


# the CPU logits buffer of _logits_buffer, one per thread
_kept = threading.local()

# The logits buffer's rows start every LOGITS_ROW_ALIGN floats (32 bytes, one AVX2 vector): MKL's fp32 product
# (1024, 768) @ (768, 50257) into rows 50257 floats apart runs well below its rate for square products, into
# rows 50264 apart at that rate (docs/benchmarks.md). The padded vocabulary (50304) is aligned already.
LOGITS_ROW_ALIGN = 8
# A bf16 / fp16 buffer's rows start every 64 bytes (a cache line, an AVX-512 vector, an AMX tile row): oneDNN's
# bf16 products then read and write whole lines.
LOW_LOGITS_ROW_ALIGN = 32


def _logits_buffer(
    name: str, rows: int, cols: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A ``(rows, cols_aligned)`` buffer in ``dtype`` (``cols`` wide while compiling), ``cols`` rounded up to
    :data:`LOGITS_ROW_ALIGN` in fp32, else to :data:`LOW_LOGITS_ROW_ALIGN`: the fp32 logits, (bf16 / fp16) a
    low-precision matmul's output, or another ``name``'s. On CPU one of each ``name`` is kept between calls: a fresh
    100-200 MB block costs its page faults again each time (glibc returns blocks over 32 MB to the OS when they are
    freed).
    """
    if torch.compiler.is_compiling():
        # Exactly cols wide: torch.compile cannot trace a product written (out=) into the first cols of wider rows.
        # It would break the graph inside the loss's autograd.Function and run the loss eagerly (under bf16 on a
        # CPU, that eager loss's own compiled pieces could then fail).
        return torch.empty(rows, cols, dtype=dtype, device=device)
    cols = rounded_up(cols, LOGITS_ROW_ALIGN if dtype == torch.float32 else LOW_LOGITS_ROW_ALIGN)
    if device.type != "cpu":
        return torch.empty(rows, cols, dtype=dtype, device=device)
    kept = getattr(_kept, name, None)
    if kept is None or kept.dtype != dtype or kept.numel() < rows * cols:
        # a normal tensor: usable in and out of inference mode
        with torch.inference_mode(False):
            kept = torch.empty(rows * cols, dtype=dtype)
        setattr(_kept, name, kept)
    return kept[: rows * cols].view(rows, cols)


class _LinearCrossEntropy(torch.autograd.Function):
    """The gradients are computed in the forward, chunk by chunk, while each chunk's logits
    exist (no recomputation); the backward only scales them by the incoming gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, vocab_size, mean, chunk_rows, dtype, grads, tied):
        need_dx, need_dw = grads
        ctx.tied = tied
        # fp16 gradients are not scaled yet (the loss scaler multiplies the loss after this), so
        # small ones would underflow: their matmuls run in fp32. bf16 has fp32's range.
        grad_dtype = torch.float32 if dtype == torch.float16 else dtype
        scored = targets != IGNORE_INDEX
        # ignored rows read column 0, then weigh 0
        safe_targets = targets.clamp(min=0)
        count = scored.sum()
        # Each row's weight in the gradients: 0 for an ignored row, 1 (1 / count for the mean) for a
        # scored one. A batch with no scored target has zero gradients (as F.cross_entropy's) and a NaN mean.
        if mean:
            row_weights = scored * (1.0 / count.clamp(min=1))
        else:
            row_weights = scored.float()
        # the LM head's weight in the logits' matmul dtype and in the gradients': under bf16 one cast serves both
        w = w_grad = weight.to(dtype)
        if grad_dtype != dtype:
            w_grad = weight.to(grad_dtype)
        # A target that is neither a token nor IGNORE_INDEX (e.g. -100, unchecked on a GPU) makes it NaN.
        loss = torch.where(((targets < IGNORE_INDEX) | (targets >= vocab_size)).any(), float("nan"), 0.0)
        dx = torch.empty_like(x) if need_dx else None
        dw = _weight_grad(weight, x.size(0)) if need_dw else None
        need_grad = need_dx or need_dw
        # bf16 on a CPU: the logits stay in bf16 and their fp32 softmax is made a few rows at a time
        by_rows = dtype == torch.bfloat16 and x.is_cpu and not torch.compiler.is_compiling()
        loss_and_grad = _bf16_loss_and_grad if by_rows else _loss_and_grad
        with torch.autocast(x.device.type, enabled=False):
            for s in range(0, x.size(0), chunk_rows):
                chunk = slice(s, s + chunk_rows)
                xc, t, keep = x[chunk], safe_targets[chunk], scored[chunk]
                # one cast of the chunk's rows for both of its products in dtype
                xd = xc.to(dtype)
                row_loss, g, wr = loss_and_grad(xd, w, t, keep, row_weights[chunk, None], vocab_size, need_grad)
                # an ignored row's loss may be inf
                loss += row_loss.where(keep, 0.0).sum()
                if not need_grad:
                    continue
                # the head's columns (the buffer's rows may be wider)
                g = g[:, : weight.size(0)]
                if dx is not None:
                    dx[chunk] = (g @ w_grad) * wr
                if dw is not None:
                    _add_weight_grad(dw, g, xc, xd, wr, first=s == 0)
        ctx.save_for_backward(dx, dw)
        if mean:
            return loss / count
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The gradients, made in the forward for this backward alone, are scaled in place: a copy of the 124M
        # head's is a fresh 154 MB block (~0.12 s on one CPU thread). So there is no second backward.
        if getattr(ctx, "scaled", False):
            raise InvalidValueError(
                "a second backward through linear_cross_entropy (retain_graph=True) is not supported: the first "
                "scaled its gradients in place; compute the loss again for each backward"
            )
        ctx.scaled = True
        dx, dw = ctx.saved_tensors
        for grad in (dx, dw):
            if grad is not None:
                grad.mul_(grad_loss)
        # The tied token embedding's backward, which runs after this one, adds its rows to the head's gradient and
        # returns it: one weight-sized gradient, not a second dense one summed with this.
        if ctx.tied is not None:
            ctx.tied.dw, dw = dw, None
        # no gradient for targets, vocab_size, mean, chunk_rows, dtype, grads, tied
        return dx, dw, None, None, None, None, None, None, None


class _TiedGrad:
    """The head's gradient, handed from the loss's backward to the tied token embedding's."""

    dw: torch.Tensor | None = None


class _TiedEmbedding(torch.autograd.Function):
    """``F.embedding(idx, weight)`` whose backward adds its gradient's rows into the loss's head gradient
    (``index_add_``), in place of a dense weight-sized gradient that autograd would add to it. The weight gets its
    one gradient through autograd (DDP's and FSDP's gradient hooks see it as usual).
    """

    @staticmethod
    def forward(ctx, idx, weight, tied):
        ctx.save_for_backward(idx)
        ctx.tied, ctx.weight_shape = tied, weight.shape
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        # The loss's backward ran first and handed the head's gradient over, unless this backward does not pass
        # through the loss (e.g. from a block's output alone): then the embedding's gradient is its own rows only.
        dw, ctx.tied.dw = ctx.tied.dw, None
        if dw is None:
            dw = grad.new_zeros(ctx.weight_shape)
        # FSDP's bf16 compute weights give a bf16 grad here and an fp32 dw (autograd casts it to the weight's dtype)
        rows = grad.reshape(-1, grad.size(-1)).to(dw.dtype)
        return None, dw.index_add_(0, idx.reshape(-1), rows), None


def _weight_grad(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """The fp32 buffer of the head's gradient: uninitialised (the first chunk's product writes it whole, no
    pass of zeros first), zeros when there is no row, hence no chunk.
    """
    if rows == 0:
        return torch.zeros_like(weight, dtype=torch.float32)
    return torch.empty_like(weight, dtype=torch.float32)


def _loss_and_grad(
    xd: torch.Tensor,
    w: torch.Tensor,
    t: torch.Tensor,
    keep: torch.Tensor,
    wr: torch.Tensor,
    vocab_size: int,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | float]:
    """A chunk's rows ``xd`` through the fp32 logits ``xd @ w.T``: each row's loss ``-log p[target]`` and (with
    ``need_grad``) ``(g, wr)``, d loss / d logits = (softmax - one_hot(target)) * row weight made in the logits'
    memory, with the row weights ``wr`` ``(n, 1)`` still to apply to the products with ``g``, or 1.0. A bf16 / fp16
    product goes through a kept buffer in its dtype (on CPU a product's output has its inputs' dtype), where a bf16
    ``g`` is written too: no fresh block per chunk.
    """
    n = xd.size(0)
    logits = _logits_buffer("logits", n, w.size(0), xd.device)
    head = logits[:, : w.size(0)]
    # the bf16 / fp16 buffer, for the product and then a bf16 g
    low = None
    if xd.dtype == torch.float32:
        torch.mm(xd, w.T, out=head)
    else:
        low = _logits_buffer("low_logits", n, w.size(0), xd.device, xd.dtype)
        head.copy_(torch.mm(xd, w.T, out=low[:, : w.size(0)]))
    # the head's padded rows and the buffer's alignment columns are not tokens
    logits[:, vocab_size:] = float("-inf")
    rows = torch.arange(n, device=xd.device)
    if not xd.is_cpu or torch.compiler.is_compiling():
        # out of place, and no host sync
        logp = logits.log_softmax(-1)
        row_loss = -logp[rows, t]
        p = logp.exp_()
    else:
        # On CPU the softmax overwrites the logits (no second logits-sized block); the target's logit is read first.
        target_logit = logits[rows, t]
        p = torch_compat.softmax_in_place(logits)
        row_loss = _row_loss(p[rows, t], target_logit, keep, xd, w, vocab_size)
    if not need_grad:
        return row_loss, None, wr
    p[rows, t] -= 1
    if xd.dtype != torch.bfloat16:
        # fp32 (fp16's gradients are fp32 too): the row weights go on the matmuls' small sides, a pass fewer over p
        return row_loss, p, wr
    # bf16: on g before it is rounded, as the plain loss's gradient is. The columns after p's are zeroed: oneDNN's
    # bf16 product g @ w reads a row's padding up to its stride (NaN * 0 there would make the gradient NaN).
    low[:, p.size(1) :] = 0
    return row_loss, low[:, : p.size(1)].copy_(p.mul_(wr)), 1.0


def _row_loss(
    p_target: torch.Tensor, target_logit: torch.Tensor, keep: torch.Tensor, xd: torch.Tensor, w: torch.Tensor, V: int
) -> torch.Tensor:
    """Each row's loss ``-log p[target]`` from the fp32 ``p_target``. Rows whose p[target] underflowed get
    theirs from their logits ``xd @ w.T`` (the first ``V`` columns), computed again: the softmax was written over
    them. Usually there is no such row: no branch on the values.
    """
    row_loss = -p_target.log()
    underflowed = (p_target < 1e-30) & keep
    again = (xd[underflowed] @ w.T)[:, :V].float()
    row_loss[underflowed] = again.logsumexp(-1) - target_logit[underflowed]
    return row_loss


# Rows of bf16 logits whose fp32 softmax _bf16_loss_and_grad makes at once: (2, 50257) fp32 rows stay in the
# core's cache between the softmax and the bf16 gradient written from them. The whole chunk's fp32 softmax (a bf16
# to fp32 copy, the softmax, the row weights, a copy back: four passes over 200 MB) took 1.9x the time at the 124M
# shape (docs/benchmarks.md, "bf16 training step").
SOFTMAX_BLOCK_ROWS = 2


def _bf16_loss_and_grad(
    xd: torch.Tensor,
    w: torch.Tensor,
    t: torch.Tensor,
    keep: torch.Tensor,
    wr: torch.Tensor,
    vocab_size: int,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """:func:`_loss_and_grad` of a bf16 chunk on a CPU, the logits kept in bf16: their fp32 softmax is made
    :data:`SOFTMAX_BLOCK_ROWS` rows at a time, and ``g``, already weighted by ``wr``, is written over them.
    """
    n = xd.size(0)
    low = _logits_buffer("low_logits", n, w.size(0), xd.device, xd.dtype)
    logits = torch.mm(xd, w.T, out=low[:, : w.size(0)])
    rows = torch.arange(n)
    # the head's padded rows (columns from vocab_size on) are not tokens: left out of the softmax
    tokens = logits[:, :vocab_size]
    target_logit = tokens[rows, t].float()
    p_target = torch.empty(n, dtype=torch.float32)
    block = torch.empty(min(SOFTMAX_BLOCK_ROWS, n), vocab_size, dtype=torch.float32)
    for s in range(0, n, SOFTMAX_BLOCK_ROWS):
        part = slice(s, s + SOFTMAX_BLOCK_ROWS)
        p = block[: tokens[part].size(0)].copy_(tokens[part])
        torch_compat.softmax_in_place(p)
        p_target[part] = p[rows[: p.size(0)], t[part]]
        if need_grad:
            # rounded to bf16 once, as the plain loss's gradient is
            tokens[part] = p.mul_(wr[part])
    row_loss = _row_loss(p_target, target_logit, keep, xd, w, vocab_size)
    if need_grad:
        # The target's entry from its fp32 p, not from the rounded one. The columns after the tokens are zeroed:
        # oneDNN's bf16 product g @ w reads a row's padding up to its stride (NaN * 0 there would make a NaN).
        tokens[rows, t] = ((p_target - 1) * wr.squeeze(1)).to(low.dtype)
        low[:, vocab_size:] = 0
    return row_loss, low, 1.0


def _add_weight_grad(
    dw: torch.Tensor, g: torch.Tensor, xc: torch.Tensor, xd: torch.Tensor, wr: torch.Tensor | float, first: bool
) -> None:
    """Add the chunk's ``g.T @ (xc * wr)`` to ``dw``; the ``first`` chunk's writes over it (``dw`` is uninitialised).
    A bf16 ``g`` is multiplied by ``xd``, the chunk's rows already cast to bf16.
    """
    if g.dtype == dw.dtype:
        # fp32: straight into dw, no weight-sized temporary per chunk; beta=0 ignores what dw held, NaNs included
        dw.addmm_(g.T, xc * wr, beta=int(not first))
        return
    # Made transposed, (n_embd, vocab), as xd.T @ g with xd.T copied (small): on a CPU, oneDNN's bf16 product
    # g.T @ xd, its left operand a transposed view, took 1.8x the time. Then widened into dw by a transposed copy
    # (1.6x a plain one): 0.73x in all at the 124M shape (docs/benchmarks.md, "bf16 training step"). Into a kept
    # buffer: a fresh weight-sized block per chunk costs its page faults every time.
    buffer = _logits_buffer("low_weight_grad", dw.size(1), dw.size(0), dw.device, g.dtype)
    product = torch.mm(xd.T.contiguous(), g, out=buffer[:, : dw.size(0)]).T
    if first:
        dw.copy_(product)
    else:
        dw.add_(product)

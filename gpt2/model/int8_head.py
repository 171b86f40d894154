"""Greedy decoding on the CPU with the LM head read in int8: the same tokens as the fp32 head, a quarter of
the head's bytes read per token.

The bound it relies on. The head's rows are rounded to int8 with a step ``scale`` per row, the hidden
state ``h`` to 7-bit integers ``q_h`` with a step ``sh`` per row of ``h``; the int8 logit is their integer dot
product (summed exactly, rounded to fp32 once), scaled. Each int8 logit is then within a proven bound of the fp32 one:

    |h.w - int8 logit| <= sh scale / 2 (|q_h|_1 + |q_w|_1 + C/2)    (h's rounding, w's, both)
                        + 2 C 2^-24 max|h| |w|_1                     (the fp32 logits' own rounding)
                        + 2^-24 sh scale 63 |q_w|_1                  (the integer sum's rounding to fp32)

A token can be the argmax only if its upper bound (int8 logit + bound) reaches the best lower bound
(the largest int8 logit - bound) of its row. Only those candidates (14 of 50,257 per token at 124M)
are scored again in fp32, and the best of them is the token: the fp32 head's argmax, but for
near-ties within fp32 rounding (as between any two matmul kernels). When more than an eighth of the
vocabulary are candidates, or the int8 logits overflow, the whole fp32 head is used.

The integer products are fbgemm's where torch has it (x86), else oneDNN's (``torch._int_mm``), through
:func:`gpt2.torch_compat.int8_matmul`: on an AVX2 CPU without VNNI oneDNN's made the head 3-5x slower than
fp32, fbgemm's 3x faster (docs/benchmarks.md, "Generation vs llama.cpp").

Narrow heads (fewer than ``TRANSPOSED_HEAD_MAX_EMBD`` columns) are read by another int8 kernel, with a
cheaper sieve (:class:`NarrowHead`): there the int8 pass's bounds over every row cost more than the bytes they
save. torch's int8 weight-only kernel (:func:`gpt2.torch_compat.int8_rows_matmul`) rounds the hidden states to
bf16, ``h~``, multiplies each int8 weight by its row's bf16 scale, ``w~ = q scale`` (exact in fp32: 8 by 8
significant bits; a kernel that multiplies in bf16, as oneDNN's AMX one may, rounds it to bf16, ``w~'``), sums
the products in fp32 and rounds the sums to bf16. With ``u = 2^-8`` (bf16's rounding, to nearest or towards
zero), ``v = 1 + u`` and ``g = C 2^-23`` (a sum of ``C`` fp32 products, in any order, with or without FMA, is
within (C+1) 2^-24 / (1 - (C+1) 2^-24) sum|a_k b_k| of the exact one, at most ``g |a|_2 |b|_2`` for C >= 2),
for a row ``h`` of the hidden states and a row ``w`` of the head, by Cauchy-Schwarz:

    |h.w - int8 logit| <= |h|_2 |w - w~|_2                        (the weights' rounding to int8)
                        + u |h|_2 |w~|_2                           (w~'s rounding to bf16, where it is done)
                        + u v |h|_2 |w~|_2                         (h's rounding to bf16)
                        + g v^2 |h|_2 |w~|_2                       (the fp32 sums)
                        + u v^2 (1 + g) |h|_2 |w~|_2               (the sums' rounding to bf16)
                        + g |h|_2 |w|_2                            (the fp32 logits' own sums)

Each row's bound per unit of ``|h|_2``, ``r``, is computed once from the int8 weights, plus ``C 2^-64`` (with
``|h|_2`` taken at least 2^-16: squares and products that underflow, or subnormals flushed to zero) and times
``1 + C 2^-16`` (the fp32 rounding of the norms, of ``r`` and of its product with ``|h|_2``). When the copy is
made, the kernel is run on probe rows, one at a time and then four at once, and each of their logits checked
against its bound: a kernel that reads other columns than these (as torch's do for widths that are not a multiple
of 16), or that serves only the batch size of its first call, fails it, and the transposed copy below is used.

With ``b = |h|_2 r`` per row, the fp32 head's argmax ``t`` and the int8 argmax ``m``: ``int8_t >= fp32_t - b_t >=
fp32_m - b_t >= int8_m - b_m - b_t >= max int8 - 2 |h|_2 max r``. The int8 logits are cut into blocks of
``NARROW_BLOCK`` rows; the rows of every block whose best logit reaches that threshold are scored in fp32 (at 4 x
128, 1.1 blocks a token on average with random weights, 4.8 with trained ones), and the best of them is the token.
When a row's threshold is not finite (an overflow) or more than an eighth of the vocabulary is taken, the whole fp32
head scores. A head with a weight that is not finite, a width that is not a multiple of 16, or a torch without the
kernel gets a transposed fp32 copy instead (:class:`TransposedHead`).

``generate(..., int8_head=None)`` (the default) uses it for greedy decoding of at least 32 tokens on
the CPU, with an fp32 head of at least ``SIEVE_MIN_HEAD`` weights (where it pays: 1.27-1.34x faster
at 124M, docs/benchmarks.md); for a head of at least ``TRANSPOSED_HEAD_MIN`` weights but fewer than
``TRANSPOSED_HEAD_MAX_EMBD`` columns it reads the narrow int8 copy (:class:`NarrowHead`) or the transposed fp32 copy
instead; ``True`` uses the int8 head wherever it gives the fp32 head's tokens, and refuses with the reason
elsewhere; ``False`` never uses any copy. Greedy decoding with ``weights="int8"`` (every weight in int8,
other tokens: :mod:`gpt2.model.quantize`) reads the int8 head of that twin instead.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from gpt2.errors import InvalidValueError
from gpt2.torch_compat import INT8_ACTIVATION_MAX, has_int8_rows_matmul, int8_matmul, int8_rows_matmul, pack_int8

# weights in the LM head from which greedy decoding on the CPU reads it in int8 by default
SIEVE_MIN_HEAD = 2**22
# new tokens from which it does by default: the int8 copy is made (or checked) once per call
MIN_NEW_TOKENS = 32
# the most fp32 columns of the head kept for outsize hidden dimensions
MAX_KEPT_COLUMNS = 64
# Heads of at least TRANSPOSED_HEAD_MIN weights and fewer than TRANSPOSED_HEAD_MAX_EMBD columns (narrow heads) are
# read by NarrowHead or from a transposed fp32 copy by default, not by Int8Head: there the int8 pass's work over
# every row of the vocabulary (the bounds) costs more than the bytes it saves (4x128 head, one thread: 1.2-1.5 ms
# transposed against 2.1 ms a token in int8).
TRANSPOSED_HEAD_MIN = 2**22
TRANSPOSED_HEAD_MAX_EMBD = 256
# rows of the head per block of a NarrowHead's int8 logits that its sieve takes or leaves whole
NARROW_BLOCK = 64


class Int8Head(NamedTuple):
    """An LM head of ``V`` rows and ``C`` columns in int8, with what :func:`greedy_tokens` needs."""

    # (C, V) int8: the head rounded row by row, transposed for the matmul
    q_t: torch.Tensor
    # (V,): each row's int8 step
    scale: torch.Tensor
    # (V,): each row's |w|_1 bound, scale (|q|_1 + C/2)
    rows: torch.Tensor
    # fp32 columns of the head for outsize hidden dimensions, by dimension (grows to MAX_KEPT_COLUMNS)
    cols: dict[int, torch.Tensor]
    # the int8 rows in the layout of torch_compat.int8_matmul (fbgemm's, or q_t for oneDNN)
    packed: Any


class TransposedHead(NamedTuple):
    """An fp32 LM head's ``V`` rows stored transposed, ``(C, V)`` contiguous: a one-row product reads it
    along its rows (MKL, one thread: 17 GB/s for the 4x128 head against 6.8 GB/s in the ``(V, C)`` layout).
    The logits are fp32 products like the head's own, summed in another order: the same argmax but for
    near-ties within fp32 rounding, as between any two matmul kernels. Costs a second copy of the head
    (26 MB at 4 x 128) while the model lives.
    """

    w_t: torch.Tensor

    def tokens(self, h: torch.Tensor) -> torch.Tensor:
        """The argmax of ``h @ w_t`` per row of ``h`` ``(B, C)``."""
        return (h @ self.w_t).argmax(-1)


class NarrowHead(NamedTuple):
    """A narrow fp32 LM head read in int8 by torch's int8 weight-only kernel: only the rows of the blocks whose int8
    logits can hold the fp32 argmax are scored in fp32 (see the module's docstring), the fp32 head's argmax but for
    near-ties within fp32 rounding. Costs an int8 copy of the head (6.4 MB at 4 x 128) while the model lives.
    At 4 x 128 (one thread, AVX2), batch 1, greedy generation ran 1.14-1.25x as fast as through fbgemm's fp16
    copy of the head, which it replaces (docs/benchmarks.md, "Generation vs llama.cpp"); at 124M the int8
    sieve stays faster.
    """

    # (V, C): the fp32 head, which scores the rows taken (the model's weight, not a copy)
    weight: torch.Tensor
    # (V', C) int8, V' = V filled up to whole blocks with copies of the last row, and its rows' bf16 steps (V',)
    q: torch.Tensor
    scale: torch.Tensor
    # the blocks taken are those whose best int8 logit is within |h|_2 * reach of the best: 2 max r
    reach: float
    # 0 .. NARROW_BLOCK - 1
    offsets: torch.Tensor

    def tokens(self, h: torch.Tensor) -> torch.Tensor:
        """The fp32 head's argmax per row of ``h`` ``(B, C)`` (fp32), through the int8 logits."""
        V = self.weight.size(0)
        # (B, blocks): each block's best int8 logit (bf16, exact in fp32)
        logits = int8_rows_matmul(h, self.q, self.scale)
        blocks = logits.view(h.size(0), -1, NARROW_BLOCK).amax(2).float()
        norm = torch.linalg.vector_norm(h, dim=1, keepdim=True).clamp_(min=2**-16)
        lowest = torch.add(blocks.amax(1, keepdim=True), norm, alpha=-self.reach)
        # Where the logits or the bound overflowed (NaN or +inf), the row takes every block: the whole head scores.
        lowest.nan_to_num_(nan=-math.inf, posinf=-math.inf)
        # (blocks taken, 1), ascending: those that some row does not leave (NaN logits are not left)
        taken = (blocks < lowest).all(0).logical_not_().nonzero()
        if not 0 < taken.size(0) * NARROW_BLOCK <= V // 8:
            return F.linear(h, self.weight).argmax(-1)
        # ascending, for argmax's first-index ties; the padding rows are the last row again
        ids = torch.add(self.offsets, taken, alpha=NARROW_BLOCK).view(-1).clamp_(max=V - 1)
        return ids[F.linear(h, self.weight.index_select(0, ids)).argmax(-1)]


# lm_head -> (a fingerprint of its values, its Int8Head)
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# lm_head -> (a fingerprint of its values, its TransposedHead)
_KEPT_TRANSPOSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# lm_head -> (a fingerprint of its values, its NarrowHead or None where the int8 kernel cannot read it)
_KEPT_NARROW: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unsupported_reason(model: Any) -> str | None:
    """Why the int8 head cannot give the fp32 head's tokens for ``model`` (or would be a slow loop), or None."""
    head = model.lm_head
    if parametrize.is_parametrized(head):
        return "the LM head is parametrized (e.g. LoRA on it)"
    w = head.weight
    if w.device.type != "cpu":
        return f"the LM head is on {w.device.type}, and the int8 head runs on the CPU"
    if w.dtype != torch.float32:
        return f"the LM head is {w.dtype}, not torch.float32"
    # Under 16 columns degenerate strides give int_mm wrong sums; over 2^17 its int32 sums of 127 * 127 * C overflow.
    if not 16 <= w.size(1) <= 2**17:
        return f"n_embd={w.size(1)} is outside [16, 2**17], where int8 matmuls sum exactly"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast is on: the head's logits would be in its dtype"
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return (
            "oneDNN is unavailable or disabled (torch.backends.mkldnn): int8 matmuls would be a plain loop, ~8x slower"
        )
    return None


def quantize_head(model: Any, min_weights: int | None = None) -> Int8Head | None:
    """``model``'s LM head in int8, kept until a fingerprint of its values changes. None where
    :func:`unsupported_reason` says so, for a head of fewer than ``min_weights`` (default
    ``SIEVE_MIN_HEAD``) weights, where the int8 pass would not pay, or for a head with a non-finite weight.
    """
    if min_weights is None:
        min_weights = SIEVE_MIN_HEAD
    if unsupported_reason(model) is not None:
        return None
    head = model.lm_head
    w = head.weight.detach()[: model.config.vocab_size]
    if w.numel() < min_weights:
        return None
    int8 = _kept(_KEPT, head, w, _quantize)
    if not bool(int8.scale.isfinite().all()):
        return None
    return int8


def transposed_head(model: Any) -> TransposedHead | None:
    """``model``'s LM head as a :class:`TransposedHead`, kept until a fingerprint of its values changes; None
    where :func:`unsupported_reason` says so or outside the shapes where it pays (``TRANSPOSED_HEAD_MIN``,
    ``TRANSPOSED_HEAD_MAX_EMBD``).
    """
    w = _narrow_head(model)
    if w is None:
        return None
    return _kept(_KEPT_TRANSPOSED, model.lm_head, w, _transposed)


def narrow_head(model: Any) -> NarrowHead | None:
    """``model``'s LM head as a :class:`NarrowHead`, kept until a fingerprint of its values changes; None where
    :func:`unsupported_reason` says so, outside the shapes of :func:`transposed_head`, where this torch has no
    int8 weight-only kernel (or one that fails its check), for a width that is not a multiple of 16, or for a
    head with a weight that is not finite.
    """
    w = _narrow_head(model)
    if w is None:
        return None
    return _kept(_KEPT_NARROW, model.lm_head, w, _int8_rows)


def _narrow_head(model: Any) -> torch.Tensor | None:
    """The rows ``(V, C)`` of ``model``'s fp32 LM head where greedy decoding reads a narrow head's copy, else None."""
    if unsupported_reason(model) is not None:
        return None
    w = model.lm_head.weight.detach()[: model.config.vocab_size]
    if w.numel() < TRANSPOSED_HEAD_MIN or w.size(1) >= TRANSPOSED_HEAD_MAX_EMBD:
        return None
    return w


def _fingerprint(w: torch.Tensor) -> torch.Tensor:
    """A fingerprint of ``w``'s values: `.data` edits bump no version counter, so this tells whether a kept copy of
    ``w`` is stale (one read of ``w``).
    """
    return w @ torch.randn(w.size(1), generator=torch.Generator().manual_seed(0), dtype=w.dtype)


def _kept(
    kept_copies: weakref.WeakKeyDictionary, head: Any, w: torch.Tensor, make: Any, seen: torch.Tensor | None = None
) -> Any:
    """``make(w)``, kept in ``kept_copies`` for ``head`` until the fingerprint of ``w``'s values changes (``seen``:
    that fingerprint, where the caller has it already).
    """
    if seen is None:
        seen = _fingerprint(w)
    kept = kept_copies.get(head)
    if kept is None or not torch.equal(kept[0], seen):
        # drop the stale copy before making the new one (two at once would double the memory)
        kept_copies.pop(head, None)
        kept = kept_copies[head] = (seen, make(w))
    return kept[1]


def _transposed(w: torch.Tensor) -> TransposedHead:
    return TransposedHead(w.t().contiguous())


def _quantize(w: torch.Tensor) -> Int8Head:
    scale = (w.abs().amax(1) / 127).clamp(min=1e-30)
    q = (w / scale[:, None]).round_().to(torch.int8)
    rows = scale * (q.abs().sum(1, dtype=torch.float32) + w.size(1) / 2)
    return Int8Head(q.t(), scale, rows, {}, pack_int8(q))


def _int8_rows(w: torch.Tensor) -> NarrowHead | None:
    """The head ``w`` ``(V, C)`` as a :class:`NarrowHead`, or None (see :func:`narrow_head`)."""
    V, C = w.shape
    if not has_int8_rows_matmul() or C % 16 != 0 or not bool(w.isfinite().all()):
        return None
    # the copies of the last row that fill the last block up: their logits are that row's, within its bound
    padded = torch.cat([w, w[-1:].expand(-V % NARROW_BLOCK, C)])
    # each row's step in bf16, at least 2^-100 (an all-zero row), so that q * scale is exact in fp32
    scale = (padded.abs().amax(1) / 127).clamp_(min=2**-100).to(torch.bfloat16)
    step = scale.float()[:, None]
    # clamped: a step rounded down to bf16 can put a weight half a step past 127
    q = (padded / step).round_().clamp_(-127, 127).to(torch.int8)
    # the weights the kernel multiplies by; w - w8 is exact in fp32 (w8 is within a factor 2 of w, or 0)
    w8 = q.float() * step
    # each row's bound per unit of |h|_2 (the module's docstring)
    u, g = 2**-8, C * 2**-23
    v = 1 + u
    widened = u + u * v + g * v**2 + u * v**2 * (1 + g)
    rows = (padded - w8).norm(dim=1) + g * padded.norm(dim=1) + widened * w8.norm(dim=1) + C * 2**-64
    rows *= 1 + C * 2**-16
    if not bool(rows.isfinite().all()) or not _kernel_keeps_its_bound(padded, q, scale, rows):
        return None
    return NarrowHead(w, q, scale, 2 * float(rows.max()), torch.arange(NARROW_BLOCK))


def _kernel_keeps_its_bound(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether the int8 kernel's logits of a few probe rows, one at a time and then together, are each within its
    bound ``|h|_2 rows`` of the fp32 head ``w``'s. A kernel that reads other columns, or serves only the batch
    size it was first called with, fails it; rounding within the bound's slack (Cauchy-Schwarz leaves much) does
    not show, so the bound's assumptions are the kernel's documented ones (torch_compat).
    """
    probes = torch.randn(4, w.size(1), generator=torch.Generator().manual_seed(0))
    # a row of equal signs: the largest sums
    probes[0] = 1.0
    # batch 1 first (decoding's), then 4
    alone = torch.cat([int8_rows_matmul(probe[None], q, scale) for probe in probes])
    together = int8_rows_matmul(probes, q, scale)
    exact = F.linear(probes, w)
    bound = torch.linalg.vector_norm(probes, dim=1, keepdim=True) * rows
    return all(bool(((logits.float() - exact).abs() <= bound).all()) for logits in (alone, together))


def check_switch(requested: Any) -> bool | None:
    """generate's ``int8_head`` switch, once it is True, False or None; else a ValueError."""
    if requested is not None and not isinstance(requested, bool):
        raise InvalidValueError(f"generate.int8_head must be True, False or None (automatic), got {requested!r}")
    return requested


def select_int8_head(
    model: Any, requested: bool | None, temperature: float, max_new_tokens: int
) -> Int8Head | NarrowHead | TransposedHead | None:
    """The greedy head that generation uses, or None (the model's own): ``requested`` is generate's
    ``int8_head`` switch (None: where it applies and pays, the int8 head or for narrow heads a
    :class:`NarrowHead`, else a :class:`TransposedHead`; True: the int8 head wherever it applies, else an error
    saying why; False: never).
    """
    if check_switch(requested) is False:
        return None
    if requested is None:
        if temperature != 0 or max_new_tokens < MIN_NEW_TOKENS:
            return None
        narrow = _narrow_greedy_head(model)
        if narrow is not None:
            return narrow
        return quantize_head(model)
    if temperature != 0:
        reason = f"it picks the most likely token, for greedy decoding (temperature=0), not temperature={temperature}"
    else:
        reason = unsupported_reason(model)
    if reason is None:
        int8 = quantize_head(model, min_weights=0)
        if int8 is not None:
            return int8
        reason = "the LM head has a weight that is not finite"
    raise InvalidValueError(
        f"int8_head=True, but the int8 greedy head cannot be used: {reason}; "
        f"pass int8_head=None (used where it applies) or False"
    )


def _narrow_greedy_head(model: Any) -> NarrowHead | TransposedHead | None:
    """The int8 copy of a narrow LM head, or its transposed fp32 copy where the int8 kernel cannot read it; None
    for other heads.
    """
    w = _narrow_head(model)
    if w is None:
        return None
    # one fingerprint for both copies (each is a read of the fp32 head)
    seen = _fingerprint(w)
    narrow = _kept(_KEPT_NARROW, model.lm_head, w, _int8_rows, seen)
    if narrow is None:
        return _kept(_KEPT_TRANSPOSED, model.lm_head, w, _transposed, seen)
    # a transposed copy from before the int8 kernel could read the head would only take memory
    _KEPT_TRANSPOSED.pop(model.lm_head, None)
    return narrow


def greedy_tokens(h: torch.Tensor, weight: torch.Tensor, int8: Int8Head) -> torch.Tensor:
    """``argmax(h @ weight[:V].T)`` per row of ``h`` ``(B, C)`` (fp32), the head read in ``int8``:
    only tokens whose int8 logit's upper bound reaches the row's best lower bound are scored in fp32
    (see the module's docstring). Outsize dimensions of ``h`` (GPT-2 has a few) would widen every
    bound: they are left out of the int8 product and added from fp32 columns of the head.
    """
    V, C = int8.scale.numel(), h.size(1)
    absh = h.abs()
    out = _outsize_dimensions(absh, weight, int8)
    if out:
        main = h.index_fill(1, torch.tensor(out, dtype=torch.long), 0.0)
        top = main.abs().amax(1, keepdim=True)
    else:
        main = h
        top = absh.amax(1, keepdim=True)
    # (B, 1): the int8 step of what is left of h, and the unit of the logits and bounds below
    sh = (top / INT8_ACTIVATION_MAX).clamp(min=1e-30)
    # integers in [-INT8_ACTIVATION_MAX, INT8_ACTIVATION_MAX], held in fp32
    qh = (main / sh).round_()
    # (B, V): integer dot products (summed exactly, rounded to fp32 once), scaled
    approx = int8_matmul(qh, int8.packed) * int8.scale
    if out:
        approx += (h[:, out] / sh) @ torch.stack([int8.cols[j] for j in out])
    bound = _bound(int8, qh, absh, sh, C)
    # (B, 1): each row's best lower bound. Where the logits or bounds overflowed (NaN, +inf) every token stays a
    # candidate, so such a row, beside ordinary ones too, is scored by the whole fp32 head.
    best = (approx - bound).amax(1, keepdim=True).nan_to_num_(nan=-math.inf, posinf=-math.inf)
    # (B, V): the tokens that may be the row's argmax (NaN logits are not left out)
    maybe = (approx + bound < best).logical_not_()
    # candidates of any row, ascending: argmax's first-index ties
    ids = maybe.any(0).nonzero()[:, 0]
    if not 0 < ids.numel() <= V // 8:
        return F.linear(h, weight[:V]).argmax(-1)
    scores = F.linear(h, weight.index_select(0, ids)).masked_fill(~maybe.index_select(1, ids), -math.inf)
    return ids[scores.argmax(-1)]


def _outsize_dimensions(absh: torch.Tensor, weight: torch.Tensor, int8: Int8Head) -> list[int]:
    """Up to 16 dimensions of ``h`` above 6x a row's mean magnitude, whose fp32 columns of the head
    are kept in ``int8.cols`` (at most ``MAX_KEPT_COLUMNS``; new ones are taken here).
    """
    V, cols = int8.scale.numel(), int8.cols
    out = (absh > 6 * absh.mean(1, keepdim=True)).any(0).nonzero()[:16, 0].tolist()
    out = [j for j in out if j in cols or len(cols) < MAX_KEPT_COLUMNS]
    cols.update({j: weight[:V, j].contiguous() for j in out if j not in cols})
    return out


def _bound(int8: Int8Head, qh: torch.Tensor, absh: torch.Tensor, sh: torch.Tensor, C: int) -> torch.Tensor:
    """``(B, V)``, in units of ``sh``: |h.w - approx| <= scale/2 (|qh|_1 + |q|_1 + C/2) (h's rounding,
    w's, both), plus the fp32 rounding of the logits (the reference's, the columns') <= 2 C 2^-24 max|h| |w|_1
    and of the integer sums <= 2^-24 INT8_ACTIVATION_MAX scale |q|_1.
    """
    bound = 0.5 * torch.addcmul(int8.rows, int8.scale, qh.abs().sum(1, keepdim=True, dtype=torch.float32))
    bound += int8.rows * (absh.amax(1, keepdim=True) / sh * C * 2**-23 + INT8_ACTIVATION_MAX * 2**-24)
    return bound

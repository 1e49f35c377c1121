"""The last row's logits without the output head's work on every other row.

A step that samples from a prefill step (an edit's changed tokens, see the engine's
`ALONE_FINAL_STEP`) needs the logits of its last token only, but a model call computes
the output head for every input row: for Gemma 3 270M (a 262,144-word head of 640-wide
rows) that is 0.2 s of a 20-token step on 2 cores, one row 0.1 s. MLX does not move a
slice of a matmul's result before the matmul, so the engine calls the model's *body* (the
decoder stack and its final norm) and applies the *head* to the last row itself.

`split_head(model)` finds, in an mlx-lm text model, the body (``model.model`` or
``model.language_model.model``) and the head (``lm_head``, else the tied embedding's
``as_linear``; followed by the library's own ``logit_softcap`` where the model caps its
logits with one, as Gemma 4 does), then checks on one token that ``head(body(x))`` equals
``model(x)`` exactly: a family whose output does more than that fails the check and keeps
whole-model calls (for Gemma 4 E2B, a 1,024-token step would then compute 1,024 rows of a
262,144-word head: about as much work as the whole decoder stack). The head over one row
may differ from its row of the head over many in the last bits (another matmul shape), like
every short tail step (see the README's parity table).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

__all__ = ["SplitHead", "split_head"]


@dataclass(frozen=True)
class SplitHead:
    """A model's body (inputs, cache -> hidden states) and head (hidden -> logits)."""

    body: Callable[..., mx.array]
    head: Callable[[mx.array], mx.array]

    def last_logits(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """Logits of each row's last position, shape (batch, 1, vocab); fills `cache`."""
        hidden = self.body(inputs, cache=cache)
        return self.head(hidden[:, -1:, :])


def _candidate(model: Any) -> SplitHead | None:
    for owner in (model, getattr(model, "language_model", None)):
        if owner is None:
            continue
        body = getattr(owner, "model", None)
        if body is None or not callable(body):
            continue
        head = getattr(owner, "lm_head", None)
        if head is None:
            embed = getattr(body, "embed_tokens", None)
            head = getattr(embed, "as_linear", None)
        if head is None or not callable(head):
            continue
        cap = getattr(owner, "final_logit_softcapping", None)
        if cap:
            module = sys.modules.get(type(owner).__module__)
            if not callable(getattr(module, "logit_softcap", None)):
                return None  # a cap we cannot apply the library's way: whole-model calls
            head = _capped(head, module, cap)
        return SplitHead(body, head)
    return None


def _capped(head: Callable, module: Any, cap: float) -> Callable[[mx.array], mx.array]:
    # The module's function looked up at each call, as its model does: a route may replace it
    # (cpu_math.SOFTCAP) and give it back.
    def capped(hidden: mx.array) -> mx.array:
        return module.logit_softcap(cap, head(hidden))

    return capped


def split_head(model: Any, make_cache: Callable[[], list[Any]], token: int = 0) -> SplitHead | None:
    """The model's body and head when they give exactly the model's logits on one token
    (`token`, with fresh caches from `make_cache`), else None. Call on the model's thread."""
    split = _candidate(model)
    if split is None:
        return None
    x = mx.array([[token]], dtype=mx.uint32)
    try:
        whole = model(x, cache=make_cache())
        whole = getattr(whole, "logits", whole)
        parts = split.head(split.body(x, cache=make_cache()))
        if whole.shape != parts.shape or not mx.array_equal(whole, parts).item():
            return None
    except Exception:  # a body that wants other arguments: keep whole-model calls
        return None
    return split

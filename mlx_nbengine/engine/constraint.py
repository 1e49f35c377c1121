"""Grammar-constrained decoding: a request's tokens held to an llguidance grammar.

`Engine.submit(..., grammar=G)` gives the request a `Constraint`: an llguidance
``LLMatcher`` over the model's tokenizer. Before each of its tokens is chosen, the row of
logits gets the matcher's token mask (every token the grammar cannot take next is set to
-inf), then the usual argmax or draw picks from what is left; the token is fed to the
matcher (`Sequence.accept`). When the grammar is complete (the matcher takes nothing more
but end-of-text) the request stops: ``finish_reason == "stop"``, ``stop_reason ==
"grammar"``; where the grammar could also go on, the mask lets the model end with EOS
(``stop_reason == "eos"``).

`G` is what llguidance's ``LLMatcher`` takes: a Lark grammar, or llguidance's JSON form
(``LLMatcher.grammar_from_json_schema``, ``grammar_from_lark``, ``grammar_from_regex``).
`compile_constraint` checks it on the caller's thread: a grammar llguidance cannot build
is an `InvalidRequestError` in one line, so no bad grammar reaches the generation thread.
A matcher that fails later (a token it refuses, a resource limit) ends that request only,
with a `GrammarError`.

The masks are computed in numpy on the host: a decode step with a constrained member is a
`sampling.HostDraw`, read before the next step is built (steps with only unconstrained
members keep their pipeline). The `LLTokenizer` (the tokenizer as llguidance reads it) is
built once per engine, at its first grammar (`GrammarTokenizer`).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlx_nbengine.errors import GrammarError, InvalidRequestError

__all__ = ["Constraint", "GrammarError", "GrammarTokenizer", "compile_constraint"]


class Constraint:
    """One request's matcher and its mask buffer (generation thread, after submit)."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int, eos: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos = eos
        self._bits = allocate_token_bitmask(1, n_vocab)
        self.error: str | None = None

    def allowed(self) -> np.ndarray:
        """A bool per token id: what the grammar takes next (padded ids included: False)."""
        try:
            fill_next_token_bitmask(self.matcher, self._bits)
        except Exception as e:  # never out of the step: this request fails, not the batch
            self.error = _first_line(str(e)) or type(e).__name__
        if self.matcher.is_error() and self.error is None:
            self.error = _first_line(self.matcher.get_error())
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little").astype(bool)

    def mask(self, row: np.ndarray) -> np.ndarray:
        """`row` (1-D float logits, changed in place) with the tokens the grammar cannot
        take next at -inf."""
        allowed = self.allowed()
        n = min(len(row), len(allowed))
        row[:n][~allowed[:n]] = -np.inf
        row[n:] = -np.inf
        return row

    def consume(self, token: int) -> str | None:
        """Feed the chosen `token` to the matcher; what went wrong, or None."""
        if self.error is not None:
            return self.error
        if token in self.eos and self.matcher.is_accepting():
            return None  # the grammar may end here; the sequence ends with EOS
        try:
            taken = self.matcher.consume_token(token)
        except Exception as e:  # never out of the step: this request fails, not the batch
            self.error = _first_line(str(e)) or type(e).__name__
            return self.error
        if not taken:
            self.error = _first_line(self.matcher.get_error()) or f"token {token} refused"
        return self.error

    @property
    def complete(self) -> bool:
        """The grammar takes nothing more (but end-of-text)."""
        return self.matcher.is_stopped()


class GrammarTokenizer:
    """A model's `llguidance.LLTokenizer`, built at first use (about a second on a large
    vocabulary), shared by every request of the engine; thread-safe."""

    def __init__(self, lm: Any) -> None:
        self._lm = lm
        self._lock = threading.Lock()
        self._built: tuple[llguidance.LLTokenizer, int] | None = None

    def get(self) -> tuple[llguidance.LLTokenizer, int]:
        """The LLTokenizer and the width of the masks (the model's logits, at least the
        tokenizer's ids)."""
        with self._lock:
            if self._built is None:
                self._built = _build_tokenizer(self._lm)
            return self._built


def compile_constraint(
    grammar: Any, tokenizer: GrammarTokenizer, eos: frozenset[int]
) -> Constraint:
    """The `Constraint` of `grammar` (see the module docstring); raises
    `InvalidRequestError` in one line when llguidance cannot build it."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise InvalidRequestError(
            "grammar must be a non-empty string: a Lark grammar or an llguidance grammar "
            "(e.g. llguidance.LLMatcher.grammar_from_json_schema(schema)), got "
            f"{type(grammar).__name__}"
        )
    lltok, n_vocab = tokenizer.get()
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"grammar: {_first_line(matcher.get_error())}")
    return Constraint(matcher, n_vocab, eos)


def _build_tokenizer(lm: Any) -> tuple[llguidance.LLTokenizer, int]:
    wrapper = lm.tokenizer
    backend = getattr(wrapper, "backend_tokenizer", None)  # a fast (Rust) tokenizer
    if backend is None:
        raise InvalidRequestError(
            "grammar needs the model's fast tokenizer (tokenizer.json); this model has none"
        )
    backend = copy.copy(backend)  # as llguidance.hf does: no padding or truncation
    backend.no_padding()
    backend.no_truncation()
    ids = wrapper.get_vocab().values()
    n_vocab = max(max(ids, default=-1) + 1, _config_vocab(lm.config))
    try:
        lltok = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=n_vocab, eos_token=sorted(lm.eos_token_ids)
        )
    except Exception as e:  # ValueError / RuntimeError: a tokenizer llguidance cannot read
        raise InvalidRequestError(
            f"grammar: llguidance cannot read this model's tokenizer ({_first_line(str(e))})"
        ) from e
    return lltok, n_vocab


def _config_vocab(config: dict[str, Any]) -> int:
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size or 0)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")

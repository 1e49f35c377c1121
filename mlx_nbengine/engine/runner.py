"""The model calls of the engine: prefill steps, grouped prefill steps, decode steps.

A *prefill step* feeds prompt tokens ``start:end`` of one sequence into its own
single-sequence cache; when it ends at the prompt's end it also samples the first token
(through the *split head* where the model has one: the output head over the last row
only, see `models.head`). A *grouped* prefill step feeds several sequences' final steps
in one call over their right-padded rows (mlx-lm's ``merge``, ``prepare`` and
``finalize`` of batched caches). A *decode step* feeds one token per member of the
`DecodeBatch` and samples the next; it is *launched* (built and started with
``mx.async_eval``) and read later (see `decoding`). Vision models are fed embeddings
(see `vision`). Each call runs on the BLAS thread count its engine's `_blas.ThreadPolicy`
chooses for its size (`thread_policy`: the engine's own, so two engines share nothing).
Generation thread only: every MLX array given to the model is made here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_nbengine._blas import ThreadPolicy
from mlx_nbengine.cache import extract_block_records
from mlx_nbengine.engine.batch import DecodeBatch, merge_caches
from mlx_nbengine.engine.memory import give_back_memory
from mlx_nbengine.engine.sampling import HostDraw, draw_rows
from mlx_nbengine.engine.sequence import Sequence
from mlx_nbengine.engine.vision import VisionRunner
from mlx_nbengine.models import deltaroute
from mlx_nbengine.models.head import split_head


class Runner:
    """Calls one loaded model (`lm`, a `models.LoadedModel`); see the module docstring."""

    def __init__(
        self, lm: Any, *, split: bool = True, thread_policy: ThreadPolicy | None = None
    ) -> None:
        self.lm = lm
        # Each step's thread count (None: a policy of its own, as a test's runner needs).
        self.thread_policy = thread_policy if thread_policy is not None else ThreadPolicy()
        self.vision = VisionRunner(lm) if lm.modality == "vision" else None
        # A final prefill step's logits for its last row only (see `models.head`); its
        # check calls the model, which a sharded model (`ranks`) must not do on one rank.
        # Its products, as the record probe's, count for this engine's policy.
        with self.thread_policy.running():
            self.split = (
                split_head(lm.model, lm.make_cache, lm.bos_token_id or 0)
                if split and lm.modality == "text"
                else None
            )
        # The recurrent layers whose states can be taken inside a prefill step (the hybrid's,
        # on our kernels: `deltaroute.tapping`), where they are all the model's; else None.
        self._tapping_layers = deltaroute.tapping_layers(lm)
        # Sampled rows are drawn in numpy on the CPU, in the MLX graph elsewhere (`sampling`).
        self.host_sampling = mx.default_device().type == mx.DeviceType.cpu
        # Called with every set of logits a token is sampled from (rows = sequences).
        self.logit_watcher: Callable[[mx.array], None] | None = None

    @property
    def taps_states(self) -> bool:
        """Whether every recurrent layer's state can be taken inside a prefill step now, so
        a recurrent model's steps need not end at each block boundary."""
        return deltaroute.taps_every_state(self._tapping_layers)

    @property
    def bidirectional(self) -> bool:
        """The model's image tokens attend both ways (see `vision`)."""
        return self.vision is not None and self.vision.bidirectional

    # --- caches (hooks: a sharded model's runner, `ranks.mirror`, tells its workers) ------

    def new_batch(self) -> DecodeBatch:
        """An empty decode batch (`Decoder`'s)."""
        return DecodeBatch()

    def adopt(self, seq: Sequence, cache: list[Any], source: str | None, tokens: int) -> list[Any]:
        """The cache `seq` prefills into: `cache`, holding its first `tokens` prompt tokens
        restored from `source` (None: fresh)."""
        return cache

    def kept_hot(self, tokens: list[int], cache: list[Any]) -> None:
        """`cache`, holding `tokens`, became the hot cache."""

    # --- prefill ----------------------------------------------------------------------------

    def embed(self, seq: Sequence, restored: int) -> None:
        """Give a vision model's `seq` its prompt embeddings (its first `restored` tokens
        are in its cache already); a no-op for text models."""
        if self.vision is not None:
            seq.embedded = self.vision.embed(seq.prompt, seq.vision, need_from=restored)
            seq.rope_delta = seq.embedded.rope_delta or 0

    def prefill(self, seq: Sequence, start: int, end: int, *, block_size: int = 0) -> int | None:
        """Feed prompt tokens ``start:end`` into `seq.cache`, evaluated; when `end` is the
        prompt's end, the token sampled from the last row (else None). Where the recurrent
        layers' states can be taken inside the step (`taps_states`), those at each multiple
        of `block_size` inside it go in `seq.step_states` (boundary -> layer -> a cache)."""
        seq.step_states = {}
        inside = (
            range((start // block_size + 1) * block_size, end, block_size) if block_size else ()
        )
        if self.taps_states and len(inside):
            with deltaroute.tapping(tuple(b - start for b in inside)) as taps:
                token = self._prefill(seq, start, end)
            seq.step_states = _tapped_states(seq.cache, taps, start)
            return token
        return self._prefill(seq, start, end)

    def _prefill(self, seq: Sequence, start: int, end: int) -> int | None:
        inputs = mx.array(seq.prompt[start:end], dtype=mx.uint32)[None]
        last = end == len(seq.prompt)
        with self.thread_policy.prefill(end - start):
            if seq.embedded is not None:
                kwargs = self.vision.prefill_kwargs(seq.embedded, start, end)
                logits = _logits(self.lm.language_model(inputs, cache=seq.cache, **kwargs))
            elif last and self.split is not None:
                logits = self.split.last_logits(inputs, seq.cache)
            else:
                logits = _logits(self.lm.model(inputs, cache=seq.cache))
            if not last:
                mx.eval([c.state for c in seq.cache])  # the logits are never evaluated
                return None
            token = self.sample([seq], logits[:, -1, :])
            mx.eval(token, [c.state for c in seq.cache])
        return token.item()

    def prefill_group(self, group: list[Sequence], spans: list[tuple[int, int]]) -> list[Any]:
        """Feed each member's prompt tokens ``start:end`` (`spans`, row order) in one call;
        the members' caches are consumed; their batched caches, left-padded as decode
        steps expect, are returned."""
        lengths = [end - start for start, end in spans]
        width = max(lengths)
        padding = [width - n for n in lengths]
        rows = [
            s.prompt[a:b] + [0] * pad for s, (a, b), pad in zip(group, spans, padding, strict=True)
        ]
        caches = merge_caches([s.cache for s in group])
        for seq in group:
            seq.cache = None
        if max(padding):
            for c in caches:
                c.prepare(lengths=lengths, right_padding=padding)
        with self.thread_policy.prefill(width * len(group)):
            self.lm.model(mx.array(rows, dtype=mx.uint32), cache=caches)  # logits never read
            if max(padding):
                for c in caches:
                    c.finalize()  # right padding becomes left padding
            mx.eval([c.state for c in caches])
        return caches

    # --- decode -----------------------------------------------------------------------------

    def launch(self, batch: DecodeBatch, inputs: list[int] | mx.array | HostDraw) -> Any:
        """Build one decode step of `batch` feeding `inputs` (row i = member i) and start
        computing it; its sampled tokens (lazy, or a `HostDraw` drawn when read)."""
        members = list(batch.members)
        if isinstance(inputs, HostDraw):
            inputs = inputs.tolist()

        def forward(tokens: mx.array, *, cache: list[Any]) -> mx.array:
            if self.vision is None:
                return self.lm.model(tokens, cache=cache)
            kwargs = self.vision.decode_kwargs(members)  # each row's rope delta
            return _logits(self.lm.language_model(tokens, cache=cache, **kwargs))

        with self.thread_policy.step(len(members)):
            logits = batch.forward(forward, inputs)
            if _host_drawn(members, self.host_sampling):
                tokens = HostDraw(logits, members, host=self.host_sampling)
                mx.async_eval(logits)
            else:
                tokens = self.sample(members, logits)
                mx.async_eval(tokens)
        return tokens

    def sample(self, seqs: list[Sequence], logits: mx.array) -> mx.array:
        """Each row's next token: the argmax of greedy rows, a draw for sampled ones."""
        if self.logit_watcher is not None:
            self.logit_watcher(logits)
        if all(s.greedy and s.constraint is None for s in seqs):
            return mx.argmax(logits, axis=-1)
        if _host_drawn(seqs, self.host_sampling):  # reads the step's logits now (`sampling`)
            return mx.array(draw_rows(seqs, logits, host=self.host_sampling), dtype=mx.uint32)
        lazy = [
            mx.argmax(row, axis=-1) if s.greedy else s.sampler.graph(row - row.max())
            for s, row in zip(seqs, logits.split(len(seqs)), strict=True)
        ]
        return mx.concatenate([t.reshape(-1).astype(mx.uint32) for t in lazy])

    def idle(self) -> None:
        """Nothing is in flight (the generation thread goes idle): give memory back."""
        give_back_memory(between_steps=True)

    # --- load -------------------------------------------------------------------------------

    def probe_records(self) -> dict[str, Any]:
        """The records of one token through the model: their arrays have the heads, widths,
        dtypes and state shapes of every record the model will ever make."""
        cache = self.lm.make_cache()
        token = mx.array([[self.lm.bos_token_id or 0]], dtype=mx.uint32)
        model = self.lm.language_model if self.lm.modality == "vision" else self.lm.model
        with self.thread_policy.running():
            model(token, cache=cache)
            mx.eval([c.state for c in cache])
        return extract_block_records(cache, block=0, block_size=1)


def _host_drawn(seqs: list[Sequence], host_sampling: bool) -> bool:
    """The step's rows are chosen in numpy: sampled rows on the CPU, or a constrained row
    (its grammar's mask, see `constraint`) on any device."""
    if any(s.constraint is not None for s in seqs):
        return True
    return host_sampling and not all(s.greedy for s in seqs)


def _logits(out: Any) -> mx.array:
    return getattr(out, "logits", out)


def _tapped_states(cache: list[Any], taps: deltaroute.Taps, start: int) -> dict[int, dict]:
    """{boundary: {layer index: a stand-in cache holding that layer's state there}} from a
    step that began at `start`; a layer that gave none leaves its boundary out."""
    out: dict[int, dict[int, Any]] = {}
    for i, layer_cache in enumerate(cache):
        for n, arrays in zip(taps.at, taps.found.get(id(layer_cache), []), strict=False):
            stand_in = type(layer_cache)(size=len(arrays))  # mlx-lm's or mlx-vlm's class
            for j, array in enumerate(arrays):
                stand_in[j] = array
            out.setdefault(start + n, {})[i] = stand_in
    recurrent = deltaroute.arrays_cache_classes()
    layers = {i for i, c in enumerate(cache) if isinstance(c, recurrent)}
    return {b: states for b, states in out.items() if set(states) == layers}

"""The generation thread: loads the model, then admits, prefills and decodes requests.

Terms:

- *admission*: waiting sequences become *admitting*, oldest first, while slots are free
  (members of the batch plus admitting sequences stay within `parallel`), so a burst of
  requests is admitted together (an idle loop that wakes for a request first waits
  `ADMIT_GRACE_S` for the rest of a burst). Each restores its prefix, then prefills the
  rest of its prompt but the last token, and *joins* the batch: the prompt's last token
  is fed by the batch's next decode step, which samples the first generated token (a
  one-token prompt is computed and sampled alone; a sequence alone whose final step is
  short, `ALONE_FINAL_STEP`, samples from that step).
- *prefill*: a sequence prefills alone, with a plain single-sequence cache, except for
  its *final step* (the one that completes its prefill) when that step stays inside one
  block: sequences whose final steps are due together are prefilled as a *group*, one
  model call over their right-padded tokens (mlx-lm's ``merge``, ``prepare`` and
  ``finalize`` of batched caches), and join the batch together. A short step costs
  about as much as reading the weights once, so four chats that arrive together pay
  that once, not four times; the padding a group may add is bounded by
  `GROUP_PAD_TOKENS` per extra member. While another admitted sequence is still
  restoring, ready ones wait for it (at most `DEFER_LIMIT_S`) so that a burst forms one
  group.
- *restore*: the prompt's prefix comes from the best of two sources. ``memory``: the
  *hot cache*, the cache of the last sequence that finished, when its tokens share a
  longer prefix with the prompt than the disk can serve, that prefix covers at least one
  whole block or every prompt token but the last (a shared BOS alone is no restore), and
  it can be cut back to that prefix (it is used as is when its tokens are a prefix of the
  prompt, trimmed only when every layer is trimmable; a sliding window that has rotated
  or a recurrent state is never trimmed). ``disk``: the records of the longest
  restorable chain of whole blocks, planned and loaded by the cache-I/O thread and
  assembled here, then (``restore="token"``, the default) a *cut*: the unchanged start
  of the next block, from the stored block that followed the same prefix and shares the
  most tokens with it (see `planner`), so an edit is restored up to its first changed
  token. Full-attention and sliding-window layers (window at least a block) are cut to
  the token; a recurrent state or a window narrower than a block resumes only at a block
  boundary, and the report says why (`Report.kept_boundary`). ``restore="block"`` makes
  no cut. Once the source is chosen, every block left to compute gets its *reason* (see
  `reasons`) from the facts the restore read.
- *partial block*: when a sequence finishes, the tokens its cache holds after the last
  boundary (a prompt's tail, often the question a notebook edits, and the answer) are
  stored as a partial block (its records where cuts are made, else only its tokens), so
  a later edit of that tail is cut to the token too. Models with recurrent layers keep
  the state taken at its end: a prompt that holds the whole partial block (a chat's next
  turn, the same request again) resumes there. Their image prompts also end a prefill
  step at each image's end and store a partial block there (an *image-end checkpoint*),
  so a new question about the same image resumes after the whole image.
- *parity*: restored arrays are the stored ones; for tokens the earlier run computed in
  a prefill step of a few dozen tokens or more they equal what a cold run computes (CPU
  matmuls and attention give the same bits whatever the length of such a step). The
  rest is computed in steps of other shapes than a cold run's (from the cut to the next
  boundary, the last token alone), so its logits may differ in the last bits. Largest
  difference of the last prompt token's logits, cut restore vs cold run
  (`bench/bench_peers.py --parity`, CPU): tiny llama 1.2e-6, tiny gemma3_text windows
  24 / 64 / 512 (blocks of 16) 9.5e-6 / 1.2e-5 / 1.1e-5, tiny qwen3_5 0 (it keeps
  boundaries), Gemma 3 270M (2,048 tokens, edited 20 before the end, blocks of 256)
  2.1e-5 on logits up to 14 (a whole-block restore there: 1.5e-5, its window layers'
  buffers having another length than a cold run's); the greedy token was the same in
  every case and in every test prompt.
- *step*: one model call. A *prefill step* computes prompt tokens up to the next block
  boundary (or a few blocks, or the prompt's end); a *decode step* computes one token for
  every member of the batch. The loop alternates: one prefill step of each admitting
  sequence, then one decode step, so a new request joins while others keep decoding.
  Decode steps are *pipelined*: step n+1's graph is built from step n's sampled tokens
  before they are read (`mx.async_eval`), so MLX computes while this thread streams
  text; the pipeline is settled (step n read, nothing in flight) before a member joins,
  and a step after which a member's cache reaches a block boundary launches nothing
  until its checkpoint is taken. On the CPU, sampled (temperature > 0) rows are drawn
  in numpy when their step is read (`HostDraw`), so such steps are not pipelined.
- *checkpoint*: when a sequence's cache reaches a block boundary (after a prefill step, or
  after the decode step that feeds the boundary's last generated token), that block's
  records are extracted (from a single-sequence copy for batched members), evaluated, and
  sent to the cache-I/O thread to be stored under the block's key.

Threading: this thread owns the `LoadedModel` (it loaded it: MLX streams are per thread),
every sequence, the `DecodeBatch` and the hot cache; every MLX array given to the model
is made here. Other threads talk to it only through its inbox (submit, cancel, stop) and
read its two counters (`active`, `queued`) for stats. An exception while serving one
sequence fails that request only; one inside a batched decode step fails that step's
members; the loop keeps serving.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_nbengine._blas import PARALLEL_MIN_TOKENS, blas_step, blas_threads_for
from mlx_nbengine.engine.batch import DecodeBatch, merge_caches
from mlx_nbengine.engine.cacheio import CacheIO
from mlx_nbengine.engine.memory import give_back_memory
from mlx_nbengine.engine.reasons import computed_reasons
from mlx_nbengine.engine.request import EngineClosedError
from mlx_nbengine.engine.sampling import HostDraw, RequestSampler, draw_rows
from mlx_nbengine.engine.sequence import Sequence

# An idle loop woken by a request waits this long for the rest of a burst before admitting.
ADMIT_GRACE_S = 0.005
# The longest a sequence ready to prefill waits for others still restoring (to form a group).
DEFER_LIMIT_S = 0.05
# A sequence alone whose final prefill step is at most this many tokens (an edited question)
# takes its last prompt token into that step and samples there, instead of in a decode
# step of its own: one model call less. Only for short steps, since the output head is then
# computed for every row of the step (Gemma 3 270M, 2,028 tokens cached, 20 to go: one call
# 0.63 s against 0.70-0.76 s for the two; a 1,024-token step would pay 1,023 rows of a
# 262k-word head).
ALONE_FINAL_STEP = 32
# Padding tokens a prefill group may add per member beyond the first: a short step costs
# about one read of the weights, worth this many tokens of compute on small models.
GROUP_PAD_TOKENS = 64


def _prefill_blas(n_tokens: int) -> AbstractContextManager:
    """The BLAS thread count of a prefill step over `n_tokens` tokens (see `_blas`).

    A step long enough to be a prefill step there is tuned by `blas_step`. A shorter one
    (an edit's few changed tokens) runs on the count prefill steps run faster on (see
    `_blas`), without being counted as a decode step or timed: a tuning probe of the other
    count would otherwise land on it and cost a whole step of the edited re-run.
    """
    if n_tokens >= PARALLEL_MIN_TOKENS:
        return blas_step(n_tokens)
    blas_threads_for(n_tokens)
    return nullcontext()


@dataclass
class HotCache:
    """The last finished sequence's cache, exactly the tokens it holds and the spans of
    the images among them."""

    tokens: list[int]
    cache: list[Any]
    images: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        from mlx_nbengine.cache.blocks import match_ids

        self.match = match_ids(self.tokens, self.images)  # compared with every new prompt

    def usable(self, prompt: Any, *, block_size: int, bidirectional: tuple[Any, ...] = ()) -> int:
        """How many leading prompt tokens this cache can serve (0 if none): worth using
        only when they cover a whole block or every prompt token but the last. `prompt`
        is the prompt's `match_ids` (images told apart); `bidirectional` the prompt's
        image spans that must not be cut (models whose images attend both ways)."""
        from mlx_nbengine.cache.followers import common_prefix

        limit = min(len(self.tokens), len(prompt) - 1)
        n = common_prefix(self.match[:limit], prompt[:limit])
        for span in bidirectional:
            if span.cuts(n):
                n = span.start
        if n < block_size and n < len(prompt) - 1:
            return 0
        if n == len(self.tokens):
            return n
        trimmable = all(hasattr(c, "trim") and c.is_trimmable() for c in self.cache)
        return n if trimmable else 0

    def take(self, n: int) -> list[Any]:
        """The cache cut back to `n` tokens (consumes the hot cache)."""
        excess = len(self.tokens) - n
        if excess:
            for c in self.cache:
                c.trim(excess)
        return self.cache


class GenerationThread:
    """The loop described in the module docstring, on one daemon thread."""

    def __init__(
        self,
        *,
        loader: Callable[[], Any],
        io: CacheIO,
        prefix_factory: Callable[[Any], Any] | None,
        parallel: int,
        block_size: int,
        max_prefill_step: int,
        restore: str = "token",
        name: str = "mlx-nbengine-generation",
    ) -> None:
        self._loader = loader
        self.to_token = restore == "token"  # else "block": whole blocks from disk only
        self._cut_ok = False  # the store's model can be cut inside a block: set on load
        self._io = io
        self._prefix_factory = prefix_factory
        self.parallel = parallel
        self.block_size = block_size
        self.max_prefill_step = max_prefill_step
        self.lm: Any = None
        self.has_prefix = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._stopping = False
        self._waiting: deque[Sequence] = deque()
        self._admitting: list[Sequence] = []
        self._launched_at = 0.0
        self._host_sampling = True  # sampled rows are drawn in numpy (CPU: see `sampling`)
        self._batch = DecodeBatch()
        self._vision: Any = None  # engine.vision.VisionRunner of a vision model
        self._split: Any = None  # models.head.SplitHead of a text model whose head splits
        self._image_checkpoints = False  # end a prefill step (and store) at each image end
        self._prompt_partials = False  # store the prompt's partial block where prefill ends
        self._bidirectional = False  # its image tokens attend both ways
        self._hot: HotCache | None = None
        self._state_layers = False
        self.store_off = True  # no block store (or one with a zero budget): set on load
        self.active = 0
        self.queued = 0
        self.failures = 0
        self.group_prefills = 0  # prefill steps that served several sequences at once
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- other threads ----------------------------------------------------------------------

    def start(self) -> Any:
        """Start the thread, wait for the model, return it; re-raise a load error here."""
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error
        return self.lm

    def submit(self, seq: Sequence) -> None:
        self.queued += 1
        self._inbox.put(("submit", seq))

    def cancel(self, request: Any) -> None:
        self._inbox.put(("cancel", request))

    def stop(self) -> None:
        """Cancel everything in flight, stop the loop and join the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on this thread between steps and return its result (for tests, tools)."""
        done = threading.Event()
        box: list = []

        def job():
            try:
                box.append((True, fn()))
            except BaseException as exc:
                box.append((False, exc))
            done.set()

        self._inbox.put(("call", job))
        # A stopped loop runs the calls left in its inbox; one put after it ended never runs.
        while not done.wait(0.1):
            if not self._thread.is_alive() and not done.is_set():
                raise EngineClosedError("the engine is closed")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def drop_hot_cache(self) -> None:
        """Forget the hot cache and the image features (run on this thread, e.g. through
        `call`)."""
        self._hot = None
        if self._vision is not None:
            self._vision.memo.clear()

    def vision_counts(self) -> dict[str, int]:
        """Images encoded by the vision tower and feature-memo hits (vision models)."""
        runner = self._vision
        if runner is None:
            return {}
        return {
            "vision_encodes": runner.encodes,
            "feature_memo_hits": runner.memo.hits,
            "feature_memo_bytes": runner.memo.nbytes,
        }

    # --- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.lm = self._loader()
            if self.lm.kind == "vision":
                from mlx_nbengine.engine.vision import VisionRunner

                self._vision = VisionRunner(self.lm)
                self._bidirectional = self._vision.bidirectional
            self._host_sampling = mx.default_device().type == mx.DeviceType.cpu
            if self.lm.kind == "text":
                from mlx_nbengine.models.head import split_head

                # A final prefill step's logits for its last row only (see `head`).
                self._split = split_head(
                    self.lm.model, self.lm.make_cache, self.lm.bos_token_id or 0
                )
            if self._prefix_factory is not None:
                from mlx_nbengine.cache import layer_kinds

                self._state_layers = "state" in layer_kinds(self.lm.make_cache())
                lm = self.lm
                self._io.open(lambda: self._prefix_factory(lm))
                self._learn_record_shapes()
                self.has_prefix = True
                self.store_off = self._io.prefix.store.budget_bytes == 0
                # Partial blocks keep records where cuts can use them: every model but
                # one with windows narrower than a block (recurrent states are cut only at
                # a partial block's end, where its state record was taken).
                self._cut_ok = self._io.prefix.cut_blocker in (None, "state")
                self._image_checkpoints = (
                    self._vision is not None
                    and self.to_token
                    and self._io.prefix.cut_blocker == "state"
                )
                # A window narrower than a block forgets the partial block's first tokens
                # while the request decodes: take it where the prompt's prefill ends.
                self._prompt_partials = self.to_token and self._io.prefix.window_narrower_than_block
        except BaseException as exc:
            self._load_error = exc
            self._release_streams()
            self._loaded.set()
            return
        self._loaded.set()
        try:
            while not self._stopping:
                try:
                    wait = self._wait_s()
                    if wait is None:
                        give_back_memory()
                    if self._receive(timeout=wait) and wait is None and not self._stopping:
                        time.sleep(ADMIT_GRACE_S)  # woke from idle: let a burst arrive
                        self._receive(timeout=0)
                    if self._stopping:
                        break
                    self._tick()
                except Exception as exc:
                    # Not one sequence's fault (those are caught closer): fail what is in
                    # flight rather than let the loop die and every later request hang.
                    self._fail_in_flight(exc)
                self.active = len(self._batch) + len(self._admitting)
                self.queued = len(self._waiting)
        finally:
            self._shutdown()
            self.lm = None
            self._release_streams()

    def _learn_record_shapes(self) -> None:
        """Show the prefix cache what this model's records look like (one token through
        the model: its cache's arrays have the heads, widths, dtypes and state shapes of
        every record it will ever make), before any record is read back; records an
        earlier process stored are held to them too."""
        from mlx_nbengine.cache import extract_block_records

        cache = self.lm.make_cache()
        token = mx.array([[self.lm.bos_token_id or 0]], dtype=mx.uint32)
        model = self.lm.language_model if self.lm.kind == "vision" else self.lm.model
        model(token, cache=cache)
        mx.eval([c.state for c in cache])
        records = extract_block_records(cache, block=0, block_size=1)
        prefix = self._io.prefix
        self._io.call(lambda: prefix.learn(records)).result()

    @staticmethod
    def _release_streams() -> None:
        # MLX gives each thread its own stream and worker; one left behind at interpreter
        # exit aborts the process ("terminate called without an active exception").
        mx.synchronize()
        mx.clear_streams()

    def _wait_s(self) -> float | None:
        """How long the loop may wait for its inbox: 0 with work to do, None when idle."""
        if len(self._batch) or (self._waiting and self._free_slots() > 0):
            return 0
        if not any(a.phase == "prefilling" for a in self._admitting):
            return None
        deferred = self._deferred_until()
        return 0 if deferred is None else max(0.0, deferred - time.perf_counter())

    def _deferred_until(self) -> float | None:
        """Until when ready sequences wait for others still restoring (None: no wait)."""
        if not any(a.phase == "restoring" for a in self._admitting):
            return None
        ready = [a.ready_at for a in self._admitting if a.phase == "prefilling"]
        until = min(ready) + DEFER_LIMIT_S if ready else None
        return until if until is not None and until > time.perf_counter() else None

    def _prefill_ready(self) -> list[Sequence]:
        if self._deferred_until() is not None:
            return []
        return [a for a in self._admitting if a.phase == "prefilling"]

    def _free_slots(self) -> int:
        return self.parallel - len(self._batch) - len(self._admitting)

    def _drop_admitting(self, seq: Sequence) -> None:
        if seq in self._admitting:
            self._admitting.remove(seq)

    def _receive(self, *, timeout: float | None) -> bool:
        """Handle what is in the inbox, first waiting up to `timeout` s (None: for ever)
        for something to arrive; True if a request was submitted."""
        submitted = False
        while True:
            try:
                if timeout == 0:
                    kind, arg = self._inbox.get_nowait()
                else:
                    kind, arg = self._inbox.get(timeout=timeout)
            except queue.Empty:
                return submitted
            timeout = 0
            if kind == "submit":
                submitted = True
                self._waiting.append(arg)
            elif kind == "cancel":
                self._cancel(arg)
            elif kind == "restored":
                self._restored(arg)
            elif kind == "call":
                arg()
            elif kind == "stop":
                self._stopping = True
                return submitted

    def _tick(self) -> None:
        while self._waiting and self._free_slots() > 0:
            seq = self._waiting.popleft()
            self._admitting.append(seq)
            try:
                self._admit(seq)
            except Exception as exc:
                self._drop_admitting(seq)
                self._fail([seq], exc)
        ready = self._prefill_ready()
        group = self._final_step_group(ready)
        if group:
            try:
                self._prefill_group(group)
            except Exception as exc:
                for seq in group:
                    self._drop_admitting(seq)
                self._fail(group, exc)
        for adm in ready:
            if adm in group:
                continue
            try:
                self._prefill_step(adm)
            except Exception as exc:
                self._drop_admitting(adm)
                self._fail([adm], exc)
        if len(self._batch):
            try:
                self._decode_step()
            except Exception as exc:
                self._fail_batch(exc)

    def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        self.failures += 1
        for seq in seqs:
            seq.fail(exc)

    def _fail_in_flight(self, exc: Exception) -> None:
        seqs = list(self._batch.members) + self._admitting
        self._batch.clear()
        self._admitting = []
        self._fail(seqs, exc)

    def _shutdown(self) -> None:
        seqs = list(self._waiting) + list(self._batch.members) + self._admitting
        self._waiting.clear()
        self._batch.clear()
        self._admitting = []
        self._hot = None
        for seq in seqs:
            seq.finish("cancelled")
        # Requests still in the inbox never started: tell their callers.
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                arg.fail(EngineClosedError("the engine was closed before this request started"))
            elif kind == "call":
                arg()
        self.active = self.queued = 0

    # --- admission and restore --------------------------------------------------------------

    def _admit(self, seq: Sequence) -> None:
        seq.phase = "restoring"
        if not seq.greedy:
            seq.sampler = RequestSampler(**seq.sampling)  # its MLX key is made here
        if not self.has_prefix:
            self._start_prefill(seq, None, 0.0)
            return
        better_than = self._hot_usable(seq)
        seq.restore_started = time.perf_counter()
        fut = self._io.restore(
            seq.prompt,
            better_than=better_than,
            make_cache=self.lm.make_cache,
            to_token=self.to_token,
            images=seq.images,
            bidirectional_images=self._bidirectional,
        )
        seq.restore_future = fut
        fut.add_done_callback(lambda _: self._inbox.put(("restored", seq)))

    def _restored(self, seq: Sequence) -> None:
        if seq not in self._admitting or seq.phase != "restoring":
            return  # cancelled while the I/O thread worked
        try:
            result = seq.restore_future.result()
        except Exception:
            # A restore that fails is a miss: the prompt is computed instead.
            result = None
        seq.restore_future = None
        try:
            self._start_prefill(seq, result, time.perf_counter() - seq.restore_started)
        except Exception as exc:
            self._drop_admitting(seq)
            self._fail([seq], exc)

    def _hot_usable(self, seq: Sequence) -> int:
        if self._hot is None:
            return 0
        return self._hot.usable(
            seq.prompt_match,
            block_size=self.block_size,
            bidirectional=seq.images if self._bidirectional else (),
        )

    def _start_prefill(self, seq: Sequence, restored: Any, seconds: float) -> None:
        plan, rebuilt, facts = restored if restored is not None else (None, None, None)
        hot_n = self._hot_usable(seq)
        kinds_read = None
        if rebuilt is not None and plan.tokens > hot_n:
            # Rebuilt on the cache-I/O thread, in the restore's own job (see `cacheio`).
            cache = rebuilt.cache
            start, source = plan.tokens, "disk"
            seq.restored_bytes = rebuilt.nbytes
            kinds_read = rebuilt.kinds
            seq.kept_boundary = plan.kept_boundary
        elif hot_n > 0:
            t = time.perf_counter()
            cache, self._hot = self._hot.take(hot_n), None
            start, source = hot_n, "memory"
            seq.restored_bytes = sum(c.nbytes for c in cache)
            seconds = time.perf_counter() - t
        else:
            cache, start, source = self.lm.make_cache(), 0, None
            seq.kept_boundary = plan.kept_boundary if plan is not None else None
        seq.cache = cache
        seq.cache_tokens = list(seq.prompt[:start])
        if self._vision is not None:
            seq.embedded = self._vision.embed(seq.prompt, seq.vision, need_from=start)
            seq.rope_delta = seq.embedded.rope_delta or 0
        first = start // self.block_size  # the first block not wholly restored
        if not self.has_prefix:
            facts = None
        seq.set_reasons(*computed_reasons(seq.n_blocks, first, facts, store_off=self.store_off))
        if source is not None:
            seq.report_restored(start, source, seconds, records=kinds_read)
        if self.has_prefix:
            seq.prompt_keys = (
                list(plan.keys) if plan is not None else self._keys(seq.prompt, seq.images)
            )
        seq.phase = "prefilling"
        seq.ready_at = time.perf_counter()

    def _keys(self, tokens: list[int], images: tuple[Any, ...] = ()) -> list[str]:
        from mlx_nbengine.cache import block_keys

        return block_keys(
            tokens, fingerprint=self.lm.fingerprint, block_size=self.block_size, images=images
        )

    # --- prefill ----------------------------------------------------------------------------

    @staticmethod
    def _prefill_end(seq: Sequence) -> int:
        # The last prompt token is fed by the decode step the sequence joins (its logits
        # are the only ones needed); a one-token prompt has nothing before it.
        n = len(seq.prompt)
        return n - 1 if n > 1 else n

    def _next_step(self, seq: Sequence) -> tuple[int, int]:
        pos, end, bs = len(seq.cache_tokens), self._prefill_end(seq), self.block_size
        last = end // bs * bs
        if pos % bs:
            # Restored from memory mid-block: first reach the next boundary (or the end).
            end_step = min(end, (pos // bs + 1) * bs)
        elif pos < last:
            # Hybrid models need a state checkpoint at every boundary; others take bigger
            # steps unless sequences are decoding, which a long step would stall.
            one_block = self._state_layers or len(self._batch) > 0
            max_step = bs if one_block else max(bs, self.max_prefill_step)
            end_step = min(pos + max_step // bs * bs, last)
        else:
            end_step = end
        if self._bidirectional:
            # An image attending both ways is computed in one call (see `vision`).
            for span in seq.images:
                if span.cuts(end_step):
                    end_step = span.end
            end_step = min(end_step, len(seq.prompt))
        if self._image_checkpoints:
            # A recurrent state exists only where a call ends: end one at each image's end.
            for span in seq.images:
                if pos < span.end < end_step and span.end % bs:
                    end_step = span.end
        n = len(seq.prompt)
        if end_step == n - 1 and n - pos <= ALONE_FINAL_STEP and self._alone(seq):
            end_step = n  # the last token too, sampled from this step (see the constant)
        return pos, end_step

    def _alone(self, seq: Sequence) -> bool:
        """Nothing decoding and no other sequence admitted: no decode step to share."""
        return not len(self._batch) and self._admitting == [seq]

    def _prefill_step(self, seq: Sequence) -> None:
        if len(seq.prompt) > 1 and len(seq.cache_tokens) == len(seq.prompt) - 1:
            self._join(seq, seq.prompt[-1])  # restored up to the last token: nothing to do
            return
        start, end = self._next_step(seq)
        t = time.perf_counter()
        inputs = mx.array(seq.prompt[start:end], dtype=mx.uint32)[None]
        last = end == len(seq.prompt)
        # The BLAS thread count is chosen per step; MLX runs the step at the eval.
        with _prefill_blas(end - start):
            if seq.embedded is not None:
                kwargs = self._vision.prefill_kwargs(seq.embedded, start, end)
                out = self.lm.language_model(inputs, cache=seq.cache, **kwargs)
                logits = getattr(out, "logits", out)
            elif last and self._split is not None:
                logits = self._split.last_logits(inputs, seq.cache)
            else:
                logits = self._forward(inputs, seq.cache)
            if last:
                token = self._sample([seq], logits[:, -1, :])
                mx.eval(token, [c.state for c in seq.cache])
            else:
                mx.eval([c.state for c in seq.cache])
        seq.cache_tokens.extend(seq.prompt[start:end])
        seq.report_computed(start, end, time.perf_counter() - t)
        if last:
            # The first token reaches the caller before this step's blocks are extracted
            # and queued for saving (about 10 MB of copies for a Gemma 3 270M block).
            self._drop_admitting(seq)
            seq.embedded = None
            reason = seq.accept(token.item(), context_length=self.lm.context_length)
        self._checkpoint_prefill(seq, start, end)
        if self._image_checkpoints and end % self.block_size:
            if any(span.end == end for span in seq.images):
                # The image-end checkpoint: a partial block with the state taken here.
                self._save_partial(seq.prompt[:end], seq.cache, images=seq.images)
        if self._prompt_partials and end % self.block_size and end >= len(seq.prompt) - 1:
            self._save_partial(seq.prompt[:end], seq.cache, images=seq.images)
        if end == len(seq.prompt) - 1:
            self._join(seq, seq.prompt[-1])
        if not last:
            return
        if reason is not None:
            self._finish(seq, (list(seq.cache_tokens), seq.cache), reason)
            return
        self._join(seq, seq.generated[-1])

    def _final_step_group(self, ready: list[Sequence]) -> list[Sequence]:
        """The sequences of `ready` to prefill together now (none, or at least two)."""
        if len(ready) < 2 or self.lm.kind == "vision":
            return []
        bs = self.block_size
        steps = []
        for seq in ready:
            n, pos = len(seq.prompt), len(seq.cache_tokens)
            if n < 2 or pos >= n - 1:
                continue  # a one-token prompt, or nothing left to prefill: the single path
            start, end = self._next_step(seq)
            if end != n - 1 or end % bs == 0 or start // bs != (end - 1) // bs:
                continue  # not its final step, or a block ends within it: a checkpoint is due
            steps.append((end - start, seq))
        steps.sort(key=lambda step: step[0])
        group: list[tuple[int, Sequence]] = []
        for length, seq in steps:
            trial = [*group, (length, seq)]
            padding = len(trial) * length - sum(n for n, _ in trial)
            if padding > GROUP_PAD_TOKENS * (len(trial) - 1):
                break
            group = trial
        return [seq for _, seq in group] if len(group) > 1 else []

    def _prefill_group(self, group: list[Sequence]) -> None:
        """Prefill each member's rest of the prompt but the last token in one model call
        (right-padded), then let the members join the batch together."""
        t = time.perf_counter()
        spans = [(len(s.cache_tokens), len(s.prompt) - 1) for s in group]
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
        with _prefill_blas(width * len(group)):
            self._forward(mx.array(rows, dtype=mx.uint32), caches)  # logits never evaluated
            if max(padding):
                for c in caches:
                    c.finalize()  # right padding becomes left padding, as decode expects
            mx.eval([c.state for c in caches])
        seconds = time.perf_counter() - t
        self.group_prefills += 1
        total = sum(lengths)
        for seq, (start, end) in zip(group, spans, strict=True):
            seq.cache_tokens.extend(seq.prompt[start:end])
            seq.report_computed(start, end, seconds * (end - start) / total)
        for seq in group:
            self._drop_admitting(seq)
            seq.phase = "decoding"
            seq.next_token = seq.prompt[-1]
        self._settle_before_join()
        self._batch.add_group(group, caches)

    def _join(self, seq: Sequence, next_token: int) -> None:
        """Move a prefilled `seq` into the batch; the next decode step feeds `next_token`."""
        self._drop_admitting(seq)
        seq.phase = "decoding"
        seq.embedded = None  # the prompt's embeddings are not needed any more
        seq.next_token = next_token
        cache, seq.cache = seq.cache, None
        self._settle_before_join()
        self._batch.add(seq, cache)

    def _settle_before_join(self) -> None:
        """Settle the step in flight; if it fails, that is the batch's fault, not the
        joining sequences': its members fail and the joiners start a new batch."""
        try:
            self._settle()
        except Exception as exc:
            self._fail_batch(exc)

    def _fail_batch(self, exc: Exception) -> None:
        members = list(self._batch.members)
        self._batch.clear()
        self._fail(members, exc)

    def _checkpoint_prefill(self, seq: Sequence, start: int, end: int) -> None:
        if not self.has_prefix or seq.prompt_keys is None:
            return
        # The blocks this step completed: those whose end lies in (start, end].
        done = range(start // self.block_size, end // self.block_size)
        match = seq.prompt_match if done else None
        for block in done:
            chain = seq.prompt_keys[: block + 1] if block == done[-1] else None
            self._save_block(seq.prompt_keys, match, seq.cache, block, chain=chain)

    def _save_block(
        self,
        keys: list[str],
        tokens: Any,
        cache: list[Any],
        block: int,
        *,
        chain: list[str] | None,
    ) -> None:
        """Send block `block` of `tokens` (chain `keys`; `match_ids` where images are) from
        `cache` to the store."""
        from mlx_nbengine.cache import ROOT, extract_block_records

        bs = self.block_size
        records = extract_block_records(cache, block=block, block_size=bs)
        if records:
            self._io.save(
                keys[block],
                records,
                chain=chain,
                parent=keys[block - 1] if block else ROOT,
                tokens=list(tokens[block * bs : (block + 1) * bs]),
            )

    # --- decode -----------------------------------------------------------------------------

    def _decode_step(self) -> None:
        batch = self._batch
        if batch.pending is None:
            batch.pending = self._launch([m.next_token for m in batch.members])
        bs = self.block_size
        # Pipelining: the next step's graph feeds this step's tokens before they are read,
        # so MLX computes it while this thread reads, detokenizes and streams. Not when a
        # member's cache reaches a block boundary with this step: its checkpoint must see
        # the cache exactly there (a window may rotate, a state moves on).
        boundary = self.has_prefix and any(
            (len(m.cache_tokens) + 1) % bs == 0 for m in batch.members
        )
        # Nor when every member reaches its length limit with this step: nothing would
        # use the next one.
        context = self.lm.context_length
        all_end = all(self._ends_by_length(m, context) for m in batch.members)
        self._complete_step(pipeline=not (boundary or all_end))

    @staticmethod
    def _ends_by_length(seq: Sequence, context: int | None) -> bool:
        n = len(seq.generated) + 1  # after this step's token
        return n >= seq.max_tokens or (context is not None and len(seq.prompt) + n >= context)

    def _launch(self, inputs: list[int] | mx.array | HostDraw) -> mx.array | HostDraw:
        """Build one decode step of the batch and start computing it; its sampled tokens
        (lazy, or drawn when read: see `sampling`)."""
        members = self._batch.members
        if isinstance(inputs, HostDraw):
            inputs = inputs.tolist()
        with blas_step(len(members)):
            logits = self._batch.forward(self._forward_fn, inputs)
            if self._host_sampling and not all(m.greedy for m in members):
                tokens = HostDraw(logits, list(members))
                mx.async_eval(logits)
            else:
                tokens = self._sample(members, logits)
                mx.async_eval(tokens)
        self._launched_at = time.perf_counter()
        return tokens

    def _settle(self) -> None:
        """Read and apply the step in flight, launching none: the batch may change after."""
        if self._batch.pending is not None:
            self._complete_step(pipeline=False)

    def _complete_step(self, *, pipeline: bool) -> None:
        batch = self._batch
        members = list(batch.members)
        sampled, launched_at = batch.pending, self._launched_at
        batch.pending = self._launch(sampled) if pipeline else None
        tokens = sampled.tolist()
        finished: list[tuple[int, str]] = []
        for i, seq in enumerate(members):
            seq.cache_tokens.append(seq.next_token)
            if len(seq.cache_tokens) == len(seq.prompt):  # it fed its prompt's last token
                n = len(seq.prompt)
                seq.report_computed(n - 1, n, time.perf_counter() - launched_at)
            if self.has_prefix and len(seq.cache_tokens) % self.block_size == 0:
                self._checkpoint_decode(seq, i)
            reason = seq.accept(tokens[i], context_length=self.lm.context_length)
            if reason is None:
                seq.next_token = tokens[i]
            else:
                finished.append((i, reason))
        if finished:
            last_i, _ = finished[-1]
            hot_cache = batch.single_cache(last_i)
            hot_tokens = list(members[last_i].cache_tokens)
            if pipeline:
                # The step in flight already fed its last token into its cache.
                hot_tokens.append(tokens[last_i])
            batch.remove([i for i, _ in finished])
            for i, reason in finished:
                self._finish(members[i], (hot_tokens, hot_cache) if i == last_i else None, reason)

    def _checkpoint_decode(self, seq: Sequence, index: int) -> None:
        block = len(seq.cache_tokens) // self.block_size - 1
        chain = self._keys(seq.cache_tokens, seq.images)
        cache = self._batch.single_cache(index)
        match = seq.match(seq.cache_tokens)
        self._save_block(chain, match, cache, block, chain=chain[: block + 1])

    def _finish(self, seq: Sequence, hot: tuple[list[int], list[Any]] | None, reason: str) -> None:
        """End `seq`; `hot` (the tokens held by a cache, the cache) becomes the hot cache,
        and its partial last block is stored (see `_save_partial`)."""
        if hot is not None:
            # The only cache kept once its sequence ends; older ones leave RAM here.
            self._hot = HotCache(*hot, images=seq.images)
            # Queued before the caller sees the result, so a caller that then drains the
            # cache-I/O thread finds it stored.
            self._save_partial(*hot, images=seq.images)
        seq.finish(reason)

    def _save_partial(
        self, tokens: list[int], cache: list[Any], *, images: tuple[Any, ...] = ()
    ) -> None:
        """Store the partial last block of a finished cache (the tokens after its last
        boundary: a prompt's tail, often the question a notebook edits, and the answer),
        so a later prompt can be restored into it to the token (a cut; see `planner`).
        Also called mid-prefill at an image's end (`tokens` = the prompt up to it) on
        models with recurrent layers. Its records only where cuts are made (a
        token-exact engine whose model has no window narrower than a block; with
        recurrent layers the state taken at its end too, so a prompt holding the whole
        partial block resumes there); elsewhere only its tokens, so a later edit there is
        still reported."""
        bs, n = self.block_size, len(tokens)
        if not self.has_prefix or n % bs == 0:
            return
        from mlx_nbengine.cache import ROOT, RecordError, extract_block_records, partial_key
        from mlx_nbengine.cache.blocks import match_ids

        block = n // bs
        records: dict[str, Any] = {}
        if self.to_token and self._cut_ok:
            try:
                records = extract_block_records(cache, block=block, block_size=bs, end=n)
            except RecordError:
                return  # a cache no longer holding the block's start: a future miss, no error
        if self._bidirectional and any(s.cuts(n) for s in images):
            return  # its end lies inside an image: never a restore point
        keys = self._keys(tokens[: block * bs], images)
        key = partial_key(tokens, fingerprint=self.lm.fingerprint, block_size=bs, images=images)
        parent = keys[-1] if keys else ROOT
        # Touching the chain after it leaves the partial block older than every block of
        # its chain: the suffix evicts first.
        self._io.save(
            key,
            records,
            parent=parent,
            tokens=match_ids(tokens, images)[block * bs :],
            chain=keys or None,
        )

    # --- model calls ------------------------------------------------------------------------

    def _forward(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        out = self._forward_fn(inputs, cache=cache)
        return getattr(out, "logits", out)

    def _forward_fn(self, inputs: mx.array, *, cache: list[Any]) -> mx.array:
        if self.lm.kind == "vision":
            # A decode step: each row's rope delta (see `vision`).
            kwargs = self._vision.decode_kwargs(self._batch.members) if inputs.shape[1] == 1 else {}
            out = self.lm.language_model(inputs, cache=cache, **kwargs)
            return getattr(out, "logits", out)
        return self.lm.model(inputs, cache=cache)

    def _sample(self, seqs: list[Sequence], logits: mx.array) -> mx.array:
        """Each row's next token: the argmax of greedy rows, a draw for sampled ones."""
        if all(s.greedy for s in seqs):
            return mx.argmax(logits, axis=-1)
        if self._host_sampling:  # reads the step's logits now (see `sampling`)
            return mx.array(draw_rows(seqs, logits), dtype=mx.uint32)
        lazy = [
            mx.argmax(row, axis=-1) if s.greedy else s.sampler.graph(row - row.max())
            for s, row in zip(seqs, logits.split(len(seqs)), strict=True)
        ]
        return mx.concatenate([t.reshape(-1).astype(mx.uint32) for t in lazy])

    # --- cancellation -----------------------------------------------------------------------

    def _cancel(self, request: Any) -> None:
        for seq in self._waiting:
            if seq.request is request:
                self._waiting.remove(seq)
                seq.finish("cancelled")
                return
        for adm in self._admitting:
            if adm.request is not request:
                continue
            self._drop_admitting(adm)
            hot = (list(adm.cache_tokens), adm.cache) if adm.phase == "prefilling" else None
            self._finish(adm, hot, "cancelled")
            return
        for i, seq in enumerate(self._batch.members):
            if seq.request is request:
                self._batch.remove([i])
                seq.finish("cancelled")
                return

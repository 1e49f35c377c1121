"""Rank 0's hooks: every model call and cache change the engine makes is sent to the
workers first, as a step plan, so that each rank runs the same call on its shard.

- `Mirrored`: a layer cache list of rank 0 with the *ref* under which every worker holds
  its own part of the same cache (``("seq", request id)``, ``("group", n)``,
  ``("single", n)``). When rank 0 drops the list, the workers drop theirs (``free``).
- `RankRunner` (a `Runner`): ``start`` (a sequence's cache: fresh, the hot cache cut back,
  or the disk restore every rank rebuilt), ``prefill``, ``group``, ``decode`` and
  ``probe`` steps, ``hot``. A decode step's tokens go with its plan: rank 0 reads the
  previous step's tokens before it launches the next (no pipelining across ranks). The
  split head is off (its load check would call the sharded model on rank 0 alone).
- `MirroredBatch` (a `DecodeBatch`): ``add``, ``add_group``, ``remove``, ``clear``,
  ``single`` in the same order as rank 0's, so each worker's batch has the same rows.
- `RankCheckpoints` (a `Checkpoints`): every block and partial-block save goes to the
  workers too (each extracts its own layers' or heads' records into its own store).
- `Agreement`: a restore's plan, made on rank 0's store, is held to what every worker's
  store holds (``holds``), then every worker rebuilds it (``restore``); a block counts as
  restored only when every rank holds its records.

Every step plan is sent before rank 0 runs the same call; a collective then joins them.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from dataclasses import replace
from typing import Any

import mlx.core as mx

from mlx_nbengine._blas import ThreadPolicy
from mlx_nbengine.engine.batch import DecodeBatch
from mlx_nbengine.engine.checkpoints import Checkpoints
from mlx_nbengine.engine.ranks import plans
from mlx_nbengine.engine.ranks.group import RankGroup, RankLostError
from mlx_nbengine.engine.runner import Runner
from mlx_nbengine.engine.sampling import HostDraw
from mlx_nbengine.engine.sequence import Sequence

_refs = itertools.count(1)


class Mirrored(list):
    """A layer cache list whose workers' parts are held under `ref` (see the module)."""

    ref: tuple[str, int]


def mirrored(cache: list[Any], ref: tuple[str, int], group: RankGroup) -> Mirrored:
    out = Mirrored(cache)
    out.ref = ref
    weakref.finalize(out, _free, group, ref)
    return out


def _free(group: RankGroup, ref: tuple[str, int]) -> None:
    try:
        group.send(plans.Free(ref=ref))
    except Exception:  # noqa: BLE001 - a failed or closed group frees everything anyway
        pass


def ref_of(cache: Any) -> tuple[str, int]:
    ref = getattr(cache, "ref", None)
    if ref is None:
        raise RankLostError("a cache the workers do not hold reached a sharded step")
    return ref


def guarded(group: RankGroup, fn: Any, *args: Any) -> Any:
    """`fn(*args)`; a failure of the group (a collective broken by a lost worker) raises
    the group's `RankLostError` naming the worker."""
    try:
        return fn(*args)
    except RankLostError:
        raise
    except Exception as exc:
        ring = "[ring]" in str(exc)
        deadline = time.monotonic() + (2.0 if ring else 0.0)
        while group.error is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the watchdog names the lost worker within a second or two
        if group.error is not None:
            raise group.error from exc
        if ring:
            raise RankLostError(f"the rank group failed: {exc}") from exc
        raise


class MirroredBatch(DecodeBatch):
    """A `DecodeBatch` whose every change the workers make to theirs (see the module)."""

    def __init__(self, group: RankGroup) -> None:
        super().__init__()
        self.group = group

    def add(self, member: Any, cache: list[Any]) -> None:
        self.group.send(plans.Add(ref=ref_of(cache)))
        super().add(member, cache)

    def add_group(self, members: list[Any], caches: list[Any]) -> None:
        self.group.send(plans.AddGroup(ref=ref_of(caches), n=len(members)))
        super().add_group(members, caches)

    def remove(self, indices: list[int]) -> None:
        self.group.send(plans.Remove(indices=list(indices)))
        super().remove(indices)

    def clear(self) -> None:
        if self.group.error is None:
            self.group.send(plans.Clear())
        super().clear()

    def single_cache(self, index: int) -> list[Any]:
        ref = ("single", next(_refs))
        self.group.send(plans.Single(index=index, ref=ref))
        return mirrored(super().single_cache(index), ref, self.group)


class RankRunner(Runner):
    """A `Runner` whose every model call the workers make too (see the module)."""

    def __init__(
        self, lm: Any, group: RankGroup, *, thread_policy: ThreadPolicy | None = None
    ) -> None:
        super().__init__(lm, split=False, thread_policy=thread_policy)
        self.group = group
        self._tapping_layers = None  # the workers' layers keep their states to themselves

    def new_batch(self) -> DecodeBatch:
        return MirroredBatch(self.group)

    def adopt(self, seq: Sequence, cache: list[Any], source: str | None, tokens: int) -> list[Any]:
        ref = ("seq", seq.request.id)
        self.group.send(plans.Start(ref=ref, cid=seq.request.id, source=source, tokens=tokens))
        return mirrored(cache, ref, self.group)

    def kept_hot(self, tokens: list[int], cache: list[Any]) -> None:
        self.group.send(plans.Hot(ref=ref_of(cache), tokens=list(tokens)))

    def prefill(self, seq: Sequence, start: int, end: int, *, block_size: int = 0) -> int | None:
        last = end == len(seq.prompt)
        self.group.send(
            plans.Prefill(ref=ref_of(seq.cache), tokens=list(seq.prompt[start:end]), last=last)
        )
        return guarded(self.group, super().prefill, seq, start, end)

    def prefill_group(self, group: list[Sequence], spans: list[tuple[int, int]]) -> list[Any]:
        ref = ("group", next(_refs))
        rows = [list(s.prompt[a:b]) for s, (a, b) in zip(group, spans, strict=True)]
        self.group.send(plans.Group(refs=[ref_of(s.cache) for s in group], rows=rows, ref=ref))
        caches = guarded(self.group, super().prefill_group, group, spans)
        return mirrored(caches, ref, self.group)

    def launch(self, batch: DecodeBatch, inputs: Any) -> Any:
        if isinstance(inputs, HostDraw | mx.array | _Checked):
            inputs = guarded(self.group, inputs.tolist)  # the previous step, read now
        self.group.send(plans.Decode(tokens=[int(t) for t in inputs]))
        tokens = guarded(self.group, super().launch, batch, inputs)
        return _Checked(tokens, self.group) if isinstance(tokens, mx.array) else tokens

    def idle(self) -> None:
        # A failed group has no workers left to tell, and a collective of its last step
        # may never return: MLX's pool is left alone (`clear_cache` would wait for it).
        with contextlib.suppress(RankLostError):
            self.group.send(plans.Idle())
            super().idle()

    def probe_records(self) -> dict[str, Any]:
        self.group.send(plans.Probe())
        return guarded(self.group, super().probe_records)


class _Checked:
    """A decode step's lazy tokens whose reading raises the group's error when a lost
    worker broke the step's collectives."""

    def __init__(self, tokens: mx.array, group: RankGroup) -> None:
        self.tokens = tokens
        self.group = group

    def tolist(self) -> list[int]:
        return guarded(self.group, self.tokens.tolist)

    def __getitem__(self, index: Any) -> _Checked:
        return _Checked(self.tokens[index], self.group)


class RankCheckpoints(Checkpoints):
    """`Checkpoints` whose saves every worker makes of its own records (see the module)."""

    def __init__(self, group: RankGroup, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def restore(self, seq: Sequence, *, other_source_tokens: int, make_cache: Any) -> Any:
        return self._io.restore(
            seq.prompt,
            other_source_tokens=other_source_tokens,
            make_cache=make_cache,
            to_token=self.to_token,
            images=seq.images,
            bidirectional_images=self.bidirectional,
            agree=Agreement(self.group, seq.request.id),
        )

    def _save_block(
        self,
        keys: list[str],
        tokens: Any,
        cache: list[Any],
        block: int,
        *,
        chain: Any,
        states: dict[int, Any] | None = None,
    ) -> None:
        self.group.send(
            plans.Save(
                ref=ref_of(cache),
                keys=list(keys),
                tokens=[int(t) for t in tokens],
                block=block,
                chain=list(chain) if chain is not None else None,
            )
        )
        super()._save_block(keys, tokens, cache, block, chain=chain, states=states)

    def partial(self, tokens: list[int], cache: list[Any], *, images: tuple[Any, ...] = ()) -> None:
        self.group.send(plans.Partial(ref=ref_of(cache), tokens=[int(t) for t in tokens]))
        super().partial(tokens, cache, images=images)


class Agreement:
    """One restore's agreement of every rank (on rank 0's cache-I/O thread)."""

    def __init__(self, group: RankGroup, cid: int) -> None:
        self.group = group
        self.cid = cid
        self.held: list[bool] | None = None  # per prompt block: every worker holds it

    def plan(self, prefix: Any, plan: Any) -> Any:
        """`plan` cut back to what every worker's store holds."""
        if plan.tokens == 0:
            return plan
        answers = self.group.ask(plans.Holds(plan=_portable(plan)))
        self.held = [all(held) for held in zip(*(a["held"] for a in answers), strict=True)]
        n = min(a["blocks"] for a in answers)
        cut_held = all(a["cut"] for a in answers)
        if n == plan.n_blocks and (plan.cut is None or cut_held):
            return plan
        kept = "evicted" if plan.cut is not None else plan.kept_boundary
        return replace(
            plan,
            n_blocks=n,
            needed=tuple(prefix.needed(plan.keys, n)),
            cut=None,
            spare_cuts=(),
            kept_boundary=kept,
        )

    def facts(self, facts: list[Any]) -> list[Any]:
        """`facts` (rank 0's store's) with the blocks a worker lacks marked as not held:
        such a block is reported ``"evicted"`` (its records are gone on a rank)."""
        if self.held is None:
            return facts
        lacking = {j for j, held in enumerate(self.held) if not held}
        return [
            replace(f, held=False, chain_held=False, restorable=False) if f.index in lacking else f
            for f in facts
        ]

    def rebuilt(self, plan: Any) -> bool:
        """Every worker rebuilt `plan` (the one rank 0 served)."""
        answers = self.group.ask(plans.Restore(cid=self.cid, plan=_portable(plan)))
        return all(a == plan.tokens for a in answers)


def _portable(plan: Any) -> Any:
    return replace(plan, spare_cuts=())

"""Why each computed prompt block was computed: the rule behind the computed reasons.

At admission the cache-I/O thread reads, for the prompt blocks its restore plan does
not cover, the store's `BlockFacts` (stored once? own records held? restorable to its
end? where does the prompt leave the closest stored continuation?). Once the generation
thread knows where the restore ended (the *first computed block* `first`: the first one
not wholly restored, from disk or memory), `computed_reasons` names every later block.
Going through blocks ``first .. last`` in order:

1. the last block (partial, or holding the prompt's last token) is ``"tail"``;
2. with no block store, ``"store_off"``;
3. a block stored once whose own records are gone is ``"evicted"``;
4. the first computed block, its own records held but the prompt not restorable up to
   its end: ``"window"`` when every block's own records up to it are held (so what is
   missing are window/state records), else ``"after_miss"``;
5. the first block that leaves a stored continuation of its prefix is ``"edited"``
   (with its `edit_at`);
6. a block never seen is ``"new"`` while every computed block before it is new too;
7. anything else is ``"after_miss"``: an earlier block was computed, so this one's
   chain broke even if its own tokens are unchanged.

So a cold prompt is all new then the tail; an edit inside block 2 gives disk, disk,
edited, after_miss..., tail; a prompt whose first block was evicted gives evicted, then
evicted or after_miss. The tail keeps its reason, but when it is where the prompt first
leaves a stored continuation its `edit_at` is set too (and so the report's).
"""

from __future__ import annotations

from collections.abc import Mapping

from mlx_nbengine.cache import BlockFacts


def computed_reasons(
    n_blocks: int,
    first: int,
    facts: Mapping[int, BlockFacts] | None,
    *,
    store_off: bool = False,
) -> tuple[dict[int, str], dict[int, int]]:
    """The reasons of blocks ``first .. n_blocks - 1`` and the edit positions by block.

    `facts` maps block index to its facts (None when the store could not be asked: then
    every whole block is ``"new"``); a block without facts counts as stored and held.
    """
    reasons: dict[int, str] = {}
    edits: dict[int, int] = {}
    all_new = True
    for j in range(first, n_blocks):
        if facts is None:
            fact = BlockFacts(j, 0, 0)
        else:
            fact = facts.get(j) or BlockFacts(j, 0, 0, seen=True, held=True, restorable=True)
        edit = fact.diverges_at if not edits else None
        if j == n_blocks - 1:
            reason = "tail"
            if edit is not None and not store_off:
                edits[j] = edit
        elif store_off:
            reason = "store_off"
        elif fact.seen and not fact.held:
            reason = "evicted"
        elif j == first and fact.held and not fact.restorable:
            reason = "window" if fact.chain_held else "after_miss"
        elif edit is not None:
            reason = "edited"
            edits[j] = edit
        elif not fact.seen and all_new:
            reason = "new"
        else:
            reason = "after_miss"
        all_new = all_new and reason == "new"
        reasons[j] = reason
    return reasons, edits

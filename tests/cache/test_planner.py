"""Planner: prefill schedule, longest restorable prefix, fallback on bad records, recency.

The cache is driven with random keys/values (no model): one full-attention
layer, one sliding-window layer (W=24 over blocks of 16) and one recurrent
(state) layer, so a plan needs all three record kinds. Records go through the
real `BlockStore` (a scratch file in the test's temp folder).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as lm_cache

from mlx_nbengine.cache.blocks import partial_key
from mlx_nbengine.cache.followers import ROOT
from mlx_nbengine.cache.kinds import extract_block_records
from mlx_nbengine.cache.planner import PrefixCache, prefill_steps
from mlx_nbengine.cache.store import BlockStore
from mlx_nbengine.models.vision import ImageSpan

B = 16
W = 24


def make_layers():
    return [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=W), lm_cache.ArraysCache(2)]


def feed(layers, n: int, seed: int) -> None:
    k1, k2 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, 2, n, 8), key=k1)
    for c in layers:
        if isinstance(c, lm_cache.ArraysCache):
            c[0] = keys[0, :, -1]
            c[1] = mx.random.normal((1, 4), key=k2)
        else:
            c.update_and_fetch(keys, keys * 2)
    mx.eval([c.state for c in layers])


@pytest.fixture
def store(tmp_path):
    with BlockStore(budget_bytes=1 << 26, directory=tmp_path) as s:
        yield s


def prefix_cache(store, *, fingerprint="model-a") -> PrefixCache:
    return PrefixCache.for_cache(make_layers(), fingerprint=fingerprint, store=store, block_size=B)


def prefill_and_save(pc: PrefixCache, tokens, images=()) -> list:
    """Prefill block by block, saving every completed block; returns the live cache."""
    layers = make_layers()
    keys = pc.keys(tokens, images)
    for i, (start, end) in enumerate(prefill_steps(0, len(tokens), block_size=B, max_step=B)):
        feed(layers, end - start, seed=i)
        if end % B == 0:
            recs = extract_block_records(layers, block=end // B - 1, block_size=B)
            assert pc.save(keys[end // B - 1], recs)
    pc.touch(keys)
    return layers


TOKENS = list(range(6 * B + 3))  # six whole blocks and a tail


# --- prefill_steps ---------------------------------------------------------------------------


def test_prefill_steps_end_on_boundaries_and_the_last_at_the_end():
    assert prefill_steps(0, 40, block_size=16, max_step=16) == [(0, 16), (16, 32), (32, 40)]
    assert prefill_steps(32, 40, block_size=16, max_step=16) == [(32, 40)]
    assert prefill_steps(16, 48, block_size=16, max_step=16) == [(16, 32), (32, 48)]


def test_prefill_steps_use_multiples_of_the_block_and_stop_at_the_last_boundary():
    assert prefill_steps(0, 100, block_size=16, max_step=40) == [
        (0, 32),
        (32, 64),
        (64, 96),
        (96, 100),
    ]
    assert prefill_steps(0, 20, block_size=16, max_step=8) == [(0, 16), (16, 20)]
    assert prefill_steps(16, 16, block_size=16, max_step=16) == []


def test_prefill_steps_refuse_a_start_off_a_boundary():
    with pytest.raises(ValueError, match="boundary"):
        prefill_steps(5, 40, block_size=16, max_step=16)


# --- planning ----------------------------------------------------------------------------------


def test_plan_restores_every_whole_block_and_leaves_the_last_token(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    assert pc.plan(TOKENS).n_blocks == 6
    assert pc.plan(TOKENS[: 6 * B + 1]).n_blocks == 6
    # A prompt ending exactly on a boundary keeps its last block to compute.
    assert pc.plan(TOKENS[: 6 * B]).n_blocks == 5
    assert pc.plan(TOKENS[:B]).n_blocks == 0


def test_plan_needs_kv_of_all_blocks_window_blocks_and_the_boundary_state(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    plan = pc.plan(TOKENS)
    k = plan.keys
    # Boundary 96, window 24: blocks 4 and 5 overlap [72, 96).
    assert plan.needed == (
        *[(k[j], "kv") for j in range(4)],
        (k[4], "kv"),
        (k[4], "window"),
        (k[5], "kv"),
        (k[5], "window"),
        (k[5], "state"),
    )
    assert plan.tokens == 6 * B


def test_window_records_outside_the_window_are_not_needed(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)
    store.delete(keys[2], "window")
    assert pc.plan(TOKENS).n_blocks == 6


def test_a_missing_window_record_falls_back_to_a_boundary_whose_window_is_complete(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)
    store.delete(keys[2], "window")
    store.delete(keys[4], "window")
    # Boundaries 96, 80 need block 4; 64 and 48 need block 2; 32 needs blocks 0 and 1.
    assert pc.plan(TOKENS).n_blocks == 2


def test_a_missing_state_checkpoint_falls_back_one_boundary(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    store.delete(pc.keys(TOKENS)[5], "state")
    assert pc.plan(TOKENS).n_blocks == 5


def test_a_missing_kv_slice_caps_the_chain_before_it(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    store.delete(pc.keys(TOKENS)[3], "kv")
    assert pc.plan(TOKENS).n_blocks == 3


def test_an_edit_restores_the_blocks_before_it(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    edited = list(TOKENS)
    edited[3 * B + 5] = 999
    assert pc.plan(edited).n_blocks == 3


def test_a_different_fingerprint_never_hits(store):
    prefill_and_save(prefix_cache(store), TOKENS)
    assert prefix_cache(store, fingerprint="model-b").plan(TOKENS).n_blocks == 0


def test_bidirectional_images_forbid_a_boundary_inside_the_image(store):
    pc = prefix_cache(store)
    tokens = TOKENS[:50]  # the last token keeps boundaries up to 48
    images = [ImageSpan(40, 50, "photo")]
    prefill_and_save(pc, tokens, images)
    assert pc.plan(tokens, images).n_blocks == 3  # causal over the image: 48 is fine
    assert pc.plan(tokens, images, bidirectional_images=True).n_blocks == 2
    assert pc.plan(tokens, [ImageSpan(40, 50, "other photo")]).n_blocks == 2


# --- loading -------------------------------------------------------------------------------


def test_load_returns_the_needed_records_and_assembly_rebuilds_the_cache(store):
    pc = prefix_cache(store)
    live = prefill_and_save(pc, TOKENS[: 4 * B])
    plan, records = pc.load(pc.plan(TOKENS))
    assert plan.n_blocks == 4
    assert sorted(records) == [0, 1, 2, 3]
    assert set(records[3]) == {"kv", "window", "state"}
    restored = pc.assemble(records, n_blocks=4, template_cache=make_layers())
    assert restored[0].offset == restored[1].offset == 4 * B
    assert mx.array_equal(
        restored[0].keys[..., : restored[0].offset, :], live[0].keys[..., : 4 * B, :]
    ).item()
    assert mx.array_equal(restored[2][1], live[2][1]).item()


def test_a_corrupt_record_is_deleted_and_load_falls_back_to_a_shorter_chain(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)
    store.delete(keys[5], "state")
    store.put(keys[5], "state", b"\x00garbage that is not safetensors")
    plan, records = pc.load(pc.plan(TOKENS))
    assert plan.n_blocks == 5
    assert not store.has(keys[5], "state")
    assert set(records) == set(range(5))


def test_a_record_of_another_block_under_a_key_is_rejected(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)
    wrong = store.get(keys[2], "kv")
    store.delete(keys[3], "kv")
    store.put(keys[3], "kv", wrong)
    plan, _ = pc.load(pc.plan(TOKENS))
    assert plan.n_blocks == 3
    assert not store.has(keys[3], "kv")


def test_a_record_that_vanished_after_planning_falls_back(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    plan = pc.plan(TOKENS)
    store.delete(plan.keys[0], "kv")
    plan, records = pc.load(plan)
    assert plan.n_blocks == 0 and records == {}


# --- storing and recency --------------------------------------------------------------------


def test_touch_orders_the_chain_suffix_first_after_records_not_needed(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)
    pc.touch(keys)
    order = store.items()  # least recently used first
    needed = list(pc.needed(keys, 6))
    not_needed = [item for item in order if item not in set(needed)]
    # Earlier boundaries' checkpoints and out-of-window slices are oldest...
    assert order[: len(not_needed)] == not_needed
    assert (keys[4], "state") in not_needed and (keys[0], "window") in not_needed
    # ...then the needed records, the last block's first, block 0's kv most recent.
    assert order[len(not_needed) :] == needed[::-1]
    assert order[-1] == (keys[0], "kv")


def test_eviction_under_pressure_takes_unneeded_records_then_suffixes(tmp_path):
    with BlockStore(budget_bytes=1 << 26, directory=tmp_path) as big:
        prefill_and_save(prefix_cache(big), TOKENS)
        held = big.stats().bytes_held
    evicted = []

    def on_event(name, key, kind, nbytes):
        if name == "evicted":
            evicted.append((key, kind))

    with BlockStore(budget_bytes=held, directory=tmp_path, on_event=on_event) as s:
        pc = prefix_cache(s)
        prefill_and_save(pc, TOKENS)
        order = s.items()
        prefill_and_save(prefix_cache(s, fingerprint="another model"), TOKENS[: 2 * B])
        # A little pressure takes only records this chain's full restore does not need.
        assert pc.plan(TOKENS).n_blocks == 6
        prefill_and_save(prefix_cache(s, fingerprint="a third model"), TOKENS[:B])
        ours = [item for item in evicted if item in set(order)]
        assert ours == order[: len(ours)]  # least recently used first, i.e. suffix-first
        needed = pc.needed(pc.keys(TOKENS), 6)
        gone = [item for item in needed[::-1] if item in ours]
        assert 0 < len(gone) < len(needed) and gone == needed[::-1][: len(gone)]
        assert s.has(pc.keys(TOKENS)[0], "kv")


def test_save_reports_a_record_the_store_could_not_take(tmp_path):
    with BlockStore(budget_bytes=0, memory_budget_bytes=64) as tiny:
        pc = prefix_cache(tiny)
        layers = make_layers()
        feed(layers, B, seed=0)
        recs = extract_block_records(layers, block=0, block_size=B)
        assert pc.save(pc.keys(TOKENS)[0], recs) is False
        assert pc.plan(TOKENS).n_blocks == 0


# --- cuts: token-exact restore into the next block -------------------------------------------


def cut_cache(store, *, window: int = W, fingerprint: str = "model-a") -> PrefixCache:
    """A PrefixCache for a layout every layer of which can be cut (kv and a window >= B)."""
    layers = [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=window)]
    return PrefixCache.for_cache(layers, fingerprint=fingerprint, store=store, block_size=B)


def save_with_followers(pc: PrefixCache, tokens, *, seed: int = 0) -> None:
    """Prefill `tokens` (random data) and save every whole block with its parent and tokens."""
    live = [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=pc.max_window)]
    keys = pc.keys(tokens)
    for i, (start, end) in enumerate(prefill_steps(0, len(tokens), block_size=B, max_step=B)):
        feed(live, end - start, seed=seed + i)
        if end % B == 0:
            j = end // B - 1
            recs = extract_block_records(live, block=j, block_size=B)
            parent = keys[j - 1] if j else ROOT
            assert pc.save(keys[j], recs, parent=parent, tokens=tokens[j * B : end])


def edit_at(tokens, at: int) -> list[int]:
    return tokens[:at] + [t + 1000 for t in tokens[at:]]


def test_a_cut_restores_the_unchanged_start_of_the_edited_block(store):
    pc = cut_cache(store)
    save_with_followers(pc, TOKENS)
    plan = pc.plan(edit_at(TOKENS, 3 * B + 5), to_token=True)
    assert (plan.n_blocks, plan.boundary, plan.tokens) == (3, 3 * B, 3 * B + 5)
    assert plan.cut.block == 3 and plan.cut.tokens == 5
    assert plan.cut.key == pc.keys(TOKENS)[3]
    assert plan.cut.needed == ((plan.cut.key, "kv"), (plan.cut.key, "window"))
    assert plan.kept_boundary is None
    # Whole blocks only unless asked: the plan then says a cut was possible.
    whole = pc.plan(edit_at(TOKENS, 3 * B + 5))
    assert (whole.tokens, whole.cut, whole.kept_boundary) == (3 * B, None, "block")


def test_a_cut_never_reaches_the_prompts_last_token(store):
    pc = cut_cache(store)
    save_with_followers(pc, TOKENS)
    plan = pc.plan(TOKENS[: 4 * B + 7], to_token=True)  # a prefix of what was stored
    assert plan.n_blocks == 4 and plan.tokens == 4 * B + 6


def test_the_follower_sharing_most_is_cut_from(store):
    pc = cut_cache(store)
    first = TOKENS[: 2 * B] + [500 + i for i in range(3 * B)]
    second = TOKENS[: 2 * B + 9] + [700 + i for i in range(3 * B)]
    save_with_followers(pc, first, seed=0)
    save_with_followers(pc, second, seed=50)  # the most recent follower of block 1
    plan = pc.plan(first[: 2 * B + 12] + [9] * 20, to_token=True)
    assert plan.cut.key == pc.keys(first)[2] and plan.cut.tokens == 12


def test_a_follower_whose_records_are_gone_is_passed_over(store):
    pc = cut_cache(store)
    first = TOKENS[: 2 * B] + [500 + i for i in range(3 * B)]
    second = first[: 2 * B + 4] + [700 + i for i in range(3 * B)]
    save_with_followers(pc, first, seed=0)
    save_with_followers(pc, second, seed=50)
    store.delete(pc.keys(first)[2], "window")
    plan = pc.plan(first[: 2 * B + 12] + [9] * 20, to_token=True)
    assert plan.cut.key == pc.keys(second)[2] and plan.cut.tokens == 4
    store.delete(pc.keys(second)[2], "kv")
    plan = pc.plan(first[: 2 * B + 12] + [9] * 20, to_token=True)
    assert (plan.tokens, plan.cut, plan.kept_boundary) == (2 * B, None, "evicted")


def test_layers_that_cannot_be_cut_keep_the_boundary_and_say_why(store, tmp_path):
    edited = edit_at(TOKENS, 3 * B + 5)
    state = prefix_cache(store)  # kv, window and a recurrent state
    prefill_and_save(state, TOKENS)
    for j, key in enumerate(state.keys(TOKENS)):  # followers, as the engine records them
        parent = state.keys(TOKENS)[j - 1] if j else ROOT
        state.followers.add(key, parent, TOKENS[j * B : (j + 1) * B])
    plan = state.plan(edited, to_token=True)
    assert (plan.tokens, plan.kept_boundary) == (3 * B, "state")


def test_a_window_narrower_than_a_block_is_cut_to_the_token(store):
    pc = cut_cache(store, window=8)  # W < B: its records hold their blocks whole
    save_with_followers(pc, TOKENS)
    plan, records = pc.load(pc.plan(edit_at(TOKENS, 3 * B + 11), to_token=True))
    assert (plan.tokens, plan.kept_boundary) == (3 * B + 11, None)
    template = [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=8)]
    cache = pc.assemble(records, n_blocks=3, template_cache=template, cut_tokens=11)
    assert [c.offset for c in cache] == [3 * B + 11] * 2
    assert cache[1].keys.shape[2] == 8  # the last W tokens before the cut


def save_decoded(pc: PrefixCache, tokens, *, decoded: int, seed: int = 0) -> None:
    """`save_with_followers`, but block `decoded` is fed one token at a time (as decode
    steps feed a generated block): a window narrower than a block then keeps only the
    block's last W tokens."""
    live = [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=pc.max_window)]
    keys = pc.keys(tokens)
    for j in range(len(tokens) // B):
        for i, n in enumerate([1] * B if j == decoded else [B]):
            feed(live, n, seed=seed + 100 * j + i)
        recs = extract_block_records(live, block=j, block_size=B)
        parent = keys[j - 1] if j else ROOT
        assert pc.save(keys[j], recs, parent=parent, tokens=tokens[j * B : (j + 1) * B])


def test_a_follower_whose_window_record_lacks_its_start_keeps_the_boundary(store):
    pc = cut_cache(store, window=8)
    save_decoded(pc, TOKENS, decoded=3)  # block 3's window record starts at 3B + 8
    follower = pc.keys(TOKENS)[3]
    plan, _ = pc.load(pc.plan(edit_at(TOKENS, 3 * B + 5), to_token=True))
    assert (plan.tokens, plan.cut, plan.kept_boundary) == (3 * B, None, "window")
    assert store.has(follower, "window")  # a sound record: kept for whole-block restores
    assert pc.plan(edit_at(TOKENS, 4 * B), to_token=True).tokens == 4 * B


def test_load_reads_on_to_a_follower_whose_window_record_serves_the_cut(store):
    pc = cut_cache(store, window=8)
    prefilled = TOKENS[: 3 * B + 6] + [700 + i for i in range(B)]
    save_with_followers(pc, prefilled, seed=50)  # shares 6 tokens of block 3
    save_decoded(pc, TOKENS, decoded=3)  # shares 9: the best, but decoded
    plan = pc.plan(edit_at(TOKENS, 3 * B + 9), to_token=True)
    assert plan.cut.key == pc.keys(TOKENS)[3] and plan.cut.tokens == 9
    plan, records = pc.load(plan)
    assert plan.cut.key == pc.keys(prefilled)[3] and plan.tokens == 3 * B + 6
    assert set(records[3]) == {"kv", "window"}


def test_a_cut_into_block_0_needs_half_a_block(store):
    pc = cut_cache(store)
    save_with_followers(pc, TOKENS)
    assert pc.plan(edit_at(TOKENS, 7), to_token=True).tokens == 0  # BOS, a header...
    assert pc.plan(edit_at(TOKENS, 8), to_token=True).tokens == 8
    # ... or every prompt token but the last.
    assert pc.plan(TOKENS[:5], to_token=True).tokens == 4


def test_load_reads_the_cut_and_assembly_stops_at_the_token(store):
    pc = cut_cache(store)
    save_with_followers(pc, TOKENS)
    plan, records = pc.load(pc.plan(edit_at(TOKENS, 3 * B + 5), to_token=True))
    assert sorted(records) == [0, 1, 2, 3] and set(records[3]) == {"kv", "window"}
    template = [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=W)]
    cache = pc.assemble(records, n_blocks=3, template_cache=template, cut_tokens=5)
    assert [c.offset for c in cache] == [3 * B + 5] * 2
    assert cache[1].keys.shape[2] == W  # the last W tokens before the cut


def test_a_cut_record_that_vanished_after_planning_keeps_the_boundary(store):
    pc = cut_cache(store)
    save_with_followers(pc, TOKENS)
    plan = pc.plan(edit_at(TOKENS, 3 * B + 5), to_token=True)
    store.delete(plan.cut.key, "kv")
    plan, records = pc.load(plan)
    assert (plan.tokens, plan.cut, plan.kept_boundary) == (3 * B, None, "evicted")
    assert sorted(records) == [0, 1, 2]


def test_a_prompt_extending_a_stored_partial_block_is_cut_not_edited(store):
    pc = cut_cache(store)
    save_with_followers(pc, TOKENS[: 2 * B])
    live = [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=W)]
    feed(live, 2 * B + 6, seed=3)
    partial = extract_block_records(live, block=2, block_size=B, end=2 * B + 6)
    tail = TOKENS[: 2 * B + 6]
    key = partial_key(tail, fingerprint="model-a", block_size=B)
    assert key not in pc.keys(TOKENS)  # never a block key
    assert pc.save(key, partial, parent=pc.keys(TOKENS)[1], tokens=tail[2 * B :])
    plan = pc.plan(TOKENS, to_token=True)
    assert plan.cut.key == key and plan.tokens == 2 * B + 6
    facts = pc.block_facts(TOKENS, plan.keys, first=2)
    assert facts[0].diverges_at is None  # an extension changes nothing stored
    assert pc.block_facts(edit_at(TOKENS, 2 * B + 3), plan.keys, first=2)[0].diverges_at == (
        2 * B + 3
    )

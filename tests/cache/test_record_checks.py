"""Records are checked against the model before they reach it.

A record read back from the store must fit the model: its metadata the block and the
layer layout, its arrays the shapes and dtypes of the model's cache (learned from the
records the process saved itself). A record with the wrong head count, head_dim, dtype
or token count, or a foreign safetensors file under a record's key, is a `RecordError`:
`PrefixCache.load` deletes it and falls back to a shorter chain (a miss, never a crash),
and the engine still answers the prompt exactly as a cold run does.

The first part drives a `PrefixCache` with random keys/values (no model), as
tests/cache/test_planner.py does: one full-attention layer (2 kv heads of 8), one
sliding-window layer (W=24 over blocks of 16) and one recurrent (state) layer, in
float32. The last part plants bad blobs in a real engine with a tiny model.
"""

from __future__ import annotations

import io
import json
import random

import mlx.core as mx
import pytest
from mlx_lm.models import cache as lm_cache
from test_planner import feed  # tests/ is on sys.path

from mlx_nbengine import Engine
from mlx_nbengine.cache.followers import ROOT
from mlx_nbengine.cache.kinds import check_record, extract_block_records, kind_named
from mlx_nbengine.cache.planner import PrefixCache, prefill_steps
from mlx_nbengine.cache.records import (
    BLOB_FORMAT,
    ArraySpec,
    Record,
    RecordError,
    merge_signatures,
    record_from_bytes,
    record_to_bytes,
)
from mlx_nbengine.cache.store import BlockStore

B = 16
W = 24
HEADS, HEAD_DIM = 2, 8
TOKENS = list(range(6 * B + 3))  # six whole blocks and a tail


def make_layers():
    return [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=W), lm_cache.ArraysCache(2)]


@pytest.fixture
def store(tmp_path):
    with BlockStore(budget_bytes=1 << 26, directory=tmp_path) as s:
        yield s


def prefix_cache(store, layers=None) -> PrefixCache:
    layers = make_layers() if layers is None else layers
    return PrefixCache.for_cache(layers, fingerprint="model-a", store=store, block_size=B)


def prefill_and_save(pc: PrefixCache, tokens, *, layers=None) -> list:
    """Prefill block by block, saving every completed block with its parent and tokens."""
    layers = make_layers() if layers is None else layers
    keys = pc.keys(tokens)
    for i, (start, end) in enumerate(prefill_steps(0, len(tokens), block_size=B, max_step=B)):
        feed(layers, end - start, seed=i)
        if end % B == 0:
            j = end // B - 1
            recs = extract_block_records(layers, block=j, block_size=B)
            parent = keys[j - 1] if j else ROOT
            assert pc.save(keys[j], recs, parent=parent, tokens=tokens[j * B : end])
    pc.touch(keys)
    return layers


def replace_blob(store, key: str, kind: str, data: bytes) -> None:
    store.delete(key, kind)
    assert store.put(key, kind, data)


def rewritten(data: bytes, change) -> bytes:
    """The record in `data` after `change(arrays, layers)` edited its arrays / layer meta."""
    rec = record_from_bytes(data)
    arrays, layers = dict(rec.arrays), {str(i): m for i, m in rec.layers.items()}
    change(arrays, layers)
    meta = {**rec.meta, "layers": json.dumps(layers, sort_keys=True)}
    return record_to_bytes(Record(rec.kind, arrays, meta))


def foreign_safetensors() -> bytes:
    """A valid safetensors file that is no record: a model shard's weights and metadata."""
    buf = io.BytesIO()
    weight = mx.zeros((1, HEADS, B, HEAD_DIM))
    mx.save_safetensors(buf, {"model.layers.0.k_proj.weight": weight}, metadata={"format": "pt"})
    return buf.getvalue()


def more_heads(arrays, layers):
    arrays["L0.k"] = mx.concatenate([arrays["L0.k"]] * 2, axis=1)
    arrays["L0.v"] = mx.concatenate([arrays["L0.v"]] * 2, axis=1)


def wider_heads(arrays, layers):
    arrays["L0.k"] = mx.concatenate([arrays["L0.k"]] * 2, axis=3)


def half_precision(arrays, layers):
    arrays["L0.k"] = arrays["L0.k"].astype(mx.float16)
    arrays["L0.v"] = arrays["L0.v"].astype(mx.float16)


def fewer_tokens(arrays, layers):  # the arrays disagree with the meta's token range
    arrays["L0.k"] = arrays["L0.k"][..., :-1, :]
    arrays["L0.v"] = arrays["L0.v"][..., :-1, :]


def fewer_tokens_said(arrays, layers):  # a partial block under a whole block's key
    fewer_tokens(arrays, layers)
    layers["0"]["end"] -= 1


def no_values(arrays, layers):
    del arrays["L0.v"]


def stray_array(arrays, layers):
    arrays["L5.k"] = arrays["L0.k"]


def another_class(arrays, layers):
    layers["0"]["class"] = "QuantizedKVCache"


def string_range(arrays, layers):
    layers["0"]["start"] = str(layers["0"]["start"])


KV_DAMAGE = {
    "more kv heads": more_heads,
    "another head_dim": wider_heads,
    "another dtype": half_precision,
    "fewer tokens than the meta says": fewer_tokens,
    "a partial block under a whole block's key": fewer_tokens_said,
    "an array missing": no_values,
    "an array of no layer": stray_array,
    "another layer class": another_class,
    "a token range that is no integer": string_range,
}


# --- each bad record is rejected and the load falls back ---------------------------------------


@pytest.mark.parametrize("damage", list(KV_DAMAGE), ids=list(KV_DAMAGE))
def test_a_kv_record_that_does_not_fit_the_model_falls_back_to_a_shorter_chain(store, damage):
    pc = prefix_cache(store)
    live = prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)
    replace_blob(store, keys[3], "kv", rewritten(store.get(keys[3], "kv"), KV_DAMAGE[damage]))
    plan, records = pc.load(pc.plan(TOKENS))
    assert plan.n_blocks == 3 and sorted(records) == [0, 1, 2]
    assert not store.has(keys[3], "kv")  # deleted: never read again
    cache = pc.assemble(records, n_blocks=3, template_cache=make_layers())
    assert mx.array_equal(
        cache[0].keys[..., : cache[0].offset, :], live[0].keys[..., : 3 * B, :]
    ).item()


def test_a_foreign_safetensors_file_under_a_key_is_rejected(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)
    replace_blob(store, keys[1], "kv", foreign_safetensors())
    with pytest.raises(RecordError, match="not an mlx_nbengine record"):
        record_from_bytes(store.get(keys[1], "kv"))
    plan, records = pc.load(pc.plan(TOKENS))
    assert plan.n_blocks == 1 and sorted(records) == [0]
    assert not store.has(keys[1], "kv")


def test_a_foreign_file_dressed_as_a_record_is_rejected_by_its_arrays(store):
    """Record metadata copied onto other arrays: the arrays do not fit."""
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)
    meta = record_from_bytes(store.get(keys[2], "kv")).meta
    weights = {"model.embed_tokens.weight": mx.zeros((512, 64))}
    replace_blob(store, keys[2], "kv", record_to_bytes(Record("kv", weights, meta)))
    plan, _ = pc.load(pc.plan(TOKENS))
    assert plan.n_blocks == 2 and not store.has(keys[2], "kv")


def test_a_window_record_of_another_shape_or_window_is_rejected(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)

    def wider(arrays, layers):
        arrays["L1.v"] = mx.concatenate([arrays["L1.v"]] * 2, axis=3)

    def other_window(arrays, layers):
        layers["1"]["max_size"] = 2 * W

    replace_blob(store, keys[5], "window", rewritten(store.get(keys[5], "window"), wider))
    plan, _ = pc.load(pc.plan(TOKENS))
    assert plan.n_blocks == 5 and not store.has(keys[5], "window")  # 6 needed blocks 4, 5
    replace_blob(store, keys[3], "window", rewritten(store.get(keys[3], "window"), other_window))
    plan, _ = pc.load(pc.plan(TOKENS))
    assert plan.n_blocks == 3 and not store.has(keys[3], "window")  # 5, 4 needed block 3


@pytest.mark.parametrize("damage", ["shape", "dtype", "skeleton", "offset"])
def test_a_state_record_that_does_not_fit_the_layer_falls_back_one_boundary(store, damage):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    keys = pc.keys(TOKENS)

    def change(arrays, layers):
        (name,) = [n for n, a in arrays.items() if a.shape == (1, 4)]
        if damage == "shape":
            arrays[name] = mx.zeros((1, 5))
        elif damage == "dtype":
            arrays[name] = arrays[name].astype(mx.bfloat16)
        elif damage == "skeleton":
            layers["2"]["snapshot"] = {"state": "not a skeleton"}
        else:
            layers["2"]["offset"] -= 1

    replace_blob(store, keys[5], "state", rewritten(store.get(keys[5], "state"), change))
    plan, records = pc.load(pc.plan(TOKENS))
    assert plan.n_blocks == 5 and not store.has(keys[5], "state")
    pc.assemble(records, n_blocks=5, template_cache=make_layers())


def test_a_cut_followers_record_that_does_not_fit_keeps_the_boundary(store):
    layers = [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=W)]
    pc = prefix_cache(store, layers)
    prefill_and_save(pc, TOKENS, layers=[lm_cache.KVCache(), lm_cache.RotatingKVCache(W)])
    edited = TOKENS[: 3 * B + 5] + [t + 1000 for t in TOKENS[3 * B + 5 :]]
    plan = pc.plan(edited, to_token=True)
    assert plan.cut is not None and plan.cut.tokens == 5
    replace_blob(
        store, plan.cut.key, "kv", rewritten(store.get(plan.cut.key, "kv"), half_precision)
    )
    plan, records = pc.load(plan)
    assert (plan.tokens, plan.cut, plan.kept_boundary) == (3 * B, None, "evicted")
    assert sorted(records) == [0, 1, 2] and not store.has(pc.keys(TOKENS)[3], "kv")


def test_before_any_save_a_chain_must_agree_with_its_first_record(store):
    """A PrefixCache that saved nothing yet (so learned no signature) still never serves a
    chain whose blocks disagree on shapes."""
    prefill_and_save(prefix_cache(store), TOKENS)
    fresh = prefix_cache(store)
    assert fresh.signatures == {}
    keys = fresh.keys(TOKENS)
    replace_blob(store, keys[2], "kv", rewritten(store.get(keys[2], "kv"), more_heads))
    plan, _ = fresh.load(fresh.plan(TOKENS))
    assert plan.n_blocks == 2 and not store.has(keys[2], "kv")
    assert fresh.signatures == {}  # what a load reads teaches nothing


def test_save_learns_each_kinds_signature_from_the_records_it_is_given(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS[: 2 * B])
    assert set(pc.signatures) == {"kv", "window", "state"}
    kv = pc.signatures["kv"]
    assert kv["L0.k"] == ArraySpec(frozenset([mx.float32]), (1, HEADS, None, HEAD_DIM))
    assert kv["L0.v"] == kv["L0.k"]
    assert set(pc.signatures["window"]) == {"L1.k", "L1.v"}
    assert {s.shape for s in pc.signatures["state"].values()} == {(HEADS, HEAD_DIM), (1, 4)}


def test_merged_signatures_free_what_saved_records_disagree_on():
    a = {"L0.0": ArraySpec(frozenset([mx.float32]), (1, 3, 8)), "L0.1": None}
    b = {
        "L0.0": ArraySpec(frozenset([mx.bfloat16]), (1, 5, 8)),
        "L0.1": ArraySpec(frozenset([mx.float32]), (2,)),
        "L0.2": ArraySpec(frozenset([mx.float32]), (4,)),
    }
    merged = merge_signatures(a, b)
    assert merged["L0.0"] == ArraySpec(frozenset([mx.float32, mx.bfloat16]), (1, None, 8))
    assert merged["L0.1"] is None  # any array
    assert merged["L0.2"] == b["L0.2"]
    ranks = merge_signatures(merged, {"L0.0": ArraySpec(frozenset([mx.float32]), (1, 8))})
    assert ranks["L0.0"] is None


def test_state_records_of_varying_shapes_all_load_once_saved(store):
    """A state whose arrays grow with the tokens (a rotating cache with keep > 0 is
    checkpointed whole) loads at every boundary: each saved record widened the signature."""
    layers = [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=40, keep=4)]
    pc = prefix_cache(store, layers)
    assert pc.layer_kinds == ["kv", "state"]
    prefill_and_save(pc, TOKENS, layers=[lm_cache.KVCache(), lm_cache.RotatingKVCache(40, 4)])
    for n in range(1, 7):
        plan, records = pc.load(pc.plan(TOKENS[: n * B + 1]))
        assert plan.n_blocks == n
        cache = pc.assemble(
            records,
            n_blocks=n,
            template_cache=[lm_cache.KVCache(), lm_cache.RotatingKVCache(40, 4)],
        )
        assert cache[1].offset == n * B


def test_malformed_layer_metadata_is_a_record_error_not_a_crash():
    rec = Record("kv", {"L0.k": mx.zeros((1, 1, B, 4))}, {})
    for layers in ('["not", "a", "dict"]', '{"0": 5}', '{"x": {}}'):
        rec.meta = {"format": BLOB_FORMAT, "kind": "kv", "kind_version": "1", "block": "0"}
        rec.meta |= {"block_size": str(B), "layers": layers}
        with pytest.raises(RecordError):
            check_record(
                record_from_bytes(record_to_bytes(rec)),
                block=0,
                kind="kv",
                block_size=B,
                layer_kinds=["kv"],
                windows=[None],
            )


def test_the_engines_own_records_fit_their_signature(store):
    pc = prefix_cache(store)
    prefill_and_save(pc, TOKENS)
    for key in pc.keys(TOKENS):
        for kind in ("kv", "window", "state"):
            if store.has(key, kind):
                rec = record_from_bytes(store.get(key, kind))
                assert kind_named(kind).signature(rec).keys() <= pc.signatures[kind].keys()


# --- end to end: a bad blob under a real key of a running engine --------------------------------

BOS = 2


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [BOS] + [rng.randrange(5, 512) for _ in range(n - 1)]


def run(engine: Engine, tokens, **kwargs):
    kwargs.setdefault("max_tokens", 6)
    done = engine.submit(tokens, **kwargs).result(timeout=60)
    engine.wait_for_saves(timeout=60)
    return done


ENGINE_DAMAGE = {
    "more kv heads": ("kv", more_heads),
    "another head_dim": ("kv", wider_heads),
    "another dtype": ("kv", half_precision),
    "fewer tokens": ("kv", fewer_tokens),
    "a foreign safetensors file": ("kv", None),
}


@pytest.mark.parametrize("damage", list(ENGINE_DAMAGE), ids=list(ENGINE_DAMAGE))
def test_an_engine_serves_a_prompt_whose_stored_record_was_replaced(
    tiny_model_dir, tmp_path, damage
):
    kind, change = ENGINE_DAMAGE[damage]
    tokens = prompt(5 * B + 5)
    with Engine.load(tiny_model_dir("llama"), block_size=B, cache_dir=tmp_path) as engine:
        first = run(engine, tokens)

        def plant(prefix):
            key = prefix.keys(tokens)[2]
            good = prefix.store.get(key, kind)
            bad = foreign_safetensors() if change is None else rewritten(good, change)
            prefix.store.delete(key, kind)
            assert prefix.store.put(key, kind, bad)

        engine.internals.on_store_thread(plant)
        run(engine, prompt(20, seed=777), max_tokens=2)  # the hot cache holds another prompt
        again = run(engine, tokens)

    report = again.report
    assert report.restore_source == "disk"
    assert report.restored_tokens == 2 * B  # blocks 0 and 1; the bad block 2 is computed
    assert [b.source for b in report.blocks[:3]] == ["disk", "disk", "computed"]
    assert again.tokens == first.tokens  # answered as before (greedy)


def test_a_hybrid_engine_falls_back_past_a_state_record_of_another_shape(tiny_model_dir, tmp_path):
    tokens = prompt(5 * B + 5)
    with Engine.load(tiny_model_dir("qwen3_5"), block_size=B, cache_dir=tmp_path) as engine:
        first = run(engine, tokens)
        prefix = engine.internals.prefix_cache
        state_layer = prefix.layer_kinds.index("state")

        def plant(prefix):
            key = prefix.keys(tokens)[4]

            def change(arrays, layers):
                name = sorted(n for n in arrays if n.startswith(f"L{state_layer}."))[0]
                arrays[name] = mx.concatenate([arrays[name]] * 2, axis=-1)

            bad = rewritten(prefix.store.get(key, "state"), change)
            prefix.store.delete(key, "state")
            assert prefix.store.put(key, "state", bad)

        engine.internals.on_store_thread(plant)
        run(engine, prompt(20, seed=777), max_tokens=2)
        again = run(engine, tokens)

    report = again.report
    assert report.restore_source == "disk"
    assert report.restored_tokens == 4 * B  # the checkpoint at block 3's end
    assert again.tokens == first.tokens


def test_records_that_fail_to_assemble_are_a_miss_not_a_failed_request(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The last guard: should assembly still reject what the load checks let through, the
    prompt is computed from the start and answered as before."""
    tokens = prompt(5 * B + 5)
    with Engine.load(tiny_model_dir("llama"), block_size=B, cache_dir=tmp_path) as engine:
        first = run(engine, tokens)
        run(engine, prompt(20, seed=777), max_tokens=2)  # the hot cache holds another prompt

        def refuse(*args, **kwargs):
            raise RecordError("does not fit")

        monkeypatch.setattr(engine.internals.prefix_cache, "assemble", refuse)
        again = run(engine, tokens)
    assert again.finish_reason == first.finish_reason
    assert again.report.restored_tokens == 0
    assert again.tokens == first.tokens

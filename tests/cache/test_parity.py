"""Parity: a restored cache continues bit-identically to a fresh prefill, for every family.

A 1,500-token prompt is prefilled block by block (`prefill_steps`, one block
per model call) while every completed block's records are saved through
`PrefixCache.save` into a real `BlockStore`. Then the same prompt with its
last 100 tokens edited is planned, loaded, assembled and its rest prefilled;
the final step's logits, and a few decode steps after it, must equal
(`mx.array_equal`) those of a fresh block-by-block prefill of the edited
prompt, and the plan must restore every whole block before the edit.

Families (tiny random models): llama (kv only), gemma3_text with sliding
window 64 (< block) and 512 (> block), and qwen3_5 (kv + recurrent state).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx
import pytest

from mlx_nbengine.cache import PrefixCache, extract_block_records, prefill_steps
from mlx_nbengine.cache.store import BlockStore
from mlx_nbengine.models import load

B = 256
PROMPT = 1500
EDITED = 100

FAMILIES = {
    "llama": ("llama", {}),
    "gemma3_text-w64": ("gemma3_text", {"sliding_window": 64}),
    "gemma3_text-w512": ("gemma3_text", {"sliding_window": 512}),
    "qwen3_5": ("qwen3_5", {}),
}


def prefill(model, cache, tokens, start: int, *, on_boundary=None) -> mx.array:
    """Prefill ``tokens[start:]`` in block-aligned steps; the logits of the last step."""
    logits = None
    for s, e in prefill_steps(start, len(tokens), block_size=B, max_step=B):
        logits = model(mx.array(tokens[s:e])[None], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        if on_boundary is not None and e % B == 0:
            on_boundary(e)
    return logits


def decode(model, cache, token_ids) -> list[mx.array]:
    out = []
    for t in token_ids:
        out.append(model(mx.array([[t]]), cache=cache))
        mx.eval(out[-1])
    return out


@dataclass
class Stored:
    lm: object
    pc: PrefixCache
    tokens: list[int]


@pytest.fixture(scope="module", params=list(FAMILIES))
def stored(request, tiny_model_dir, tmp_path_factory):
    """A tiny model whose 1,500-token prompt has been prefilled and saved block by block."""
    family, kwargs = FAMILIES[request.param]
    lm = load(tiny_model_dir(family, **kwargs))
    rng = random.Random(1)
    tokens = [rng.randrange(5, 500) for _ in range(PROMPT)]
    with BlockStore(budget_bytes=1 << 30, directory=tmp_path_factory.mktemp("store")) as store:
        cache = lm.make_cache()
        pc = PrefixCache.for_cache(cache, fingerprint=lm.fingerprint, store=store, block_size=B)
        keys = pc.keys(tokens)

        def save(end: int) -> None:
            block = end // B - 1
            assert pc.save(keys[block], extract_block_records(cache, block=block, block_size=B))

        prefill(lm.model, cache, tokens, 0, on_boundary=save)
        pc.touch(keys)
        yield Stored(lm, pc, tokens)


def restore(stored: Stored, prompt):
    plan, records = stored.pc.load(stored.pc.plan(prompt))
    cache = stored.pc.assemble(
        records, n_blocks=plan.n_blocks, template_cache=stored.lm.make_cache()
    )
    return plan, cache


def test_edited_prompt_restores_every_block_before_the_edit_and_matches_fresh(stored):
    rng = random.Random(2)
    edited = stored.tokens[: PROMPT - EDITED] + [rng.randrange(5, 500) for _ in range(EDITED)]
    plan, cache = restore(stored, edited)
    assert plan.n_blocks == (PROMPT - EDITED) // B == 5

    restored_logits = prefill(stored.lm.model, cache, edited, plan.tokens)
    fresh = stored.lm.make_cache()
    fresh_logits = prefill(stored.lm.model, fresh, edited, 0)
    assert mx.array_equal(restored_logits, fresh_logits).item()

    # Decoding on (single-token updates, rotating buffers wrap) stays identical too.
    follow = [7, 11, 13, 17, 19]
    restored_steps = decode(stored.lm.model, cache, follow)
    fresh_steps = decode(stored.lm.model, fresh, follow)
    for a, b in zip(restored_steps, fresh_steps, strict=True):
        assert mx.array_equal(a, b).item()


def test_a_one_token_suffix_continues_on_the_single_token_path(stored):
    prompt = stored.tokens[: 5 * B + 1]
    plan, cache = restore(stored, prompt)
    assert plan.n_blocks == 5
    restored_logits = prefill(stored.lm.model, cache, prompt, plan.tokens)
    assert restored_logits.shape[1] == 1
    fresh_logits = prefill(stored.lm.model, stored.lm.make_cache(), prompt, 0)
    assert mx.array_equal(restored_logits, fresh_logits).item()


def test_a_prompt_ending_on_a_boundary_restores_all_but_its_last_block(stored):
    prompt = stored.tokens[: 4 * B]
    plan, cache = restore(stored, prompt)
    assert plan.n_blocks == 3
    restored_logits = prefill(stored.lm.model, cache, prompt, plan.tokens)
    fresh_logits = prefill(stored.lm.model, stored.lm.make_cache(), prompt, 0)
    assert mx.array_equal(restored_logits, fresh_logits).item()

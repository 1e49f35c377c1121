"""Block keys: whole blocks only, a chain over the prefix, seeded per model and block size."""

from __future__ import annotations

import pytest

from mlx_nbengine.cache.blocks import block_keys
from mlx_nbengine.models.vision import ImageSpan

B = 4


def keys(tokens, **kw):
    return block_keys(tokens, fingerprint=kw.pop("fingerprint", "m"), block_size=B, **kw)


def test_only_whole_blocks_get_keys():
    assert len(keys(list(range(11)))) == 2
    assert len(keys(list(range(12)))) == 3
    assert keys([]) == []


def test_keys_are_deterministic_hex_sha256():
    a = keys(list(range(8)))
    assert a == keys(list(range(8)))
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in a)
    assert len(set(a)) == 2


def test_a_prefix_has_the_same_keys_as_the_longer_prompt():
    long = list(range(40))
    assert keys(long[:17]) == keys(long)[:4]


def test_an_edit_changes_the_edited_block_and_every_later_one_only():
    a = list(range(24))
    b = list(a)
    b[9] = 99  # inside block 2
    ka, kb = keys(a), keys(b)
    assert ka[:2] == kb[:2]
    assert all(x != y for x, y in zip(ka[2:], kb[2:], strict=True))


def test_the_same_block_tokens_after_a_different_prefix_get_a_different_key():
    a = [1, 2, 3, 4, 9, 9, 9, 9]
    b = [5, 6, 7, 8, 9, 9, 9, 9]
    assert keys(a)[1] != keys(b)[1]


def test_image_digest_changes_keys_of_overlapping_blocks_from_there_on_only():
    tokens = [7] * 24
    plain = keys(tokens, images=[ImageSpan(6, 11, "cat")])
    other = keys(tokens, images=[ImageSpan(6, 11, "dog")])
    # The span [6, 11) overlaps blocks 1 and 2; block 0 is untouched.
    assert plain[0] == other[0]
    assert all(x != y for x, y in zip(plain[1:], other[1:], strict=True))
    assert keys(tokens)[0] == plain[0] and keys(tokens)[1] != plain[1]


def test_different_fingerprint_or_block_size_never_share_a_key():
    tokens = list(range(64))
    base = set(keys(tokens))
    assert base.isdisjoint(keys(tokens, fingerprint="other"))
    assert base.isdisjoint(block_keys(tokens, fingerprint="m", block_size=2 * B))
    assert base.isdisjoint(block_keys(tokens, fingerprint="m", block_size=B // 2))


def test_token_ids_outside_uint32_are_rejected():
    with pytest.raises(ValueError, match="uint32"):
        keys([-1, 0, 0, 0])


def test_image_span_needs_a_non_empty_range_and_knows_cuts():
    with pytest.raises(ValueError):
        ImageSpan(5, 5, "x")
    span = ImageSpan(4, 8, "x")
    assert span.cuts(6) and not span.cuts(4) and not span.cuts(8)

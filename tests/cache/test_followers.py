"""Which stored blocks came after a prefix (`cache.followers`) on its own: the siblings
ranked by the tokens they share, where a prompt leaves the closest one, and the bounds
(at most `capacity` blocks, `per_parent` under one parent, the oldest dropped first)."""

from __future__ import annotations

import pytest

from mlx_nbengine.cache.followers import ROOT, FollowerIndex, common_prefix


def test_common_prefix_counts_the_shared_leading_ids():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([7], [8]) == 0


def test_followers_of_a_parent_most_recent_first_and_their_tokens():
    index = FollowerIndex()
    index.add("a", ROOT, [1, 2, 3, 4])
    index.add("b", ROOT, [1, 2, 9, 9])
    index.add("c", "a", [5, 6, 7, 8])
    assert index.followers(ROOT) == ["b", "a"] and index.followers("a") == ["c"]
    assert index.tokens("c") == [5, 6, 7, 8] and index.tokens("gone") is None
    assert "a" in index and "gone" not in index and len(index) == 3
    index.add("a", ROOT, [1, 2, 3, 4])  # seen again: the most recent now
    assert index.followers(ROOT) == ["a", "b"]


def test_ranked_puts_the_longest_shared_prefix_first_and_keeps_recency_on_ties():
    index = FollowerIndex()
    index.add("old", ROOT, [1, 2, 3, 4])
    index.add("partial", ROOT, [1, 2])  # a partial block: two tokens long
    index.add("new", ROOT, [1, 2, 3, 5])
    assert index.ranked(ROOT, [1, 2, 3, 4]) == [("old", 4, 4), ("new", 3, 4), ("partial", 2, 2)]
    assert [k for k, *_ in index.ranked(ROOT, [1, 2, 3, 9])] == ["new", "old", "partial"]


def test_diverges_at_is_where_the_prompt_leaves_the_closest_follower():
    index = FollowerIndex()
    index.add("block", "p", [10, 11, 12, 13])
    assert index.diverges_at("p", [10, 11, 99, 13], start=32, root_min=0) == 34
    # A prompt block that is a prefix of the follower, or extends a partial one, changes
    # nothing stored.
    assert index.diverges_at("p", [10, 11], start=32, root_min=0) is None
    index.add("short", "q", [10, 11])
    assert index.diverges_at("q", [10, 11, 12, 13], start=0, root_min=0) is None
    assert index.diverges_at("nobody", [1], start=0, root_min=0) is None


def test_a_first_block_counts_only_when_it_shares_root_min_tokens():
    index = FollowerIndex()
    index.add("first", ROOT, [1, 2, 3, 4])
    assert index.diverges_at(ROOT, [1, 9, 9, 9], start=0, root_min=2) is None
    assert index.diverges_at(ROOT, [1, 2, 9, 9], start=0, root_min=2) == 2


def test_the_index_is_bounded_overall_and_per_parent_oldest_first():
    index = FollowerIndex(capacity=3, per_parent=2)
    index.add("a", ROOT, [1])
    index.add("b", ROOT, [2])
    index.add("c", ROOT, [3])  # a third sibling: the oldest, a, goes
    assert index.followers(ROOT) == ["c", "b"]
    index.add("d", "c", [4])
    index.add("e", "d", [5])  # a fourth block: the oldest overall, b, goes
    assert "b" not in index and len(index) == 3
    index.add("f", "x", [6])
    index.add("g", "x", [7])
    assert len(index) == 3 and "c" not in index and "d" not in index
    assert index.followers("x") == ["g", "f"] and index.followers("d") == ["e"]


def test_bounds_below_one_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        FollowerIndex(capacity=0)
    with pytest.raises(ValueError, match="at least 1"):
        FollowerIndex(per_parent=0)

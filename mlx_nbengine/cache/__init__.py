"""Prefix cache: whole-block keys, per-layer-kind records, disk LRU store, restore planning.

See `blocks` (keys, partial-block keys), `records` (what a block keeps per layer kind),
`planner` (`PrefixCache`, `RestorePlan` and its token-exact `Cut`, `BlockFacts`,
`prefill_steps`), `followers` (which stored blocks followed a prefix, with their tokens),
`assembly` (rebuilding live caches), `store` (`BlockStore`, the LRU over one scratch file)
and `blobfile`.
"""

from mlx_nbengine.cache.blocks import ImageSpan, block_keys, partial_key
from mlx_nbengine.cache.followers import ROOT, FollowerIndex
from mlx_nbengine.cache.planner import (
    BOUNDARY_REASONS,
    BlockFacts,
    Cut,
    PrefixCache,
    RestorePlan,
    prefill_steps,
)
from mlx_nbengine.cache.records import (
    HostArray,
    Record,
    RecordError,
    RecordKind,
    extract_block_records,
    layer_kinds,
    layer_windows,
    record_from_buffer,
    record_from_bytes,
    record_to_bytes,
)

__all__ = [
    "BOUNDARY_REASONS",
    "ROOT",
    "BlockFacts",
    "Cut",
    "FollowerIndex",
    "HostArray",
    "ImageSpan",
    "PrefixCache",
    "Record",
    "RecordError",
    "RecordKind",
    "RestorePlan",
    "block_keys",
    "extract_block_records",
    "layer_kinds",
    "layer_windows",
    "partial_key",
    "prefill_steps",
    "record_from_buffer",
    "record_from_bytes",
    "record_to_bytes",
]

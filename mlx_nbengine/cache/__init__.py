"""Prefix cache: whole-block keys, per-layer-kind records, disk LRU store, restore planning.

See `blocks` (keys, partial-block keys), `kinds` (one class per layer kind: what a block
keeps of it, its checks, what a restore reads, its rebuilding, its cuts), `records` (a
record, its bytes and signature), `snapshots` (recurrent states as skeleton + arrays),
`types` (the shared types: `RestorePlan` and its token-exact `Cut`, `KeptBoundary`,
`CutRead`, `BlockFacts`: what the store knows of a computed block), `planner`
(`PrefixCache`: plans, block facts, loads; `prefill_steps`), `reader` (a restore's reads,
checked), `followers` (which stored blocks followed a prefix, with their tokens),
`assembly` (what one rebuild reads, slice copying), `store` (`BlockStore`, the LRU over
one scratch file), `backends` (memory, scratch file or persistent directory), `persist`
(the persistent directory), `indexlog` (its index), `blobfile` (a file's blob I/O) and
`extents` (its offset table and free list).
"""

from mlx_nbengine.cache.blocks import block_keys, partial_key
from mlx_nbengine.cache.followers import ROOT, FollowerIndex
from mlx_nbengine.cache.kinds import (
    KINDS,
    RECORD_FORMAT,
    LayerKind,
    extract_block_records,
    kind_of,
    layer_kinds,
    layer_windows,
)
from mlx_nbengine.cache.planner import PrefixCache, prefill_steps
from mlx_nbengine.cache.records import (
    HostArray,
    Record,
    RecordError,
    RecordKind,
    record_from_buffer,
    record_from_bytes,
    record_to_bytes,
)
from mlx_nbengine.cache.types import BlockFacts, Cut, CutRead, KeptBoundary, RestorePlan

__all__ = [
    "KINDS",
    "RECORD_FORMAT",
    "ROOT",
    "BlockFacts",
    "Cut",
    "CutRead",
    "FollowerIndex",
    "HostArray",
    "KeptBoundary",
    "LayerKind",
    "PrefixCache",
    "Record",
    "RecordError",
    "RecordKind",
    "RestorePlan",
    "block_keys",
    "extract_block_records",
    "kind_of",
    "layer_kinds",
    "layer_windows",
    "partial_key",
    "prefill_steps",
    "record_from_buffer",
    "record_from_bytes",
    "record_to_bytes",
]

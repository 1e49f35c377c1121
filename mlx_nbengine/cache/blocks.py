"""Block keys: content addresses of whole token blocks.

A *block* is a run of `block_size` consecutive token positions ``[i*B, (i+1)*B)``;
a prompt's tail shorter than a block has no block key and is always computed. A
*boundary* is a block end, ``n*B``.

A *partial block* is such a tail once it is stored: the last ``m < B`` tokens of a
finished request's cache (prompt and generated tokens). Its key (`partial_key`) hashes
the key of the block before it (or the chain seed), a marker and its tokens, so it never
equals a block key; it is only ever restored in part, as the unchanged start of a prompt
block (see `planner`), never as a block of a chain.

The *key* of block i is a SHA-256 hex digest over the key of block i-1, the
block's token ids (little-endian uint32, so the bytes do not depend on the
platform) and the images overlapping the block (their token range and content
digest). The chain is seeded with the model fingerprint and the block size, so
two models or two block sizes never share a key, and a key names the whole
prefix up to its block: equal keys mean equal prefixes.

An *image span* is the token range an image's placeholder tokens occupy after
the processor expanded them, plus a digest of the image's content; two
different pictures behind identical placeholder tokens get different keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["ImageSpan", "block_keys", "chain_seed", "partial_key"]

_KEY_VERSION = b"mlx_nbengine.blocks.v1"
_PARTIAL = b"\0partial\0"


@dataclass(frozen=True)
class ImageSpan:
    """Token range ``[start, end)`` of one image and a content hash of the image."""

    start: int
    end: int
    digest: str

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"image span needs 0 <= start < end, got {self.start}..{self.end}")

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and self.end > start

    def cuts(self, boundary: int) -> bool:
        """True when `boundary` falls strictly inside the image's tokens."""
        return self.start < boundary < self.end


def chain_seed(*, fingerprint: str, block_size: int) -> bytes:
    """The digest block 0 chains from: model fingerprint and block size."""
    h = hashlib.sha256(_KEY_VERSION)
    h.update(b"\0fingerprint\0" + fingerprint.encode())
    h.update(b"\0block_size\0" + str(int(block_size)).encode())
    return h.digest()


def block_keys(
    tokens: Sequence[int],
    *,
    fingerprint: str,
    block_size: int,
    images: Iterable[ImageSpan] = (),
) -> list[str]:
    """Hex keys of every whole block of `tokens` (``len(tokens) // block_size`` of them)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("token ids must fit in uint32")
    ids = ids.astype("<u4")
    spans = sorted(images, key=lambda s: (s.start, s.end, s.digest))
    prev = chain_seed(fingerprint=fingerprint, block_size=block_size)
    keys = []
    for i in range(len(ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        h = hashlib.sha256(prev)
        h.update(ids[start:end].tobytes())
        for span in spans:
            if span.overlaps(start, end):
                h.update(f"\0image\0{span.start}\0{span.end}\0{span.digest}".encode())
        prev = h.digest()
        keys.append(h.hexdigest())
    return keys


def partial_key(tokens: Sequence[int], *, fingerprint: str, block_size: int) -> str | None:
    """Hex key of the partial block of `tokens` (its last ``len % block_size`` tokens after
    the whole blocks), None when `tokens` ends on a boundary. Text only (no images)."""
    n_whole = len(tokens) // block_size
    if len(tokens) == n_whole * block_size:
        return None
    keys = block_keys(
        tokens[: n_whole * block_size], fingerprint=fingerprint, block_size=block_size
    )
    prev = (
        bytes.fromhex(keys[-1])
        if keys
        else chain_seed(fingerprint=fingerprint, block_size=block_size)
    )
    ids = np.asarray(tokens[n_whole * block_size :], dtype=np.int64).astype("<u4")
    h = hashlib.sha256(prev)
    h.update(_PARTIAL)
    h.update(ids.tobytes())
    return h.hexdigest()

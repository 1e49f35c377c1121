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

An *image span* (`models.vision.ImageSpan`) is the token range an image's placeholder
tokens occupy after the processor expanded them, plus a digest of the image's content;
two different pictures behind identical placeholder tokens get different keys.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from mlx_nbengine.models.vision import ImageSpan

__all__ = ["block_keys", "chain_seed", "match_ids", "partial_key", "token_ids"]

_KEY_VERSION = b"mlx_nbengine.blocks.v1"
_PARTIAL = b"\0partial\0"


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


def partial_key(
    tokens: Sequence[int],
    *,
    fingerprint: str,
    block_size: int,
    images: Iterable[ImageSpan] = (),
) -> str | None:
    """Hex key of the partial block of `tokens` (its last ``len % block_size`` tokens after
    the whole blocks), None when `tokens` ends on a boundary; the images overlapping it
    count as in `block_keys`."""
    n_whole = len(tokens) // block_size
    if len(tokens) == n_whole * block_size:
        return None
    images = tuple(images)
    keys = block_keys(
        tokens[: n_whole * block_size],
        fingerprint=fingerprint,
        block_size=block_size,
        images=images,
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
    start = n_whole * block_size
    for span in sorted(images, key=lambda s: (s.start, s.end, s.digest)):
        if span.overlaps(start, len(tokens)):
            h.update(f"\0image\0{span.start}\0{span.end}\0{span.digest}".encode())
    return h.hexdigest()


_IMAGE_NUMBERS: dict[str, int] = {}
_IMAGE_NUMBERS_LOCK = threading.Lock()
_POSITION_BITS = 15  # places in an image, modulo 32,768
_NUMBER_BITS = 16  # images, modulo 65,536 (see `match_ids`)


def _image_number(digest: str) -> int:
    with _IMAGE_NUMBERS_LOCK:
        return _IMAGE_NUMBERS.setdefault(digest, len(_IMAGE_NUMBERS))


def match_ids(tokens: Sequence[int], images: Iterable[ImageSpan] = ()) -> np.ndarray:
    """`tokens` as int64 ids that also tell images apart, for comparing prompts token by
    token (the follower index, the hot cache).

    A text token keeps its id. An image token becomes a negative number made of the
    token id, the image's place number (the order in which this process first saw its
    digest) and the token's place in the image, so two prompts share a prefix only as far
    as their images are the same pictures; `token_ids` gives the token ids back. Place
    numbers wrap after 65,536 distinct pictures, far beyond what the follower index
    remembers (4,096 blocks).
    """
    ids = np.asarray(tokens, dtype=np.int64).copy()
    for span in images:
        end = min(span.end, len(ids))  # `tokens` may stop inside an image
        if end <= span.start:
            continue
        number = _image_number(span.digest) % (1 << _NUMBER_BITS)
        places = np.arange(end - span.start, dtype=np.int64) % (1 << _POSITION_BITS)
        tag = (number << _POSITION_BITS) | places
        ids[span.start : end] = -1 - ((tag << 32) | (ids[span.start : end] & 0xFFFFFFFF))
    return ids


def token_ids(ids: np.ndarray) -> np.ndarray:
    """The token ids of `match_ids` output."""
    ids = np.asarray(ids, dtype=np.int64)
    return np.where(ids < 0, (-1 - ids) & 0xFFFFFFFF, ids)

"""The engine's block store: opened for one model, named by its identity, drawn by its figures.

The *identity* of a store says whose records it holds (model fingerprint, block size,
record and key formats, layer layout) and what computed their numbers (`software`: MLX,
mlx-lm, mlx-vlm, our kernels, the BLAS core): a persistent store written under another
identity is set aside, never read, and the store's note says why in one line. The
*figures* are what the store view draws of the store now (`Engine.cache_view` adds the
ledger's counts over time).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from mlx_nbengine import _blas, kernels
from mlx_nbengine.cache import RECORD_FORMAT, PrefixCache, blocks, layer_kinds, layer_windows
from mlx_nbengine.cache.persist import SOFTWARE
from mlx_nbengine.cache.store import BlockStore
from mlx_nbengine.engine.ledger import CacheLedger
from mlx_nbengine.kernels import digest
from mlx_nbengine.models import gguf

KINDS_SHOWN = ("kv", "window", "state")


def open_prefix_cache(
    lm: Any,
    *,
    ledger: CacheLedger,
    block_size: int,
    disk_budget: int | None,
    cache_dir: Any,
    persist_dir: str | None,
) -> PrefixCache:
    """The `PrefixCache` of `lm` over a new `BlockStore` (call on the cache-I/O thread),
    its evictions reported to `ledger`."""
    template = lm.make_cache()
    block_store = BlockStore(
        budget_bytes=disk_budget,
        directory=cache_dir,
        on_event=ledger.store_event,
        persist_dir=persist_dir,
        identity=store_identity(lm, template, block_size=block_size),
    )
    prefix = PrefixCache.for_cache(
        template, fingerprint=lm.fingerprint, store=block_store, block_size=block_size
    )
    # What earlier processes saw follow each prefix (a persistent store only).
    for key, parent, ids in block_store.remembered():
        prefix.followers.add(key, parent, ids)

    def lookup(key: str, kind: str) -> tuple[list[int] | None, bool]:
        held = any(block_store.has(key, k) for k in prefix.kinds)
        return prefix.followers.tokens(key), held

    ledger.attach(lookup)
    return prefix


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def software() -> dict[str, str]:
    """What computes a record's numbers in this process, name -> version: the libraries
    (MLX, mlx-lm, mlx-vlm), our kernels (the digest of their sources; the build serving this
    process, with its set) and the BLAS behind MLX's CPU matmuls (its core)."""
    return {
        "MLX": _version("mlx"),
        "mlx-lm": _version("mlx-lm"),
        "mlx-vlm": _version("mlx-vlm"),
        "kernel sources": digest.kernel_sources_digest(),
        "kernel build": kernels.build_identity(),
        "BLAS": _blas.blas_identity(),
    }


def store_identity(lm: Any, template_cache: list, *, block_size: int) -> dict[str, Any]:
    """Whose records a persistent store holds: records written under another identity are
    never read (the store is set aside). The model fingerprint covers config, weights,
    dtype and the routes' variants (named again in ``variant``); `software` what computes
    the numbers; the rest names the formats and the layer layout."""
    key_format = getattr(blocks, "_KEY_VERSION", b"")
    return {
        SOFTWARE: software(),
        "variant": getattr(lm, "variant", None) or "",
        "fingerprint": lm.fingerprint,
        "block_size": block_size,
        "model_type": getattr(lm, "model_type", ""),
        "record_format": RECORD_FORMAT,
        "key_format": key_format.decode() if isinstance(key_format, bytes) else str(key_format),
        "converter": getattr(gguf, "CONVERTER_VERSION", ""),
        "layers": ",".join(layer_kinds(template_cache)),
        "windows": ",".join(str(w) for w in layer_windows(template_cache)),
    }


def store_figures(store: BlockStore | None) -> dict[str, Any]:
    """The store view's figures of `store` now (zeros and backend ``"off"`` for None, or
    for a store closing under the caller); safe from any thread."""
    figures: dict[str, Any] = {
        "blocks_held": 0,
        "records": 0,
        "bytes_held": 0,
        "budget_bytes": 0,
        "file_size": 0,
        "free_bytes": 0,
        "backend": "off",
        "by_kind": {k: {"records": 0, "bytes": 0} for k in KINDS_SHOWN},
    }
    if store is None:
        return figures
    try:
        stats = store.stats()
        held, by_kind = store.census()
    except Exception:  # a store closing under us: show it empty
        return figures
    figures.update(
        blocks_held=held,
        records=stats.records,
        bytes_held=stats.bytes_held,
        budget_bytes=stats.budget_bytes,
        file_size=stats.file_size,
        free_bytes=stats.free_bytes,
        backend=stats.description,
    )
    for kind, (count, nbytes) in by_kind.items():
        figures["by_kind"][kind] = {"records": count, "bytes": nbytes}
    return figures

"""An edited prompt restored from the block store against a cold run of it (the tests of
families whose caches cannot be cut back: tests/engine/test_gemma4_text.py,
tests/integration/test_gated_delta.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_nbengine import Engine


def restored_and_cold(path: Path, cache_dir: Path, prompt: list[int], edited: list[int]) -> Any:
    """`edited`'s 12-token answers (warm, cold): warm after `prompt` was saved to disk and
    another prompt took the hot cache, so `edited` restores from disk; cold without a store."""
    with Engine.load(path, cache_dir=cache_dir) as engine:
        engine.submit(prompt, max_tokens=4).result(timeout=300)
        engine.wait_for_saves(timeout=60)
        engine.submit([2, 7, 7, 7], max_tokens=2).result(timeout=300)  # another hot cache
        warm = engine.submit(edited, max_tokens=12).result(timeout=300)
    with Engine.load(path, store=False) as cold_engine:
        cold = cold_engine.submit(edited, max_tokens=12).result(timeout=300)
    return warm, cold

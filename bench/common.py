"""What every benchmark records: ``bench/results/<name>.json`` (the machine, the run's
settings, its data) and ``<name>.txt`` (the readable table, also printed)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """Where the figures come from (call after MLX is imported the benchmark's way)."""
    import mlx.core as mx

    return {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "mlx": mx.__version__,
    }


def write_results(name: str, data: dict, text: str) -> None:
    """Write ``<name>.json`` (`machine()` + `data`) and ``<name>.txt`` (`text`); print it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({**machine(), **data}, indent=2))
    (RESULTS / f"{name}.txt").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {RESULTS / name}.json and {name}.txt")

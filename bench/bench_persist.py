"""What a persistent block store costs and what it gives back after a restart.

Measures, in one directory (a fresh folder in the system temp folder unless --dir is given):

- *restart to first restored block*: a store of --size bytes (default 1 GiB) of synthetic
  records of --record-mb MB (Gemma 3 270M's 256-token blocks are ~10 MB) is written through
  the store API and closed; then, --restarts times, a fresh Python process imports the store,
  opens it (lock, index replay, free list) and `get`s the most recent record (read and
  checksum). The page cache is not dropped (no root needed): the figure is the store's own
  cost on a warm cache, what a kernel restart on the same machine sees.
- *the cost of durability*: put throughput of --put-records records into a persistent store
  (each put: write the blob, append the index entry; the store's own thread syncs both
  after it) until all are durable (`flush`, in the time), and into the scratch-file store
  (write only), in alternating rounds (--rounds), so a busy machine slows both alike; the
  ratio is persistent / scratch.

Results: bench/results/persist.{json,txt} (see bench/common.py; ``--json PATH``: there);
the table is printed too. ``--quick``: a 32 MiB store of 1 MB records, one restart, one
round, a smoke test in seconds (writes only ``--json``).

    .venv/bin/python -m bench.bench_persist [--size 1GiB] [--record-mb 10] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file, too

from bench.common import add_run_args, fill_sizes, write_results  # noqa: E402
from mlx_nbengine.cache import persist  # noqa: E402
from mlx_nbengine.cache.store import BlockStore  # noqa: E402

MB = 1_000_000
IDENTITY = {"fingerprint": "bench-persist", "block_size": 256, "record_format": "bench"}

RESTART = r"""
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from mlx_nbengine.cache.store import BlockStore
t1 = time.perf_counter()
store = BlockStore(persist_dir=sys.argv[2], identity=json.loads(sys.argv[3]),
                   budget_bytes=int(sys.argv[4]))
t2 = time.perf_counter()
key, kind = store.items()[-1]
data = store.get(key, kind)
t3 = time.perf_counter()
assert data is not None and store.persistent, store.note
records = store.stats().records
store.close()
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "first_get_s": t3 - t2,
                  "close_s": t4 - t3, "records": records, "bytes": len(data)}))
"""


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '300MB', '2G' (binary), or a plain number of bytes."""
    t = text.strip().lower()
    units = {"gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10, "gb": 10**9, "mb": MB, "kb": 1000}
    units |= {"g": 1 << 30, "m": 1 << 20, "k": 1 << 10, "b": 1}
    for suffix, factor in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * factor)
    return int(t)


def records(count: int, nbytes: int, *, tag: str):
    """`count` distinct blobs of `nbytes` (float16 noise, like a K/V slice), made lazily."""
    base = np.random.default_rng(0).standard_normal(nbytes // 2).astype(np.float16).tobytes()
    base = bytearray(base[:nbytes].ljust(nbytes, b"\0"))
    for i in range(count):
        stamp = f"{tag}-{i:08d}".encode()
        base[: len(stamp)] = stamp
        yield f"{tag}-{i:08d}", bytes(base)


def put_all(store: BlockStore, blobs) -> tuple[int, float]:
    moved, start = 0, time.perf_counter()
    for key, data in blobs:
        if not store.put(key, "kv", data):
            raise SystemExit(f"put refused ({store.saving_error or 'over budget'})")
        moved += len(data)
    store.flush()  # a persistent store's records durable: part of what a put costs
    return moved, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_run_args(ap, model=None)
    ap.add_argument("--size", default=None, help="bytes the restarted store holds (1GiB)")
    ap.add_argument("--record-mb", type=float, default=None, help="MB per record (10)")
    ap.add_argument("--put-records", type=int, default=None, help="records per put round (20)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating put rounds (3)")
    ap.add_argument("--restarts", type=int, default=None, help="fresh processes timed (3)")
    ap.add_argument("--dir", default=None, help="where to work (default: the temp folder)")
    args = ap.parse_args(argv)
    fill_sizes(
        args,
        {"size": "1GiB", "record_mb": 10.0, "put_records": 20, "rounds": 3, "restarts": 3},
        {"size": "32MiB", "record_mb": 1.0, "put_records": 4, "rounds": 1, "restarts": 1},
    )

    size = parse_size(args.size)
    record = int(args.record_mb * MB)
    count = max(1, size // record)
    work = Path(tempfile.mkdtemp(prefix="bench-persist-", dir=args.dir))
    budget = 2 * count * record + (64 << 20)
    try:
        # 1. A store of `size` bytes, written and closed.
        store_dir = work / "store"
        with BlockStore(persist_dir=store_dir, identity=IDENTITY, budget_bytes=budget) as store:
            written, fill_s = put_all(store, records(count, record, tag="fill"))
        index_bytes = (store_dir / persist.INDEX_FILE).stat().st_size
        data_bytes = (store_dir / persist.DATA_FILE).stat().st_size

        # 2. Restarts: a fresh process opens it and reads the newest record.
        restarts = []
        for _ in range(args.restarts):
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    RESTART,
                    str(ROOT),
                    str(store_dir),
                    json.dumps(IDENTITY),
                    str(budget),
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                raise SystemExit(done.stderr)
            restarts.append(json.loads(done.stdout))
        med = {k: statistics.median(r[k] for r in restarts) for k in restarts[0]}

        # 3. Durability: put throughput, persistent vs scratch file, alternating rounds.
        speeds: dict[str, list[float]] = {"persistent": [], "scratch": []}
        for round_no in range(args.rounds):
            for name in ("persistent", "scratch"):
                target = work / f"{name}-{round_no}"
                target.mkdir()
                options = (
                    {"persist_dir": target / "store", "identity": IDENTITY}
                    if name == "persistent"
                    else {"directory": target}
                )
                with BlockStore(budget_bytes=budget, **options) as store:
                    moved, seconds = put_all(
                        store, records(args.put_records, record, tag=f"{name}{round_no}")
                    )
                speeds[name].append(moved / seconds / MB)
                shutil.rmtree(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    persistent_mbps = statistics.median(speeds["persistent"])
    scratch_mbps = statistics.median(speeds["scratch"])
    restart_s = med["open_s"] + med["first_get_s"]
    data = {
        "settings": {
            "size_bytes": written,
            "record_bytes": record,
            "records": count,
            "put_records": args.put_records,
            "rounds": args.rounds,
            "restarts": args.restarts,
            "dir": "temp folder" if args.dir is None else "given",
            "quick": args.quick,
        },
        "store": {
            "fill_seconds": fill_s,
            "fill_MBps": written / fill_s / MB,
            "index_bytes": index_bytes,
            "data_bytes": data_bytes,
        },
        "restart": {
            "runs": restarts,
            "median": med,
            "open_plus_first_get_s": restart_s,
            "with_import_s": restart_s + med["import_s"],
        },
        "put": {
            "persistent_MBps": speeds["persistent"],
            "scratch_MBps": speeds["scratch"],
            "persistent_median_MBps": persistent_mbps,
            "scratch_median_MBps": scratch_mbps,
            "ratio_persistent_over_scratch": persistent_mbps / scratch_mbps,
        },
    }

    def rounds(name: str) -> str:
        return ", ".join(f"{v:,.0f}" for v in speeds[name])

    rows = [
        ("store written", f"{written / 2**30:.2f} GiB in {count} records of {record / MB:.1f} MB"),
        ("  fill (persistent puts)", f"{fill_s:.2f} s, {written / fill_s / MB:,.0f} MB/s"),
        ("  index / data file", f"{index_bytes:,} B / {data_bytes / 2**30:.2f} GiB"),
        ("restart, median of", f"{args.restarts} fresh processes"),
        ("  import the store", f"{med['import_s'] * 1e3:,.1f} ms"),
        ("  open (lock, replay)", f"{med['open_s'] * 1e3:,.2f} ms"),
        ("  first get (read+check)", f"{med['first_get_s'] * 1e3:,.2f} ms"),
        ("  open + first get", f"{restart_s * 1e3:,.2f} ms"),
        ("  close (compaction)", f"{med['close_s'] * 1e3:,.2f} ms"),
        ("put, persistent", f"{persistent_mbps:,.0f} MB/s (rounds: {rounds('persistent')})"),
        ("put, scratch file", f"{scratch_mbps:,.0f} MB/s (rounds: {rounds('scratch')})"),
        ("  persistent / scratch", f"{persistent_mbps / scratch_mbps:.2f}x"),
    ]
    width = max(len(k) for k, _ in rows)
    text = "bench_persist: the persistent block store\n\n" + "\n".join(
        f"{k.ljust(width)}  {v}" for k, v in rows
    )
    write_results("persist", data, text, json_path=args.json, quick=args.quick)


if __name__ == "__main__":
    main()

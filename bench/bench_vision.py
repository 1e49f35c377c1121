"""Image prompts: the same high-resolution image prompt sent twice, and a new question.

The reference engine's headline: a repeated high-resolution image prompt comes back about
3.5x faster from its cache. Here, per tiny vision model (`mlx_nbengine.testing`: ``qwen2_vl``,
causal image tokens; ``gemma4``, image tokens attending both ways), in one run:

- *first*: the image prompt on a fresh engine (processor, vision tower, prefill), one
  generated token;
- *repeat (memory)*: the same prompt again at once (the hot cache);
- *repeat (disk)*: the same prompt after another request took the hot cache (the store);
- *new question*: the same image with another question (restored up to the question).

Each time is wall time from ``submit`` to the result, the processor included, median of
``--repeats`` rounds (each round on a fresh engine). *speed-up* is first / that time;
targets: the repeat at least 5x, the new question at least 3x. *bytes/image block* is
what the store holds per block that overlaps the image (all record kinds). The picture is
``--size`` pixels square (a smooth gradient with noise); the processors resize it to their
limit, set for ``--image-tokens`` image tokens (qwen2_vl's ``max_pixels``, gemma4's
``max_soft_tokens``).

Results: ``bench/results/vision.json`` and ``vision.txt`` (``--json PATH``: there). Run from
the repository root:
``.venv/bin/python -m bench.bench_vision [--size 2048] [--repeats 3] [--image-tokens 1024]``;
``--model DIR`` measures that vision model (as it is) instead of the tiny families;
``--quick`` (a smoke test, seconds): a 256-pixel picture, 64 image tokens, blocks of 32,
one round, writing only ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlx_nbengine._blas import ensure_fast_blas

ensure_fast_blas()

import numpy as np  # noqa: E402

from bench.common import add_run_args, fill_sizes, write_results  # noqa: E402
from mlx_nbengine.engine import Engine  # noqa: E402
from mlx_nbengine.testing import make_tiny_model  # noqa: E402

PRE = "You are looking at a photograph taken on a long walk along the coast. "
QUESTION = "What is in this picture? Describe it."
NEW_QUESTION = "Which colours stand out most in this picture, and where?"


def picture(size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([x, y, (x + y) / 2], axis=-1) * 200
    return np.clip(base + rng.rand(size, size, 3) * 55, 0, 255).astype("uint8")


def chat(question: str) -> list[dict]:
    parts = [{"type": "text", "text": PRE}, {"type": "image"}, {"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]


def model_dir(family: str, root: Path, image_tokens: int) -> Path:
    path = make_tiny_model(family, root / family)
    if family == "qwen2_vl":
        config_path = path / "preprocessor_config.json"
        config = json.loads(config_path.read_text())
        config["max_pixels"] = 28 * 28 * image_tokens
        config_path.write_text(json.dumps(config, indent=2))
    elif family == "gemma4":
        config_path = path / "processor_config.json"
        config = json.loads(config_path.read_text())
        config["image_seq_length"] = image_tokens
        config["image_processor"]["max_soft_tokens"] = image_tokens
        config_path.write_text(json.dumps(config, indent=2))
        model_config = json.loads((path / "config.json").read_text())
        model_config["vision_soft_tokens_per_image"] = image_tokens
        model_config["vision_config"]["default_output_length"] = image_tokens
        (path / "config.json").write_text(json.dumps(model_config, indent=2))
    return path


def timed(engine: Engine, prompt: list[dict], image: np.ndarray) -> tuple[float, object]:
    t = time.perf_counter()
    done = engine.submit(prompt, images=[image], max_tokens=1).result()
    return time.perf_counter() - t, done


def one_round(path: Path, image: np.ndarray, block_size: int) -> dict:
    engine = Engine.load(path, block_size=block_size)
    try:
        first, done = timed(engine, chat(QUESTION), image)
        span = done.report.images[0]
        repeat_memory, again = timed(engine, chat(QUESTION), image)
        engine.submit("Something else entirely.", max_tokens=1).result()
        repeat_disk, from_disk = timed(engine, chat(QUESTION), image)
        engine.submit("Something else again.", max_tokens=1).result()
        new_question, asked = timed(engine, chat(NEW_QUESTION), image)
        view = engine.cache_view()
        stats = engine.stats()
        image_blocks = [b for b in done.report.blocks if b.images]
        return {
            "prompt_tokens": len(done.prompt_tokens),
            "image_tokens": span.end - span.start,
            "image_blocks": len(image_blocks),
            "first_s": first,
            "repeat_memory_s": repeat_memory,
            "repeat_disk_s": repeat_disk,
            "new_question_s": new_question,
            "restored": {
                "repeat_memory": again.report.restored_tokens,
                "repeat_disk": from_disk.report.restored_tokens,
                "new_question": asked.report.restored_tokens,
            },
            "same_token": again.tokens == done.tokens == from_disk.tokens,
            "bytes_per_block": view["bytes_held"] / max(1, view["blocks_held"]),
            "vision_encodes": stats.get("vision_encodes"),
        }
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(parser, model="the tiny vision families")
    parser.add_argument("--size", type=int, default=None, help="picture side in pixels (2048)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds, median of (3)")
    parser.add_argument("--block-size", type=int, default=None, help="block size (256)")
    parser.add_argument("--image-tokens", type=int, default=None, help="per picture (1024)")
    parser.add_argument("--families", default="qwen2_vl,gemma4")
    args = parser.parse_args(argv)
    fill_sizes(
        args,
        {"size": 2048, "repeats": 3, "block_size": 256, "image_tokens": 1024},
        {"size": 256, "repeats": 1, "block_size": 32, "image_tokens": 64},
    )
    image = picture(args.size)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = [Path(args.model).name] if args.model else args.families.split(",")
        for family in models:
            if args.model:
                path = Path(args.model)
            else:
                path = model_dir(family, Path(tmp), args.image_tokens)
            one_round(path, image, args.block_size)  # warm-up: imports, first compilations
            rounds = [one_round(path, image, args.block_size) for _ in range(args.repeats)]
            med = {
                k: statistics.median(r[k] for r in rounds)
                for k in ("first_s", "repeat_memory_s", "repeat_disk_s", "new_question_s")
            }
            rows[family] = {"median": med, "rounds": rounds}
    lines = [
        f"Image prompt twice and a new question ({args.size}x{args.size} picture, blocks of "
        f"{args.block_size}, one generated token, median of {args.repeats})",
        "",
        "| model | image tokens | first | repeat (memory) | repeat (disk) | new question "
        "| bytes/image block |",
        "|---|---|---|---|---|---|---|",
    ]
    for family, row in rows.items():
        med, r0 = row["median"], row["rounds"][0]

        def cell(key: str, med=med) -> str:
            return f"{med[key]:.3f} s ({med['first_s'] / med[key]:.1f}x)"

        lines.append(
            f"| tiny {family} | {r0['image_tokens']} of {r0['prompt_tokens']} "
            f"| {med['first_s']:.3f} s | {cell('repeat_memory_s')} | {cell('repeat_disk_s')} "
            f"| {cell('new_question_s')} | {r0['bytes_per_block'] / 1024:.0f} KiB |"
        )
    lines += [
        "",
        "Targets: repeat at least 5x, new question at least 3x faster than the first.",
    ]
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_results(
        "vision",
        {"args": settings, "rows": rows},
        "\n".join(lines),
        json_path=args.json,
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

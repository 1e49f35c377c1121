"""CPU kernels of our own, as MLX primitives: quantized matrix-vector products and attention.

MLX's CPU kernels for its quantized format are scalar on x86, slower than a float32
matrix-vector product; decode is bound by the bytes of weights read per token, so 8-bit and
4-bit weights should decode two to four times faster than float32. These kernels compute
``x @ dequantize(w, scales, biases).T`` for 1 to `MAX_ROWS` rows of ``x`` (a decode step)
straight from the packed weights, as an MLX primitive on the CPU device; the vectorized
sets take more rows too (a prefill step: an integer GEMM on int16 x; past the set's
`gemm_tile_rows`, 96 rows where the CPU lacks AVX-512 VNNI, the weights dequantized a tile
at a time onto the BLAS; past 96 rows, a *long step*, int8 x on request: `long_products`).

`attention` is scaled-dot-product attention (``mx.fast.scaled_dot_product_attention``'s
function, plus sliding windows and soft-capping): its two products on the BLAS, the softmax
ours, vectorized and tiled over keys with a running max and sum (see src/attention.h).

*Kernel sets* (``isa``): ``avx512`` (AVX-512F), ``avx2`` (AVX2 + FMA) and ``portable``
(plain C++). The CPU that runs them decides (cpuid), never the build machine: a set the
CPU lacks falls to the next one. Each product splits its output columns (attention: its
softmax rows; its products are the BLAS's) over the BLAS thread count the engine's thread
policy chose for the step in progress (`_blas.current_threads`, `_blas.ThreadPolicy`).

*The switch*, ``MLX_NBENGINE_KERNELS``: ``auto`` (the default: the best set this CPU has,
on Linux), ``avx512``, ``avx2`` or ``portable`` (force a set, falling down where the CPU
lacks it), ``off`` (MLX's own kernels). The module is compiled at first use (`build`);
where it cannot be built or does not compute right, everything runs on MLX's kernels as
before and one line on stderr says why (one line for both kinds of kernel).

*Long steps*, ``MLX_NBENGINE_LONG_PRODUCTS``: ``auto`` (the default, now ``int16``),
``int16`` (the int16 tiles up to `gemm_tile_rows`, then the BLAS), ``blas`` (the weights
dequantized onto the BLAS past 96 rows on every set, as a CPU without VNNI runs them) or
``int8``: x rounded to int8 per row and group, on every set (AVX-512 VNNI's vpdpbusd, the
int16 tiles on int8 values, or plain C++ on the portable set, all the same bits). int8 runs a
long step's products 1.6-2.2x faster than the BLAS where the CPU has VNNI
(`gemm_int8_fast`), but costs the default model about 1.5 points of top-1 agreement with
float32 (tests/integration/test_default_q8.py), under the 8-bit decode path's; so it is
asked for, not chosen, until it holds that path's accuracy. The model's variant names the
choice (`models.qroute.variant`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np

from mlx_nbengine import _blas
from mlx_nbengine.kernels import build as _build

__all__ = [
    "ACTIVATIONS",
    "BITS",
    "GROUP_SIZES",
    "MAX_ROWS",
    "MODE_ENV",
    "LONG_PRODUCTS_ENV",
    "KernelStatus",
    "attention",
    "attention_isa",
    "block_tail",
    "build_identity",
    "gated_mlp",
    "gemm_available",
    "gemm_int8_fast",
    "gemm_pack",
    "gemm_tile_rows",
    "join_tokens",
    "long_products",
    "qkv_step",
    "quantized_matmul",
    "status",
    "supports",
    "usable_isa",
]

MODE_ENV = "MLX_NBENGINE_KERNELS"
MODES = ("auto", "avx512", "avx2", "portable", "off")
LONG_PRODUCTS_ENV = "MLX_NBENGINE_LONG_PRODUCTS"
LONG_PRODUCTS = ("auto", "int16", "blas", "int8")
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# Rows of x the portable set takes (a decode step, a short prefill step in blocks of 8). The
# vectorized sets take any number (`gemm_available`): past 8 rows an integer GEMM, past
# 96 the weights dequantized a tile at a time onto the BLAS (src/qgemm.h).
MAX_ROWS = 64


@dataclass(frozen=True)
class KernelStatus:
    """Whether the kernels serve this process: ``isa`` is the set chosen, None when off."""

    active: bool
    reason: str
    isa: str | None = None
    module: str | None = None


_status: KernelStatus | None = None
_module: ModuleType | None = None


def _mode() -> str:
    mode = os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    return mode if mode in MODES else "invalid"


def _import(path: os.PathLike) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_build.MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _self_check(module: ModuleType, isa: str) -> None:
    """Compute one small product of each width against MLX; raise if it is not right."""
    key = mx.random.key(0)
    w = mx.random.normal((37, 256), key=key, stream=mx.cpu)
    x = mx.random.normal((3, 256), key=mx.random.key(1), stream=mx.cpu)
    for bits in BITS:
        q, s, b = mx.quantize(w, group_size=64, bits=bits, stream=mx.cpu)
        want = x @ mx.dequantize(q, s, b, group_size=64, bits=bits, stream=mx.cpu).T
        got = module.quantized_matvec(x, q, s, b, 64, bits, isa, 1)
        # The vectorized sets round x to int16 per group (qkernels.h): about 1e-3 off here.
        if not mx.allclose(got, want, rtol=1e-3, atol=1e-2, stream=mx.cpu).item():
            raise ValueError(f"the {isa} kernels computed a wrong {bits}-bit product")
    q = mx.random.normal((1, 4, 5, 32), key=mx.random.key(2), stream=mx.cpu)
    k = mx.random.normal((1, 2, 40, 32), key=mx.random.key(3), stream=mx.cpu)
    v = mx.random.normal((1, 2, 40, 32), key=mx.random.key(4), stream=mx.cpu)
    with mx.stream(mx.cpu):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    attention_set = module.attention_isa(isa)
    got = module.attention(q, k, v, None, 0.2, True, 0, 0.0, attention_set, 1)
    if not mx.allclose(got, want, rtol=1e-4, atol=1e-5, stream=mx.cpu).item():
        raise ValueError(f"the {attention_set} attention kernels computed a wrong result")


def _setup() -> KernelStatus:
    global _module
    mode = _mode()
    if mode == "invalid":
        reason = f"{MODE_ENV} must be one of {', '.join(MODES)}"
        print(f"mlx_nbengine: CPU kernels not used ({reason})", file=sys.stderr)
        return KernelStatus(False, reason)
    if mode == "off":
        return KernelStatus(False, f"{MODE_ENV}=off: MLX's own quantized kernels")
    if not sys.platform.startswith("linux"):
        return KernelStatus(False, "not Linux: MLX's own quantized kernels")
    try:
        path = _build.build()
        module = _import(path)
        isa = module.usable_isa("avx512" if mode == "auto" else mode)
        _self_check(module, isa)
    except Exception as e:  # noqa: BLE001 - a kernel problem must never stop a model
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(
            f"mlx_nbengine: CPU kernels not used ({reason}); quantized kernels and "
            "attention fall back to MLX's slower ones",
            file=sys.stderr,
        )
        return KernelStatus(False, f"not built: {reason}")
    _module = module
    return KernelStatus(True, f"compiled kernels, {isa}", isa=isa, module=str(path))


def status() -> KernelStatus:
    """Set the kernels up once (build, import, check) and say what happened; never raises."""
    global _status
    if _status is None:
        _status = _setup()
    return _status


def build_identity() -> str:
    """The build key of the module serving this process (`build.build_key`: its sources, MLX,
    nanobind, Python, the compiler) and the set chosen, or "not used" where the kernels do
    not serve it (never set up, off, refused); builds nothing."""
    if _status is None or not _status.active or _status.module is None:
        return "not used"
    return f"{Path(_status.module).parent.name} {_status.isa}"


def usable_isa(isa: str) -> str | None:
    """The kernel set that runs when `isa` is asked for on this CPU (a lesser one where the
    CPU lacks it); None where the kernels are not active."""
    if not status().active:
        return None
    return _module.usable_isa(isa)


def gemm_available(isa: str | None = None) -> bool:
    """Whether products of any number of rows run on the kernels with set `isa` (default:
    the one `status` chose): the vectorized sets; the portable one takes `MAX_ROWS`."""
    if not status().active:
        return False
    return bool(_module.gemm_available(isa or _status.isa))


def gemm_tile_rows(isa: str | None = None) -> int:
    """The most rows of x a product with set `isa` (default: the one `status` chose)
    multiplies on its int16 tiles (4,096 where the CPU has AVX-512 VNNI: every step the
    engine makes; else 96); past them, the BLAS's product of the weights dequantized (or a
    long step's int8 product). 0 where the set has no GEMM or the kernels are off."""
    if not status().active:
        return 0
    return int(_module.gemm_tile_rows(isa or _status.isa))


def gemm_pack(
    x: np.ndarray, group_size: int, *, int8: bool, per_word: int, isa: str, vector: bool
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """x (float32, M x K) rounded and laid out as set `isa`'s GEMM tiles read it (src/qgemm.h,
    ``qgemm_pack``): (lanes, words int32, scales, sums), with the set's vectorized packing
    (`vector`) or the scalar loop it restates, for the tests to compare. Raises RuntimeError
    where the kernels are not active."""
    if _module is None and not status().active:
        raise RuntimeError(f"the quantized kernels are not active: {status().reason}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    lanes, words, scales, sums = _module.gemm_pack(
        x.tobytes(), rows, k, group_size, per_word, int8, isa, vector
    )
    return (
        lanes,
        np.frombuffer(words, dtype=np.int32),
        np.frombuffer(scales, dtype=np.float32),
        np.frombuffer(sums, dtype=np.float32),
    )


def gemm_int8_fast(isa: str | None = None) -> bool:
    """Whether set `isa` (default: the one `status` chose) multiplies int8 at VNNI's rate on
    this CPU, where a long step's int8 product beats the BLAS."""
    if not status().active:
        return False
    return bool(_module.gemm_int8_fast(isa or _status.isa))


_refused_long: set[str] = set()


def long_products() -> str:
    """How a long step's products run: ``"int16"``, ``"blas"`` or ``"int8"``, as
    `LONG_PRODUCTS_ENV` asks (``auto``: int16, see the module docstring); another value is
    ``auto``, and one stderr line says so."""
    asked = os.environ.get(LONG_PRODUCTS_ENV, "").strip().lower() or "auto"
    if asked not in LONG_PRODUCTS:
        if asked not in _refused_long:
            _refused_long.add(asked)
            print(
                f"mlx_nbengine: {LONG_PRODUCTS_ENV}={asked!r} is not one of "
                f"{', '.join(LONG_PRODUCTS)}; using auto",
                file=sys.stderr,
            )
        asked = "auto"
    return "int16" if asked == "auto" else asked


def join_tokens(parts: list[np.ndarray], tokens: int, dtype: mx.Dtype) -> mx.array:
    """`parts`, numpy arrays [B, H, n, D] of `dtype`'s item size (bfloat16 held as uint16) that
    differ only in n and have their last axis contiguous, joined along axis 2 into a new MLX
    array of `tokens` tokens (at least their sum) of `dtype`, zeros after them: each part
    copied once, and no byte written before (what ``mx.zeros`` and a copy would cost twice).
    The copy is exact, the same on every kernel set. Raises RuntimeError where the kernels
    are not active, ValueError for parts that do not fit."""
    if _module is None and not status().active:
        raise RuntimeError(f"the CPU kernels are not active: {status().reason}")
    if not parts:
        raise ValueError("join_tokens: no parts")
    b, h, _, d = parts[0].shape
    slices = []
    for a in parts:
        if (
            a.ndim != 4
            or (a.shape[0], a.shape[1], a.shape[3]) != (b, h, d)
            or a.itemsize != dtype.size
            or (d > 1 and a.strides[3] != a.itemsize)
        ):
            raise ValueError(f"join_tokens: a part of shape {a.shape} does not fit")
        address = a.__array_interface__["data"][0]
        slices.append((address, a.strides[0], a.strides[1], a.strides[2], a.shape[2]))
    return _module.join_tokens(slices, b, h, tokens, d, dtype)


def supports(*, bits: int, group_size: int, mode: str = "affine") -> bool:
    """Whether weights quantized this way can use the kernels (on a CPU where they are active)."""
    return mode == "affine" and bits in BITS and group_size in GROUP_SIZES


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    isa: str | None = None,
    threads: int | None = None,
    long_products: str = "int16",
) -> mx.array:
    """``x @ dequantize(w, scales, biases).T`` on our kernels, for 1 to `MAX_ROWS` rows of x,
    or any number where `gemm_available` or `long_products` is ``"int8"`` (a prefill step).

    Like ``mx.quantized_matmul(..., transpose=True)`` with MLX's affine mode. `isa` forces a
    kernel set (default: the one `status` chose); `threads` defaults to the engine's BLAS
    thread count for the step; `long_products` (``"int16"``: the int16 tiles up to
    `gemm_tile_rows`, then the BLAS; ``"blas"``: the BLAS; or ``"int8"``) says how a step of
    more than 96 rows multiplies (``"int8-pairs"``: int8 on the set's int16 tiles, never its
    VNNI quads, the same bits: the tests' switch for a CPU without VNNI). Raises RuntimeError
    where the kernels are not active.
    """
    if _module is None and not status().active:
        raise RuntimeError(f"the quantized kernels are not active: {status().reason}")
    return _module.quantized_matvec(
        x,
        w,
        scales,
        biases,
        group_size,
        bits,
        isa or _status.isa,
        threads or _blas.current_threads(),
        long_products,
    )


ACTIVATIONS = ("gelu_tanh", "silu")


def gated_mlp(
    x: mx.array,
    gate: tuple[mx.array, mx.array, mx.array],
    up: tuple[mx.array, mx.array, mx.array],
    down: tuple[mx.array, mx.array, mx.array],
    *,
    group_size: int,
    bits: int,
    activation: str,
    isa: str | None = None,
    threads: int | None = None,
) -> mx.array:
    """``down(act(x @ gate.T) * (x @ up.T))`` on our kernels as one primitive, for 1 to 8
    rows of float32 x; `gate`, `up` and `down` are each (weight, scales, biases) of MLX's
    affine layout with the same `group_size` and `bits`; `activation` one of `ACTIVATIONS`
    (GELU's tanh approximation, or x * sigmoid(x)). `isa` and `threads` as in
    `quantized_matmul`. Raises RuntimeError where the kernels are not active."""
    if _module is None and not status().active:
        raise RuntimeError(f"the quantized kernels are not active: {status().reason}")
    return _module.gated_mlp(
        x,
        *gate,
        *up,
        *down,
        group_size,
        bits,
        activation,
        isa or _status.isa,
        threads or _blas.current_threads(),
    )


def qkv_step(
    x: mx.array,
    q: tuple[mx.array, mx.array, mx.array],
    k: tuple[mx.array, mx.array, mx.array] | None,
    v: tuple[mx.array, mx.array, mx.array] | None,
    *,
    q_norm: mx.array,
    k_norm: mx.array | None,
    eps: float,
    x_norm: mx.array | None = None,
    x_eps: float = 0.0,
    heads: int,
    kv_heads: int,
    rope_dims: int,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    group_size: int,
    bits: int,
    freqs: mx.array | None = None,
    v_norm: bool = False,
    isa: str | None = None,
    threads: int | None = None,
) -> tuple[mx.array, ...]:
    """A decode step's attention heads as one primitive (src/qkv_step.h): for x [B, L, K]
    (float32, at most 8 rows) and the quantized q, k and v projections ((weight, scales,
    biases), one `group_size` and `bits`), ``(rope(rms_norm(q heads, q_norm)),
    rope(rms_norm(k heads, k_norm)), v heads)``, each [B, H, L, D], at positions `offset` + t
    (an int, or an int array of one offset or one per batch row); with `x_norm` ([K]), x
    is first ``rms_norm(x, x_norm, x_eps)`` (the layer's input norm). Without k, v and
    k_norm (a layer reading an earlier layer's keys and values), ``(rope(rms_norm(q)),)``.
    `v_norm`: the value heads are ``rms_norm(v, None, eps)`` (Gemma 4). RoPE's frequencies
    are `base`'s, or `freqs` ([rope_dims / 2], as ``mx.fast.rope`` takes them) where given.
    The same bits as the norms, products and RoPE one by one (`quantized_matmul`, `rowops`).
    `isa` and `threads` as in `quantized_matmul`."""
    if _module is None and not status().active:
        raise RuntimeError(f"the quantized kernels are not active: {status().reason}")
    if not isinstance(offset, mx.array):
        offset = mx.array(int(offset), dtype=mx.int32)
    if (base is None) == (freqs is None):
        raise ValueError("qkv_step: give exactly one of base and freqs")
    return _module.qkv_step(
        x,
        *q,
        *(k or (None, None, None)),
        *(v or (None, None, None)),
        q_norm,
        k_norm,
        offset,
        x_norm,
        float(x_eps),
        int(heads),
        int(kv_heads),
        float(eps),
        int(rope_dims),
        bool(traditional),
        float(base or 0.0),
        float(scale),
        freqs,
        bool(v_norm),
        int(group_size),
        int(bits),
        isa or _status.isa,
        threads or _blas.current_threads(),
    )


def block_tail(
    attn: mx.array,
    x: mx.array,
    o: tuple[mx.array, mx.array, mx.array],
    gate: tuple[mx.array, mx.array, mx.array],
    up: tuple[mx.array, mx.array, mx.array],
    down: tuple[mx.array, mx.array, mx.array],
    *,
    post_attn_norm: mx.array,
    pre_ffn_norm: mx.array,
    post_ffn_norm: mx.array,
    eps: float,
    group_size: int,
    bits: int,
    activation: str,
    per_layer_input: mx.array | None = None,
    per_layer_gate: tuple[mx.array, mx.array, mx.array] | None = None,
    per_layer_projection: tuple[mx.array, mx.array, mx.array] | None = None,
    post_per_layer_norm: mx.array | None = None,
    scalar: mx.array | None = None,
    isa: str | None = None,
    threads: int | None = None,
) -> mx.array:
    """A decode step's layer after attention as one primitive (src/block_tail.h): for the
    attention output `attn` [B, H, L, D] and the layer's input `x` [B, L, K] (float32, at
    most 8 rows), ``h = x + rms_norm(o(attn rows), post_attn_norm)`` then
    ``out = h + rms_norm(mlp(rms_norm(h, pre_ffn_norm)), post_ffn_norm)``, mlp as in
    `gated_mlp`; every matrix (weight, scales, biases) with one `group_size` and `bits`, the
    norms' weights [K] as the norms scale by them. The same bits as those operations one by
    one. Gemma 4's tail, where given: ``out + rms_norm(per_layer_projection(act(
    per_layer_gate(out)) * per_layer_input), post_per_layer_norm)`` (`per_layer_input`
    [B, L, P]), then ``* scalar`` ([1]). `isa` and `threads` as in `quantized_matmul`."""
    if _module is None and not status().active:
        raise RuntimeError(f"the quantized kernels are not active: {status().reason}")
    return _module.block_tail(
        attn,
        x,
        *o,
        post_attn_norm,
        pre_ffn_norm,
        *gate,
        *up,
        *down,
        post_ffn_norm,
        per_layer_input,
        *(per_layer_gate or (None, None, None)),
        *(per_layer_projection or (None, None, None)),
        post_per_layer_norm,
        scalar,
        float(eps),
        int(group_size),
        int(bits),
        activation,
        isa or _status.isa,
        threads or _blas.current_threads(),
    )


def attention_isa(isa: str | None = None) -> str | None:
    """The attention kernel set that runs when `isa` is asked for (default: the set the switch
    chose) on this CPU; None where the kernels are not active."""
    if not status().active:
        return None
    return _module.attention_isa(isa or _status.isa)


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | None = None,
    causal: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    isa: str | None = None,
    threads: int | None = None,
) -> mx.array:
    """``softmax(scale * q @ k.T [masked]) @ v`` on our kernels, float32, on the CPU.

    `queries` [B, Hq, L, D], `keys` [B, Hkv, S, D] and `values` [B, Hkv, S, Dv] with Hq a
    multiple of Hkv (grouped-query heads); query i sits at absolute position S - L + i.
    `causal`: a query sees the keys up to its own position; `window` (> 0, with causal): and
    only those after ``position - window``; `mask`: a bool array broadcastable to
    [B, Hq, L, S], True where a key is visible; `softcap` (> 0): scores become
    ``softcap * tanh(score / softcap)`` before the mask. A query that sees no key gets the
    mean of all values, as MLX gives it.
    `isa` forces a kernel set; `threads` (the softmax's) defaults to the engine's BLAS thread
    count. Raises RuntimeError where the kernels are not active.
    """
    if _module is None and not status().active:
        raise RuntimeError(f"the CPU kernels are not active: {status().reason}")
    return _module.attention(
        queries,
        keys,
        values,
        mask,
        float(scale),
        bool(causal or window > 0),
        int(window),
        float(softcap),
        isa or _status.isa,
        threads or _blas.current_threads(),
    )

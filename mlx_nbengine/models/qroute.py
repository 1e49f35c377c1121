"""Route MLX's quantized layers to our kernels on the CPU: the routes of quantized products.

Three kinds of `routes.InstanceRoute`, applied to one model's modules (`route`), never to
the library's classes:

- `LINEAR` (``QuantizedLinear.__call__``): every projection of an MLX-quantized model;
- `EMBEDDING_HEAD` (``QuantizedEmbedding.as_linear``): the output head of a model whose head
  is tied to its quantized embedding (Gemma's);
- `SWIGLU_MLPS` (mlx-lm's llama / qwen2 / qwen3 ``MLP.__call__`` and Qwen 3.5's
  ``Qwen3NextMLP.__call__``): a decode step's MLP of quantized projections as one primitive
  (`routed_gated_mlp`: the gate and up products, the activation and the down product, in one
  graph node), a longer step's activation as one pass of `rowops.silu_mul`; Gemma's GELU MLPs
  reach the first through `cpu_math`.

A *routed* call is one whose weights our kernels handle (affine mode, 4 or 8 bits, group
32, 64 or 128) on the CPU device, with any number of rows where the kernel set has its GEMM
(`kernels.gemm_available`: the vectorized sets), else at most `kernels.MAX_ROWS` (64): a
decode step on the row kernels; an edit's tail on the integer GEMM (faster there than MLX's
dequantize + matmul); a long prefill step (more than 96 rows) as `kernels.long_products`
says: int16 x on the same GEMM up to the set's `kernels.gemm_tile_rows` and past them the
weights dequantized by our kernels a tile at a time onto the BLAS, or always the BLAS, or
int8 x times the weights (never for the output head). A longer step of the portable set dequantizes with
MLX and multiplies on the BLAS, much faster on the CPU than ``mx.quantized_matmul`` (the
README's "Quantized weights on the CPU" gives the figures), unless int8 is forced; anything
else (other modes, the GPU) calls the library's own method.
Each route applies only while the library's body is the one restated (`routes.Body`); an
MLX that changes them keeps its own and one line says so; tests/test_qkernels.py fails
loudly on such an MLX.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from mlx_nbengine import kernels
from mlx_nbengine._blas import note_kernel_products
from mlx_nbengine.kernels import digest, rowops
from mlx_nbengine.models.routes import Body, InstanceRoute, Routing

__all__ = [
    "EMBEDDING_HEAD",
    "LINEAR",
    "SWIGLU_MLPS",
    "VARIANT_SOURCES",
    "has_quantized_layers",
    "product_arrays",
    "quantize_for_cpu",
    "route",
    "routed_gated_mlp",
    "routed_matmul",
    "usable",
    "variant",
]

# The files that decide the bits of a routed product (`variant` is their digest, so a change
# to any of them names itself in the fingerprint): this module, the row kernels, the integer
# GEMM, the gated MLP (its GELU's tanh in attention_math.h) and a prefill step's SwiGLU
# activation (the row primitives).
VARIANT_SOURCES = (
    "models/qroute.py",
    "kernels/rowops.py",
    *digest.COMMON,
    *digest.kernel_source(
        "qmatvec.h",
        "qmatvec.cpp",
        "qkernels.h",
        "qkernels_portable.cpp",
        "qkernels_x86.cpp",
        "qkernels_x86_body.h",
        "qgemm.h",
        "qgemm.cpp",
        "qgemm_x86.cpp",
        "qgemm_x86_body.h",
        "qgemm_x86_pack.h",
        "qgemm_x86_quads.h",
        "gated_mlp.h",
        "gated_mlp.cpp",
        "attention_math.h",
        "rowops.h",
        "rowops.cpp",
        "rowops_bindings.cpp",
    ),
)

CHECKED_WITH = "mlx 0.32.4, mlx-lm 0.32.2"

_QUANTIZED_MATMUL = """\
mx.quantized_matmul(
    x,
    self["weight"],
    scales=self["scales"],
    biases=self.get("biases"),
    transpose=True,
    group_size=self.group_size,
    bits=self.bits,
    mode=self.mode,
)"""


# A quantized layer's scales and biases as float16, where that holds them exactly (every
# group on a block format's grid, `quantize_for_cpu`): what our kernels read in its products
# (the same values, so the same bits, in fewer bytes a step). Held on the layer itself (it
# goes with the model; not a parameter, so the library's own paths keep float32).
_HALF_ATTRIBUTE = "_mlx_nbengine_half_scales"


def product_arrays(layer: Any) -> tuple[mx.array, mx.array, mx.array]:
    """(weight, scales, biases) of a quantized layer as our kernels read them: the float16
    copies `quantize_for_cpu` made where they are exact, else the layer's own."""
    half = layer.__dict__.get(_HALF_ATTRIBUTE)
    if half is not None and half[0] is layer["scales"]:
        return layer["weight"], half[1], half[2]
    return layer["weight"], layer["scales"], layer["biases"]


def routed_matmul(layer: Any, x: mx.array, *, head: bool = False) -> mx.array | None:
    """``x @ W.T`` of a quantized layer on our kernels or dequantized on the BLAS; None where
    the layer's own method should run (see the module docstring). The output `head` never
    takes int8 x: its logits are what is sampled, and a prefill step runs it on one row a
    sequence, where int8 would gain nothing."""
    if (
        layer.mode != "affine"
        or "biases" not in layer
        or not kernels.supports(bits=layer.bits, group_size=layer.group_size)
        or mx.default_device() != mx.cpu
    ):
        return None
    rows = x.size // x.shape[-1] if x.ndim else 0
    # Read only for a step past the row kernels' rows: a decode step's products never ask.
    long_products = kernels.long_products() if rows > kernels.MAX_ROWS else "int16"
    if head and long_products == "int8":
        long_products = "int16"
    if 1 <= rows <= kernels.MAX_ROWS or (
        rows > kernels.MAX_ROWS and (kernels.gemm_available() or long_products == "int8")
    ):
        note_kernel_products()  # the decode steps' threads are ours, not OpenBLAS's
        return kernels.quantized_matmul(
            x,
            *product_arrays(layer),
            group_size=layer.group_size,
            bits=layer.bits,
            long_products=long_products,
        )
    w, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    dense = mx.dequantize(w, scales, biases, group_size=layer.group_size, bits=layer.bits)
    return x @ dense.T.astype(x.dtype)


def routed_gated_mlp(mlp: Any, x: mx.array, activation: str) -> mx.array | None:
    """``down(act(gate(x)) * up(x))`` of an MLP whose three projections are routed quantized
    layers (`LINEAR`) without biases, as one kernel call (`kernels.gated_mlp`) for a decode
    step's 1 to 8 rows of float32 x; None where the MLP's own code should run."""
    layers = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if x.dtype != mx.float32 or not x.ndim:
        return None
    if not all(LINEAR.routes(layer) for layer in layers):
        return None
    first = layers[0]
    if any(
        layer.mode != "affine"
        or "biases" not in layer
        or "bias" in layer
        or (layer.bits, layer.group_size) != (first.bits, first.group_size)
        for layer in layers
    ) or not kernels.supports(bits=first.bits, group_size=first.group_size):
        return None
    if mx.default_device() != mx.cpu or not 1 <= x.size // x.shape[-1] <= 8:
        return None
    note_kernel_products()
    return kernels.gated_mlp(
        x,
        *[product_arrays(layer) for layer in layers],
        group_size=first.group_size,
        bits=first.bits,
        activation=activation,
    )


def _linear_call(self: nn.QuantizedLinear, x: mx.array) -> mx.array:
    y = routed_matmul(self, x)
    if y is None:
        return nn.QuantizedLinear.__call__(self, x)
    if "bias" in self:
        y = y + self["bias"]
    return y


def _embedding_as_linear(self: nn.QuantizedEmbedding, x: mx.array) -> mx.array:
    y = routed_matmul(self, x, head=True)
    if y is None:
        return nn.QuantizedEmbedding.as_linear(self, x)
    return y


_REFUSAL = "quantized kernels not used"
_FALLBACK = "quantized layers run MLX's own products"

# Decode steps of every quantized projection: MLX's CPU kernel is scalar on x86.
LINEAR = InstanceRoute(
    name="quantized-linear",
    bodies=(
        Body(
            "mlx.nn",
            "QuantizedLinear.__call__",
            "x = " + _QUANTIZED_MATMUL + '\nif "bias" in self:\n    x = x + self["bias"]\nreturn x',
        ),
    ),
    checked_with=CHECKED_WITH,
    refusal=_REFUSAL,
    fallback=_FALLBACK,
    methods={"__call__": _linear_call},
)
# The tied output head of a quantized embedding: the largest matrix of a small model.
EMBEDDING_HEAD = InstanceRoute(
    name="quantized-embedding-head",
    bodies=(Body("mlx.nn", "QuantizedEmbedding.as_linear", "return " + _QUANTIZED_MATMUL),),
    checked_with=CHECKED_WITH,
    refusal=_REFUSAL,
    fallback=_FALLBACK,
    methods={"as_linear": _embedding_as_linear},
)


def _swiglu_call(self: Any, x: mx.array) -> mx.array:
    fused = routed_gated_mlp(self, x, "silu")  # a quantized decode step
    if fused is not None:
        return fused
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype == mx.float32 and up.dtype == mx.float32 and mx.default_device() == mx.cpu:
        # One pass of our kernel instead of MLX's compiled silu, whose sigmoid is scalar on
        # x86.
        return self.down_proj(rowops.silu_mul(gate, up))
    return self.down_proj(swiglu(gate, up))


# mlx-lm's SwiGLU MLPs: while routed, a decode step's MLP is one `routed_gated_mlp` call.
SWIGLU_MLPS = tuple(
    InstanceRoute(
        name=f"swiglu-mlp-{family}",
        bodies=(
            Body(
                f"mlx_lm.models.{family}",
                "MLP.__call__",
                "return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))",
            ),
        ),
        checked_with=CHECKED_WITH,
        refusal=f"the fused SwiGLU MLP is not used for {family}",
        fallback="its decode steps run the library's MLP (three products, not one)",
        methods={"__call__": _swiglu_call},
    )
    for family in ("llama", "qwen2", "qwen3")
) + (
    # Qwen 3.5's (and Qwen3-Next's) MLP, the same body under another name.
    InstanceRoute(
        name="swiglu-mlp-qwen3_next",
        bodies=(
            Body(
                "mlx_lm.models.qwen3_next",
                "Qwen3NextMLP.__call__",
                "return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))",
            ),
        ),
        checked_with=CHECKED_WITH,
        refusal="the fused SwiGLU MLP is not used for qwen3_next",
        fallback="its decode steps run the library's MLP (three products, not one)",
        methods={"__call__": _swiglu_call},
    ),
    # mlx-vlm's Qwen 3.5 (the published checkpoints, with their vision tower), the same body.
    InstanceRoute(
        name="swiglu-mlp-vlm-qwen3_5",
        bodies=(
            Body(
                "mlx_vlm.models.qwen3_5.language",
                "Qwen3_5MLP.__call__",
                "return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))",
            ),
        ),
        checked_with="mlx-vlm 0.7.10",
        refusal="the fused SwiGLU MLP is not used for mlx-vlm's qwen3_5",
        fallback="its decode steps run the library's MLP (three products, not one)",
        methods={"__call__": _swiglu_call},
    ),
)


def usable(routing: Routing) -> bool:
    """Whether quantized layers can route to our kernels here (the kernels are active and
    MLX's bodies are the ones restated; a refusal is said once)."""
    return kernels.status().active and all(routing.usable(r) for r in (LINEAR, EMBEDDING_HEAD))


def route(model: Any, routing: Routing) -> bool:
    """Route `model`'s quantized layers (and its SwiGLU MLPs) to our kernels where `usable`;
    never raises. Returns whether they are routed."""
    if not usable(routing):
        return False
    for each in (LINEAR, EMBEDDING_HEAD, *SWIGLU_MLPS):
        routing.swap(each, model)
    return True


def variant() -> str | None:
    """What the fingerprint records for a model whose quantized layers are routed (the kernel
    set, as the sets differ in the last bits, how long steps multiply, and the digest of
    `VARIANT_SOURCES`); None where the kernels are not active."""
    if not kernels.status().active:
        return None
    long_products = kernels.long_products()
    return f"qmv-{kernels.status().isa}-{long_products}-{digest.of_files(VARIANT_SOURCES)}"


def has_quantized_layers(model: Any) -> bool:
    return any(
        isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in model.named_modules()
    )


# Steps of the symmetric integer grids of llama.cpp's round-to-nearest block formats, as
# the largest magnitude of a block over its grid step: Q8_0 (k in -127..127), Q5_0 (k in
# -16..15), Q4_0 (k in -8..7).
GRID_STEPS = (127, 16, 8)


def _on_grid(w: mx.array, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """Per group of `w` (float32 [N, K]): whether the group is d * k for integers k with
    |k| <= 127 and d its largest magnitude over one of `GRID_STEPS` (a block of Q8_0, Q5_0
    or Q4_0 dequantized), the first such grid's d where it is (else 0), and k + 128 (uint8,
    [N, K]; 128 elsewhere). Evaluated, one pass over `w` a grid, stopping once every group
    is on one (a GGUF's Q8_0 tensors: at the first)."""
    groups = w.reshape(w.shape[0], -1, group_size)
    largest = mx.abs(groups).max(axis=-1)
    exact = mx.zeros(largest.shape, dtype=mx.bool_)
    step = mx.zeros(largest.shape, dtype=mx.float32)
    q = mx.full(groups.shape, 128, dtype=mx.uint8)
    for grid in GRID_STEPS:
        d = largest / grid
        k = groups / d[..., None]  # not finite where d is 0: those groups never fit
        fits = mx.all(k == mx.round(k), axis=-1) & (mx.abs(k).max(axis=-1) <= 127)
        fits = fits & (largest > 0) & ~exact
        step = mx.where(fits, d, step)
        q = mx.where(fits[..., None], (k + 128).astype(mx.uint8), q)
        exact = exact | fits
        mx.eval(exact, step, q)
        if exact.all().item():
            break
    return exact, step, q.reshape(w.shape)


_GRID_ROWS = 8192  # rows of a matrix checked at a time (bounds the memory it takes)


def _exact_where_on_grid(module: Any, weight: mx.array) -> int:
    """Give the groups of 8-bit `module` (quantized from float32 `weight`) that lie on a
    block format's grid (`_on_grid`) the exact codes: scale d, bias -128 d, codes k + 128,
    so s * q + b is the weight itself where mx.quantize's (max - min) / 255 steps are off
    the grid by up to half a step. Where every group is on a grid and float16 holds its
    scales and biases exactly (a GGUF block's d is a float16), the layer keeps float16 copies
    for our kernels (`product_arrays`). Returns how many groups changed."""
    rows, group = weight.shape[0], module.group_size
    codes = mx.view(module.weight, mx.uint8).reshape(rows, -1)
    scales = module.scales.astype(mx.float32)
    biases = module.biases.astype(mx.float32)
    parts: list[tuple[mx.array, mx.array, mx.array]] = []
    changed = 0
    for start in range(0, rows, _GRID_ROWS):
        end = min(rows, start + _GRID_ROWS)
        part = (codes[start:end], scales[start:end], biases[start:end])
        exact, d, q = _on_grid(weight[start:end].astype(mx.float32), group)
        n = exact.sum().item()
        if n:
            changed += n
            shape = (end - start, -1, group)
            part = (
                mx.where(exact[..., None], q.reshape(shape), part[0].reshape(shape)).reshape(
                    end - start, -1
                ),
                mx.where(exact, d, part[1]),
                mx.where(exact, -128 * d, part[2]),
            )
            mx.eval(part)
        parts.append(part)
    if changed:
        codes, scales, biases = (mx.concatenate(p) for p in zip(*parts, strict=True))
        module.weight = mx.view(codes.reshape(-1), mx.uint32).reshape(rows, -1)
        module.scales = scales.astype(module.scales.dtype)
        module.biases = biases.astype(module.biases.dtype)
    if changed == scales.size:  # every group on a grid: float16 may hold them exactly
        half = scales.astype(mx.float16), biases.astype(mx.float16)
        pairs = zip(half, (scales, biases), strict=True)
        if all(mx.array_equal(h.astype(mx.float32), f).item() for h, f in pairs):
            copies = (module.scales, half[0], half[1])
            object.__setattr__(module, _HALF_ATTRIBUTE, copies)
    return changed


def quantize_for_cpu(model: Any, *, bits: int, group_size: int) -> str:
    """Quantize `model`'s linear and embedding layers in place for our kernels; return the
    variant name the fingerprint records (e.g. ``q8g64``). At 8 bits, groups whose float32
    weights lie on a block format's grid (a GGUF's Q8_0, Q5_0 or Q4_0 tensors, dequantized)
    keep them exactly (`_exact_where_on_grid`; the variant ends in ``x``)."""

    def fits(_: str, module: Any) -> bool:
        weight = getattr(module, "weight", None)
        return (
            isinstance(module, nn.Linear | nn.Embedding)
            and weight is not None
            and weight.shape[-1] % group_size == 0
        )

    floats = {name: m.weight for name, m in model.named_modules() if fits(name, m)}
    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=fits)
    if bits == 8:
        mx.eval(model.parameters())
        for name, module in model.named_modules():
            weight = floats.get(name)
            if weight is not None and isinstance(
                module, nn.QuantizedLinear | nn.QuantizedEmbedding
            ):
                _exact_where_on_grid(module, weight)
    del floats
    mx.eval(model.parameters())
    return f"q{bits}g{group_size}" + ("x" if bits == 8 else "")

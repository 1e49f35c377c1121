"""Route a decode step of Gemma 3's decoder layer to two primitives around its cache and
attention: the route of mlx-lm's ``gemma3_text.TransformerBlock``.

Per layer and decode step, mlx-lm's layer builds the input norm, three quantized products,
three reshapes, three transposes, the query and key norms, two RoPEs, the cache update,
attention, a transpose and a reshape, the output product, the post-attention norm, an add,
the pre-MLP norm, the MLP, the post-MLP norm and another add: about 16 graph nodes per layer
even with each operation on our kernels, each costing the Python that builds it and MLX's
bookkeeping that runs it, while the step's products wait. `LAYER`, a `routes.InstanceRoute`
of a model's layers (only where the library's layer and attention bodies are still
`EXPECTED_BLOCK` and `EXPECTED_ATTENTION`), hands a *routed* step to

- `kernels.qkv_step`: the input norm, the q/k/v products, the heads' norms and RoPE;
- the cache's own ``update_and_fetch`` and mlx-lm's attention function, as the library
  calls them (attention then runs on our kernel, `attnroute`);
- `kernels.block_tail`: the output product, the three sandwich norms, the MLP and both
  residual adds.

Both primitives give the bits of the operations they replace, one by one on our kernels
(the same row kernels, norm and RoPE passes, in the same order; tests/test_decode_layer.py
compares logits bit for bit). The fingerprint names the route all the same (`variant`: a
digest of the sources that decide its bits), so a change that moves them cannot pass unsaid.
Where mlx-lm's layer or attention differs from the body restated, one line on stderr says
that the layer runs unfused (once per process).

A routed step: a cache; float32 x of 1 to 8 rows on the CPU; every projection of the layer
routed by `qroute` (affine quantized, no bias, one bits and group size); the norms routed
by `fastops` (Gemma's ``1 + weight``, one eps); ``nn.RoPE`` with a base; the MLP swapped by
`cpu_math` (its decode step is `kernels.gated_mlp` with GELU-tanh); an offset the RoPE
kernel takes. Anything else (a prefill step, the GPU, MLX's own kernels) runs the library's
layer. What a layer routes is worked out once per layer and kept while its arrays are the
same.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_nbengine import kernels
from mlx_nbengine._blas import note_kernel_products
from mlx_nbengine.kernels import digest
from mlx_nbengine.models import cpu_math, fastops, qroute
from mlx_nbengine.models.routes import Body, InstanceRoute, Routing

__all__ = [
    "EXPECTED_ATTENTION",
    "EXPECTED_BLOCK",
    "LAYER",
    "VARIANT_SOURCES",
    "fused_matrix",
    "gemma_tail",
    "held_plan",
    "plan_of",
    "route",
    "variant",
]

# The files that decide a routed step's bits (`variant` is their digest): this module, its
# two primitives, and the routes whose operations they fuse (products, norms, RoPE, the MLP).
VARIANT_SOURCES = tuple(
    dict.fromkeys(
        (
            "models/layerroute.py",
            *digest.kernel_source("qkv_step.h", "qkv_step.cpp", "block_tail.h", "block_tail.cpp"),
            *qroute.VARIANT_SOURCES,
            *fastops.VARIANT_SOURCES,
            *cpu_math.VARIANT_SOURCES,
        )
    )
)

# The library's bodies we restate.
EXPECTED_BLOCK = """\
r = self.self_attn(self.input_layernorm(x), mask, cache)
h = clip_residual(x, self.post_attention_layernorm(r))
r = self.mlp(self.pre_feedforward_layernorm(h))
out = clip_residual(h, self.post_feedforward_layernorm(r))
return out"""

EXPECTED_ATTENTION = """\
B, L, _ = x.shape
queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
queries = self.q_norm(queries)
keys = self.k_norm(keys)
if cache is not None:
    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
else:
    queries = self.rope(queries)
    keys = self.rope(keys)
# Sliding window
output = scaled_dot_product_attention(
    queries, keys, values, cache=cache, scale=self.scale, mask=mask
)
output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
return self.o_proj(output)"""

_MODULE = "mlx_lm.models.gemma3_text"
# A layer's (arrays, plan), held on the layer itself (it goes with the model; not a parameter).
_PLAN_ATTRIBUTE = "_mlx_nbengine_plan"

Matrix = tuple[mx.array, mx.array, mx.array]


@dataclass(frozen=True)
class _Plan:
    """What a routed step of one layer hands the kernels."""

    q: Matrix
    k: Matrix
    v: Matrix
    o: Matrix
    gate: Matrix
    up: Matrix
    down: Matrix
    input_norm: mx.array
    q_norm: mx.array
    k_norm: mx.array
    post_attn_norm: mx.array
    pre_ffn_norm: mx.array
    post_ffn_norm: mx.array
    eps: float
    heads: int
    kv_heads: int
    rope: nn.RoPE
    group_size: int
    bits: int


def fused_matrix(layer: Any) -> Matrix | None:
    """What a fused step hands the kernels for `layer`, a projection `qroute` routes (affine
    quantized, no bias): (weight, scales, biases); None for any other layer."""
    if not qroute.LINEAR.routes(layer) or layer.mode != "affine":
        return None
    if "biases" not in layer or "bias" in layer:
        return None
    return qroute.product_arrays(layer)


def _layers(block: Any) -> tuple[Any, ...]:
    """The layer's projections, in `_Plan`'s order: q, k, v, o, gate, up, down."""
    attn, mlp = block.self_attn, block.mlp
    return (
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    )


def _norms(block: Any) -> tuple[Any, ...]:
    """The layer's norms, in `_Plan`'s order."""
    attn = block.self_attn
    return (
        block.input_layernorm,
        attn.q_norm,
        attn.k_norm,
        block.post_attention_layernorm,
        block.pre_feedforward_layernorm,
        block.post_feedforward_layernorm,
    )


def _arrays(block: Any) -> tuple[Any, ...]:
    """The arrays a plan is made of, and its modules' classes (routed or the library's): a
    plan is remade when any of them changes."""
    modules = (*_layers(block), *_norms(block), block.mlp)
    arrays = tuple(m.get(name) for m in modules[:-1] for name in ("weight", "scales"))
    return (*arrays, *map(type, modules))


def _make_plan(block: Any) -> _Plan | None:
    attn, mlp = block.self_attn, block.mlp
    layers = _layers(block)
    matrices = [fused_matrix(layer) for layer in layers]
    if any(m is None for m in matrices) or not cpu_math.runs_gelu_mlp(mlp):
        return None
    bits, group = layers[0].bits, layers[0].group_size
    if any((layer.bits, layer.group_size) != (bits, group) for layer in layers[1:]):
        return None
    if not kernels.supports(bits=bits, group_size=group):
        return None
    norm_modules = _norms(block)
    norms = [fastops.offset_norm_weight(n) for n in norm_modules]
    if any(n is None for n in norms) or len({n.eps for n in norm_modules}) != 1:
        return None
    rope = attn.rope
    if type(rope) is not nn.RoPE or rope.base is None or rope.dims % 2:
        return None
    return _Plan(
        *matrices,
        *norms,
        eps=norm_modules[0].eps,
        heads=attn.n_heads,
        kv_heads=attn.n_kv_heads,
        rope=rope,
        group_size=group,
        bits=bits,
    )


def _plan(block: Any, x: mx.array, cache: Any) -> _Plan | None:
    """The plan of a routed step of `block` (see the module docstring), else None."""
    if cache is None:
        return None
    if x.dtype != mx.float32 or x.ndim != 3 or not 1 <= x.shape[0] * x.shape[1] <= 8:
        return None
    if mx.default_device() != mx.cpu or not fastops.offset_fits(cache.offset, x.shape[0]):
        return None
    return held_plan(block, _arrays(block), _make_plan)


def held_plan(block: Any, arrays: tuple[Any, ...], make: Callable[[Any], Any]) -> Any:
    """`block`'s plan, remade by `make(block)` when any of `arrays` (what it is made of) is not
    the one it was made from; held on the block (it goes with the model)."""
    held = block.__dict__.get(_PLAN_ATTRIBUTE)
    if held is None or any(a is not b for a, b in zip(held[0], arrays, strict=True)):
        held = (arrays, make(block))
        # Past nn.Module's __setattr__, which would take a tuple of arrays for parameters.
        object.__setattr__(block, _PLAN_ATTRIBUTE, held)
    return held[1]


def plan_of(block: Any) -> Any:
    """The plan `block` last routed a decode step with (tests), else None."""
    held = block.__dict__.get(_PLAN_ATTRIBUTE)
    return None if held is None else held[1]


def _call(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    plan = _plan(self, x, cache)
    if plan is None:
        return super(type(self), self).__call__(x, mask, cache)
    note_kernel_products()  # the decode step's threads are our kernels'
    rope = plan.rope
    queries, keys, values = kernels.qkv_step(
        x,
        plan.q,
        plan.k,
        plan.v,
        q_norm=plan.q_norm,
        k_norm=plan.k_norm,
        eps=plan.eps,
        x_norm=plan.input_norm,
        x_eps=plan.eps,
        heads=plan.heads,
        kv_heads=plan.kv_heads,
        rope_dims=rope.dims,
        traditional=rope.traditional,
        base=rope.base,
        scale=rope.scale,
        offset=cache.offset,
        group_size=plan.group_size,
        bits=plan.bits,
    )
    keys, values = cache.update_and_fetch(keys, values)
    output = sys.modules[_MODULE].scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=self.self_attn.scale, mask=mask
    )
    return gemma_tail(output, x, plan)


def gemma_tail(output: mx.array, x: mx.array, plan: Any, **extra: Any) -> mx.array:
    """`kernels.block_tail` of a Gemma layer's plan (its output product, sandwich norms and
    GELU MLP: the fields Gemma 3's and Gemma 4's plans share) after attention's `output`;
    `extra` goes to the primitive as it is (Gemma 4's per-layer tail)."""
    return kernels.block_tail(
        output,
        x,
        plan.o,
        plan.gate,
        plan.up,
        plan.down,
        post_attn_norm=plan.post_attn_norm,
        pre_ffn_norm=plan.pre_ffn_norm,
        post_ffn_norm=plan.post_ffn_norm,
        eps=plan.eps,
        group_size=plan.group_size,
        bits=plan.bits,
        activation="gelu_tanh",
        **extra,
    )


LAYER = InstanceRoute(
    name="gemma3-decoder-layer",
    bodies=(
        Body(_MODULE, "TransformerBlock.__call__", EXPECTED_BLOCK),
        Body(_MODULE, "Attention.__call__", EXPECTED_ATTENTION),
    ),
    checked_with="mlx-lm 0.32.2",
    refusal="Gemma 3's decoder layer is not fused",
    fallback="its decode steps run mlx-lm's unfused layer (about 16 graph nodes a layer)",
    methods={"__call__": _call},
)


def route(model: Any, routing: Routing) -> bool:
    """Route `model`'s Gemma 3 decoder layers (any it has) where the kernels are active and
    mlx-lm's layer and attention are the bodies restated; never raises. Returns whether the
    route is usable in this process, whatever the model's family: its variant names the
    route on every model the kernels run (as when the route replaced the class's method)."""
    if not kernels.status().active or not routing.usable(LAYER):
        return False
    routing.swap(LAYER, model)
    return True


def variant() -> str:
    """What the fingerprint records where the layer is routed (the digest of
    `VARIANT_SOURCES`)."""
    return f"layer-{digest.of_files(VARIANT_SOURCES)}"

"""Route a decode step of Gemma 4's decoder layer to the two primitives Gemma 3's runs on:
the route of mlx-lm's ``gemma4_text.DecoderLayer``.

Per layer and decode step, mlx-lm's Gemma 4 layer builds the input norm, three quantized
products, the query, key and value norms, two RoPEs, reshapes and transposes, the cache
update, attention, the output product, four sandwich norms and two adds, the MLP, then the
per-layer input's gate, GELU, multiply, projection, norm and add, and the layer scalar:
about 30 graph nodes, over E2B's 35 layers (E4B's 42) about a thousand a token, each costing
the Python that builds it and MLX's bookkeeping that runs it. `LAYER`, a
`routes.InstanceRoute` of a model's decoder layers (only where the library's layer and
attention bodies are still `EXPECTED_LAYER` and `EXPECTED_ATTENTION`), hands a *routed*
step to

- `kernels.qkv_step`: the input norm, the q/k/v products, the heads' norms (the values'
  without a weight) and RoPE, with the proportional RoPE's frequencies on the full layers;
  a layer that reads an earlier layer's keys and values (the last ``num_kv_shared_layers``)
  computes its queries only;
- the cache's own ``update_and_fetch`` and mlx-lm's attention function, as the library
  calls them (attention then runs on our kernel, `attnroute`);
- `kernels.block_tail`: the output product, the four sandwich norms, the MLP, both residual
  adds, the per-layer input's gate, projection and norm, and the layer scalar.

Its results are the bits of the library's layer on our kernels (the same row kernels, norm
and RoPE passes, in the same order) but for one function: the per-layer input's GELU, which
the library runs as MLX's ``gelu_approx`` and the primitive as our row pass
(`rowops.gelu_tanh_mul`, `cpu_math`'s tanh; a few float32 ulps apart).
tests/integration/test_gemma4_layer.py measures the difference and states its bound. The
fingerprint names the route (`variant`: a digest of the sources that decide its bits), so
no stored block mixes the fused and unfused steps. Where
mlx-lm's layer or attention differs from the body restated, one line on stderr says that
the layer runs unfused (once per process).

A routed step: a cache (or an earlier layer's keys and values); float32 x of 1 to 8 rows on
the CPU; no mixture of experts and separate keys and values; every projection routed by
`qroute` (affine quantized, no bias, one bits and group size); the norms ``nn.RMSNorm``
with one eps, routed by `fastops`; ``nn.RoPE`` with a base or mlx-lm's
``ProportionalRoPE``; the MLP swapped by `cpu_math`; an offset the RoPE kernel takes.
Anything else (a prefill step, the GPU, MLX's own kernels) runs the library's layer. What a
layer routes is worked out once per layer and kept while its arrays are the same.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_nbengine import kernels
from mlx_nbengine._blas import note_kernel_products
from mlx_nbengine.kernels import digest
from mlx_nbengine.models import cpu_math, fastops, layerroute
from mlx_nbengine.models.routes import Body, InstanceRoute, Routing

__all__ = [
    "EXPECTED_ATTENTION",
    "EXPECTED_LAYER",
    "LAYER",
    "VARIANT_SOURCES",
    "plan_of",
    "route",
    "variant",
]

# The files that decide a routed step's bits (`variant` is their digest): this module and
# the sources of Gemma 3's route, whose primitives it calls.
VARIANT_SOURCES = tuple(dict.fromkeys(("models/gemma4route.py", *layerroute.VARIANT_SOURCES)))

# The library's bodies we restate.
EXPECTED_LAYER = """\
residual = x

h = self.input_layernorm(x)
h, shared_kv, offset = self.self_attn(
    h, mask, cache, shared_kv=shared_kv, offset=offset
)
h = self.post_attention_layernorm(h)
h = residual + h

residual = h

if self.enable_moe:
    h1 = self.pre_feedforward_layernorm(h)
    h1 = self.mlp(h1)
    h1 = self.post_feedforward_layernorm_1(h1)

    top_k_indices, top_k_weights = self.router(h)
    h2 = self.pre_feedforward_layernorm_2(h)
    h2 = self.experts(h2, top_k_indices, top_k_weights)
    h2 = self.post_feedforward_layernorm_2(h2)

    h = h1 + h2
else:
    h = self.pre_feedforward_layernorm(h)
    h = self.mlp(h)

h = self.post_feedforward_layernorm(h)
h = residual + h

# Per-layer input gating
if (
    self.per_layer_input_gate is not None
    and self.per_layer_projection is not None
    and self.post_per_layer_input_norm is not None
    and per_layer_input is not None
):
    residual = h
    gate = self.per_layer_input_gate(h)
    gate = nn.gelu_approx(gate)
    gate = mx.multiply(gate, per_layer_input)
    gate = self.per_layer_projection(gate)
    gate = self.post_per_layer_input_norm(gate)
    h = residual + gate

if self.layer_scalar is not None:
    h = h * self.layer_scalar

return h, shared_kv, offset"""

EXPECTED_ATTENTION = """\
B, L, _ = x.shape

queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
queries = self.q_norm(queries)

if shared_kv is not None:
    keys, values = shared_kv
elif not self.has_kv:
    raise ValueError(
        f"Layer {self.layer_idx} is a KV-shared layer but received no shared_kv"
    )
else:
    keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
    values = keys
    if not self.use_k_eq_v:
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)

    offset = mx.array(cache.offset) if cache is not None else 0

    keys = self.k_norm(keys)
    keys = keys.transpose(0, 2, 1, 3)
    keys = self.rope(keys, offset=offset)

    values = self.v_norm(values)
    values = values.transpose(0, 2, 1, 3)

queries = queries.transpose(0, 2, 1, 3)
queries = self.rope(queries, offset=offset)

if cache is not None:
    keys, values = cache.update_and_fetch(keys, values)

output = scaled_dot_product_attention(
    queries, keys, values, cache=cache, scale=self.scale, mask=mask
)
output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)

return self.o_proj(output), (keys, values), offset"""

_MODULE = "mlx_lm.models.gemma4_text"

Matrix = tuple[mx.array, mx.array, mx.array]


@dataclass(frozen=True)
class _Plan:
    """What a routed step of one layer hands the kernels."""

    q: Matrix
    k: Matrix | None  # None: the layer reads an earlier layer's keys and values
    v: Matrix | None
    o: Matrix
    gate: Matrix
    up: Matrix
    down: Matrix
    per_layer_gate: Matrix | None  # None: the model has no per-layer inputs
    per_layer_projection: Matrix | None
    input_norm: mx.array
    q_norm: mx.array
    k_norm: mx.array | None
    post_attn_norm: mx.array
    pre_ffn_norm: mx.array
    post_ffn_norm: mx.array
    post_per_layer_norm: mx.array | None
    scalar: mx.array | None
    eps: float
    heads: int
    kv_heads: int
    rope_dims: int
    traditional: bool
    base: float | None
    freqs: mx.array | None
    rope_scale: float
    group_size: int
    bits: int


def _layers(block: Any) -> tuple[Any, ...]:
    """The layer's projections, in `_Plan`'s order (k and v None in a shared layer, the
    per-layer ones None in a model without per-layer inputs)."""
    attn, mlp = block.self_attn, block.mlp
    kv = (attn.k_proj, attn.v_proj) if attn.has_kv else (None, None)
    per_layer = (block.per_layer_input_gate, block.per_layer_projection)
    return (attn.q_proj, *kv, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, *per_layer)


def _norms(block: Any) -> tuple[Any, ...]:
    """The layer's weighted norms, in `_Plan`'s order (None where it has none)."""
    attn = block.self_attn
    return (
        block.input_layernorm,
        attn.q_norm,
        attn.k_norm if attn.has_kv else None,
        block.post_attention_layernorm,
        block.pre_feedforward_layernorm,
        block.post_feedforward_layernorm,
        block.post_per_layer_input_norm,
    )


def _arrays(block: Any) -> tuple[Any, ...]:
    """The arrays a plan is made of, and its modules' classes (routed or the library's): a
    plan is remade when any of them changes."""
    attn = block.self_attn
    modules = [m for m in (*_layers(block), *_norms(block)) if m is not None]
    arrays = tuple(m.get(name) for m in modules for name in ("weight", "scales"))
    rope = getattr(attn.rope, "_freqs", None)
    classes = tuple(map(type, (*modules, block.mlp, attn.rope)))
    return (*arrays, block.layer_scalar, rope, *classes)


def _rope(rope: Any) -> tuple[int, bool, float | None, mx.array | None, float] | None:
    """(dims, traditional, base, freqs, scale) of a RoPE the kernel runs, else None."""
    if type(rope) is nn.RoPE and rope.base is not None and rope.dims % 2 == 0:
        return rope.dims, rope.traditional, rope.base, None, rope.scale
    proportional = sys.modules["mlx_lm.models.rope_utils"].ProportionalRoPE
    freqs = getattr(rope, "_freqs", None)
    if type(rope) is proportional and isinstance(freqs, mx.array) and rope.dims % 2 == 0:
        if freqs.shape == (rope.dims // 2,):
            return rope.dims, rope.traditional, None, freqs.astype(mx.float32), 1.0
    return None


def _make_plan(block: Any) -> _Plan | None:
    attn, mlp = block.self_attn, block.mlp
    if block.enable_moe or attn.use_k_eq_v or not cpu_math.runs_gelu_mlp(mlp):
        return None
    if not fastops.ROWS.held():
        return None
    layers = _layers(block)
    present = [layer for layer in layers if layer is not None]
    matrices = [None if layer is None else layerroute.fused_matrix(layer) for layer in layers]
    if any(m is None for m, layer in zip(matrices, layers, strict=True) if layer is not None):
        return None
    bits, group = present[0].bits, present[0].group_size
    if any((layer.bits, layer.group_size) != (bits, group) for layer in present[1:]):
        return None
    if not kernels.supports(bits=bits, group_size=group):
        return None
    norm_modules = _norms(block)
    weighted = [n for n in norm_modules if n is not None]
    if any(type(n) is not nn.RMSNorm or n.weight.dtype != mx.float32 for n in weighted):
        return None
    eps = weighted[0].eps
    if any(n.eps != eps for n in weighted):
        return None
    if attn.has_kv and getattr(attn.v_norm, "eps", None) != eps:
        return None
    rope = _rope(attn.rope)
    scalar = block.layer_scalar
    if rope is None or (scalar is not None and (scalar.dtype != mx.float32 or scalar.size != 1)):
        return None
    dims, traditional, base, freqs, scale = rope
    return _Plan(
        *matrices,
        *(None if n is None else n.weight for n in norm_modules),
        scalar=scalar,
        eps=eps,
        heads=attn.n_heads,
        kv_heads=attn.n_kv_heads,
        rope_dims=dims,
        traditional=traditional,
        base=base,
        freqs=freqs,
        rope_scale=scale,
        group_size=group,
        bits=bits,
    )


def _plan(block: Any, x: mx.array, cache: Any, shared_kv: Any, offset: Any) -> _Plan | None:
    """The plan of a routed step of `block` (see the module docstring), else None."""
    if x.dtype != mx.float32 or x.ndim != 3 or not 1 <= x.shape[0] * x.shape[1] <= 8:
        return None
    if mx.default_device() != mx.cpu:
        return None
    if shared_kv is None:
        if cache is None or not block.self_attn.has_kv:
            return None
        if not fastops.offset_fits(cache.offset, x.shape[0]):
            return None
    elif cache is not None or not fastops.offset_fits(offset, x.shape[0]):
        return None
    return layerroute.held_plan(block, _arrays(block), _make_plan)


# The plan a layer last routed a decode step with (tests), held as Gemma 3's layers hold theirs.
plan_of = layerroute.plan_of


def _call(
    self: Any,
    x: mx.array,
    mask: Any = None,
    cache: Any = None,
    per_layer_input: mx.array | None = None,
    shared_kv: Any = None,
    offset: Any = None,
) -> tuple[mx.array, Any, Any]:
    plan = _plan(self, x, cache, shared_kv, offset)
    if plan is None or (per_layer_input is None) != (plan.per_layer_gate is None):
        return super(type(self), self).__call__(x, mask, cache, per_layer_input, shared_kv, offset)
    note_kernel_products()  # the decode step's threads are our kernels'
    attn = self.self_attn
    if shared_kv is None:
        offset = mx.array(cache.offset)
    heads = kernels.qkv_step(
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
        rope_dims=plan.rope_dims,
        traditional=plan.traditional,
        base=plan.base,
        freqs=plan.freqs,
        scale=plan.rope_scale,
        offset=offset,
        v_norm=True,
        group_size=plan.group_size,
        bits=plan.bits,
    )
    if shared_kv is None:
        queries, keys, values = heads
        keys, values = cache.update_and_fetch(keys, values)
    else:
        (queries,) = heads
        keys, values = shared_kv
    output = sys.modules[_MODULE].scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=attn.scale, mask=mask
    )
    h = layerroute.gemma_tail(
        output,
        x,
        plan,
        per_layer_input=per_layer_input,
        per_layer_gate=plan.per_layer_gate,
        per_layer_projection=plan.per_layer_projection,
        post_per_layer_norm=plan.post_per_layer_norm,
        scalar=plan.scalar,
    )
    return h, (keys, values), offset


LAYER = InstanceRoute(
    name="gemma4-decoder-layer",
    bodies=(
        Body(_MODULE, "DecoderLayer.__call__", EXPECTED_LAYER),
        Body(_MODULE, "Attention.__call__", EXPECTED_ATTENTION),
    ),
    checked_with="mlx-lm 0.32.2",
    refusal="Gemma 4's decoder layer is not fused",
    fallback="its decode steps run mlx-lm's unfused layer (about 30 graph nodes a layer)",
    methods={"__call__": _call},
)


def route(model: Any, routing: Routing) -> bool:
    """Route `model`'s Gemma 4 decoder layers where the kernels are active and mlx-lm's layer
    and attention are the bodies restated; never raises. Returns whether any layer is
    routed (the fingerprint then names the route)."""
    if not kernels.status().active or not LAYER.present() or not routing.usable(LAYER):
        return False
    return routing.swap(LAYER, model) > 0


def variant() -> str:
    """What the fingerprint records where the layer is routed (the digest of
    `VARIANT_SOURCES`)."""
    return f"gemma4-layer-{digest.of_files(VARIANT_SOURCES)}"

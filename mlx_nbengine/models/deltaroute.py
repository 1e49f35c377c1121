"""Route Qwen 3.5's linear-attention layers (gated delta) to our CPU primitive: the routes of
mlx-lm's ``qwen3_5.GatedDeltaNet`` (`DELTA`) and of mlx-vlm's ``Qwen3_5GatedDeltaNet``
(`DELTA_VLM`: Qwen publishes the family with a vision tower, so its checkpoints load through
mlx-vlm, whose CPU path prefills with a chunked scan of MLX operations and decodes with the
per-token loop: about a third of the routed prefill speed).

mlx-lm's ``gated_delta_update`` has Metal kernels only. On the CPU it runs
``gated_delta_ops``, a Python loop that calls a compiled step once per token and layer
(about 1 ms a token for 16 heads of 128 on x86, in prefill and decode alike), so the hybrid
family read a prompt at a third of the speed of a dense model of its size. `DELTA`, a
`routes.InstanceRoute` of a model's ``GatedDeltaNet`` modules (only where the library's
layer, ``gated_delta_update``, ``gated_delta_ops`` and its step are the bodies restated),
runs the layer as the library does, with three parts on our kernels:

- the recurrence, `kernels.delta.gated_delta`: every token of a step in one primitive, each
  head's state worked in blocks of rows that stay in the core's cache, split over the
  step's threads;
- the short convolution and its silu, `kernels.delta.conv_silu` (MLX runs a grouped
  convolution and silu on the CPU as scalar loops: 200 ms and 100 ms of a 1,024-token step
  of a 0.8B layer, against about 12 ms for both);
- the gated output norm's activation, `kernels.rowops.silu_mul`;
- a decode step between the projections, `kernels.delta.delta_step`: the convolution and
  its state, the norms, gate, beta, recurrence and output norm as one graph node.

Its results differ from the library's by float32 rounding only: summation order, and the
exp of silu (tests/integration/test_gated_delta.py states the bounds). The fingerprint names
the route (`variant`: the kernel set and a digest of the sources that decide its bits), so
stored recurrent states never mix paths. Anything the primitive does not take (the GPU, training,
MLX's own kernels) runs the library's layer.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from mlx_nbengine import kernels
from mlx_nbengine.kernels import delta, digest, rowops
from mlx_nbengine.models.routes import Body, InstanceRoute, Routing

__all__ = [
    "DELTA",
    "DELTA_VLM",
    "VARIANT_SOURCES",
    "arrays_cache_classes",
    "Taps",
    "route",
    "taps_every_state",
    "tapping",
    "tapping_layers",
    "variant",
]

# The files that decide a routed layer's bits (`variant` is their digest): this module and the
# primitive (its Python face, bindings and source).
VARIANT_SOURCES = (
    "models/deltaroute.py",
    "kernels/delta.py",
    *digest.COMMON,
    "kernels/rowops.py",
    *digest.kernel_source(
        "gated_delta.h",
        "gated_delta.cpp",
        "rowops.h",
        "rowops.cpp",
        "rowops_bindings.cpp",
        "attention_math.h",
    ),
)

_MODULE = "mlx_lm.models.qwen3_5"
_DELTA_MODULE = "mlx_lm.models.gated_delta"
_NEXT_MODULE = "mlx_lm.models.qwen3_next"

# The library's bodies we restate: the layer (its convolution, recurrence and output norm
# replaced), the update (the gate and beta it computes), the loop and its step (what the
# primitive computes), the gated output norm and its activation.
EXPECTED_LAYER = """\
B, S, _ = inputs.shape
if self.sharding_group is not None:
    inputs = sum_gradients(self.sharding_group)(inputs)
qkv = self.in_proj_qkv(inputs)
z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
b = self.in_proj_b(inputs)
a = self.in_proj_a(inputs)
if cache is not None and cache[0] is not None:
    conv_state = cache[0]
else:
    conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
if mask is not None:
    qkv = mx.where(mask[..., None], qkv, 0)
conv_input = mx.concatenate([conv_state, qkv], axis=1)
if cache is not None:
    n_keep = self.conv_kernel_size - 1
    if cache.lengths is not None:
        ends = mx.clip(cache.lengths, 0, S)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
    else:
        cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
conv_out = nn.silu(self.conv1d(conv_input))
q, k, v = [
    t.reshape(B, S, h, d)
    for t, h, d in zip(
        mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
        [self.num_k_heads, self.num_k_heads, self.num_v_heads],
        [self.head_k_dim, self.head_k_dim, self.head_v_dim],
    )
]
state = cache[1] if cache else None
q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
out, state = gated_delta_update(
    q, k, v, a, b, self.A_log, self.dt_bias, state, mask, use_kernel=not self.training
)
if cache is not None:
    cache[1] = state
    cache.advance(S)
out = self.norm(out, z)
out = self.out_proj(out.reshape(B, S, -1))
if self.sharding_group is not None:
    out = mx.distributed.all_sum(out, group=self.sharding_group)
return out"""

EXPECTED_UPDATE = """\
beta = mx.sigmoid(b)
if allow_neg_eigval:
    beta = beta * 2.0
if lower_bound is None:
    g = compute_g(A_log, a, dt_bias)
else:
    g = compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
if state is None:
    B, _, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
if (
    not use_kernel
    or mx.default_device() != mx.gpu
    or not mx.metal.is_available()
    or k.shape[-1] < 32
    or k.shape[-1] % 32 != 0
):
    return gated_delta_ops(q, k, v, g, beta, state, mask)
return gated_delta_kernel(q, k, v, g, beta, state, mask)"""

EXPECTED_OPS = """\
B, T, Hk, Dk = q.shape
Hv, Dv = v.shape[-2:]
if state is None:
    state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
if (repeat_factor := Hv // Hk) > 1:
    q = mx.repeat(q, repeat_factor, -2)
    k = mx.repeat(k, repeat_factor, -2)
ys = []
for t in range(T):
    y, state = _gated_delta_step_ops(
        q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state,
        None if mask is None else mask[:, t],
    )
    ys.append(y)
y = mx.stack(ys, axis=1)
return y, state"""

EXPECTED_STEP = """\
old_state = state
if g.ndim == 2:
    decay = g[..., None, None]
elif g.ndim == 3:
    decay = g[..., None, :]
else:
    raise ValueError(f"Unsupported gating shape {g.shape}")
state = state * decay
kv_mem = (state * k[..., None, :]).sum(axis=-1)
delta = (v - kv_mem) * beta[..., None]
state = state + k[..., None, :] * delta[..., None]
y = (state * q[..., None, :]).sum(axis=-1)
if mask is not None:
    mask = mx.expand_dims(mask, axis=(1, 2, 3))
    state = mx.where(mask, state, old_state)
return y.astype(q.dtype), state"""

EXPECTED_NORM = """\
x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
if gate is not None:
    return precise_swiglu(hidden_states, gate, x)
else:
    return x.astype(hidden_states.dtype)"""

EXPECTED_SWIGLU = """\
gate = nn.silu(gate.astype(mx.float32))
x = x.astype(mx.float32)
return (gate * x).astype(h.dtype)"""


# mlx-vlm's Qwen 3.5 (the published checkpoints carry a vision tower, so they load through
# mlx-vlm): its own layer, which keeps its states through the cache's `update_window` and
# `update_recurrent` and, on the CPU, prefills with a chunked scan in MLX operations (its decode
# steps run the per-token loop). The recurrence, the step and the output norm are the bodies
# above under mlx-vlm's names.
_VLM_MODULE = "mlx_vlm.models.qwen3_5.language"
_VLM_DELTA_MODULE = "mlx_vlm.models.qwen3_5.gated_delta"
_VLM_CACHE_MODULE = "mlx_vlm.models.cache"

EXPECTED_VLM_LAYER = """\
B, S, _ = inputs.shape
mixed_qkv = self.in_proj_qkv(inputs)
z = self.in_proj_z(inputs)
b, a = self._project_gates(inputs)
z = z.reshape(B, S, -1, self.head_v_dim)
if cache is not None and cache[0] is not None:
    conv_state = cache[0]
    if conv_state.shape[0] != B:
        conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
else:
    conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
if mask is not None:
    if mask.shape[0] != B:
        mask = None
    else:
        mixed_qkv = mx.where(mask[..., None], mixed_qkv, 0)
conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)
if cache is not None:
    cache.update_window(0, conv_input, self.conv_kernel_size - 1, lengths=cache.lengths)
if (
    S == 1
    and conv_input.shape[1] == self.conv_kernel_size
    and self.conv1d.weight.dtype in (mx.bfloat16, mx.float16)
):
    conv_out = nn.silu(self._causal_conv1d_decode(conv_input))
else:
    conv_out = nn.silu(self.conv1d(conv_input))
q, k, v = [
    t.reshape(B, S, h, d)
    for t, h, d in zip(
        mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
        [self.num_k_heads, self.num_k_heads, self.num_v_heads],
        [self.head_k_dim, self.head_k_dim, self.head_v_dim],
    )
]
q, k = self._normalize_qk(q, k)
out, _ = gated_delta_update(
    q, k, v, a, b, self.A_log, self.dt_bias,
    mask=mask, use_kernel=not self.training, cache=cache,
)
if cache is not None:
    if hasattr(cache, "advance"):
        cache.advance(S)
        _qwen3_5_advance_lengths_info(cache, S)
out = self.norm(out, z)
return self.out_proj(out.reshape(B, S, -1))"""

EXPECTED_VLM_UPDATE = """\
if cache is not None:
    if state is not None or state_steps is not None:
        raise ValueError("The cache owns recurrent state and history retention.")
    return cache.update_recurrent(
        cache_index,
        q.shape[1],
        lambda initial, steps: gated_delta_update(
            q, k, v, a, b, A_log, dt_bias,
            state=(initial if initial is None or initial.shape[0] == q.shape[0] else None),
            mask=mask, use_kernel=use_kernel, state_steps=steps,
        ),
    )
if state_steps is not None:
    return gated_delta_update_with_states(
        q, k, v, a, b, A_log, dt_bias, state, mask,
        use_kernel=use_kernel, state_steps=state_steps,
    )
g, beta = _compute_g_beta(A_log, a, b, dt_bias)
if state is None:
    B, _, _Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
if not use_kernel or mx.default_device() != mx.gpu or not mx.metal.is_available():
    if q.shape[1] > 1 and g.ndim == 3:
        return gated_delta_chunked(q, k, v, g, beta, state, mask)
    return gated_delta_ops(q, k, v, g, beta, state, mask)
return gated_delta_kernel(q, k, v, g, beta, state, mask)"""

EXPECTED_VLM_G = "return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))"
EXPECTED_VLM_G_BETA = "return compute_g(A_log, a, dt_bias), mx.sigmoid(b)"

EXPECTED_VLM_NORMALIZE = """\
inv_scale = k.shape[-1] ** -0.5
eps = 1e-6 / k.shape[-1]
q = (inv_scale**2) * mx.fast.rms_norm(q, None, eps)
k = inv_scale * mx.fast.rms_norm(k, None, eps)
return q, k"""

EXPECTED_VLM_NORM = """\
x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
if gate is not None:
    return _precise_swiglu(hidden_states, gate, x)
return x.astype(hidden_states.dtype)"""

# What a decode step relies on when it sets the cache's two entries itself: a cache that records
# no history (no speculation) and has no lengths keeps the window's last inputs and the state.
EXPECTED_VLM_WINDOW = """\
width = int(width)
length = source.shape[1] - width
if width < 0 or length < 0:
    raise ValueError("Invalid causal cache window width.")
if self.history_capacity:
    self.record_speculative_window(index, source, width)
if lengths is None:
    state = mx.contiguous(source[:, length : length + width])
else:
    positions = mx.clip(lengths, 0, length)[:, None] + mx.arange(width)
    positions = positions.reshape(*positions.shape, *([1] * (source.ndim - 2)))
    state = mx.take_along_axis(source, positions, axis=1)
self.cache[index] = state
return state"""

EXPECTED_VLM_RECURRENT = """\
if length < 1:
    raise ValueError("Recurrent updates must contain at least one token.")
if self.history_capacity:
    if self._recorded_length(index) + length > self.history_capacity:
        raise ValueError("Recurrent update exceeds the cache history capacity.")
    state_steps = length - 1 if length > 1 else None
else:
    state_steps = None
result = update(self.cache[index], state_steps)
output, state = result[:2]
if self.history_capacity:
    intermediate = result[2] if len(result) > 2 else None
    if (0 if intermediate is None else intermediate.shape[1]) != length - 1:
        raise ValueError("Recurrent update did not return the requested history.")
    self.record_speculative_states(index, intermediate, state)
self.cache[index] = state
return output, state"""


@dataclass
class Taps:
    """The states a prefill step leaves inside it: `at` (token counts into the step, each a
    block boundary), and per routed layer's cache (by ``id``) one ``[conv_state, state]``
    per count, as the layer's cache would hold them there (`found`, filled by the layers)."""

    at: tuple[int, ...]
    found: dict[int, list[list[mx.array]]] = field(default_factory=dict)


_TAPS: ContextVar[Taps | None] = ContextVar("mlx_nbengine_delta_taps", default=None)


@contextlib.contextmanager
def tapping(at: tuple[int, ...]) -> Iterator[Taps]:
    """Model calls in the block ask the routed layers for their states after `at` tokens
    of the step as well (one sequence: batch size 1, no lengths), kept in the yielded
    `Taps`: a long prefill step of a hybrid model then still checkpoints every block."""
    taps = Taps(tuple(at))
    token = _TAPS.set(taps)
    try:
        yield taps
    finally:
        _TAPS.reset(token)


def arrays_cache_classes() -> tuple[type, ...]:
    """The recurrent layers' cache classes (``ArraysCache``) of mlx-lm and, where a model of
    it was loaded (its module imported), mlx-vlm."""
    from mlx_lm.models.cache import ArraysCache  # noqa: PLC0415 - mlx-lm's, where it is used

    vlm = sys.modules.get(_VLM_CACHE_MODULE)
    return (ArraysCache,) if vlm is None else (ArraysCache, vlm.ArraysCache)


def _routes_here() -> tuple[InstanceRoute, ...]:
    """The routes whose library class a model in this process can have (mlx-vlm's only once
    its module is imported: importing it for a text model would cost seconds)."""
    vlm = (DELTA_VLM,) if _VLM_MODULE in sys.modules and DELTA_VLM.present() else ()
    return ((DELTA,) if DELTA.present() else ()) + vlm


def tapping_layers(lm: Any) -> list[Any] | None:
    """`lm`'s linear-attention layers (mlx-lm's or mlx-vlm's Qwen 3.5 ``GatedDeltaNet``
    modules) where they are all its recurrent layers (its ``ArraysCache`` layers), else None:
    while `taps_every_state` of them, `tapping` gives the state of every recurrent layer."""
    routes = _routes_here()
    if not routes:
        return None
    classes = tuple(r.library_class() for r in routes)
    layers = [m for _, m in lm.language_model.named_modules() if isinstance(m, classes)]
    arrays = arrays_cache_classes()
    recurrent = sum(isinstance(c, arrays) for c in lm.make_cache())
    return layers if recurrent > 0 and len(layers) == recurrent else None


def taps_every_state(layers: list[Any] | None) -> bool:
    """Whether every one of `layers` (`tapping_layers`) runs this route now (a route
    suspended for a comparison gives the library's layer, which takes no taps)."""
    return (
        bool(layers)
        and kernels.status().active
        and mx.default_device() == mx.cpu
        and all(DELTA.routes(m) or DELTA_VLM.routes(m) for m in layers)
    )


def _library_call(layer: Any, inputs: mx.array, mask: Any, cache: Any) -> mx.array:
    return DELTA.library_class().__call__(layer, inputs, mask, cache)


def _conv_heads(layer: Any, conv_input: mx.array) -> list[mx.array]:
    """The layer's short convolution and its silu over `conv_input` (the kept inputs, then
    the step's), split into q, k and v heads, as the library computes them."""
    B, S = conv_input.shape[0], conv_input.shape[1] - (layer.conv_kernel_size - 1)
    if conv_input.dtype == mx.float32 and layer.conv1d.weight.dtype == mx.float32:
        conv_out = delta.conv_silu(conv_input, layer.conv1d.weight)
    else:
        conv_out = nn.silu(layer.conv1d(conv_input))
    return [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
            strict=True,
        )
    ]


def _convolved(layer: Any, qkv: mx.array, mask: Any, cache: Any) -> tuple[list[mx.array], mx.array]:
    """mlx-lm's layer's short convolution of q, k and v (its state kept in ``cache[0]``), split
    into heads, as the library computes it, and the convolution's input (the kept inputs,
    then the step's)."""
    B, S, _ = qkv.shape
    if cache is not None and cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), dtype=qkv.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    if cache is not None:
        n_keep = layer.conv_kernel_size - 1
        if cache.lengths is not None:
            ends = mx.clip(cache.lengths, 0, S)
            positions = (ends[:, None] + mx.arange(n_keep))[..., None]
            cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
        else:
            cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    return _conv_heads(layer, conv_input), conv_input


def _recurrence(q, k, v, g, beta, state, mask, at=()) -> tuple[mx.array, ...]:
    """``gated_delta_ops`` of the layer's heads on our primitive, given the library's gate
    `g` and `beta` (a new state is float32 zeros, as the library's); with `at`, also the
    states after those token counts."""
    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    f32 = mx.float32
    y, state, *tapped = delta.gated_delta(
        q.astype(f32),
        k.astype(f32),
        v.astype(f32),
        g.astype(f32),
        beta.astype(f32),
        state.astype(f32),
        mask,
        taps=tuple(at),
    )
    return (y.astype(q.dtype), state, *tapped)


def _taps_of(cache: Any, B: int, S: int) -> tuple[Taps | None, tuple[int, ...]]:
    """The `tapping` block's taps and the counts inside a step of `S` tokens (one sequence)."""
    taps = _TAPS.get() if cache is not None and B == 1 else None
    return taps, tuple(r for r in taps.at if 0 < r < S) if taps is not None else ()


def _keep_taps(layer: Any, taps: Taps, cache: Any, conv_input: mx.array, at, tapped) -> None:
    keep = layer.conv_kernel_size - 1
    taps.found[id(cache)] = [
        [mx.contiguous(conv_input[:, r : r + keep, :]), tapped[0][i]] for i, r in enumerate(at)
    ]


def _gated_norm(norm: Any, out: mx.array, z: mx.array) -> mx.array:
    """The layer's output norm, ``silu(z) * rms_norm(out)``, with one pass of our kernel for
    the activation (MLX's sigmoid is scalar on x86)."""
    if out.dtype != mx.float32 or z.dtype != mx.float32:
        return norm(out, z)
    return rowops.silu_mul(z, mx.fast.rms_norm(out, norm.weight, norm.eps))


def _one_step(layer: Any, inputs: mx.array, mask: Any, cache: Any) -> bool:
    """Whether a call is a decode step `_decode_step` takes: one float32 token a row, no
    mask or a row mask (a batched cache's left padding), a cache without lengths that
    records no history (mlx-vlm's speculation) and whose entries are the step's rows, one
    process."""
    B = inputs.shape[0]
    return (
        inputs.shape[1] == 1
        and (mask is None or (mask.dtype == mx.bool_ and mask.shape == (B, 1)))
        and cache is not None
        and getattr(cache, "lengths", None) is None
        and not getattr(cache, "history_capacity", 0)
        and all(c is None or c.shape[0] == B for c in (cache[0], cache[1]))
        and getattr(layer, "sharding_group", None) is None
        and inputs.dtype == mx.float32
        and all(
            p.dtype == mx.float32
            for p in (layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight)
        )
    )


def _decode_step(layer: Any, inputs: mx.array, cache: Any, mask: Any = None) -> mx.array:
    """The layer's decode step: its four projections, then `kernels.delta.delta_step` (the
    convolution, norms, gate, recurrence and output norm in one graph node, where the
    library builds about twenty), then its output projection."""
    B = inputs.shape[0]
    qkv = layer.in_proj_qkv(inputs)
    z = layer.in_proj_z(inputs).reshape(B, 1, layer.num_v_heads, layer.head_v_dim)
    b, a = layer.in_proj_b(inputs), layer.in_proj_a(inputs)  # mlx-vlm's `_project_gates`
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), dtype=mx.float32)
    state = cache[1]
    if state is None:
        shape = (B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim)
        state = mx.zeros(shape, dtype=mx.float32)
    out, cache[0], cache[1] = delta.delta_step(
        qkv,
        conv_state,
        layer.conv1d.weight,
        a,
        b,
        layer.A_log,
        layer.dt_bias,
        state.astype(mx.float32),
        z,
        layer.norm.weight,
        heads_k=layer.num_k_heads,
        key_dim=layer.head_k_dim,
        value_dim=layer.head_v_dim,
        norm_eps=layer.norm.eps,
        mask=mask,
    )
    cache.advance(1)
    return layer.out_proj(out)


def _call(self, inputs: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    """mlx-lm's layer (`EXPECTED_LAYER`) on our primitives."""
    if self.training or mx.default_device() != mx.cpu or not kernels.status().active:
        return _library_call(self, inputs, mask, cache)
    if _one_step(self, inputs, mask, cache):
        return _decode_step(self, inputs, cache, mask)
    B, S, _ = inputs.shape
    if self.sharding_group is not None:
        inputs = sum_gradients(self.sharding_group)(inputs)
    qkv = self.in_proj_qkv(inputs)
    z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
    b = self.in_proj_b(inputs)
    a = self.in_proj_a(inputs)
    (q, k, v), conv_input = _convolved(self, qkv, mask, cache)
    state = cache[1] if cache else None
    q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
    taps, at = _taps_of(cache, B, S)
    g = compute_g(self.A_log, a, self.dt_bias)
    out, state, *tapped = _recurrence(q, k, v, g, mx.sigmoid(b), state, mask, at)
    if tapped:
        _keep_taps(self, taps, cache, conv_input, at, tapped)
    if cache is not None:
        cache[1] = state
        cache.advance(S)
    out = self.out_proj(_gated_norm(self.norm, out, z).reshape(B, S, -1))
    if self.sharding_group is not None:
        out = mx.distributed.all_sum(out, group=self.sharding_group)
    return out


def _vlm_call(self, inputs: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    """mlx-vlm's layer (`EXPECTED_VLM_LAYER`) on our primitives: the states still go through
    its cache's `update_window` and `update_recurrent`; a cache that records history (its
    speculative decoding) runs the library's layer."""
    if (
        self.training
        or mx.default_device() != mx.cpu
        or not kernels.status().active
        or getattr(cache, "history_capacity", 0)
    ):
        return DELTA_VLM.library_class().__call__(self, inputs, mask, cache)
    B, S, _ = inputs.shape
    if mask is not None and mask.shape[0] != B:
        mask = None
    if _one_step(self, inputs, mask, cache):
        return _decode_step(self, inputs, cache, mask)
    qkv = self.in_proj_qkv(inputs)
    z = self.in_proj_z(inputs).reshape(B, S, -1, self.head_v_dim)
    b, a = self._project_gates(inputs)
    keep = self.conv_kernel_size - 1
    conv_state = cache[0] if cache is not None else None
    if conv_state is None or conv_state.shape[0] != B:
        conv_state = mx.zeros((B, keep, self.conv_dim), dtype=inputs.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    if cache is not None:
        cache.update_window(0, conv_input, keep, lengths=cache.lengths)
    q, k, v = _conv_heads(self, conv_input)
    q, k = self._normalize_qk(q, k)
    g, beta = sys.modules[_VLM_DELTA_MODULE]._compute_g_beta(self.A_log, a, b, self.dt_bias)
    taps, at = _taps_of(cache, B, S)

    def update(initial: mx.array | None, _steps: Any) -> tuple[mx.array, ...]:
        state = initial if initial is not None and initial.shape[0] == B else None
        out, state, *tapped = _recurrence(q, k, v, g, beta, state, mask, at)
        if tapped:
            _keep_taps(self, taps, cache, conv_input, at, tapped)
        return out, state

    if cache is None:
        out, _ = update(None, None)
    else:
        out, _ = cache.update_recurrent(1, S, update)
        cache.advance(S)
        sys.modules[_VLM_MODULE]._qwen3_5_advance_lengths_info(cache, S)
    return self.out_proj(_gated_norm(self.norm, out, z).reshape(B, S, -1))


DELTA = InstanceRoute(
    name="gated-delta-qwen3_5",
    bodies=(
        Body(_MODULE, "GatedDeltaNet.__call__", EXPECTED_LAYER),
        Body(_DELTA_MODULE, "gated_delta_update", EXPECTED_UPDATE),
        Body(_DELTA_MODULE, "gated_delta_ops", EXPECTED_OPS),
        Body(_DELTA_MODULE, "_gated_delta_step_ops", EXPECTED_STEP),
        Body(_NEXT_MODULE, "Qwen3NextRMSNormGated.__call__", EXPECTED_NORM),
        Body("mlx_lm.models.activations", "precise_swiglu", EXPECTED_SWIGLU),
    ),
    checked_with="mlx-lm 0.32.2",
    refusal="Qwen 3.5's linear attention is not on the CPU kernel",
    fallback="its layers run mlx-lm's gated_delta_ops (a Python loop, about 30x slower)",
    methods={"__call__": _call},
    prefix="Cpu",
)


DELTA_VLM = InstanceRoute(
    name="gated-delta-vlm-qwen3_5",
    bodies=(
        Body(_VLM_MODULE, "Qwen3_5GatedDeltaNet.__call__", EXPECTED_VLM_LAYER),
        Body(_VLM_MODULE, "Qwen3_5GatedDeltaNet._normalize_qk", EXPECTED_VLM_NORMALIZE),
        Body(_VLM_DELTA_MODULE, "gated_delta_update", EXPECTED_VLM_UPDATE),
        Body(_VLM_DELTA_MODULE, "compute_g", EXPECTED_VLM_G),
        Body(_VLM_DELTA_MODULE, "_compute_g_beta", EXPECTED_VLM_G_BETA),
        Body(_VLM_DELTA_MODULE, "gated_delta_ops", EXPECTED_OPS),
        Body(_VLM_DELTA_MODULE, "_gated_delta_step_ops", EXPECTED_STEP),
        Body(_VLM_MODULE, "Qwen3_5RMSNormGated.__call__", EXPECTED_VLM_NORM),
        Body(_VLM_MODULE, "_precise_swiglu", EXPECTED_SWIGLU),
        Body(_VLM_CACHE_MODULE, "ArraysCache.update_window", EXPECTED_VLM_WINDOW),
        Body(_VLM_CACHE_MODULE, "ArraysCache.update_recurrent", EXPECTED_VLM_RECURRENT),
    ),
    checked_with="mlx-vlm 0.7.10",
    refusal="Qwen 3.5's linear attention (mlx-vlm) is not on the CPU kernel",
    fallback="its layers run mlx-vlm's chunked scan (about 3x slower) and per-token decode loop",
    methods={"__call__": _vlm_call},
    prefix="Cpu",
)


def route(model: Any, routing: Routing) -> bool:
    """Route `model`'s Qwen 3.5 linear-attention layers (any it has: mlx-lm's, or mlx-vlm's
    in a vision model) to the primitive where the kernels are active and the library's
    bodies are the ones restated; never raises. Returns whether any layer is routed."""
    if not kernels.status().active:
        return False
    return sum(routing.swap(r, model) for r in _routes_here()) > 0


def variant() -> str | None:
    """What the fingerprint records for a model whose layers are routed (the kernel set, whose
    vector widths decide the last bits, and the digest of `VARIANT_SOURCES`)."""
    if not kernels.status().active:
        return None
    return f"delta-{kernels.status().isa}-{digest.of_files(VARIANT_SOURCES)}"

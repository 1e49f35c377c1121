"""Route attention on the CPU to our kernel: the route of attention.

mlx-lm's models call ``mlx_lm.models.base.scaled_dot_product_attention``, which calls
``mx.fast.scaled_dot_product_attention`` for an unquantized cache; some models (and
mlx-vlm's) call ``mx.fast.scaled_dot_product_attention`` directly. Each model module imports
mlx-lm's function by name, so replacing that function would miss the modules already
imported; `ATTENTION`, a `routes.ProcessRoute`, replaces
``mx.fast.scaled_dot_product_attention`` itself, which both paths look up at call time, while
a model holds it (the library's is back once the last one lets go). It applies only while
mlx-lm's function is the body restated (it must still look ours up).

A *routed* call is one our kernel (`mlx_nbengine.kernels.attention`) handles: float32
queries, keys and values of 4 dimensions with grouped-query heads, on the CPU device, no
attention sinks, and a mask that is None, ``"causal"`` (at least as many keys as queries)
or a bool array broadcastable to [B, Hq, L, S]. MLX's CPU attention is its composed
fallback (matmul, scalar softmax, matmul); ours keeps the products on the BLAS and
vectorizes the softmax. Everything else (additive masks, half precision, the GPU) calls the
library's function.

It changes logits by float rounding only (tests/test_attention_kernel.py measures it), and
`variant` names it in the model fingerprint so cached blocks never mix with MLX's.
tests/test_attention_kernel.py fails loudly when mlx-lm stops calling the function we
replace.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_nbengine import kernels
from mlx_nbengine.kernels import digest
from mlx_nbengine.models.routes import Body, ProcessRoute, Routing

__all__ = ["ATTENTION", "VARIANT_SOURCES", "routable", "route", "variant"]

# The files that decide a routed call's bits (`variant` is their digest): this module and the
# attention kernels (the set's name comes from qkernels.h).
VARIANT_SOURCES = (
    "models/attnroute.py",
    *digest.COMMON,
    *digest.kernel_source(
        "attention.h",
        "attention.cpp",
        "attention_math.h",
        "attention_portable.cpp",
        "attention_x86.cpp",
        "qkernels.h",
    ),
)


def _mask_fits(mask: Any, b: int, hq: int, length: int, keys: int) -> bool:
    if mask is None:
        return True
    if isinstance(mask, str):
        return mask == "causal" and keys >= length
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim > 4:
        return False
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    return (
        shape[0] in (1, b) and shape[1] in (1, hq) and shape[2] in (1, length) and shape[3] == keys
    )


def routable(q: Any, k: Any, v: Any, mask: Any = None, sinks: Any = None) -> bool:
    """Whether a call with these arguments runs on our kernel (see the module docstring)."""
    if sinks is not None or mx.default_device() != mx.cpu:
        return False
    arrays = (q, k, v)
    if not all(isinstance(a, mx.array) and a.ndim == 4 and a.dtype == mx.float32 for a in arrays):
        return False
    b, hq, length, d = q.shape
    _, hkv, keys, _ = k.shape
    return (
        k.shape[0] == b
        and v.shape[:3] == k.shape[:3]
        and k.shape[3] == d
        and hkv > 0
        and hq % hkv == 0
        and _mask_fits(mask, b, hq, length, keys)
    )


def _scaled_dot_product_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: Any = None,
    stream: Any = None,
    **kwargs: Any,
) -> mx.array:
    if stream is None and not kwargs and routable(q, k, v, mask, sinks):
        if isinstance(mask, str):
            return kernels.attention(q, k, v, scale=scale, causal=True)
        return kernels.attention(q, k, v, scale=scale, mask=mask)
    library = ATTENTION.library["scaled_dot_product_attention"]
    return library(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream, **kwargs)


# mlx-lm's attention function, which looks mx.fast's up at call time (the models that call
# MLX directly do too).
_MLX_LM_ATTENTION = """\
if hasattr(cache, "bits"):
    if sinks is not None:
        raise ValueError("Quantized SDPA does not support attention sinks.")
    return quantized_scaled_dot_product_attention(
        queries,
        keys,
        values,
        scale=scale,
        mask=mask,
        group_size=cache.group_size,
        bits=cache.bits,
    )
else:
    return mx.fast.scaled_dot_product_attention(
        queries,
        keys,
        values,
        scale=scale,
        mask=mask,
        sinks=sinks,
    )"""

ATTENTION = ProcessRoute(
    name="attention",
    bodies=(Body("mlx_lm.models.base", "scaled_dot_product_attention", _MLX_LM_ATTENTION),),
    checked_with="mlx 0.32.4, mlx-lm 0.32.2",
    refusal="the CPU attention kernel is not used",
    fallback="attention runs MLX's own function",
    namespace=mx.fast,
    replacements={"scaled_dot_product_attention": _scaled_dot_product_attention},
)


def route(routing: Routing) -> bool:
    """Route CPU attention to our kernel for a model (`ATTENTION` held by `routing`) where the
    kernels are active; never raises. Returns whether it is routed."""
    if not kernels.status().active or kernels.attention_isa() is None:
        return False
    return routing.hold(ATTENTION)


def variant() -> str | None:
    """What the fingerprint records for a model whose attention is routed (its kernel set, as
    the sets differ in the last bits, and the digest of `VARIANT_SOURCES`); None where the
    kernels are not active."""
    if not kernels.status().active or kernels.attention_isa() is None:
        return None
    return f"attn-{kernels.attention_isa()}-{digest.of_files(VARIANT_SOURCES)}"

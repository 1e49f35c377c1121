"""Route RMS norm and RoPE on the CPU to our kernels: the routes of norms and RoPE.

Every model family calls ``mx.fast.rms_norm`` (``nn.RMSNorm`` and the families' own norms)
and ``mx.fast.rope`` (``nn.RoPE`` and the scaled variants in mlx-lm's ``rope_utils``),
looking them up at call time; `ROWS`, a `routes.ProcessRoute`, replaces those two functions
of ``mx.fast`` while a model holds it (the library's are back once the last one lets go). On the
CPU MLX 0.32 computes each as a graph of a dozen or more small operations (RoPE its cos and
sin every call): a decode step of Gemma 3 270M runs 109 norms and 36 RoPEs, about a fifth of
its time. Ours are one primitive each (`mlx_nbengine.kernels.rowops`).

Gemma's norms (``gemma``, ``gemma2``, ``gemma3_text``) scale by ``1 + weight``, which they
add again on every call: two more graph nodes per norm, 218 of a decode step's 1,203 nodes
in Gemma 3 270M. While routed (`OFFSET_NORMS`: per module of a model that holds `ROWS`,
only where the library's body is still the one restated), their ``__call__`` reuses the sum
for as long as the weight is the same array.

A *routed* call is a float32 input on the CPU device with no explicit stream (RoPE: at
least 3 dimensions, an even ``dims``, an int or int32 array offset); everything else calls
the library's function. Results differ from MLX's in float rounding: sums in another order,
and RoPE's angles taken in double precision (MLX's float32 angles lose about 1e-3 radians by
position 9,000). `variant` names the change in the model fingerprint, so cached blocks never
mix with MLX's; the first hold checks each kernel against the library's function. Where
a Gemma norm's body differs from the one restated, one line on stderr says that it keeps the
library's call.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_nbengine import kernels
from mlx_nbengine.kernels import digest, rowops
from mlx_nbengine.models.routes import Body, InstanceRoute, ProcessRoute, Routing

__all__ = [
    "OFFSET_NORMS",
    "ROWS",
    "VARIANT_SOURCES",
    "offset_fits",
    "offset_norm_weight",
    "route",
    "variant",
]

# The files that decide a routed call's bits (`variant` is their digest): this module and the
# row primitives (their Python face and C++; rowops.h takes the set from qmatvec.h).
VARIANT_SOURCES = (
    "models/fastops.py",
    "kernels/rowops.py",
    *digest.COMMON,
    *digest.kernel_source(
        "rowops.h",
        "rowops.cpp",
        "rowops_bindings.cpp",
        "attention_math.h",
        "qmatvec.h",
        "qkernels.h",
    ),
)

CHECKED_WITH = "mlx 0.32.4, mlx-lm 0.32.2"

# A routed Gemma norm's (weight, 1 + weight), held on the norm itself (it goes with the
# model; not a parameter).
_SUM_ATTRIBUTE = "_mlx_nbengine_offset_sum"


def _offset_sum(norm: Any) -> mx.array:
    weight = norm.weight
    held = norm.__dict__.get(_SUM_ATTRIBUTE)
    if held is None or held[0] is not weight:  # a new norm, or new weights loaded into it
        held = (weight, 1.0 + weight)
        # Past nn.Module's __setattr__, which would take the arrays for parameters.
        object.__setattr__(norm, _SUM_ATTRIBUTE, held)
    return held[1]


def _offset_norm_call(self: Any, x: mx.array) -> mx.array:
    return mx.fast.rms_norm(x, _offset_sum(self), self.eps)


# mlx-lm's Gemma norms that add 1 to their weight on every call.
OFFSET_NORMS = tuple(
    InstanceRoute(
        name=f"offset-norm-{family}",
        bodies=(
            Body(
                f"mlx_lm.models.{family}",
                "RMSNorm.__call__",
                "return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)",
            ),
        ),
        checked_with=CHECKED_WITH,
        refusal=f"Gemma's norms keep their library call for {family}",
        fallback="they add 1 to their weight on every call (two graph nodes a norm more)"
        + (", and Gemma 3's decoder layer is not fused" if family == "gemma3_text" else ""),
        methods={"__call__": _offset_norm_call},
    )
    for family in ("gemma", "gemma2", "gemma3_text")
)


def offset_norm_weight(norm: Any) -> mx.array | None:
    """The weight a routed Gemma norm (`OFFSET_NORMS`) scales by, ``1 + weight``, as its call
    passes it to the kernel; None for any other module, or while not routed."""
    if not any(each.routes(norm) for each in OFFSET_NORMS):
        return None
    return _offset_sum(norm)


def _on_cpu(stream: Any) -> bool:
    return stream is None and mx.default_device() == mx.cpu


def _rms_norm(x: Any, weight: Any, eps: float, *, stream: Any = None) -> mx.array:
    if (
        _on_cpu(stream)
        and isinstance(x, mx.array)
        and x.dtype == mx.float32
        and x.ndim >= 1
        and (
            weight is None
            or (
                isinstance(weight, mx.array)
                and weight.dtype == mx.float32
                and weight.shape == (x.shape[-1],)
            )
        )
    ):
        return rowops.rms_norm(x, weight, eps)
    return ROWS.library["rms_norm"](x, weight, eps, stream=stream)


def offset_fits(offset: Any, batch: int) -> bool:
    """Whether RoPE's `offset` is one the kernel takes (an int, or an integer array of one
    offset or one per batch row)."""
    if isinstance(offset, int) and not isinstance(offset, bool):
        return True
    return (
        isinstance(offset, mx.array)
        and mx.issubdtype(offset.dtype, mx.integer)
        and (offset.ndim == 0 or (offset.ndim == 1 and offset.size in (1, batch)))
    )


def _rope(
    a: Any,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: Any,
    freqs: Any = None,
    stream: Any = None,
) -> mx.array:
    if (
        _on_cpu(stream)
        and isinstance(a, mx.array)
        and a.dtype == mx.float32
        and a.ndim >= 3
        and isinstance(dims, int)
        and 0 < dims <= a.shape[-1]
        and dims % 2 == 0
        and (base is None) != (freqs is None)
        and (freqs is None or (isinstance(freqs, mx.array) and freqs.shape == (dims // 2,)))
        and offset_fits(offset, a.shape[0])
    ):
        return rowops.rope(
            a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
        )
    return ROWS.library["rope"](
        a,
        dims,
        traditional=traditional,
        base=base,
        scale=scale,
        offset=offset,
        freqs=freqs,
        stream=stream,
    )


def _agrees() -> str | None:
    """None where each kernel matches the library on a small case, else what differs."""
    library_norm, library_rope = ROWS.library["rms_norm"], ROWS.library["rope"]
    with mx.stream(mx.cpu):
        x = mx.random.normal((2, 3, 5, 64), key=mx.random.key(7))
        w = mx.random.normal((64,), key=mx.random.key(8))
        want = library_norm(x, w, 1e-5)
        if not mx.allclose(rowops.rms_norm(x, w, 1e-5), want, rtol=1e-4, atol=1e-5).item():
            return "rms_norm"
        for traditional in (False, True):
            args = dict(traditional=traditional, base=10000.0, scale=1.0, offset=11)
            want = library_rope(x, 48, **args)
            if not mx.allclose(rowops.rope(x, 48, **args), want, rtol=1e-4, atol=1e-5).item():
                return "rope"
    return None


# mx.fast's norm and RoPE (C++ functions: no body to restate; `_agrees` compares them).
ROWS = ProcessRoute(
    name="rows",
    bodies=(),
    checked_with="mlx 0.32.4",
    refusal="CPU norm and RoPE kernels not used",
    fallback="norms and RoPE run MLX's own functions",
    namespace=mx.fast,
    replacements={"rms_norm": _rms_norm, "rope": _rope},
    probe=_agrees,
)


def route(model: Any, routing: Routing) -> bool:
    """Route CPU norms and RoPE to our kernels for `model` (`ROWS` held, its Gemma norms
    swapped) where the kernels are active; never raises. Returns whether they are routed."""
    if not kernels.status().active or not routing.hold(ROWS):
        return False
    for each in OFFSET_NORMS:
        routing.swap(each, model)
    return True


def variant() -> str | None:
    """What the fingerprint records for a model whose norms and RoPE are routed (the kernel
    set and the digest of `VARIANT_SOURCES`); None where the kernels are not active."""
    if not kernels.status().active:
        return None
    return f"rows-{kernels.status().isa}-{digest.of_files(VARIANT_SOURCES)}"

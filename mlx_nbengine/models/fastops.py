"""Route RMS norm and RoPE on the CPU to our kernels: the one module that patches them.

Every model family calls ``mx.fast.rms_norm`` (``nn.RMSNorm`` and the families' own norms)
and ``mx.fast.rope`` (``nn.RoPE`` and the scaled variants in mlx-lm's ``rope_utils``),
looking them up at call time; `install` replaces those two functions of ``mx.fast``. On the
CPU MLX 0.32 computes each as a graph of a dozen or more small operations (RoPE its cos and
sin every call): a decode step of Gemma 3 270M runs 109 norms and 36 RoPEs, about a fifth of
its time. Ours are one primitive each (`mlx_nbengine.kernels.rowops`).

Gemma's norms (``gemma``, ``gemma2``, ``gemma3_text``) scale by ``1 + weight``, which they
add again on every call: two more graph nodes per norm, 218 of a decode step's 1,203 nodes
in Gemma 3 270M. While routed, their ``__call__`` (only where the library's is still the
line `_OFFSET_NORM_BODY`) reuses the sum for as long as the weight is the same array.

A *routed* call is a float32 input on the CPU device with no explicit stream (RoPE: at
least 3 dimensions, an even ``dims``, an int or int32 array offset); everything else calls
the library's function. Results differ from MLX's in float rounding: sums in another order,
and RoPE's angles taken in double precision (MLX's float32 angles lose about 1e-3 radians by
position 9,000). `variant` names the change in the model fingerprint, so cached blocks never
mix with MLX's; `install` first checks each kernel against the library's function. Where
a Gemma norm's line differs from the one restated, one line on stderr says that it keeps the
library's call.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from typing import Any

import mlx.core as mx

from mlx_nbengine import kernels
from mlx_nbengine.kernels import digest, rowops

__all__ = [
    "VARIANT_SOURCES",
    "install",
    "installed",
    "offset_fits",
    "offset_norm_weight",
    "uninstall",
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

_original: dict[str, Any] = {}

# mlx-lm's Gemma norms that add 1 to their weight on every call, and the body they run.
_OFFSET_NORMS = ("gemma", "gemma2", "gemma3_text")
_OFFSET_NORM_BODY = "return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)"
_offset_sums: dict[int, tuple[Any, mx.array]] = {}  # id(norm) -> (its weight, 1 + weight)
_norm_classes: dict[type, Any] = {}  # class -> its library __call__, while replaced


def _offset_sum(norm: Any) -> mx.array:
    weight = norm.weight
    held = _offset_sums.get(id(norm))
    if held is None or held[0] is not weight:  # a new norm, or new weights loaded into it
        if len(_offset_sums) > 65536:  # norms of models long gone
            _offset_sums.clear()
        held = (weight, 1.0 + weight)
        _offset_sums[id(norm)] = held
    return held[1]


def _offset_norm_call(self: Any, x: mx.array) -> mx.array:
    return mx.fast.rms_norm(x, _offset_sum(self), self.eps)


def offset_norm_weight(norm: Any) -> mx.array | None:
    """The weight a routed Gemma norm (`_OFFSET_NORMS`) scales by, ``1 + weight``, as its call
    passes it to the kernel; None for any other module, or while not routed."""
    if type(norm).__call__ is not _offset_norm_call:
        return None
    return _offset_sum(norm)


def _offset_norm_classes() -> list[type]:
    """mlx-lm's Gemma norm classes whose ``__call__`` still ends in `_OFFSET_NORM_BODY`; one
    line on stderr names those that changed (they add 1 to their weight on every call)."""
    found: list[type] = []
    changed: list[str] = []
    for name in _OFFSET_NORMS:
        try:
            cls = importlib.import_module(f"mlx_lm.models.{name}").RMSNorm
            library = _norm_classes.get(cls, cls.__call__)  # the library's, even while replaced
            body = textwrap.dedent(inspect.getsource(library)).strip().splitlines()[-1]
        except (ImportError, AttributeError, OSError, TypeError):
            continue
        if body.strip() == _OFFSET_NORM_BODY:
            found.append(cls)
        else:
            changed.append(name)
    if changed:
        layer = ", and Gemma 3's decoder layer is not fused" if "gemma3_text" in changed else ""
        print(
            f"mlx_nbengine: Gemma's norms keep their library call for {', '.join(changed)}: "
            "mlx-lm's RMSNorm.__call__ there is not the line restated "
            "(fastops._OFFSET_NORM_BODY); they add 1 to their weight on every call (two graph "
            f"nodes a norm more){layer}",
            file=sys.stderr,
        )
    return found


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
    return _original["rms_norm"](x, weight, eps, stream=stream)


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
    return _original["rope"](
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
    with mx.stream(mx.cpu):
        x = mx.random.normal((2, 3, 5, 64), key=mx.random.key(7))
        w = mx.random.normal((64,), key=mx.random.key(8))
        want = mx.fast.rms_norm(x, w, 1e-5)
        if not mx.allclose(rowops.rms_norm(x, w, 1e-5), want, rtol=1e-4, atol=1e-5).item():
            return "rms_norm"
        for traditional in (False, True):
            args = dict(traditional=traditional, base=10000.0, scale=1.0, offset=11)
            want = mx.fast.rope(x, 48, **args)
            if not mx.allclose(rowops.rope(x, 48, **args), want, rtol=1e-4, atol=1e-5).item():
                return "rope"
    return None


def installed() -> bool:
    """Whether norms and RoPE route to our kernels in this process."""
    return bool(_original)


def install() -> bool:
    """Route CPU norms and RoPE to our kernels (once) where the kernels are active; never
    raises. Returns whether they are routed."""
    if _original:
        return True
    if not kernels.status().active:
        return False
    try:
        wrong = _agrees()
    except Exception as e:  # noqa: BLE001 - a kernel problem must never stop a model
        wrong = f"{type(e).__name__}: {e}"
    if wrong is not None:
        print(
            f"mlx_nbengine: CPU norm and RoPE kernels not used ({wrong} disagrees)", file=sys.stderr
        )
        return False
    _original["rms_norm"] = mx.fast.rms_norm
    _original["rope"] = mx.fast.rope
    mx.fast.rms_norm = _rms_norm
    mx.fast.rope = _rope
    for cls in _offset_norm_classes():
        _norm_classes[cls] = cls.__call__
        cls.__call__ = _offset_norm_call
    return True


def uninstall() -> None:
    """Give MLX its own norm and RoPE back (tests compare both ways)."""
    if _original:
        mx.fast.rms_norm = _original.pop("rms_norm")
        mx.fast.rope = _original.pop("rope")
    for cls, call in _norm_classes.items():
        cls.__call__ = call
    _norm_classes.clear()
    _offset_sums.clear()


def variant() -> str | None:
    """What the fingerprint records while they are routed (the kernel set and the digest of
    `VARIANT_SOURCES`), else None."""
    if not _original:
        return None
    return f"rows-{kernels.status().isa}-{digest.of_files(VARIANT_SOURCES)}"

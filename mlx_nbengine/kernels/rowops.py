"""RMS norm, RoPE and a gated GELU as our own CPU primitives (src/rowops.h), in the kernels'
one module.

MLX 0.32 runs ``mx.fast.rms_norm`` and ``mx.fast.rope`` on the CPU as graphs of a dozen or
more small operations each (RoPE recomputes its cos and sin on every call); each of these is
one primitive, float32, vectorized for the kernel set `kernels.status` chose.
`models/fastops.py` routes the library's functions here.
"""

from __future__ import annotations

import mlx.core as mx

import mlx_nbengine.kernels as _kernels
from mlx_nbengine import _blas

__all__ = ["gelu_tanh_mul", "rms_norm", "rope", "silu_mul"]


def _module():
    if not _kernels.status().active:
        raise RuntimeError(f"the CPU kernels are not active ({_kernels.status().reason})")
    return _kernels._module  # noqa: SLF001 - the package's one built module


def gelu_tanh_mul(
    gate: mx.array, up: mx.array, *, isa: str | None = None, threads: int | None = None
) -> mx.array:
    """``gelu_tanh(gate) * up`` (GELU's tanh approximation, tanh by `cpu_math`'s rational
    fit) for float32 arrays of one shape on the CPU: a GELU-gated MLP's activation, split
    over `threads` (default: the step's BLAS thread count)."""
    return _module().gelu_tanh_mul(
        gate, up, isa or _kernels.status().isa, threads or _blas.current_threads()
    )


def silu_mul(
    gate: mx.array, up: mx.array, *, isa: str | None = None, threads: int | None = None
) -> mx.array:
    """``silu(gate) * up`` for float32 arrays of one shape on the CPU (SwiGLU's activation;
    silu(x) = x / (1 + exp(-x)), exp by the attention kernels' polynomial), split over
    `threads` (default: the step's BLAS thread count)."""
    return _module().silu_mul(
        gate, up, isa or _kernels.status().isa, threads or _blas.current_threads()
    )


def rms_norm(
    x: mx.array, weight: mx.array | None, eps: float, *, isa: str | None = None
) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)`` for a float32 `x` on the CPU."""
    return _module().rms_norm(x, weight, float(eps), isa or _kernels.status().isa)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
    isa: str | None = None,
) -> mx.array:
    """``mx.fast.rope`` of a float32 `x` on the CPU; `offset` an int, or an array of one
    offset or one per batch row."""
    if not isinstance(offset, mx.array):
        offset = mx.array(int(offset), dtype=mx.int32)
    return _module().rope(
        x,
        int(dims),
        bool(traditional),
        None if base is None else float(base),
        float(scale),
        offset,
        freqs,
        isa or _kernels.status().isa,
    )

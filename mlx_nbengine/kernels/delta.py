"""The gated delta rule (Qwen 3.5's linear attention) as our own CPU primitive
(src/gated_delta.h), in the kernels' one module.

mlx-lm runs ``gated_delta_update`` on Metal kernels only; on the CPU it falls to
``gated_delta_ops``, a Python loop that calls a compiled step once per token and layer.
`gated_delta` runs every token of a step in one primitive. `models/deltaroute.py` routes
the hybrid family's layers here.
"""

from __future__ import annotations

import mlx.core as mx

import mlx_nbengine.kernels as _kernels
from mlx_nbengine import _blas

__all__ = ["conv_silu", "delta_step", "gated_delta"]


def _module():
    if not _kernels.status().active:
        raise RuntimeError(f"the CPU kernels are not active ({_kernels.status().reason})")
    return _kernels._module  # noqa: SLF001 - the package's one built module


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
    *,
    taps: tuple[int, ...] = (),
    isa: str | None = None,
    threads: int | None = None,
) -> tuple[mx.array, ...]:
    """``gated_delta_ops(q, k, v, g, beta, state, mask)`` on the CPU: q, k [B, T, Hk, Dk],
    v [B, T, Hv, Dv] (Hv a multiple of Hk), a scalar gate g and beta [B, T, Hv], state
    [B, Hv, Dv, Dk], mask [B, T] bool or None; all float32. Returns (y [B, T, Hv, Dv],
    the new state), and where `taps` (ascending token counts in 1..T) are given, the states
    after each of them [len(taps), B, Hv, Dv, Dk] too; split over `threads` (default: the
    step's BLAS thread count)."""
    module = _module()
    return module.gated_delta(
        q,
        k,
        v,
        g,
        beta,
        state,
        mask,
        list(taps),
        isa or _kernels.status().isa,
        threads or _blas.current_threads(),
    )


def conv_silu(
    x: mx.array, w: mx.array, *, isa: str | None = None, threads: int | None = None
) -> mx.array:
    """``nn.silu(conv1d(x))`` for the hybrid layer's short convolution (MLX's ``Conv1d`` with
    groups = channels, no padding, no bias): x [B, S + K - 1, C], w [C, K, 1], float32.
    Returns [B, S, C]."""
    module = _module()
    return module.conv_silu(x, w, isa or _kernels.status().isa, threads or _blas.current_threads())


def delta_step(
    qkv: mx.array,
    conv_state: mx.array,
    conv_w: mx.array,
    a: mx.array,
    b: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    z: mx.array,
    norm_w: mx.array,
    *,
    heads_k: int,
    key_dim: int,
    value_dim: int,
    norm_eps: float,
    mask: mx.array | None = None,
    isa: str | None = None,
    threads: int | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """A decode step of Qwen 3.5's linear-attention layer between its projections (one token
    a batch row; float32): the short convolution, silu, normalize_qk, the gate and beta, the
    recurrence and the gated output norm in one primitive. qkv [B, 1, C], conv_state
    [B, K - 1, C], conv_w [C, K, 1], a and b [B, 1, Hv], a_log and dt_bias [Hv], state
    [B, Hv, Dv, Dk], z [B, 1, Hv, Dv], norm_w [Dv]. Returns (the normed output
    [B, 1, Hv * Dv], the new conv state, the new state). `mask` (bool [B, 1], a batched
    cache's left padding): a masked row's input counts as zeros and its state is kept, as
    the library's masked token."""
    module = _module()
    return module.delta_step(
        qkv,
        conv_state,
        conv_w,
        a,
        b,
        a_log,
        dt_bias,
        state,
        z,
        norm_w,
        mask,
        int(heads_k),
        int(key_dim),
        int(value_dim),
        float(norm_eps),
        isa or _kernels.status().isa,
        threads or _blas.current_threads(),
    )

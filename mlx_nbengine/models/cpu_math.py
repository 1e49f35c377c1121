"""Faster activations for float32 models on MLX's CPU backend.

MLX's CPU kernels for transcendental functions (``tanh``, ``exp``, ``sigmoid``) are
scalar on x86: about 25 ns per element here, against 0.7 ns for a fused multiply-add
and 1.5 ns for numpy's ``tanh``. Gemma's MLP applies the tanh approximation of GELU
to every hidden unit (2,048 per token and layer in Gemma 3 270M), so on CPU that one
activation took about a fifth of a 256-token prefill step, and a four-row decode step
paid about 5 ms more for it than a one-row step.

*Rational tanh*: ``tanh(z) ~ z * P(z^2) / Q(z^2)`` with P and Q of degree 4, for
``|z| <= 9`` (beyond, float32 tanh is +-1). The coefficients are our own weighted
least-squares fit of ``tanh(z)/z`` on [0, 9] in float64 (Lawson reweighting toward the
minimax error); evaluated in float32 the error is at most 3.2e-7, a few float32 ulps
(``tests/test_cpu_math.py`` checks it). Built only from multiplies, adds, one divide
and a clip, ``mx.compile`` fuses it into one kernel (about 0.4 ns per operation and
element here): about 3.5x faster than MLX's own GELU over a prefill step's activations.

`speed_up(model, routing)` swaps that GELU into the MLP modules of the families in
`GELU_MLPS` (one `routes.InstanceRoute` each) when the weights are float32 on the CPU, and
only when the library's ``__call__`` is still the body we restate, so an mlx-lm update that
changes the MLP leaves the model untouched. It changes outputs by float32 rounding
only; `LoadedModel.fingerprint` records it (`variant`: a digest of the sources that decide
its bits), so cached blocks are never shared with an unmodified model. Where the library's
``__call__`` differs, one line on stderr says that its MLP keeps MLX's GELU.
"""

from __future__ import annotations

from functools import partial
from importlib import import_module
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_nbengine import kernels
from mlx_nbengine.kernels import digest, rowops
from mlx_nbengine.models import fastops, qroute
from mlx_nbengine.models.routes import Body, InstanceRoute, ProcessRoute, Routing

__all__ = [
    "GELU_MLPS",
    "SOFTCAP",
    "VARIANT_SOURCES",
    "cap_logits",
    "gelu_tanh",
    "runs_gelu_mlp",
    "softcap_variant",
    "speed_up",
    "variant",
]

# The files that decide the swapped MLP's bits (`variant` is their digest): this module, the
# row primitive of a prefill step's activation (fastops') and the fused gated MLP of a decode
# step (qroute's).
VARIANT_SOURCES = tuple(
    dict.fromkeys(("models/cpu_math.py", *fastops.VARIANT_SOURCES, *qroute.VARIANT_SOURCES))
)

_TANH_LIMIT = 9.0
_TANH_P = (
    0.9999999064111154,
    0.13373193403958475,
    0.0034865765808515903,
    2.0471735757692857e-05,
    1.3184082163685872e-08,
)
_TANH_Q = (
    1.0,
    0.46706490278360036,
    0.025841959527310217,
    0.0003271376361793971,
    7.702607488883779e-07,
)
_SQRT_2_OVER_PI = 0.7978845608028654


def _horner(coefficients: tuple[float, ...], t: mx.array) -> mx.array:
    acc = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        acc = acc * t + c
    return acc


def tanh_rational(z: mx.array) -> mx.array:
    """tanh from multiplies, adds and one divide (float32 error <= 3.2e-7)."""
    z = mx.clip(z, -_TANH_LIMIT, _TANH_LIMIT)
    t = z * z
    # The fit overshoots 1 by an ulp or two near the limit: keep |tanh| <= 1.
    return mx.clip(z * _horner(_TANH_P, t) / _horner(_TANH_Q, t), -1.0, 1.0)


@partial(mx.compile, shapeless=True)
def gelu_tanh(x: mx.array) -> mx.array:
    """GELU, tanh approximation (the same function as ``nn.gelu_approx``), fused."""
    return 0.5 * x * (1.0 + tanh_rational(_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))))


def _gelu_mlp_call(self, x: mx.array) -> mx.array:
    fused = qroute.routed_gated_mlp(self, x, "gelu_tanh")  # a quantized decode step
    if fused is not None:
        return fused
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype == mx.float32 and mx.default_device() == mx.cpu and kernels.status().active:
        # One pass of our kernel (the same rational tanh) instead of the compiled graph,
        # which MLX runs scalar on x86: a prefill step's activation about 4x faster.
        return self.down_proj(rowops.gelu_tanh_mul(gate, up))
    return self.down_proj(gelu_tanh(gate) * up)


def variant() -> str:
    """What the fingerprint records when `speed_up` changed a model: the rational tanh (r44)
    and the digest of `VARIANT_SOURCES`."""
    return f"cpu-gelu-r44-{digest.of_files(VARIANT_SOURCES)}"


# Gemma 4 caps its logits, ``tanh(logits / cap) * cap``, over the whole vocabulary (262,144
# values a decode step): MLX's scalar tanh took about 4 ms of E2B's 134 ms step here, the
# rational one, fused by mx.compile, about 1.2 ms.
_SOFTCAP_MODULE = "mlx_lm.models.gemma4_text"


@partial(mx.compile, shapeless=True)
def _rational_softcap(softcap: float, x: mx.array) -> mx.array:
    return tanh_rational(x / softcap) * softcap


def _softcap(softcap: Any, x: mx.array) -> mx.array:
    if isinstance(x, mx.array) and x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return _rational_softcap(softcap, x)
    return SOFTCAP.library["logit_softcap"](softcap, x)


def _softcap_agrees() -> str | None:
    """None where ours matches the library's cap on a small case, else what differs."""
    x = mx.random.normal((4, 257), key=mx.random.key(3)) * 40.0
    want = SOFTCAP.library["logit_softcap"](30.0, x)
    if not mx.allclose(_rational_softcap(30.0, x), want, rtol=0.0, atol=1e-4).item():
        return "logit_softcap"
    return None


# The module's compiled ``logit_softcap``, which its model (and `head.split_head`'s capped
# head) looks up at call time. The function itself is what is replaced, so no body is
# restated: the probe compares ours with the library's before the first hold.
SOFTCAP = ProcessRoute(
    name="cpu-softcap-gemma4_text",
    bodies=(),
    probe=_softcap_agrees,
    checked_with="mlx-lm 0.32.2",
    refusal="the CPU tanh is not used for Gemma 4's logit cap",
    fallback="it runs MLX's tanh over the vocabulary (about 3 ms more a decode step)",
    namespace=import_module(_SOFTCAP_MODULE),
    replacements={"logit_softcap": _softcap},
)


def cap_logits(model: Any, routing: Routing) -> bool:
    """Hold `SOFTCAP` for a float32 Gemma 4 text model on the CPU (its logit cap on the
    rational tanh). Returns whether it is held (the fingerprint then names it)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return False
    if type(model).__module__ != _SOFTCAP_MODULE or not getattr(
        model, "final_logit_softcapping", None
    ):
        return False
    return routing.hold(SOFTCAP)


def softcap_variant() -> str:
    """What the fingerprint records where `cap_logits` holds the route."""
    return f"cpu-softcap-r44-{digest.of_files(VARIANT_SOURCES)}"


# The MLP bodies restated: Gemma 2 and 3 call nn.gelu_approx; Gemma 4 calls its module's
# compiled ``geglu``, whose body is restated too.
_GELU_CALL = "return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))"
_GEGLU_CALL = "return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))"
_GEGLU = "return nn.gelu_approx(gate) * x"


def _bodies(module: str, geglu: bool) -> tuple[Body, ...]:
    if not geglu:
        return (Body(module, "MLP.__call__", _GELU_CALL),)
    return (Body(module, "MLP.__call__", _GEGLU_CALL), Body(module, "geglu", _GEGLU))


# mlx-lm's and mlx-vlm's GELU MLPs (the module of each MLP class).
GELU_MLPS = tuple(
    InstanceRoute(
        name=f"cpu-gelu-{family}",
        bodies=_bodies(module, geglu),
        checked_with="mlx-lm 0.32.2, mlx-vlm 0.7.10",
        refusal=f"the CPU GELU is not used for {module}.MLP",
        fallback="it runs the library's nn.gelu_approx (about 3.5x slower on the CPU)",
        methods={"__call__": _gelu_mlp_call},
        prefix="CpuGelu",
    )
    for family, module, geglu in (
        ("gemma3_text", "mlx_lm.models.gemma3_text", False),
        ("gemma2", "mlx_lm.models.gemma2", False),
        ("vlm-gemma3", "mlx_vlm.models.gemma3.language", False),
        ("gemma4_text", "mlx_lm.models.gemma4_text", True),
        ("vlm-gemma4", "mlx_vlm.models.gemma4.language", True),
    )
)


def runs_gelu_mlp(module: Any) -> bool:
    """Whether `module` is an MLP that `speed_up` swapped: its decode step runs
    ``kernels.gated_mlp(..., activation="gelu_tanh")`` where `qroute` routes its layers."""
    return any(each.routes(module) for each in GELU_MLPS)


def _float32_gate(mlp: Any) -> bool:
    gate = getattr(mlp, "gate_proj", None)
    # A quantized gate computes in its scales' dtype (float32 after a float32 cast).
    if isinstance(gate, nn.QuantizedLinear):
        return gate.scales.dtype == mx.float32
    return isinstance(gate, nn.Linear) and gate.weight.dtype == mx.float32


def speed_up(model: Any, routing: Routing) -> int:
    """Swap `gelu_tanh` into `model`'s GELU MLPs (`GELU_MLPS`, held by `routing`) when it runs
    float32 on the CPU.

    Returns how many modules changed (0 on other devices, other dtypes, other
    families, or when a library's MLP is no longer the body restated).
    """
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    return sum(routing.swap(each, model, where=_float32_gate) for each in GELU_MLPS)

"""The kernel sets a test of our CPU kernels runs on (tests/integration/test_qkernels.py,
test_rowops.py, test_attention_kernel.py, test_decode_layer.py): each vectorized set this
CPU has, and the portable one always.

Outside CI a module of such tests is skipped where the kernels are not active (no C++
compiler, a failed build: `kernels.status().reason`). Under ``CI=true`` that never happens:
`tests/conftest.py` stops the session first, with one line (`needs.kernels_missing`). A set
this CPU lacks skips with its reason anywhere; the portable set and this CPU's best set never
skip under CI (`isa_or_skip` fails instead).
"""

from __future__ import annotations

import pytest
from needs import IN_CI  # tests/ is on sys.path

from mlx_nbengine import kernels

ISAS = ("avx512", "avx2", "portable")

needs_kernels = pytest.mark.skipif(
    not kernels.status().active, reason=f"kernels not active: {kernels.status().reason}"
)


def best_isa() -> str | None:
    """The best set this CPU runs (what ``MLX_NBENGINE_KERNELS=auto`` chooses); None where
    the kernels are not active."""
    return kernels.usable_isa(ISAS[0])


def _lacks(isa: str, runs: str | None) -> str:
    """`isa`, or skip the test where this CPU runs `runs` for it, a lesser set."""
    if runs == isa:
        return isa
    reason = f"this CPU has no {isa}"
    if IN_CI and isa in ("portable", best_isa()):
        pytest.fail(f"CI=true, but the {isa} kernels would skip ({reason})", pytrace=False)
    pytest.skip(reason)


def isa_or_skip(isa: str) -> str:
    """`isa`, or skip the test where this CPU runs a lesser set for it."""
    return _lacks(isa, kernels.usable_isa(isa))


def attention_isa_or_skip(isa: str) -> str:
    """`isa`, or skip the test where this CPU runs a lesser attention set for it."""
    return _lacks(isa, kernels.attention_isa(isa))

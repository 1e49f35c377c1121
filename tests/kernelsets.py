"""The kernel sets a test of our CPU kernels runs on (tests/test_qkernels.py,
test_rowops.py, test_attention_kernel.py): each vectorized set this CPU has, and the
portable one always; a module of such tests is skipped where the kernels are not active."""

from __future__ import annotations

import pytest

from mlx_nbengine import kernels

ISAS = ("avx512", "avx2", "portable")

needs_kernels = pytest.mark.skipif(
    not kernels.status().active, reason=f"kernels not active: {kernels.status().reason}"
)


def isa_or_skip(isa: str) -> str:
    """`isa`, or skip the test where this CPU runs a lesser set for it."""
    if kernels.usable_isa(isa) != isa:
        pytest.skip(f"this CPU has no {isa}")
    return isa

"""The child process of the BLAS guard (`_blaslib.probe`): ``python -P _blas_probe.py LIB``.

Loads LIB into the global symbol scope, as `_blas` would, and checks ``cblas_sgemm`` on
several shapes (1x1x1 up to a few hundred, every transpose pair, beta 0 and 1) through
ctypes, then MLX's own matmul bound to it, each against numpy in float64. Before each call it
prints ``trying ...`` so a parent whose child died knows where. Its last line is the verdict
as JSON: ok, reason, config, core, max_error. It imports nothing of mlx_nbengine.
"""

from __future__ import annotations

import ctypes
import json
import sys

# float32 products of length k: the error bound grows with k; 1e-4 relative to the norm of
# |a| @ |b| is far above float32 rounding (about 6e-8 * k) and far below any wrong kernel.
TOLERANCE = 1e-4
SHAPES = [(1, 1, 1), (2, 3, 4), (7, 5, 3), (16, 16, 16), (33, 17, 65), (64, 64, 64)]
SHAPES += [(1, 640, 2048), (257, 129, 96), (512, 256, 384)]
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def say(line: str) -> None:
    print(line, flush=True)


def main(path: str) -> dict:
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    for name in ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm"):
        if not hasattr(lib, name):
            return {"ok": False, "reason": f"it does not export {name}"}
    config, core = _identify(lib)

    import numpy as np

    rng = np.random.default_rng(0)
    checker = _Checker()
    wrong = _check_sgemm(lib, rng, checker) or _check_mlx(rng, checker)
    if wrong:
        return {"ok": False, "reason": wrong, "config": config, "core": core}
    return {
        "ok": True,
        "reason": "passed its check",
        "config": config,
        "core": core,
        "max_error": checker.worst,
    }


def _identify(lib: ctypes.CDLL) -> tuple[str | None, str | None]:
    """OpenBLAS's build configuration and the core it chose (None where not OpenBLAS)."""
    config = core = None
    if hasattr(lib, "openblas_get_config"):
        lib.openblas_get_config.restype = ctypes.c_char_p
        config = lib.openblas_get_config().decode(errors="replace")
    if hasattr(lib, "openblas_get_corename"):
        lib.openblas_get_corename.restype = ctypes.c_char_p
        core = lib.openblas_get_corename().decode(errors="replace")
    return config, core


class _Checker:
    """Compares products with numpy's in float64; keeps the worst relative error."""

    def __init__(self) -> None:
        self.worst = 0.0

    def __call__(self, what: str, got, a, b, c0, alpha, beta) -> str | None:
        import numpy as np

        want = alpha * (a.astype(np.float64) @ b.astype(np.float64)) + beta * c0
        scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64) + np.abs(c0) + 1e-30
        error = float(np.max(np.abs(got - want) / scale.max()))
        self.worst = max(self.worst, error)
        if not np.isfinite(error) or error > TOLERANCE:
            return f"it computes {what} wrong (relative error {error:.2g})"
        return None


def _check_sgemm(lib: ctypes.CDLL, rng, check: _Checker) -> str | None:
    """``cblas_sgemm`` through ctypes on every shape, transpose pair and beta; what is
    wrong, or None."""
    import numpy as np

    sgemm = lib.cblas_sgemm
    f, i, p = ctypes.c_float, ctypes.c_int, ctypes.c_void_p
    sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    sgemm.restype = None
    for m, n, k in SHAPES:
        for ta in (False, True):
            for tb in (False, True):
                for alpha, beta in ((1.0, 0.0), (0.5, 1.0)):
                    what = f"sgemm {m}x{n}x{k} {'NT'[ta]}{'NT'[tb]} beta={beta:g}"
                    a = rng.standard_normal((m, k), dtype=np.float32)
                    b = rng.standard_normal((k, n), dtype=np.float32)
                    a_stored = np.ascontiguousarray(a.T if ta else a)
                    b_stored = np.ascontiguousarray(b.T if tb else b)
                    c = rng.standard_normal((m, n), dtype=np.float32)
                    c0 = c.astype(np.float64)
                    say(f"trying {what}")
                    sgemm(
                        ROW_MAJOR,
                        TRANS if ta else NO_TRANS,
                        TRANS if tb else NO_TRANS,
                        m,
                        n,
                        k,
                        alpha,
                        a_stored.ctypes.data,
                        a_stored.shape[1],
                        b_stored.ctypes.data,
                        b_stored.shape[1],
                        beta,
                        c.ctypes.data,
                        n,
                    )
                    wrong = check(what, c.astype(np.float64), a, b, c0, alpha, beta)
                    if wrong:
                        return wrong
    return None


def _check_mlx(rng, check: _Checker) -> str | None:
    """MLX's own matmul (bound to the library now) on every shape; what is wrong, or None."""
    import numpy as np

    say("trying MLX matmuls bound to it")
    import mlx.core as mx

    for m, n, k in SHAPES:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        for left, right, name in ((a, b, "NN"), (a, b, "TN")):
            x = mx.array(left) if name == "NN" else mx.array(np.ascontiguousarray(left.T)).T
            got = np.array(x @ mx.array(right), dtype=np.float64)
            wrong = check(f"MLX's matmul {m}x{n}x{k} {name}", got, left, right, 0.0, 1.0, 0.0)
            if wrong:
                return wrong
    return None


if __name__ == "__main__":
    say(json.dumps(main(sys.argv[1])))

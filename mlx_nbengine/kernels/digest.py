"""Digests of the source text that decides a result's bits: no hand-bumped version constants.

A route that puts a model's operations on our kernels (`models.qroute`, `models.fastops`,
`models.attnroute`, `models.cpu_math`, `models.layerroute`) names itself in the model
fingerprint with a *variant*: its name, the kernel set where the sets differ in the last
bits, and `of_files` over the files that decide its bits (the route module itself, the
kernels' Python face and the C++ sources it calls, the build's CMakeLists.txt). A change to
any of them changes the variant, so blocks cached before it are never restored after it;
nobody has to remember to bump a number. The text is hashed as it is (a comment's edit
counts too: the digest cannot tell which edits move bits, so every edit does).

`kernel_sources_digest` is the same over every source the kernels' module is built from
(`build.SOURCES`): a persistent store's identity names it.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path

from mlx_nbengine.kernels import build

__all__ = [
    "COMMON",
    "DIGEST_CHARS",
    "PACKAGE",
    "digest",
    "kernel_source",
    "kernel_sources_digest",
    "of_files",
    "read_sources",
]

# The package's root folder: source paths below are relative to it ("models/qroute.py").
PACKAGE = Path(__file__).resolve().parents[1]
# Hex digits of a digest in a variant (32 bits: a change shows; the fingerprint hashes it all).
DIGEST_CHARS = 8


def kernel_source(*names: str) -> tuple[str, ...]:
    """Paths (relative to `PACKAGE`) of the kernels' C++ sources `names` (in ``src/``)."""
    return tuple(f"kernels/src/{name}" for name in names)


# What every route's bits depend on: the kernels' Python face (arguments, dtypes, the set
# chosen), the build's flags, the bindings, the BLAS calls, strided views, the workers (their
# split of the work is meant to move no bits; the digest does not take that on trust) and the
# restore's token joins (built into the same module; they copy, and the same distrust holds).
COMMON = (
    "kernels/__init__.py",
    *kernel_source(
        "CMakeLists.txt",
        "bindings.cpp",
        "blas.h",
        "strided.h",
        "targets.h",
        "tokens.cpp",
        "tokens.h",
        "workers.h",
    ),
)


def read_sources(paths: Iterable[str]) -> list[tuple[str, bytes]]:
    """``(path, text)`` of each file (relative to `PACKAGE`); a file that cannot be read is
    hashed as a marker that says so, never an error (a load must not fail on it)."""
    out = []
    for path in paths:
        try:
            text = (PACKAGE / path).read_bytes()
        except OSError as exc:
            text = f"<unreadable: {type(exc).__name__}>".encode()
        out.append((path, text))
    return out


def digest(texts: Iterable[tuple[str, bytes]]) -> str:
    """`DIGEST_CHARS` hex digits of SHA-256 over each ``(name, text)`` and the build's format
    (`build.BUILD_FORMAT`: flags the sources do not show)."""
    h = hashlib.sha256(f"mlx_nbengine-bits\0build={build.BUILD_FORMAT}\0".encode())
    for name, text in texts:
        h.update(f"{name}\0{len(text)}\0".encode())
        h.update(text)
    return h.hexdigest()[:DIGEST_CHARS]


@functools.cache
def of_files(paths: tuple[str, ...]) -> str:
    """`digest` of the files `paths` (relative to `PACKAGE`) as they are on disk, read once
    per process."""
    return digest(read_sources(paths))


def kernel_sources_digest() -> str:
    """`of_files` over every source the kernels' module is built from."""
    return of_files(kernel_source(*build.SOURCES))

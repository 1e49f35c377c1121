"""Finding the system's compilers: the C one for the BLAS shim (`_blaslib`), the C++ one for
the kernels' extension module (`kernels.build`).

A compiler is named by its environment variable (``$CC``, ``$CXX``) if set, where an empty
value means "no compiler" (to test the paths without one); else it is the first of the usual
names found on PATH. This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import os
import shutil

__all__ = ["c_compiler", "cxx_compiler", "find_compiler"]


def find_compiler(variable: str, names: tuple[str, ...]) -> str | None:
    """A compiler: ``$variable`` if set (empty: none), else the first of `names` on PATH."""
    if variable in os.environ:
        chosen = os.environ[variable].strip()
        return shutil.which(chosen.split()[0]) if chosen else None
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def c_compiler() -> str | None:
    """The C compiler: ``$CC`` if set (empty: none), else ``cc``, ``gcc`` or ``clang``."""
    return find_compiler("CC", ("cc", "gcc", "clang"))


def cxx_compiler() -> str | None:
    """The C++ compiler: ``$CXX`` if set (empty: none), else ``c++``, ``g++`` or ``clang++``."""
    return find_compiler("CXX", ("c++", "g++", "clang++"))

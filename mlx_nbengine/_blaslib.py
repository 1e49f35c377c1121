"""Find, prepare and vet the optimized BLAS that `_blas` binds into the process.

MLX's CPU matmuls call the plain CBLAS names ``cblas_sgemm``, ``cblas_dgemm`` and
``cblas_cgemm``. The library we bring is ``scipy-openblas32``: OpenBLAS built by the
numpy/scipy projects with ``DYNAMIC_ARCH`` (its kernels are chosen at run time for the CPU
that runs them: Haswell, SkylakeX, Zen, Neoverse...) and ``MAX_THREADS=64``. Its symbols
carry a ``scipy_`` prefix (``scipy_cblas_sgemm``), so MLX cannot bind to it as it is. Two
ways give the plain names, both built once into the cache home
(``$MLX_NBENGINE_HOME/blas/<key>/``) and reused:

- ``shim``: a 30-line C file (`SHIM_SOURCE`) whose functions forward the plain names to the
  prefixed ones, compiled with the system C compiler (`compiler.c_compiler`: ``$CC``, ``cc``,
  ``gcc`` or ``clang``)
  and linked against the library. Where there is a compiler, this is the way.
- ``renamed``: for machines without a compiler (slim container images), a copy of the
  library whose dynamic symbol table names a few symbols without their prefix
  (`rename_dynamic_symbols`: each renamed symbol's name is the tail of its old one, the GNU
  hash table is rebuilt as one bucket with a full Bloom filter). Pure Python, any ELF64
  little-endian platform.

Before either is bound, `vet` runs it in a child process (``_blas_probe.py``): it loads the
library, computes several ``sgemm`` shapes (tiny ones too: a bad build's small-matrix kernel
killed the process with SIGILL), all four transpose pairs, through ctypes and through MLX,
against numpy in float64. A child that dies, hangs or computes wrong refuses the library, and
MLX keeps its reference BLAS: a bad wheel costs speed, never the process. The verdict is
cached per library build, CPU and ``OPENBLAS_CORETYPE`` (`verdict_key`), so the child runs
once per machine, not once per import.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import signal
import struct
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_nbengine.home import home

# The plain names MLX binds (nm -D libmlx.so), and OpenBLAS's own calls that `_blas` uses.
CBLAS_NAMES = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
OPENBLAS_NAMES = (
    "openblas_get_num_threads",
    "openblas_set_num_threads",
    "openblas_get_config",
    "openblas_get_corename",
)
PREFIX = "scipy_"
SHIM_NAME = "libmnb_cblas.so"
RENAMED_NAME = "libmnb_openblas.so"
# Bumped whenever the shim's source or the renaming changes: old builds are not reused.
BUILD_FORMAT = 1
PROBE_TIMEOUT_S = 120.0
COMPILE_TIMEOUT_S = 120.0

SHIM_SOURCE = r"""
/* Written by mlx_nbengine: the plain CBLAS names MLX binds, forwarded to scipy-openblas32's
   prefixed ones (each call compiles to one jump). */
typedef int blasint;
#define FWD_GEMM(name, T, S)                                                                  \
    extern void scipy_##name(int, int, int, blasint, blasint, blasint, S, const T *, blasint, \
                             const T *, blasint, S, T *, blasint);                            \
    void name(int o, int ta, int tb, blasint m, blasint n, blasint k, S alpha, const T *a,     \
              blasint lda, const T *b, blasint ldb, S beta, T *c, blasint ldc) {               \
        scipy_##name(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);                 \
    }
FWD_GEMM(cblas_sgemm, float, float)
FWD_GEMM(cblas_dgemm, double, double)
FWD_GEMM(cblas_cgemm, void, const void *)
extern int scipy_openblas_get_num_threads(void);
extern void scipy_openblas_set_num_threads(int);
extern char *scipy_openblas_get_config(void);
extern char *scipy_openblas_get_corename(void);
int openblas_get_num_threads(void) { return scipy_openblas_get_num_threads(); }
void openblas_set_num_threads(int n) { scipy_openblas_set_num_threads(n); }
char *openblas_get_config(void) { return scipy_openblas_get_config(); }
char *openblas_get_corename(void) { return scipy_openblas_get_corename(); }
"""


class BlasBuildError(Exception):
    """A library could not be prepared; the message is one line saying why."""


@dataclass(frozen=True)
class Verdict:
    """What the child process found: ``ok`` and, when not, a one-line ``reason``."""

    ok: bool
    reason: str
    config: str | None = None
    core: str | None = None
    max_error: float | None = None


def scipy_openblas() -> Path | None:
    """The installed scipy-openblas32 library, found without importing its package."""
    try:
        spec = importlib.util.find_spec("scipy_openblas32")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    found = sorted(lib.glob("libscipy_openblas*.so*")) if lib.is_dir() else []
    return found[0] if found else None


def _file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def build_key(kind: str, library: Path) -> str:
    text = f"{BUILD_FORMAT}|{kind}|{_file_identity(library)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _atomic_write(target: Path, data: bytes, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)  # atomic: a concurrent process never sees half a file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_shim(library: Path, compiler: str) -> Path:
    """Compile (once, cached) the forwarding shim against `library`; return its path."""
    directory = home() / "blas" / build_key("shim", library)
    target = directory / SHIM_NAME
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        source = Path(tmp) / "shim.c"
        source.write_text(SHIM_SOURCE)
        out = Path(tmp) / SHIM_NAME
        # The library's own path as an input: the linker records its SONAME as NEEDED, and
        # the rpath finds it at run time wherever the environment lives.
        command = [
            compiler,
            "-O2",
            "-shared",
            "-fPIC",
            "-o",
            str(out),
            str(source),
            str(library),
            f"-Wl,-rpath,{library.resolve().parent}",
        ]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=COMPILE_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BlasBuildError(f"the C compiler did not run: {e}") from None
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise BlasBuildError(f"compiling the BLAS shim failed: {first}")
        os.chmod(out, 0o755)
        os.replace(out, target)
    return target


# -- the no-compiler way: rename dynamic symbols in a copy of the library --------------------

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_HASH, _DT_STRTAB, _DT_SYMTAB, _DT_STRSZ, _DT_SONAME = 0, 4, 5, 6, 10, 14
_DT_GNU_HASH = 0x6FFFFEF5
_SHT_DYNSYM = 11
_SYM = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size


def _gnu_hash(name: bytes) -> int:
    h = 5381
    for c in name:
        h = (h * 33 + c) & 0xFFFFFFFF
    return h


def _sysv_hash(name: bytes) -> int:
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


class _Elf:
    """The dynamic-linking tables of an ELF64 little-endian shared library, in a bytearray."""

    def __init__(self, data: bytearray) -> None:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise BlasBuildError("not an ELF64 little-endian library")
        self.data = data
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        self.loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
        dynamic = None
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
                "<IIQQQQ", data, phoff + i * phentsize
            )
            if p_type == _PT_LOAD:
                self.loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == _PT_DYNAMIC:
                dynamic = (p_offset, p_filesz)
        if dynamic is None:
            raise BlasBuildError("the library has no dynamic section")
        self.dyn: dict[int, int] = {}
        for at in range(dynamic[0], dynamic[0] + dynamic[1], 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == _DT_NULL:
                break
            self.dyn.setdefault(tag, value)
        if _DT_SYMTAB not in self.dyn or _DT_STRTAB not in self.dyn:
            raise BlasBuildError("the library has no dynamic symbol table")
        self.symtab = self.offset(self.dyn[_DT_SYMTAB])
        self.strtab = self.offset(self.dyn[_DT_STRTAB])
        self.strsz = self.dyn.get(_DT_STRSZ, len(data) - self.strtab)
        self.nsyms = self._count_symbols(shoff, shentsize, shnum)

    def offset(self, vaddr: int) -> int:
        for start, off, size in self.loads:
            if start <= vaddr < start + size:
                return vaddr - start + off
        raise BlasBuildError(f"address {vaddr:#x} is in no loaded segment")

    def _count_symbols(self, shoff: int, shentsize: int, shnum: int) -> int:
        for i in range(shnum if shoff else 0):
            _, sh_type, _, _, sh_offset, sh_size, _, _, _, sh_entsize = struct.unpack_from(
                "<IIQQQQIIQQ", self.data, shoff + i * shentsize
            )
            if sh_type == _SHT_DYNSYM and sh_offset == self.symtab and sh_entsize:
                return sh_size // sh_entsize
        if _DT_HASH in self.dyn:  # nchain is the symbol count
            return struct.unpack_from("<I", self.data, self.offset(self.dyn[_DT_HASH]) + 4)[0]
        raise BlasBuildError("cannot count the dynamic symbols")

    def name_at(self, offset: int) -> bytes:
        start = self.strtab + offset
        end = self.data.index(b"\0", start)
        return bytes(self.data[start:end])

    def symbol(self, index: int) -> tuple[int, ...]:
        return _SYM.unpack_from(self.data, self.symtab + index * _SYM.size)

    def set_name(self, index: int, name_offset: int) -> None:
        struct.pack_into("<I", self.data, self.symtab + index * _SYM.size, name_offset)

    def names(self) -> list[bytes]:
        return [self.name_at(self.symbol(i)[0]) for i in range(self.nsyms)]

    def rebuild_gnu_hash(self, names: list[bytes]) -> None:
        """One bucket (any symbol order is valid), the Bloom filter set from every name."""
        at = self.offset(self.dyn[_DT_GNU_HASH])
        nbuckets, symoffset, bloom_size, bloom_shift = struct.unpack_from("<IIII", self.data, at)
        old_size = 16 + 8 * bloom_size + 4 * nbuckets + 4 * max(0, self.nsyms - symoffset)
        bloom = [0] * bloom_size
        chain = []
        for name in names[symoffset:]:
            h = _gnu_hash(name)
            word = (h // 64) % bloom_size
            bloom[word] |= (1 << (h % 64)) | (1 << ((h >> bloom_shift) % 64))
            chain.append(h & ~1)
        if chain:
            chain[-1] |= 1  # the end of bucket 0's chain
        table = struct.pack("<IIII", 1, symoffset, bloom_size, bloom_shift)
        table += struct.pack(f"<{bloom_size}Q", *bloom)
        table += struct.pack("<I", symoffset if chain else 0)
        table += struct.pack(f"<{len(chain)}I", *chain)
        self.data[at : at + old_size] = table.ljust(old_size, b"\0")

    def rebuild_sysv_hash(self, names: list[bytes]) -> None:
        at = self.offset(self.dyn[_DT_HASH])
        nbucket, nchain = struct.unpack_from("<II", self.data, at)
        buckets, chains = [0] * nbucket, [0] * nchain
        for i in range(1, min(nchain, len(names))):
            b = _sysv_hash(names[i]) % nbucket
            chains[i], buckets[b] = buckets[b], i
        struct.pack_into(f"<{nbucket}I{nchain}I", self.data, at + 8, *buckets, *chains)


def rename_dynamic_symbols(data: bytes, renames: dict[str, str]) -> bytes:
    """A copy of an ELF64 LE shared library whose defined symbols ``old`` are named ``new``.

    Each ``new`` must be a tail of its ``old`` (``scipy_cblas_sgemm`` -> ``cblas_sgemm``): the
    symbol's name then points into its old string, and nothing in the string table moves.
    The hash tables are rebuilt for the new names. Raises `BlasBuildError` when a name is
    missing, would clash with an existing symbol, or the file is not what it should be.
    """
    elf = _Elf(bytearray(data))
    if _DT_GNU_HASH not in elf.dyn and _DT_HASH not in elf.dyn:
        raise BlasBuildError("the library has no symbol hash table")
    names = elf.names()
    index = {}
    for i, name in enumerate(names):
        if elf.symbol(i)[3] != 0:  # defined (st_shndx != SHN_UNDEF)
            index.setdefault(name, i)
    for old, new in renames.items():
        if not old.endswith(new):
            raise BlasBuildError(f"{new} is not a tail of {old}")
        i = index.get(old.encode())
        if i is None:
            raise BlasBuildError(f"the library has no symbol {old}")
        if new.encode() in index:
            raise BlasBuildError(f"the library already has a symbol {new}")
        st_name = elf.symbol(i)[0]
        elf.set_name(i, st_name + len(old) - len(new))
        names[i] = new.encode()
        index[new.encode()] = index.pop(old.encode())  # two renames to one name clash too
    if _DT_GNU_HASH in elf.dyn:
        elf.rebuild_gnu_hash(names)
    if _DT_HASH in elf.dyn:
        elf.rebuild_sysv_hash(names)
    return bytes(elf.data)


def build_renamed(library: Path) -> Path:
    """A renamed copy (once, cached) of scipy-openblas32's library; return its path."""
    directory = home() / "blas" / build_key("renamed", library)
    target = directory / RENAMED_NAME
    if target.exists():
        return target
    renames = {PREFIX + name: name for name in CBLAS_NAMES + OPENBLAS_NAMES}
    patched = rename_dynamic_symbols(library.read_bytes(), renames)
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(target, patched, 0o755)
    return target


# -- the guard ----------------------------------------------------------------------------------


def cpu_identity() -> str:
    """What decides which kernels a runtime-dispatched BLAS picks: the CPU and its features."""
    keys = {
        "vendor_id",
        "cpu family",
        "model",
        "model name",
        "stepping",
        "flags",
        "Features",
        "CPU implementer",
        "CPU architecture",
        "CPU variant",
        "CPU part",
    }
    lines = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor tells
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    lines.append(f"{key.strip()}={value.strip()}")
    except OSError:
        pass
    return "|".join([platform.machine(), *lines])


def verdict_key(library: Path) -> str:
    text = "|".join(
        [
            _file_identity(library),
            cpu_identity(),
            os.environ.get("OPENBLAS_CORETYPE", ""),
            sys.executable,
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _verdict_path(library: Path) -> Path:
    return home() / "blas" / "verdicts" / f"{verdict_key(library)}.json"


def cached_verdict(library: Path) -> Verdict | None:
    try:
        return Verdict(**json.loads(_verdict_path(library).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def probe(library: Path, *, timeout: float | None = None) -> Verdict:
    """Load `library` in a child process and check its sgemm against numpy."""
    timeout = PROBE_TIMEOUT_S if timeout is None else timeout
    script = Path(__file__).with_name("_blas_probe.py")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["MLX_NBENGINE_BLAS"] = "reference"  # the child never binds a BLAS of its own
    try:
        done = subprocess.run(
            [sys.executable, "-P", str(script), str(library)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return Verdict(False, f"its check did not finish in {timeout:.0f} s")
    except OSError as e:
        return Verdict(False, f"its check could not start: {e}")
    lines = done.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    if done.returncode < 0:
        doing = last.removeprefix("trying ") if last.startswith("trying ") else "loading it"
        name = _signal_name(-done.returncode)
        return Verdict(False, f"its check died of signal {-done.returncode} ({name}) in {doing}")
    try:
        result = json.loads(last)
    except ValueError:
        message = (done.stderr.strip().splitlines() or [last or "no output"])[-1]
        return Verdict(False, f"its check failed (exit {done.returncode}): {message}")
    return Verdict(**result)


def vet(library: Path) -> tuple[Verdict, bool]:
    """The verdict on `library` for this CPU, and whether it was cached (else `probe` ran)."""
    cached = cached_verdict(library)
    if cached is not None:
        return cached, True
    verdict = probe(library)
    if "did not finish" not in verdict.reason:  # a busy machine may do better next time
        path = _verdict_path(library)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, json.dumps(asdict(verdict)).encode())
        except OSError:
            pass  # a read-only cache home: the check runs again next time
    return verdict, False

"""llama.cpp's own tools (``llama-bench``, ``llama-server``), built from the llama.cpp that
llama-cpp-python vendors, so the benchmarks can set our engine beside llama.cpp measured by
llama.cpp itself.

- **Source**: llama-cpp-python's sdist (``pip download --no-deps --no-binary :all:
  llama-cpp-python==V``), whose ``vendor/llama.cpp`` is the llama.cpp the Python binding
  runs; V is the installed binding's version, else `DEFAULT_VERSION`. ``--sdist PATH``
  builds from an sdist already downloaded (CI downloads it once for the binding and the
  tools).
- **Build**: CMake, ``-DGGML_NATIVE=ON`` (the kernels for the CPU that builds them, as
  llama.cpp's users build it) but without AMX on x86-64 (``-mno-amx-*``: ggml's AMX kernels
  die with SIGILL on the KVM machines we run on, which report AMX), ``-DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF``, no web UI, shared libraries, only the targets ``llama-bench`` and
  ``llama-server``, ``-j2`` (``--jobs``).
- **Where**: ``$MLX_NBENGINE_HOME/llama-tools/<version>-<cpu key>/`` (else
  ``~/.cache/mlx_nbengine/...``), never the repository; the CPU key is a hash of the CPU's
  name and flags (a native build may use instructions another CPU lacks) and of the CMake
  arguments. Its ``build.json`` records the version, the CMake arguments, the CPU, the
  seconds it took and the build's system info (``llama_print_system_info`` of its own ``libllama``).
- **Use**: `tool` (a built tool's path, or None), `missing` (why not), `llama_bench` (one
  ``llama-bench -o json`` run, parsed), `build_info` (what the JSON of a benchmark records
  about llama.cpp).

``python -m bench.llama_tools build [--version V] [--sdist PATH] [--jobs N]`` builds (minutes;
nothing to do if the build is there), ``python -m bench.llama_tools info`` prints the build's
record, ``python -m bench.llama_tools path llama-bench`` a tool's path, ``python -m
bench.llama_tools no-amx`` the flags that leave AMX out (.ci/run builds the binding with them).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# Without AMX: ggml's AMX kernels (0.3.36) die with SIGILL at their first tileloadd in a
# worker thread on the KVM machines we run on, which report amx_int8 (`-march=native` would
# build them in). Its AVX-512 VNNI kernels are what then runs. x86-64's flags; .ci/run gives
# the binding's build the same (``python -m bench.llama_tools no-amx``).
NO_AMX = (
    "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    if platform.machine().lower() in ("x86_64", "amd64")
    else ""
)
DEFAULT_VERSION = "0.3.36"  # llama-cpp-python's, as the ``peers`` extra pins it at least
TARGETS = ("llama-bench", "llama-server")
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DBUILD_SHARED_LIBS=ON",
) + ((f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}") if NO_AMX else ())


def home() -> Path:
    """The cache home (as `mlx_nbengine.home.home`, without importing the package)."""
    return Path(os.environ.get("MLX_NBENGINE_HOME") or Path.home() / ".cache" / "mlx_nbengine")


def binding_version() -> str | None:
    """The installed llama-cpp-python's version, else None."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu() -> dict:
    """The CPU as ``/proc/cpuinfo`` gives its first processor: name, family, model, flags."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    flags = fields.get("flags", "").split()
    return {
        "model_name": fields.get("model name", "unknown"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "flags": flags,
    }


def cpu_summary() -> dict:
    """The CPU for a benchmark's JSON: name, family/model and the vector flags that matter
    to these kernels (not the whole flag list)."""
    info = cpu()
    wanted = ("avx", "avx2", "fma", "f16c", "avx512")
    vector = sorted(f for f in info["flags"] if f.startswith(wanted) or f in ("amx_int8",))
    return {k: info[k] for k in ("model_name", "family", "model")} | {"vector_flags": vector}


def cpu_key() -> str:
    """A hash of the CPU (a native build may use instructions another CPU lacks) and of
    `CMAKE_ARGS` (a build made with other arguments is another build)."""
    info = cpu()
    text = "\n".join([info["model_name"], info["family"] or "", info["model"] or ""])
    text += "\n" + " ".join(sorted(info["flags"])) + "\n" + " ".join(CMAKE_ARGS)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_dir(version: str | None = None) -> Path:
    """Where the build of `version` (default: the binding's, else `DEFAULT_VERSION`) for
    this CPU lives."""
    version = version or binding_version() or DEFAULT_VERSION
    return home() / "llama-tools" / f"{version}-{cpu_key()}"


def record(version: str | None = None) -> dict | None:
    """The build's ``build.json``, or None where it is not built."""
    path = build_dir(version) / "build.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tool(name: str, version: str | None = None) -> Path | None:
    """A built tool's path (``llama-bench``, ``llama-server``), or None."""
    if record(version) is None:
        return None
    path = build_dir(version) / "build" / "bin" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing(name: str = "llama-bench", version: str | None = None) -> str | None:
    """Why `name` cannot run here (None if it can)."""
    if tool(name, version) is not None:
        return None
    v = version or binding_version() or DEFAULT_VERSION
    return f"{name} {v} is not built for this CPU (python -m bench.llama_tools build)"


# --- building ------------------------------------------------------------------------------


def download_sdist(version: str, directory: Path) -> Path:
    """llama-cpp-python's sdist of `version`, through pip."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    command += ["-d", str(directory), f"llama-cpp-python=={version}"]
    subprocess.run(command, check=True)
    found = sorted(directory.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download gave no sdist in {directory}")
    return found[0]


def sdist_version(sdist: Path) -> str:
    stem = sdist.name.removesuffix(".tar.gz")
    return stem.split("-", 1)[1]


def extract_llama_cpp(sdist: Path, destination: Path) -> Path:
    """The sdist's ``vendor/llama.cpp``, extracted under `destination`."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        tar.extractall(destination, members=members, filter="data")
    found = list(destination.glob("*/vendor/llama.cpp"))
    if not found:
        raise RuntimeError(f"no vendor/llama.cpp in {sdist}")
    return found[0]


def system_info(bin_dir: Path) -> str | None:
    """``llama_print_system_info()`` of the build's own ``libllama`` (its CPU features, as
    compiled), run in a child process so this one loads no second llama.cpp."""
    lib = bin_dir / "libllama.so"
    if not lib.is_file():
        return None
    code = (
        "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
        "f = lib.llama_print_system_info; f.restype = ctypes.c_char_p; "
        "print(f().decode())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(lib)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def build(
    *,
    version: str | None = None,
    sdist: Path | None = None,
    jobs: int = 2,
    targets: tuple[str, ...] = TARGETS,
) -> dict:
    """Build `targets` (default `TARGETS`; see the module docstring); the build's record.
    Nothing is rebuilt where they are built: a later call with more targets builds those
    in the same tree, and a build that was stopped goes on where it stopped."""
    version = sdist_version(sdist) if sdist is not None else version
    version = version or binding_version() or DEFAULT_VERSION
    out = build_dir(version)
    done = record(version)
    if done is not None and all(tool(t, version) for t in targets):
        print(f"llama-tools {version}: already built in {out}")
        return done
    started = time.perf_counter()
    source = out / "src" / "llama.cpp"
    if done is None and not (out / "build" / "CMakeCache.txt").is_file():
        if out.exists():
            shutil.rmtree(out)  # an extraction that did not finish
        out.mkdir(parents=True)
        with tempfile.TemporaryDirectory(prefix="llama-sdist-") as tmp:
            if sdist is None:
                sdist = download_sdist(version, Path(tmp))
            extracted = extract_llama_cpp(Path(sdist), out / "src")
            extracted.rename(source)
            shutil.rmtree(extracted.parents[1])  # the sdist's other files, none extracted
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        configure = ["cmake", "-S", str(source), "-B", str(out / "build"), *generator]
        subprocess.run([*configure, *CMAKE_ARGS], check=True)
    make = ["cmake", "--build", str(out / "build"), "--config", "Release", "-j", str(jobs)]
    subprocess.run([*make, "--target", *targets], check=True)
    bin_dir = out / "build" / "bin"
    for name in targets:
        if not (bin_dir / name).is_file():
            raise RuntimeError(f"the build made no {name} in {bin_dir}")
    built = sorted(set(targets) | set((done or {}).get("targets", [])))
    info = {
        "llama_cpp_python": version,
        "targets": built,
        "cmake_args": list(CMAKE_ARGS),
        "jobs": jobs,
        "build_s": round(time.perf_counter() - started, 1) + (done or {}).get("build_s", 0.0),
        "cpu": cpu_summary(),
        "system_info": system_info(bin_dir),
    }
    (out / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"llama-tools {version}: built in {info['build_s']:.0f} s, {out}")
    return info


# --- running ---------------------------------------------------------------------------------


def llama_bench(
    gguf: Path,
    *,
    threads: int,
    n_prompt: int = 0,
    n_gen: int = 0,
    depth: int = 0,
    repetitions: int = 1,
    timeout: float = 1800,
) -> dict:
    """One ``llama-bench -m GGUF -p n_prompt -n n_gen -d depth -t threads -r repetitions -o
    json`` run, at llama.cpp's own defaults otherwise (batch 2048, ubatch 512, flash
    attention auto, its warm-up run): the one test's figures (``avg_ts`` tok/s and the
    samples), with the build and CPU llama-bench reports."""
    path = tool("llama-bench")
    if path is None:
        raise RuntimeError(missing("llama-bench"))
    if (n_prompt > 0) == (n_gen > 0):
        raise ValueError("one test a run: a prompt (n_prompt) or a generation (n_gen)")
    command = [str(path), "-m", str(gguf), "-p", str(n_prompt), "-n", str(n_gen)]
    command += ["-d", str(depth), "-t", str(threads), "-r", str(repetitions), "-o", "json"]
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=timeout, cwd=path.parent
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr[-1500:]}")
    rows = json.loads(done.stdout)
    if len(rows) != 1:
        raise RuntimeError(f"llama-bench gave {len(rows)} tests, not one: {done.stdout[:500]}")
    row = rows[0]
    keep = (
        "n_prompt", "n_gen", "n_depth", "n_threads", "n_batch", "n_ubatch", "flash_attn",
        "type_k", "type_v", "avg_ts", "stddev_ts", "samples_ts", "avg_ns", "build_commit",
        "build_number", "cpu_info", "backends", "model_type", "model_size",
    )  # fmt: skip
    return {k: row[k] for k in keep if k in row}


def build_info() -> dict:
    """What a benchmark's JSON records about llama.cpp here: the binding's version and
    system info (where installed) and the tools' build record (where built)."""
    out: dict = {"llama_cpp_python": binding_version(), "tools": record()}
    if out["llama_cpp_python"] is not None:
        try:
            import llama_cpp  # an optional peer

            out["binding_system_info"] = llama_cpp.llama_print_system_info().decode()
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            out["binding_system_info"] = f"unavailable ({type(exc).__name__}: {exc})"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build llama-bench and llama-server (minutes)")
    b.add_argument("--version", default=None, help="llama-cpp-python's version to build")
    b.add_argument("--sdist", type=Path, default=None, help="an sdist already downloaded")
    b.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    b.add_argument(
        "--targets",
        nargs="+",
        choices=TARGETS,
        default=list(TARGETS),
        help="the tools to build (default: both; CI's smoke tests need llama-bench only)",
    )
    sub.add_parser("info", help="print the build's record")
    sub.add_parser("no-amx", help="print the compiler flags that leave AMX out (NO_AMX)")
    p = sub.add_parser("path", help="print a tool's path (exit 1 where not built)")
    p.add_argument("name", choices=TARGETS)
    args = ap.parse_args(argv)
    if args.command == "build":
        build(version=args.version, sdist=args.sdist, jobs=args.jobs, targets=tuple(args.targets))
        return 0
    if args.command == "info":
        print(json.dumps({"dir": str(build_dir()), **build_info()}, indent=2))
        return 0
    if args.command == "no-amx":
        print(NO_AMX)
        return 0
    path = tool(args.name)
    print(path if path is not None else missing(args.name))
    return 0 if path is not None else 1


if __name__ == "__main__":
    sys.exit(main())

"""Give MLX on Linux CPU an optimized BLAS, without the user knowing, and never a crash.

The ``mlx[cpu]`` wheel links its matmuls (``cblas_sgemm``...) against a bundled
reference BLAS, many times slower than OpenBLAS (`bench/bench_blas.py`). The
dynamic linker resolves an undefined symbol in the *global scope* before a library's own
dependencies, so loading a library that exports ``cblas_sgemm`` with ``RTLD_GLOBAL``
before ``mlx.core`` is first imported makes MLX's BLAS calls land in it. After MLX is
imported it is too late: its symbols are already bound.

The library is scipy-openblas32's OpenBLAS (``DYNAMIC_ARCH``: its kernels are chosen at
run time for the CPU that runs them), given the plain CBLAS names by a compiled forwarding
shim or, without a C compiler, by a renamed copy (`_blaslib`). Before it is bound, a
child process checks that it loads and computes several sgemm shapes right on this CPU
(`_blaslib.vet`, cached per library build and CPU). Where it cannot be built, loaded or
trusted, MLX keeps the reference BLAS and one line on stderr says why and what it costs.
Its thread count is the number of cores this process may use (``os.sched_getaffinity``),
unless ``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` says otherwise.

``MLX_NBENGINE_BLAS`` chooses: unset or ``auto`` (the shim where there is a compiler, else
the renamed copy), ``shim``, ``renamed``, a path to a CBLAS library of your own (vetted
the same way), or ``reference`` (the bundled reference BLAS: the benchmark's baseline).
macOS (Accelerate) and non-Linux systems are left alone.

*Threads*: a multi-threaded matmul pays a wake-up and a barrier per call. A
prefill step (hundreds of tokens) amortizes that and runs up to N times faster;
a decode step (one token per sequence, a matrix-vector product bound by memory
bandwidth) gains nothing and, on a busy machine, loses several times over to
threads waiting for a core. Even prefill loses when other processes hold the
cores: OpenBLAS splits each matmul evenly and waits for its slowest thread (the
README gives both machines' figures).

The choice is a *thread policy* (`ThreadPolicy`): one object per engine, which creates it
and gives it to its runner, holding everything the choice learns (the timings below), so two
engines in one process never share it. A *step* (one model call and its evaluation) is
wrapped in ``with policy.step(n_tokens):``. *Prefill* steps (at least `PARALLEL_MIN_TOKENS`
tokens) get whichever of {all threads, one thread} has the lower recent seconds
per token: each is tried once, then the better one is kept, and the other is
re-tried every `PROBE_EVERY` prefill steps so a change in the machine's load is
noticed. A try of the other count waits for a step of at most `PROBE_MAX_TOKENS` tokens
(all threads until then): a whole 1,024-token step on one thread would cost a long
prompt seconds (a hybrid model's, tens of them) where a block-sized step costs a fraction.

*Decode* steps (fewer tokens) start on one thread, the safe choice on a busy
machine; on a quiet one all threads decode faster. A decode *probe* runs
`DECODE_PROBE_STEPS` consecutive decode steps on the other count: first as soon as
`DECODE_PROBE_STEPS` intervals on one thread are known, then after `DECODE_PROBE_WAIT`
decode steps. A step is measured by its *interval*, the time from entering its ``with`` block to
entering the next decode step's: the engine launches steps asynchronously and
pipelined (the block only builds the graph), and a step cannot start computing
before the previous one's tokens are read, so in a steady run the interval is
one step's compute, under the count set at its start (the count is global in
OpenBLAS, so it also governs the tail of the step still in flight). Intervals
spanning a prefill step are dropped. A probe's cost is its fastest interval,
compared with the fastest of as many intervals just before it on the preferred
count; the minimum ignores idle pauses between generations. A probe that wins
by `DECODE_MARGIN` switches the preference and resets the wait; a losing one
doubles it, up to `DECODE_PROBE_MAX`, so a busy machine pays almost
nothing (a few slow steps per thousand). A probe whose first interval is already
`DECODE_PROBE_GIVE_UP` times the baseline (and less than `DECODE_PAUSE` times, which is taken
for an idle pause) ends there, lost: on a quiet machine a probe of one thread cost three
steps at half speed, about 9% of a session's first 64-token answer.

*Short prefill steps* (2 to `PARALLEL_MIN_TOKENS` - 1 tokens: an edit's changed tokens, an
agent's first turn after a shared prefix) are matrix-matrix products like prefill, not the
memory-bound products of decode: they take the count long prefill steps run on (the faster
once both are timed, all threads until then, as prefill starts; the README's "Speed on Linux
CPU" gives the measured difference), without probing the other (a probe would cost a whole
step of an edited re-run). They never follow the decode preference, which starts on one
thread: a 20-token step after 4,420 cached tokens of the default model took 108-111 ms on
one thread against 69 ms on two (Intel Xeon, 2 cores), and 2 tokens' 55 ms against 37.

`ThreadPolicy.prefill(n_tokens)` is a prompt step's: `step` for a long one, else the count
only (`threads_for`: no timing), as the short prefill steps above.

A *decode* step of a model whose products run on our quantized kernels gives the chosen
count to our kernels only while OpenBLAS runs on one thread: the step's only BLAS
calls are attention's small products, too small to split, and an OpenBLAS thread spinning
for its next call takes a core from our kernels' workers (`ThreadPolicy.set_step_threads`).
Whether they do is what the steps since the last decode step said (`note_kernel_products`,
called as a product is routed to them); a float32 model's decode products are OpenBLAS's,
on the count. The kernels are called while the model's graph is built, inside the step's
block: the policy of the step in progress (kept per thread, in a context variable, while
its block runs) answers them (`current_threads`: the quantized products and attention's
softmax split their work over it).

*Idle threads*: after a call OpenBLAS's threads spin for ``2**28`` cycles (about 0.1 s)
before they sleep, and a prefill step calls the BLAS between our kernels' work (attention's
products between the quantized products, norms and RoPE): the spinning thread held one of
two cores for most of an edit's tail (37% of its samples). Unless ``OPENBLAS_THREAD_TIMEOUT``
is set already, it is set to `THREAD_TIMEOUT` before the library loads (OpenBLAS reads it
once, at load): about 20 us of spinning, long enough for back-to-back calls (the README's
"Speed on Linux CPU" gives what it saved).

"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_nbengine import _blaslib
from mlx_nbengine._blaslib import BlasBuildError
from mlx_nbengine.compiler import c_compiler

__all__ = [
    "BlasStatus",
    "ThreadPolicy",
    "blas_identity",
    "blas_status",
    "current_threads",
    "ensure_fast_blas",
    "note_kernel_products",
    "reference_blas_line",
    "say_reference_blas",
]

_ENV = "MLX_NBENGINE_BLAS"

# OpenBLAS's idle threads spin for 2**THREAD_TIMEOUT cycles before sleeping (its default: 28).
THREAD_TIMEOUT = 16
_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"


@dataclass(frozen=True)
class BlasStatus:
    """What `ensure_fast_blas` did: ``active`` is True when the optimized BLAS serves MLX.

    ``library`` is the file bound (the shim, the renamed copy or the user's library),
    ``source`` the library behind it, ``config`` and ``core`` OpenBLAS's own words (build
    options with ``DYNAMIC_ARCH`` and ``MAX_THREADS``; the kernels chosen for this CPU),
    ``threads`` the thread count set, ``verdict`` the guard's.
    """

    active: bool
    reason: str
    library: str | None = None
    source: str | None = None
    config: str | None = None
    core: str | None = None
    threads: int | None = None
    verdict: str | None = None

    def lines(self) -> list[str]:
        """What ``python -m mlx_nbengine blas`` prints."""
        out = [f"optimized BLAS active: {self.active} ({self.reason})"]
        for label, value in (
            ("library", self.library),
            ("serving", self.source),
            ("config", self.config),
            ("core", self.core),
            ("threads", self.threads),
            ("verdict", self.verdict),
        ):
            if value is not None:
                out.append(f"{label}: {value}")
        return out


# What the reference BLAS costs, measured (bench/bench_blas.py: 1024x1024 sgemm, 2 threads).
REFERENCE_COST = "MLX's matmuls run on the reference BLAS, about 40x slower"


_status: BlasStatus | None = None
_handles: list[ctypes.CDLL] = []  # kept alive: unloading would break bound symbols
_openblas: ctypes.CDLL | None = None
_max_threads = 1

# Steps with fewer tokens than this are decode or short prefill steps (module docstring).
PARALLEL_MIN_TOKENS = 32
# Prefill steps between two tries of the thread count not currently preferred.
PROBE_EVERY = 16
# The longest prefill step a try of the other thread count may take (one block).
PROBE_MAX_TOKENS = 256
_SMOOTHING = 0.5  # weight of the newest measurement in the seconds-per-token average

# Decode steps on the preferred count between probes of the other one, at first.
DECODE_PROBE_WAIT = 16
# The longest wait between decode probes, reached by doubling after each losing probe.
DECODE_PROBE_MAX = 1024
# Consecutive decode steps in one probe (its intervals are compared by their minimum).
DECODE_PROBE_STEPS = 3
# A probe must be this much faster (fraction of the preferred count's time) to switch.
DECODE_MARGIN = 0.1
# A probe whose first interval is this many times the baseline has lost: it ends there, so a
# quiet machine's probe of one thread costs one slow step, not `DECODE_PROBE_STEPS`.
DECODE_PROBE_GIVE_UP = 1.5
# ... but one of more than this many times is taken for an idle pause (the user reading between
# two answers), not a verdict: the probe goes on.
DECODE_PAUSE = 10.0


class _DecodeTuner:
    """Chooses the decode thread count from step intervals (see the module docstring).

    `clock` is injectable so the choice logic can be tested with fake timings.
    """

    def __init__(self, max_threads: int, clock=time.perf_counter) -> None:
        self.max_threads = max_threads
        self.clock = clock
        self.preferred = 1
        self.wait = DECODE_PROBE_WAIT  # decode steps between probes
        self.until_probe = 0  # the first probe comes once a baseline is measured
        self.probe_left = 0  # steps of the probe in progress still to launch
        self.probe: list[float] = []  # intervals of the probe in progress
        self.recent: deque[float] = deque(maxlen=DECODE_PROBE_STEPS)  # preferred intervals
        self.last: tuple[float, int] | None = None  # (entry time, threads) of the last step
        self.probes: list[tuple[int, float, float]] = []  # (threads, probe s, baseline s)

    def other(self) -> int:
        return self.max_threads if self.preferred == 1 else 1

    def interrupt(self) -> None:
        """A non-decode step ran: the interval in progress is not a decode step's."""
        self.last = None

    def step(self) -> int:
        """A decode step starts now: record the last one's interval; return this one's count."""
        now = self.clock()
        if self.last is not None:
            started, threads = self.last
            (self.probe if threads != self.preferred else self.recent).append(now - started)
        if self.probe_left > 0 and self._hopeless():
            self.probe_left = 0
        if self.probe_left == 0 and self.probe:
            self._judge()
        if self.max_threads < 2:
            threads = 1
        elif self.probe_left > 0:
            self.probe_left -= 1
            threads = self.other()
        elif self.until_probe <= 0 and len(self.recent) == self.recent.maxlen:
            self.probe_left = DECODE_PROBE_STEPS - 1
            threads = self.other()
        else:
            self.until_probe -= 1
            threads = self.preferred
        self.last = (now, threads)
        return threads

    def _hopeless(self) -> bool:
        """The probe's first interval is already `DECODE_PROBE_GIVE_UP` times the baseline
        (and less than `DECODE_PAUSE` times: a pause is no verdict)."""
        if len(self.probe) != 1 or not self.recent:
            return False
        ratio = self.probe[0] / max(min(self.recent), 1e-9)
        return DECODE_PROBE_GIVE_UP <= ratio < DECODE_PAUSE

    def _judge(self) -> None:
        probe, baseline = min(self.probe), min(self.recent)
        self.probes.append((self.other(), probe, baseline))
        self.probe = []
        if probe < (1 - DECODE_MARGIN) * baseline:
            self.preferred = self.other()
            self.wait = DECODE_PROBE_WAIT
            self.recent.clear()  # the old count's intervals are no baseline for the new
        else:
            self.wait = min(2 * self.wait, DECODE_PROBE_MAX)
        self.until_probe = self.wait


def _load_global(path: Path | str) -> ctypes.CDLL:
    handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    _handles.append(handle)
    return handle


def ensure_fast_blas() -> BlasStatus:
    """Bind the optimized BLAS globally so MLX uses it; call before the first ``import mlx``.

    Safe to call many times and on any platform; never raises. Returns (and
    remembers) what happened; a refusal is also said once on stderr.
    """
    global _status, _openblas, _max_threads
    if _status is not None:
        return _status
    try:
        _status = _ensure()
    except Exception as e:  # noqa: BLE001 - a BLAS problem must never stop an import
        _status = BlasStatus(False, f"the optimized BLAS could not be set up: {e}")
    if _status.active:
        handle = _handles[-1]
        if hasattr(handle, "openblas_set_num_threads"):
            _openblas = handle
            _max_threads = max(1, int(handle.openblas_get_num_threads()))
    elif _status.verdict is not None:  # prepared but refused, or failed: say it once
        print(f"mlx_nbengine: {_status.reason}; {REFERENCE_COST}", file=sys.stderr)
    return _status


def affinity_threads() -> int:
    """The cores this process may run on (its affinity mask), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# The policy whose step is in progress on this thread (its block is running), which our
# kernels and the routes ask; None outside any step.
_stepping: ContextVar[ThreadPolicy | None] = ContextVar("mlx_nbengine_blas_step", default=None)


class ThreadPolicy:
    """One engine's choice of each step's thread count (see the module docstring).

    `library` is the OpenBLAS handle it sets the count of and `max_threads` its count
    (None: the process's own, bound by `ensure_fast_blas`; without OpenBLAS every step runs
    on one thread and nothing is learned). `clock` times decode steps (injectable for
    tests). Use it on one thread: the engine's generation thread.
    """

    def __init__(
        self,
        *,
        library: Any = None,
        max_threads: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._library = library
        self._max_threads = max_threads
        self.clock = clock
        self.seconds_per_token: dict[int, float] = {}  # prefill count -> smoothed s/token
        self.prefill_steps = 0
        self._probed_at = 0  # `prefill_steps` when the other count was last tried
        self.kernel_threads: int | None = None  # our kernels' count in a decode step
        self.kernel_products = False  # a product went to our kernels since the last decode
        self._decode: _DecodeTuner | None = None

    @property
    def library(self) -> Any:
        return self._library if self._library is not None else _openblas

    @property
    def max_threads(self) -> int:
        return self._max_threads if self._max_threads is not None else _max_threads

    @property
    def decode(self) -> _DecodeTuner:
        """The decode steps' tuner (made anew if the thread count changed)."""
        if self._decode is None or self._decode.max_threads != self.max_threads:
            self._decode = _DecodeTuner(self.max_threads, self.clock)
        return self._decode

    @decode.setter
    def decode(self, tuner: _DecodeTuner) -> None:
        self._decode = tuner

    def _candidates(self) -> list[int]:
        return [self.max_threads, 1] if self.max_threads > 1 else [1]

    def _prefill_choice(self, n_tokens: int, *, probe: bool = False) -> int:
        """The count of a prefill step over `n_tokens`; with `probe` (a timed step) the
        other count's try where one is due and the step is short enough to pay for it."""
        candidates = self._candidates()
        timed = [c for c in candidates if c in self.seconds_per_token]
        if not timed or len(candidates) == 1:
            return candidates[0]
        best = min(timed, key=lambda c: self.seconds_per_token[c])
        due = len(timed) < len(candidates) or self.prefill_steps - self._probed_at >= PROBE_EVERY
        if probe and due and n_tokens <= PROBE_MAX_TOKENS:
            self._probed_at = self.prefill_steps
            return next(c for c in candidates if c != best)
        return best

    @contextmanager
    def running(self) -> Iterator[ThreadPolicy]:
        """Make this the policy our kernels ask (`current_threads`) while the block runs."""
        token = _stepping.set(self)
        try:
            yield self
        finally:
            _stepping.reset(token)

    @contextmanager
    def step(self, n_tokens: int) -> Iterator[int]:
        """Run one model step over `n_tokens` tokens with the thread count chosen for it.

        Wrap the model call and the `mx.eval` (or `mx.async_eval`) that runs it;
        yields the thread count. Prefill steps are timed to steer later choices,
        decode steps by the time between consecutive ones.
        """
        with self.running():
            if self.library is None:
                yield 1
                return
            if n_tokens < PARALLEL_MIN_TOKENS:
                threads = self.decode.step()
                self.set_step_threads(threads, decode=self._take_kernel_products())
                yield threads
                return
            self.decode.interrupt()
            threads = self._prefill_choice(n_tokens, probe=True)
            self.set_step_threads(threads, decode=False)
            start = time.perf_counter()
            yield threads
            per_token = (time.perf_counter() - start) / n_tokens
            old = self.seconds_per_token.get(threads)
            self.seconds_per_token[threads] = (
                per_token if old is None else _SMOOTHING * per_token + (1 - _SMOOTHING) * old
            )
            self.prefill_steps += 1

    @contextmanager
    def prefill(self, n_tokens: int) -> Iterator[int]:
        """A prompt step over `n_tokens` tokens: `step` for one long enough to be a prefill
        step; a shorter one (an edit's few changed tokens) runs on the count prefill steps
        run faster on, without being counted or timed (`threads_for`): a tuning probe of the
        other count would otherwise land on it and cost a whole step of the edited re-run.
        Yields the thread count."""
        if n_tokens >= PARALLEL_MIN_TOKENS:
            with self.step(n_tokens) as threads:
                yield threads
            return
        with self.running():
            yield self.threads_for(n_tokens)

    def threads_for(self, n_tokens: int) -> int:
        """Set OpenBLAS's thread count for a step over `n_tokens` tokens; return it.

        Call it on the thread that evaluates the step, before evaluating it. A no-op
        (returning 1) where OpenBLAS is not in use.
        """
        if self.library is None:
            return 1
        if n_tokens > 1:  # a prefill step, or a short one: the count prefill runs on
            threads = self._prefill_choice(n_tokens)
        else:
            threads = self.decode.preferred
        # Set every time (it is cheap): other code in the process may have changed it.
        self.set_step_threads(threads, decode=n_tokens == 1 and self.kernel_products)
        return threads

    def note_kernel_products(self) -> None:
        """A product of the step being built runs on our kernels."""
        self.kernel_products = True

    def _take_kernel_products(self) -> bool:
        seen, self.kernel_products = self.kernel_products, False
        return seen

    def set_step_threads(self, threads: int, *, decode: bool) -> None:
        """Set the thread count of the step about to run: OpenBLAS's and our kernels' alike,
        or, for a `decode` step, our kernels' only, with OpenBLAS on one thread (the module
        docstring says why). A no-op where OpenBLAS is not in use."""
        library = self.library
        if library is None:
            return
        library.openblas_set_num_threads(1 if decode else int(threads))
        self.kernel_threads = max(1, int(threads)) if decode else None

    def current_threads(self) -> int:
        """The thread count set for this policy's step; 1 without OpenBLAS."""
        library = self.library
        if library is None:
            return 1
        if self.kernel_threads is not None:
            return self.kernel_threads
        return max(1, int(library.openblas_get_num_threads()))


def note_kernel_products() -> None:
    """A product of the step being built runs on our kernels (`models.qroute` says so): the
    policy of the step in progress notes it; outside any step, nothing to note."""
    policy = _stepping.get()
    if policy is not None:
        policy.note_kernel_products()


_REFERENCE_WORDS = {"reference", "off", "0", "none"}
_THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOTO_NUM_THREADS")


def _prepare(choice: str) -> tuple[Path, str, Path | None]:
    """The library to vet and bind for `choice`: (path, how it was made, what it serves)."""
    if choice not in {"", "auto", "shim", "renamed"}:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise BlasBuildError(
                f"{_ENV}={choice!r} is neither auto, shim, renamed, reference nor a library file"
            )
        return path, "the library given by " + _ENV, None
    source = _blaslib.scipy_openblas()
    if source is None:
        raise BlasBuildError("scipy-openblas32 is not installed")
    compiler = c_compiler() if choice != "renamed" else None
    if choice == "shim" and compiler is None:
        raise BlasBuildError("no C compiler to build the BLAS shim with")
    if compiler is not None:
        try:
            return _blaslib.build_shim(source, compiler), "scipy-openblas32 through a shim", source
        except BlasBuildError:
            if choice == "shim":
                raise
    how = "scipy-openblas32, renamed" + ("" if choice == "renamed" else " (no C compiler)")
    return _blaslib.build_renamed(source), how, source


def _ensure() -> BlasStatus:
    if not sys.platform.startswith("linux"):
        return BlasStatus(False, "not Linux: MLX uses the platform BLAS")
    choice = os.environ.get(_ENV, "").strip()
    if choice.lower() in _REFERENCE_WORDS:
        return BlasStatus(False, f"{_ENV} asks for the reference BLAS")
    if "mlx.core" in sys.modules:
        return BlasStatus(False, "mlx.core was imported first; its BLAS is already bound")
    try:
        library, how, source = _prepare(
            choice.lower() if choice.lower() in {"auto", "shim", "renamed"} else choice
        )
    except (BlasBuildError, OSError) as e:
        return BlasStatus(False, f"no optimized BLAS: {e}", verdict="not built")
    verdict, cached = _blaslib.vet(library)
    said = verdict.reason + (" (cached verdict)" if cached else "")
    if not verdict.ok:
        return BlasStatus(
            False,
            f"the BLAS {library.name} was refused: {verdict.reason}",
            library=str(library),
            source=str(source) if source else None,
            config=verdict.config,
            core=verdict.core,
            verdict=said,
        )
    if not os.environ.get(_TIMEOUT_ENV):
        os.environ[_TIMEOUT_ENV] = str(THREAD_TIMEOUT)  # read as the library loads
    try:
        handle = _load_global(library)
    except OSError as e:
        return BlasStatus(False, f"the BLAS {library.name} did not load: {e}", verdict="load")
    threads = None
    if hasattr(handle, "openblas_set_num_threads"):
        if not any(os.environ.get(name) for name in _THREAD_ENV):
            handle.openblas_set_num_threads(affinity_threads())
        threads = int(handle.openblas_get_num_threads())
    return BlasStatus(
        True,
        how,
        library=str(library),
        source=str(source) if source else None,
        config=verdict.config,
        core=verdict.core,
        threads=threads,
        verdict=said,
    )


def current_threads() -> int:
    """The thread count of the step in progress on this thread (its `ThreadPolicy`'s), else
    OpenBLAS's count now; 1 without OpenBLAS.

    Our own kernels (`mlx_nbengine.kernels`) split their work over the same count.
    """
    policy = _stepping.get()
    if policy is not None:
        return policy.current_threads()
    if _openblas is None:
        return 1
    return max(1, int(_openblas.openblas_get_num_threads()))


def blas_status() -> BlasStatus | None:
    """What `ensure_fast_blas` did in this process, or None if it was never called."""
    return _status


def blas_identity() -> str:
    """What runs MLX's CPU matmuls in this process, in a few words (a persistent store's
    identity names it: another core gives other bits): OpenBLAS's version and the core it
    chose ("OpenBLAS 0.3.34 SkylakeX"), the library's file name where it does not say,
    "reference" (the bundled reference BLAS) or "platform" (not Linux)."""
    status = _status
    if status is None:
        return "not set up"
    if status.active:
        words = (status.config or "").split()[:2]  # "OpenBLAS 0.3.34.481.3"
        version = " ".join(words) if words[:1] == ["OpenBLAS"] else ""
        named = " ".join(part for part in (version, status.core or "") if part)
        return named or Path(status.library or "unknown").name
    if status.reason.startswith("not Linux"):
        return "platform"
    return "reference"


_reference_said = False


def reference_blas_line() -> str | None:
    """The line for a CPU process whose MLX was imported before mlx_nbengine, so its matmuls
    are bound to the reference BLAS (`REFERENCE_COST`) and nothing else said so; else None."""
    status = _status
    if status is None or status.active or "imported first" not in status.reason:
        return None
    mx = sys.modules.get("mlx.core")
    if mx is not None and mx.default_device() == mx.gpu:
        return None  # the GPU runs the model: the CPU's BLAS does not matter
    return (
        f"mlx_nbengine: mlx.core was imported before mlx_nbengine, so {REFERENCE_COST} "
        "(every float32 product); import mlx_nbengine before mlx, or restart (in a notebook: "
        "restart the kernel and run `%load_ext mlx_nbengine` first)"
    )


def say_reference_blas(*, claimed: bool = False) -> bool:
    """Write `reference_blas_line` on stderr, once per process; returns whether it was
    written now. `claimed`: the caller shows it its own way (the notebook's hint), so it is
    marked said without a word here."""
    global _reference_said
    line = reference_blas_line()
    if line is None or _reference_said:
        return False
    _reference_said = True
    if claimed:
        return False
    print(line, file=sys.stderr, flush=True)
    return True

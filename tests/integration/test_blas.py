"""`mlx_nbengine._blas`: on Linux CPU, MLX's matmuls land in scipy-openblas32 (through the
compiled shim, or the renamed copy without a compiler) when mlx_nbengine is imported first;
the reference BLAS stays when asked or when MLX came first. The guard's refusals are in
tests/integration/test_blas_guard.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_nbengine import _blas, _blaslib

ROOT = Path(__file__).resolve().parents[2]
linux_with_openblas = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _blaslib.scipy_openblas() is None,
    reason="the OpenBLAS binding is for Linux with scipy-openblas32 installed",
)

MATMUL = "import mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))"
STATUS = "import mlx_nbengine.models; from mlx_nbengine._blas import blas_status\n"


def run_python(code: str, tmp_path: Path, **env: str) -> tuple[str, str]:
    """Run `code` in a fresh interpreter with symbol-binding tracing; return (stdout, trace)."""
    trace = tmp_path / "ld"
    full_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLX_NBENGINE_HOME": str(tmp_path / "home"),
        "LD_DEBUG": "bindings",
        "LD_DEBUG_OUTPUT": str(trace),
        **env,
    }
    unset = ("LD_PRELOAD", "MLX_NBENGINE_BLAS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    for name in (*unset, "OPENBLAS_THREAD_TIMEOUT"):
        if name not in env:
            full_env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, check=True
    )
    traced = "".join(p.read_text(errors="replace") for p in tmp_path.glob("ld.*"))
    for p in tmp_path.glob("ld.*"):
        p.unlink()
    return out.stdout, traced


def sgemm_binding(trace: str) -> str:
    lines = [line for line in trace.splitlines() if "libmlx.so" in line and "`cblas_sgemm'" in line]
    assert lines, "libmlx.so never bound cblas_sgemm"
    return lines[0].split(" to ")[1]


@linux_with_openblas
def test_importing_mlx_nbengine_first_binds_mlx_sgemm_to_the_shim(tmp_path):
    code = STATUS + MATMUL + "\ns = blas_status(); print(s.active, s.reason, s.threads)"
    stdout, trace = run_python(code, tmp_path)
    assert stdout.split()[:2] == ["True", "scipy-openblas32"] and "shim" in stdout
    assert _blaslib.SHIM_NAME in sgemm_binding(trace)
    # The thread count is the cores this process may use, not OpenBLAS's build cap (64).
    assert int(stdout.split()[-1]) == len(os.sched_getaffinity(0))


@linux_with_openblas
def test_without_a_compiler_the_renamed_copy_serves_mlx(tmp_path):
    """The compiler hidden from PATH (and no $CC): the pure-Python renamed copy is bound."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    code = STATUS + MATMUL + "\ns = blas_status(); print(s.active, '|', s.reason)"
    stdout, trace = run_python(code, tmp_path, PATH=str(empty))
    assert stdout.strip() == "True | scipy-openblas32, renamed (no C compiler)"
    assert _blaslib.RENAMED_NAME in sgemm_binding(trace)
    assert not list((tmp_path / "home" / "blas").glob(f"*/{_blaslib.SHIM_NAME}"))


@linux_with_openblas
def test_threads_follow_the_affinity_mask(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to restrict the process to one")
    code = STATUS + "s = blas_status(); print(s.threads)"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_NBENGINE_HOME": str(tmp_path)}
    for name in ("MLX_NBENGINE_BLAS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        env.pop(name, None)
    one = min(os.sched_getaffinity(0))
    pinned = f"import os; os.sched_setaffinity(0, {{{one}}})\n" + code
    out = subprocess.run(
        [sys.executable, "-c", pinned], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1"


@linux_with_openblas
def test_openblas_coretype_forces_the_portable_haswell_kernels(tmp_path):
    """What a CPU without AVX-512 gets, on any x86 machine: OPENBLAS_CORETYPE=Haswell."""
    if os.uname().machine != "x86_64":
        pytest.skip("Haswell kernels are x86-64 kernels")
    code = STATUS + MATMUL + "\ns = blas_status(); print(s.active, s.core, '|', s.config)"
    stdout, trace = run_python(code, tmp_path, OPENBLAS_CORETYPE="Haswell")
    active, core, _, config = stdout.split(maxsplit=3)
    assert (active, core) == ("True", "Haswell")
    assert "DYNAMIC_ARCH" in config and "Haswell" in config
    assert _blaslib.SHIM_NAME in sgemm_binding(trace)


@linux_with_openblas
def test_reference_setting_keeps_the_bundled_blas(tmp_path):
    code = STATUS + MATMUL + "\nprint(blas_status().reason)"
    stdout, trace = run_python(code, tmp_path, MLX_NBENGINE_BLAS="reference")
    assert "asks for the reference BLAS" in stdout
    assert "libblas-" in sgemm_binding(trace)


@linux_with_openblas
def test_after_mlx_is_imported_it_is_too_late_and_says_so(tmp_path):
    code = "import mlx.core\nfrom mlx_nbengine._blas import ensure_fast_blas\n"
    code += "print(ensure_fast_blas().reason)"
    stdout, _ = run_python(code, tmp_path)
    assert "mlx.core was imported first" in stdout


def test_other_platforms_are_left_alone(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _blas._ensure() == _blas.BlasStatus(False, "not Linux: MLX uses the platform BLAS")


def test_decode_steps_start_on_one_thread():
    policy = _blas.ThreadPolicy()
    assert policy.threads_for(1) == 1
    with policy.step(1) as threads:
        assert threads == 1
        if _blas._openblas is not None:
            assert _blas._openblas.openblas_get_num_threads() == 1


def test_a_decode_step_gives_its_threads_to_our_kernels_and_one_to_openblas():
    if _blas._openblas is None:
        pytest.skip("OpenBLAS is not in use here")
    policy = _blas.ThreadPolicy()
    try:
        with policy.running():  # as in a step's block: the kernels ask this policy
            policy.set_step_threads(2, decode=True)
            assert _blas._openblas.openblas_get_num_threads() == 1
            assert _blas.current_threads() == 2
            policy.set_step_threads(2, decode=False)
            assert _blas._openblas.openblas_get_num_threads() == 2
            assert _blas.current_threads() == 2
            policy.set_step_threads(1, decode=True)
            assert _blas.current_threads() == 1
    finally:
        policy.set_step_threads(_blas._max_threads, decode=False)


class FakeOpenBLAS:
    """The two calls a `ThreadPolicy` makes of OpenBLAS, on a count of its own."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def openblas_set_num_threads(self, threads: int) -> None:
        self.threads = threads

    def openblas_get_num_threads(self) -> int:
        return self.threads


def fake_policy(threads: int = 4) -> _blas.ThreadPolicy:
    return _blas.ThreadPolicy(library=FakeOpenBLAS(threads), max_threads=threads)


def test_two_policies_learn_and_count_apart():
    first, second = fake_policy(), fake_policy()
    with first.step(_blas.PARALLEL_MIN_TOKENS):
        pass
    assert first.prefill_steps == 1 and set(first.seconds_per_token) == {4}
    assert second.prefill_steps == 0 and second.seconds_per_token == {}
    with first.running():
        _blas.note_kernel_products()  # what a route says while a step is built
    assert first.kernel_products and not second.kernel_products
    first.set_step_threads(3, decode=True)
    second.set_step_threads(2, decode=True)
    with first.running():
        assert _blas.current_threads() == 3
        with second.running():
            assert _blas.current_threads() == 2
        assert _blas.current_threads() == 3


def test_the_runner_steps_on_the_policy_it_is_given(tiny_model_dir):
    from test_scheduler import BS, prompt, run_out, submit  # tests/ is on sys.path

    from mlx_nbengine.engine.runner import Runner
    from mlx_nbengine.engine.scheduler import Scheduler
    from mlx_nbengine.models import load

    lm = load(tiny_model_dir("llama"))
    mine, other = fake_policy(), fake_policy()
    runner = Runner(lm, thread_policy=mine)
    scheduler = Scheduler(runner, block_size=BS, parallel=2, max_prefill_step=64)
    run_out(scheduler, [submit(scheduler, lm, prompt(70, seed=1), max_tokens=3)])
    assert mine.prefill_steps >= 1 and mine.seconds_per_token
    assert mine.decode.last is not None  # its decode steps were timed
    assert other.prefill_steps == 0 and other.seconds_per_token == {}
    assert Runner(lm).thread_policy is not Runner(lm).thread_policy


class FakeClock:
    """Seconds that advance only when a simulated step runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_decode(tuner, clock, seconds_per_step, steps):
    """Run `steps` decode steps costing `seconds_per_step[threads]`; the thread counts used."""
    used = []
    for _ in range(steps):
        threads = tuner.step()
        used.append(threads)
        clock.now += seconds_per_step[threads]
    return used


def test_decode_probes_all_threads_once_one_thread_is_measured_then_keeps_the_winner():
    clock = FakeClock()
    tuner = _blas._DecodeTuner(4, clock)
    quiet = {1: 0.2, 4: 0.1}  # all threads twice as fast
    first = _blas.DECODE_PROBE_STEPS  # one interval each, measured when the next step starts
    used = run_decode(tuner, clock, quiet, first + _blas.DECODE_PROBE_STEPS + 1)
    assert used[:first] == [1] * first
    assert used[first : first + _blas.DECODE_PROBE_STEPS] == [4] * _blas.DECODE_PROBE_STEPS
    assert used[-1] == 4 and tuner.preferred == 4
    assert tuner.probes == [(4, pytest.approx(0.1), pytest.approx(0.2))]
    # Later probes of one thread lose, so four threads stay.
    used = run_decode(tuner, clock, quiet, 400)
    assert tuner.preferred == 4 and used.count(1) <= 4 * _blas.DECODE_PROBE_STEPS


def test_losing_decode_probes_back_off_so_a_busy_machine_pays_almost_nothing():
    clock = FakeClock()
    tuner = _blas._DecodeTuner(2, clock)
    busy = {1: 0.01, 2: 0.5}  # threads wait for busy cores: 50x slower
    used = run_decode(tuner, clock, busy, 10_000)
    assert tuner.preferred == 1
    assert all(p[0] == 2 and p[1] > p[2] for p in tuner.probes)
    assert tuner.wait == _blas.DECODE_PROBE_MAX
    assert 6 <= len(tuner.probes) <= 16
    assert used.count(2) / len(used) < 0.005


def test_decode_preference_follows_the_machine_when_it_becomes_quiet():
    clock = FakeClock()
    tuner = _blas._DecodeTuner(2, clock)
    run_decode(tuner, clock, {1: 0.01, 2: 0.5}, 3000)
    assert tuner.preferred == 1
    run_decode(tuner, clock, {1: 0.2, 2: 0.12}, 2 * _blas.DECODE_PROBE_MAX)
    assert tuner.preferred == 2


def test_a_hopeless_probe_ends_after_one_step():
    """On a quiet machine a probe of one thread is twice as slow: it ends after its first
    step; a probe that is slower but not hopeless runs its steps."""
    clock = FakeClock()
    tuner = _blas._DecodeTuner(2, clock)
    quiet = {1: 0.2, 2: 0.1}
    run_decode(tuner, clock, quiet, 2 * _blas.DECODE_PROBE_STEPS + 1)
    assert tuner.preferred == 2
    used = run_decode(tuner, clock, quiet, 2000)
    lost = tuner.probes[1:]
    assert lost and all(t == 1 for t, _, _ in lost)
    assert used.count(1) == len(lost)  # one slow step a probe
    tuner = _blas._DecodeTuner(2, clock)
    close = {1: 0.2, 2: 0.2 / (_blas.DECODE_PROBE_GIVE_UP * 0.9)}  # one thread 1.35x as slow
    run_decode(tuner, clock, close, 2 * _blas.DECODE_PROBE_STEPS + 1)
    assert tuner.preferred == 2
    used = run_decode(tuner, clock, close, 2000)
    assert used.count(1) == _blas.DECODE_PROBE_STEPS * len(tuner.probes[1:]) > 0


def test_a_probe_must_win_by_the_margin():
    clock = FakeClock()
    tuner = _blas._DecodeTuner(2, clock)
    almost = {1: 0.100, 2: 0.100 * (1 - _blas.DECODE_MARGIN / 2)}
    run_decode(tuner, clock, almost, 500)
    assert tuner.preferred == 1 and len(tuner.probes) >= 3


def test_idle_pauses_and_prefill_steps_do_not_count_as_decode_time():
    clock = FakeClock()
    tuner = _blas._DecodeTuner(2, clock)
    quiet = {1: 0.2, 2: 0.1}
    run_decode(tuner, clock, quiet, _blas.DECODE_PROBE_STEPS)
    # The user pauses for a minute mid-probe: the probe's fastest interval still counts.
    assert tuner.step() == 2
    clock.now += 60.0
    run_decode(tuner, clock, quiet, _blas.DECODE_PROBE_STEPS)
    assert tuner.preferred == 2
    # A long prefill step between two decode steps is no decode interval.
    tuner.step()
    clock.now += 0.1
    before = list(tuner.recent)
    tuner.interrupt()
    clock.now += 30.0
    tuner.step()
    assert list(tuner.recent) == before and max(before) < 1


def test_one_core_never_probes():
    clock = FakeClock()
    tuner = _blas._DecodeTuner(1, clock)
    assert set(run_decode(tuner, clock, {1: 0.1}, 100)) == {1} and tuner.probes == []


@linux_with_openblas
def test_one_core_prefills_on_one_thread_and_never_probes():
    _blas.ensure_fast_blas()
    if _blas._openblas is None:
        pytest.skip("needs OpenBLAS")
    policy = _blas.ThreadPolicy(max_threads=1)
    for n in (_blas.PARALLEL_MIN_TOKENS, _blas.PROBE_MAX_TOKENS, 1024) * _blas.PROBE_EVERY:
        with policy.step(n) as threads:
            assert threads == 1
    assert set(policy.seconds_per_token) == {1}


@linux_with_openblas
def test_a_policy_step_sets_the_decode_choice_and_prefill_interrupts_it():
    _blas.ensure_fast_blas()
    if _blas._openblas is None or _blas._max_threads < 2:
        pytest.skip("needs OpenBLAS with at least two threads")
    policy = _blas.ThreadPolicy()
    tuner = _blas._DecodeTuner(_blas._max_threads, FakeClock())
    tuner.preferred = _blas._max_threads
    policy.decode = tuner
    policy.seconds_per_token = {1: 0.001, _blas._max_threads: 0.003}
    with policy.step(1) as threads:  # a float32 model's step: OpenBLAS takes the count
        assert threads == _blas._max_threads == _blas._openblas.openblas_get_num_threads()
        _blas.note_kernel_products()  # the step's products ran on our kernels
    with policy.step(1) as threads:
        # Our kernels take the decode count; OpenBLAS stays on one thread.
        assert threads == _blas._max_threads == _blas.current_threads()
        assert _blas._openblas.openblas_get_num_threads() == 1
    assert tuner.last is not None
    assert policy.threads_for(1) == _blas._max_threads
    with policy.step(_blas.PARALLEL_MIN_TOKENS):
        pass
    assert tuner.last is None


@linux_with_openblas
def test_prefill_tries_both_thread_counts_then_keeps_the_faster():
    _blas.ensure_fast_blas()
    if _blas._openblas is None or _blas._max_threads < 2:
        pytest.skip("needs OpenBLAS with at least two threads")
    policy = _blas.ThreadPolicy()
    n = _blas.PARALLEL_MIN_TOKENS
    with policy.step(n) as first:
        pass
    with policy.step(n) as second:
        pass
    assert (first, second) == (_blas._max_threads, 1)
    policy.seconds_per_token.update({1: 0.001, _blas._max_threads: 0.003})
    for _ in range(_blas.PROBE_EVERY - 1):
        with policy.step(n) as kept:
            assert kept == 1 == _blas._openblas.openblas_get_num_threads()
    # PROBE_EVERY prefill steps after the last try, the other count is tried again.
    with policy.step(n) as probe:
        assert probe == _blas._max_threads
    policy.seconds_per_token.update({1: 0.001, _blas._max_threads: 0.003})
    with policy.step(n) as after:
        assert after == 1


@linux_with_openblas
def test_long_prefill_steps_never_try_the_other_count():
    """A try of the other count waits for a step of at most PROBE_MAX_TOKENS tokens: a
    1,024-token step on one thread would cost a long prompt seconds (tens of them on a
    hybrid model), and the engine's steps are that long."""
    _blas.ensure_fast_blas()
    if _blas._openblas is None or _blas._max_threads < 2:
        pytest.skip("needs OpenBLAS with at least two threads")
    many, long = _blas._max_threads, _blas.PROBE_MAX_TOKENS + 1
    policy = _blas.ThreadPolicy()
    for _ in range(2 * _blas.PROBE_EVERY):  # one count untimed, then probes overdue
        with policy.step(long) as threads:
            assert threads == many
    assert set(policy.seconds_per_token) == {many}
    with policy.step(_blas.PROBE_MAX_TOKENS) as threads:  # the first short one tries it
        assert threads == 1
    policy.seconds_per_token = {1: 0.001, many: 0.003}  # one thread measured faster
    with policy.step(long) as threads:
        assert threads == 1  # long steps take the faster count, never a try
    for _ in range(2 * _blas.PROBE_EVERY):
        with policy.step(long) as threads:
            assert threads == 1
        policy.seconds_per_token = {1: 0.001, many: 0.003}
    with policy.step(_blas.PROBE_MAX_TOKENS) as threads:  # overdue: the next short step
        assert threads == many
    assert policy.threads_for(long) == 1  # an untimed step takes the best, never a try


def test_short_prefill_steps_take_the_count_prefill_runs_faster_on():
    """An edit's few changed tokens (2-31) are a matrix-matrix product: they run on the
    thread count long prefill steps measured faster, never probing the other; before
    both counts are timed, on all threads as prefill (never the decode preference, which
    starts on one thread); one token stays a decode step."""
    _blas.ensure_fast_blas()
    if _blas._openblas is None or _blas._max_threads < 2:
        pytest.skip("needs OpenBLAS with at least two threads")
    many = _blas._max_threads
    policy = _blas.ThreadPolicy()
    policy.decode = _blas._DecodeTuner(many, FakeClock())
    assert policy.decode.preferred == 1
    assert policy.threads_for(20) == many  # nothing timed: prefill's first count
    policy.seconds_per_token = {many: 0.003}
    assert policy.threads_for(20) == many  # one count untimed: still prefill's
    policy.seconds_per_token = {1: 0.004, many: 0.003}
    for step in range(2 * _blas.PROBE_EVERY):  # never a probe, whatever the step count
        policy.prefill_steps = step
        assert policy.threads_for(20) == many == _blas._openblas.openblas_get_num_threads()
        assert policy.threads_for(2) == many
    assert policy.threads_for(1) == 1  # decode keeps its own preference
    policy.seconds_per_token = {1: 0.002, many: 0.003}
    assert policy.threads_for(_blas.PARALLEL_MIN_TOKENS - 1) == 1  # a busy machine


@pytest.mark.slow
@linux_with_openblas
def test_on_the_portable_haswell_kernels_the_default_model_answers(tmp_path):
    """A CPU without AVX-512 (forced with OPENBLAS_CORETYPE=Haswell on any x86 machine): the
    binding reports that core and the default model answers its first prompt."""
    if os.uname().machine != "x86_64":
        pytest.skip("Haswell kernels are x86-64 kernels")
    code = (
        "from mlx_nbengine.engine import Engine\n"
        "from mlx_nbengine._blas import blas_status\n"
        "print(blas_status().core)\n"
        "with Engine.load('default') as engine:\n"
        "    done = engine.submit('The Eiffel Tower is located in the city of', max_tokens=8)\n"
        "    print(done.result().text)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_CORETYPE": "Haswell"}
    env.pop("MLX_NBENGINE_BLAS", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-2000:]
    core, answer = out.stdout.split("\n", 1)
    assert core == "Haswell"
    assert "Paris" in answer


# OpenBLAS's idle worker threads spin for OPENBLAS_THREAD_TIMEOUT (2**n TSC ticks) after a
# call, then sleep on a condition variable: one voluntary context switch. The workers are the
# threads `import mlx_nbengine` leaves beside the main one (it binds and starts OpenBLAS
# before MLX starts any thread of its own). Between calls 5 ms apart they sleep every time
# at 2**16 ticks (about 30 us at 2 GHz) and never at OpenBLAS's 2**28 (about 0.1 s), on a
# machine of any speed within 10x either way.
IDLE_SLEEPS = """
import os, threading, time
main = str(threading.get_native_id())
import mlx_nbengine
workers = [t for t in os.listdir("/proc/self/task") if t != main]
import mlx.core as mx
a = mx.random.normal((1024, 1024))
mx.eval(a)
def sleeps():
    total = 0
    for t in workers:
        for line in open(f"/proc/self/task/{t}/status"):
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total
for _ in range(3):
    mx.eval(a @ a)
time.sleep(0.5)
before = sleeps()
for _ in range(CALLS):
    mx.eval(a @ a)
    time.sleep(0.005)
print(os.environ.get("OPENBLAS_THREAD_TIMEOUT"), len(workers), sleeps() - before)
"""
CALLS = 20


@linux_with_openblas
def test_openblas_threads_sleep_soon_after_a_call(tmp_path):
    """OpenBLAS's idle threads spin for 2**28 cycles (about 0.1 s) by default, on the cores
    our kernels need next; with `THREAD_TIMEOUT` they sleep within microseconds: its worker
    sleeps after every one of `CALLS` two-thread matmuls 5 ms apart, where OpenBLAS's own
    setting (the user's, kept) keeps it spinning through every gap."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores for a second OpenBLAS thread")
    code = IDLE_SLEEPS.replace("CALLS", str(CALLS))

    def run(**env: str) -> list[str]:  # no LD_DEBUG trace (run_python's): it is slow
        full = {**os.environ, "PYTHONPATH": str(ROOT)}  # the session's cache home: built
        for name in ("MLX_NBENGINE_BLAS", "OMP_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT"):
            full.pop(name, None)
        full.update(OPENBLAS_NUM_THREADS="2", **env)
        done = subprocess.run(
            [sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True
        )
        return done.stdout.split()

    timeout, workers, sleeps = run()
    assert timeout == str(_blas.THREAD_TIMEOUT) and int(workers) >= 1
    assert int(sleeps) >= CALLS, f"OpenBLAS's worker slept {sleeps} times in {CALLS} gaps"
    timeout, _, sleeps = run(OPENBLAS_THREAD_TIMEOUT="28")
    assert timeout == "28"
    assert int(sleeps) < CALLS // 2, f"OpenBLAS's worker slept {sleeps} times: no spinning"

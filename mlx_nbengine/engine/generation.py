"""The generation thread: loads the model, then turns the scheduler until stopped.

The *inbox* is how other threads talk to it: ``submit`` (a new sequence), ``cancel``,
``restored`` (the cache-I/O thread finished a sequence's restore), ``call`` (run a
function here, between turns) and ``stop``. The *loop* handles what is in the inbox and
takes one `Scheduler.tick`, waiting on the inbox only when the scheduler has nothing to
do; an idle loop woken by a request waits `ADMIT_GRACE_S` for the rest of a burst.

This thread owns the `LoadedModel` (it loaded it: MLX streams are per thread), the
`Runner`, `Checkpoints` and `Scheduler` built around it, every sequence and the hot
cache. Other threads read only its counters (`active`, `queued`, ...) for stats. An
exception the scheduler does not pin on one sequence fails everything in flight; the
loop keeps serving.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_nbengine._blas import ThreadPolicy
from mlx_nbengine.cache import layer_kinds
from mlx_nbengine.engine.cacheio import CacheIO
from mlx_nbengine.engine.checkpoints import Checkpoints
from mlx_nbengine.engine.config import EngineConfig
from mlx_nbengine.engine.request import EngineClosedError
from mlx_nbengine.engine.runner import Runner
from mlx_nbengine.engine.scheduler import Scheduler
from mlx_nbengine.engine.sequence import Sequence

# An idle loop woken by a request waits this long for the rest of a burst before admitting.
ADMIT_GRACE_S = 0.005
# An idle engine gives its memory back (`Runner.idle`) after this long without work.
GIVE_BACK_AFTER_S = 0.25


class GenerationThread:
    """The inbox and the loop of the module docstring, on one daemon thread."""

    # Set for good when a thread got stuck in a lost rank group's step (`fail_everything`):
    # MLX's streams wait for it, so no engine can run in this process any more.
    wedged: str | None = None

    def __init__(
        self,
        *,
        loader: Callable[[], Any],
        io: CacheIO,
        prefix_factory: Callable[[Any], Any] | None,
        config: EngineConfig,
        name: str = "mlx-nbengine-generation",
        runner_factory: Callable[..., Runner] = Runner,
        checkpoints_factory: Callable[..., Checkpoints] = Checkpoints,
        thread_policy: ThreadPolicy | None = None,
    ) -> None:
        self._loader = loader
        # This engine's choice of each step's BLAS threads, given to its runner.
        self.thread_policy = thread_policy if thread_policy is not None else ThreadPolicy()
        # A sharded model's engine (`ranks`) builds its own, which tell its workers.
        self._runner_factory = runner_factory
        self._checkpoints_factory = checkpoints_factory
        self._io = io
        self._prefix_factory = prefix_factory
        self._config = config
        self.lm: Any = None
        self.runner: Runner | None = None
        self.scheduler: Scheduler | None = None
        self.layer_kinds: tuple[str, ...] = ()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._stopping = False
        self._idle_since: float | None = None  # when the loop last found nothing to run
        self._given_back = False  # memory given back since then
        self.stuck = False  # see `fail_everything`
        self.active = 0
        self.queued = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- other threads ----------------------------------------------------------------------

    def start(self) -> Any:
        """Start the thread, wait for the model, return it; re-raise a load error here."""
        if GenerationThread.wedged is not None:
            raise EngineClosedError(GenerationThread.wedged)
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error
        return self.lm

    @property
    def has_store(self) -> bool:
        return self.scheduler is not None and self.scheduler.checkpoints is not None

    def submit(self, seq: Sequence) -> None:
        self.queued += 1
        self._inbox.put(("submit", seq))

    def cancel(self, request: Any) -> None:
        self._inbox.put(("cancel", request))

    def io_drained(self) -> None:
        """The cache-I/O thread's queue emptied (`CacheIO.on_drained`): an idle loop gives
        memory back `GIVE_BACK_AFTER_S` from now, unless a request comes first."""
        self._inbox.put(("drained", None))

    def stop(self, timeout: float | None = None) -> None:
        """Cancel everything in flight, stop the loop and join the thread (at most
        `timeout` s; not at all once it is `stuck`)."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(0 if self.stuck else timeout)

    def fail_everything(self, exc: Exception, *, wait_s: float = 3.0) -> None:
        """Fail every request held, waiting ones too, with `exc`, between turns; if this
        thread does not take the job within `wait_s` (stuck in a step that will never
        return: a lost rank's collective), fail their handles from here and mark it stuck
        (`call` and `stop` then stop waiting for it)."""
        ran = threading.Event()

        def job() -> None:
            scheduler = self.scheduler
            if scheduler is not None:
                waiting = list(scheduler.waiting)
                scheduler.waiting.clear()
                scheduler.fail_in_flight(exc)
                for seq in waiting:
                    seq.fail(exc)
            ran.set()

        self._inbox.put(("call", job))
        if ran.wait(wait_s) or not self._thread.is_alive():
            return
        self.stuck = True
        GenerationThread.wedged = (
            "MLX in this process is stuck in a step of a sharded model whose worker was lost "
            "(a collective of MLX's ring backend that never returns); restart the kernel "
            "(the process) to load a model again"
        )
        scheduler = self.scheduler
        if scheduler is not None:
            held = [*scheduler.waiting, *scheduler.admitting, *scheduler.decoder.members]
            for seq in held:
                seq.request._fail(exc)  # thread-safe; the sequence itself stays untouched
        while True:  # requests this thread never took
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                arg.request._fail(exc)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on this thread between turns and return its result (or raise)."""
        done = threading.Event()
        box: list = []

        def job():
            try:
                box.append((True, fn()))
            except BaseException as exc:
                box.append((False, exc))
            done.set()

        self._inbox.put(("call", job))
        # A stopped loop runs the calls left in its inbox; one put after it ended never runs.
        while not done.wait(0.1):
            if (self.stuck or not self._thread.is_alive()) and not done.is_set():
                raise EngineClosedError("the engine is closed")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def counts(self) -> dict[str, int]:
        """Failures, group prefills and (vision models) image counts, for stats."""
        scheduler = self.scheduler
        if scheduler is None:
            return {"failures": 0, "group_prefills": 0}
        out = {"failures": scheduler.failures, "group_prefills": scheduler.group_prefills}
        vision = scheduler.runner.vision
        if vision is not None:
            out.update(
                vision_encodes=vision.encodes,
                feature_memo_hits=vision.memo.hits,
                feature_memo_bytes=vision.memo.nbytes,
            )
        return out

    # --- this thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:
            self._load_error = exc
            _release_streams()
            self._loaded.set()
            return
        self._loaded.set()
        try:
            self._loop()
        finally:
            self._shutdown()
            self.lm = self.runner = None
            _release_streams()

    def _load(self) -> None:
        self.lm = lm = self._loader()
        self.runner = runner = self._runner_factory(lm, thread_policy=self.thread_policy)
        try:
            self.layer_kinds = tuple(str(k) for k in layer_kinds(lm.make_cache()))
        except Exception:  # a layer cache no record kind claims: no store can serve it anyway
            self.layer_kinds = ()
        checkpoints = None
        if self._prefix_factory is not None:
            self._io.open(lambda: self._prefix_factory(lm))
            prefix = self._io.prefix
            # Show the prefix cache what this model's records look like before any record
            # is read back; records an earlier process stored are held to them too.
            records = runner.probe_records()
            self._io.call(lambda: prefix.learn(records)).result()
            checkpoints = self._checkpoints_factory(
                self._io,
                fingerprint=lm.fingerprint,
                block_size=self._config.block_size,
                to_token=self._config.restore == "token",
                uncuttable_kind=prefix.uncuttable_kind,
                recurrent="state" in self.layer_kinds,
                store_off=prefix.store.budget_bytes == 0,
                vision=runner.vision is not None,
                bidirectional=runner.bidirectional,
            )
        self.scheduler = Scheduler(
            runner,
            checkpoints=checkpoints,
            on_restored=lambda seq: self._inbox.put(("restored", seq)),
            parallel=self._config.parallel,
            block_size=self._config.block_size,
            max_prefill_step=self._config.max_prefill_step,
        )

    def _loop(self) -> None:
        scheduler = self.scheduler
        while not self._stopping:
            try:
                wait = scheduler.wait_s()
                if wait is None:
                    self._wait_idle()
                else:
                    self._idle_since = None
                    self._receive(timeout=wait)
                if self._stopping:
                    break
                scheduler.tick()
            except Exception as exc:
                # Not one sequence's fault (those are caught closer): fail what is in
                # flight rather than let the loop die and every later request hang.
                scheduler.fail_in_flight(exc)
            self.active, self.queued = scheduler.active, scheduler.queued

    def _wait_idle(self) -> None:
        """Nothing to run: wait for a message (then the loop ticks and counts again), giving
        memory back once the loop has been idle for `GIVE_BACK_AFTER_S` (back-to-back
        requests keep MLX's buffers: the next one does not fault them in again)."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since, self._given_back = now, False
        timeout = None if self._given_back else self._idle_since + GIVE_BACK_AFTER_S - now
        if timeout is not None and timeout <= 0:
            self.scheduler.runner.idle()
            self._given_back, timeout = True, None
        if self._receive(timeout=timeout) and not self._stopping:
            time.sleep(ADMIT_GRACE_S)  # woke from idle: let a burst arrive
            self._receive(timeout=0)

    def _receive(self, *, timeout: float | None) -> bool:
        """Handle what is in the inbox, first waiting up to `timeout` s (None: for ever)
        for something to arrive; True if a request was submitted."""
        submitted = False
        while True:
            try:
                if timeout == 0:
                    kind, arg = self._inbox.get_nowait()
                else:
                    kind, arg = self._inbox.get(timeout=timeout)
            except queue.Empty:
                return submitted
            timeout = 0
            if kind == "submit":
                submitted = True
                self.scheduler.submit(arg)
            elif kind == "cancel":
                self.scheduler.cancel(arg)
            elif kind == "restored":
                self.scheduler.restored(arg)
            elif kind == "call":
                arg()
            elif kind == "drained":
                if self._idle_since is not None:  # idle: give back again, a while from now
                    self._idle_since, self._given_back = time.monotonic(), False
            elif kind == "stop":
                self._stopping = True
                return submitted

    def _shutdown(self) -> None:
        self.scheduler.shutdown()
        # Requests still in the inbox never started: tell their callers.
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                arg.fail(EngineClosedError("the engine was closed before this request started"))
            elif kind == "call":
                arg()
        self.active = self.queued = 0


def _release_streams() -> None:
    # MLX gives each thread its own stream and worker; one left behind at interpreter
    # exit aborts the process ("terminate called without an active exception").
    mx.synchronize()
    mx.clear_streams()

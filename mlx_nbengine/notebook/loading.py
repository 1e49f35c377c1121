"""`%load_model`'s wait: the engine loads on a helper thread while the cell shows progress.

*Phases* of a load, as the engine's progress hook reports them (each counting from 0 to its
total): a download (only when the model is an id found in no local place), then a GGUF
conversion. The cell's one line names the phase and its bytes while there is one, else the
time spent; the main thread stays interruptible (an interrupted load is closed when it
completes).
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from typing import Any

from mlx_nbengine.errors import EngineError, SessionError
from mlx_nbengine.models import sources
from mlx_nbengine.notebook.render import progress_bundle
from mlx_nbengine.notebook.streaming import short_error
from mlx_nbengine.notebook.words import format_bytes

__all__ = ["load_with_progress", "starts_with_download", "takes_progress"]


def takes_progress(factory: Any) -> bool:
    """Whether an engine factory names `progress` (only those get it: one taking **options
    may pass them on to something that does not know it)."""
    try:
        return "progress" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def model_title(model: str) -> str:
    """How the progress line names `model`: a path by its file name, an id as written."""
    if model == "default":
        return "the default model"
    if os.path.exists(model):
        return os.path.basename(model.rstrip("/\\")) or model
    return model


def progress_line(verb: str, model: str, done: int, total: int) -> str:
    percent = f" ({done / total:.0%})" if total else ""
    return f"{verb} {model_title(model)}: {format_bytes(done)} / {format_bytes(total)}{percent}"


def starts_with_download(model: str, revision: str | None) -> bool:
    """Whether loading `model` begins with a download: an id found in no local place.

    Asked before the load so that the progress line can name its first phase; the same
    look-ups as `sources.locate`, which reads no network for them. Anything it cannot
    decide (an ambiguous folder, an unreadable cache) counts as no download: the load
    itself then reports the problem.
    """
    if model == "default" or os.path.exists(model):
        return False
    parsed = sources.parse_model_id(model)
    if parsed is None:
        return False
    repo_id, gguf_file = parsed
    try:
        if sources.find_in_hub_cache(repo_id, revision=revision, gguf_file=gguf_file) is not None:
            return False
        # As in `locate`: LM Studio has no revisions, so it is skipped when one is asked for.
        if revision is None and sources.find_in_lmstudio(repo_id, gguf_file=gguf_file) is not None:
            return False
    except (EngineError, OSError):
        return False
    return True


class _Loading:
    """One load on its helper thread, and the latest progress it reported."""

    def __init__(self, factory: Any, model: str, options: dict[str, Any]) -> None:
        self.model = model
        self.result: dict[str, Any] = {}
        self.lock = threading.Lock()
        # Latest (phase, done, total); list ops are atomic. The hook counts from 0 again
        # for a conversion after a download, so a drop in `done` starts the next phase.
        self.reported: list[tuple[int, int, int]] = []
        self.changed = threading.Event()
        options = dict(options)
        if takes_progress(factory):
            options["progress"] = self.progress
        self.thread = threading.Thread(
            target=self._work, args=(factory, options), name="mlx-nbengine-load", daemon=True
        )

    def progress(self, done: int, total: int) -> None:
        phase = self.reported[0][0] if self.reported else 0
        if self.reported and done < self.reported[0][1]:
            phase += 1
        self.reported[:] = [(phase, done, total)]
        self.changed.set()

    def _work(self, factory: Any, options: dict[str, Any]) -> None:
        try:
            engine = factory(self.model, **options)
        except BaseException as exc:  # noqa: BLE001 - reported on the main thread
            self.result["error"] = exc
            return
        with self.lock:
            if self.result.get("discard"):
                engine.close()
            else:
                self.result["engine"] = engine
        self.changed.set()

    def line(self, *, downloads: bool) -> str | None:
        """The phase line while a phase is under way, else None."""
        if not self.reported:
            return None
        phase, done, total = self.reported[0]
        if done >= total:
            return None
        verb = "downloading" if downloads and phase == 0 else "converting"
        return progress_line(verb, self.model, done, total)

    def discard(self) -> None:
        """The user gave up: close the engine now if it is there, else when it arrives."""
        with self.lock:
            self.result["discard"] = True
            engine = self.result.pop("engine", None)
        if engine is not None:
            engine.close()


def load_with_progress(
    factory: Any,
    model: str,
    options: dict[str, Any],
    *,
    revision: str | None,
    display: Any,
    live: bool,
) -> Any:
    """``factory(model, **options)`` on a helper thread, showing its progress through
    `display` (redrawn in place when `live`); returns the engine or raises `SessionError`."""
    loading = _Loading(factory, model, options)
    downloads = starts_with_download(model, revision)
    started = time.monotonic()
    what = f"loading {model}"
    handle = display(progress_bundle(what, elapsed=0.0), display_id=True)
    loading.thread.start()
    try:
        while loading.thread.is_alive():
            loading.changed.wait(0.1)  # woken by progress reports too: a short phase shows
            loading.changed.clear()
            if live and loading.thread.is_alive():
                line = loading.line(downloads=downloads) or what
                elapsed = time.monotonic() - started
                handle.update(progress_bundle(line, elapsed=elapsed), raw=True)
    except KeyboardInterrupt:
        loading.discard()
        handle.update({"text/plain": f"loading {model} interrupted"}, raw=True)
        raise SessionError(f"loading {model} was interrupted; no model is loaded") from None
    elapsed = time.monotonic() - started
    error = loading.result.get("error")
    if error is not None:
        handle.update({"text/plain": f"loading {model} failed"}, raw=True)
        if isinstance(error, EngineError | OSError | ValueError):
            raise SessionError(f"could not load {model}: {short_error(error)}") from None
        raise error
    engine = loading.result["engine"]
    loaded = getattr(engine, "model", None)
    what = f" ({loaded.model_type}, {loaded.modality})" if hasattr(loaded, "modality") else ""
    handle.update({"text/plain": f"loaded {model}{what} in {elapsed:.1f} s"}, raw=True)
    return engine

"""Store views that stay live: every `%llm_cache` view shown redraws as requests finish.

Terms:

- *live views* (`LiveStores`): the `StoreView` widgets ``%llm_cache`` showed for the
  loaded engine. `clear` forgets them when the engine closes (a new engine has a new
  store; the old views keep their last picture).
- *refresh*: after a request ends, every live view gets ``engine.cache_view()`` at once,
  then once more when the blocks that request queued for saving are in the store (a
  daemon thread waits for them, at most `SAVES_WAIT_S`), so its figures count them.

Any thread may call `refresh` (the kernel's main thread after a foreground answer, a
``--bg`` answer's reader thread); the widgets sync only what changed.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["SAVES_WAIT_S", "LiveStores"]

# How long the second redraw waits for a request's block saves.
SAVES_WAIT_S = 30.0


class LiveStores:
    """The live store views of one engine; see the module docstring."""

    def __init__(self) -> None:
        self._views: list[Any] = []
        self._lock = threading.Lock()

    def add(self, view: Any) -> None:
        with self._lock:
            self._views.append(view)

    def clear(self) -> None:
        with self._lock:
            self._views.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._views)

    def refresh(self, engine: Any) -> None:
        """Redraw every view from `engine` now, and again once its saves are stored."""
        if not len(self):
            return
        self._draw(engine)
        threading.Thread(
            target=self._after_saves, args=(engine,), name="mlx-nbengine-store", daemon=True
        ).start()

    def _after_saves(self, engine: Any) -> None:
        wait = getattr(engine, "wait_for_saves", None)
        if wait is None:
            return
        try:
            wait(timeout=SAVES_WAIT_S)
        except Exception:  # noqa: BLE001 - the engine closed meanwhile: nothing to draw
            return
        self._draw(engine)

    def _draw(self, engine: Any) -> None:
        if getattr(engine, "closed", False):
            return
        view = engine.cache_view()
        with self._lock:
            views = list(self._views)
        for widget in views:
            widget.view = view

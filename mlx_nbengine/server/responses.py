"""OpenAI's Responses API (``POST /v1/responses``), what Codex speaks (being built)."""

from __future__ import annotations

from typing import Any

from starlette.routing import Route

__all__ = ["routes"]


def routes(app: Any) -> list[Route]:
    """The routes of this API over the server's handlers `app` (`app._App`)."""
    return []

"""`EngineConfig`: every option of an engine, in one frozen object, validated once.

`Engine.load(model, **options)` builds one; the engine, its generation thread, its block
store's factory and a sharded model's ranks all read it, so an option is named, defaulted
and checked here only. A bad option raises `InvalidRequestError` in one line that says what
to pass. The notebook's ``%load_model`` parses its flags into the same object
(`notebook.prompting.engine_config`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from mlx_nbengine.errors import InvalidRequestError

__all__ = ["RESTORE_MODES", "EngineConfig"]

RESTORE_MODES = ("token", "block")
"""``restore``: to the first changed token, or whole blocks only."""


@dataclass(frozen=True)
class EngineConfig:
    """An engine's options (`Engine.load(model, **options)`).

    `model` is "default", a model directory, a .gguf file, or a model id ``ORG/NAME``
    found in the Hugging Face hub cache or LM Studio's models folder, else downloaded from
    the hub (see `mlx_nbengine.models.sources`); `revision` picks a branch, tag or commit
    of a Hugging Face id. `dtype` casts the weights.

    `parallel` requests decode together; prompts are cached in blocks of `block_size`
    tokens. `disk_budget` caps the scratch file's live bytes (None: a default from the free
    disk space; 0: keep the records in memory instead). `cache_dir` is where the scratch
    file lives (default: the system temp folder). `max_prefill_step` bounds the tokens of
    one prefill call when nothing else runs. `store=False` runs without a block store: no
    scratch file, nothing restored from disk, every whole prompt block computed (reason
    ``"store_off"``). `restore="token"` (the default) restores an edited prompt up to its
    first changed token where the model's layers allow it (see `scheduler`); ``"block"``
    restores whole blocks from disk only, bit-identical to a cold run of the same steps.
    `persist_dir` keeps the block store in that directory (created, or made, 0700; a data
    file, an index and a lock) so that a later process loading the same model, dtype and
    block size restores its blocks from disk; when another process holds it, the engine
    runs with a temporary store and `Engine.store_note` says so (an incompatible store
    found there is set aside, also noted).

    `ranks=N` runs the model sharded over N local processes (rank 0 is this one; the others
    are worker processes it starts), `hosts=[THIS, HOST2, ...]` over one rank per host
    (workers started over ssh; see `engine.ranks`); `shard` is ``"tensor"`` or
    ``"pipeline"`` (default: what mlx-lm supports for the family, tensor first). Each rank
    loads only its shard and keeps the block records of its own layers or heads in a store
    of its own; a lost worker fails the running requests with a `RankLostError` naming its
    host and rank and closes the engine.

    Paths are kept as strings, `persist_dir` with ``~`` expanded, `hosts` as a tuple. The
    loader checks `dtype` and the ranks' `shard` against the model (their errors name it).
    """

    model: str = "default"
    parallel: int = 4
    block_size: int = 256
    disk_budget: int | None = None
    cache_dir: str | None = None
    dtype: str | None = None
    max_prefill_step: int = 1024
    store: bool = True
    restore: str = "token"
    revision: str | None = None
    persist_dir: str | None = None
    ranks: int | None = None
    hosts: tuple[str, ...] | None = None
    shard: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "model", os.fspath(self.model))
        if self.cache_dir is not None:
            set_(self, "cache_dir", os.fspath(self.cache_dir))
        if self.persist_dir is not None:
            set_(self, "persist_dir", os.path.expanduser(os.fspath(self.persist_dir)))
        if self.hosts is not None and not isinstance(self.hosts, str):
            set_(self, "hosts", tuple(self.hosts))
        for problem in (self._engine_problem(), self._store_problem(), self._ranks_problem()):
            if problem:
                raise InvalidRequestError(problem)

    @classmethod
    def of(cls, model: Any = "default", **options: Any) -> EngineConfig:
        """The config of ``Engine.load(model, **options)``; an unknown option is an
        `InvalidRequestError` naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option {unknown[0]!r}; the options are "
                f"{', '.join(sorted(known - {'model'}))}"
            )
        return cls(model=model, **options)

    @property
    def name(self) -> str:
        """The model's display name: the last part of its path or id."""
        return os.path.basename(self.model.rstrip("/\\")) or self.model

    @property
    def sharded(self) -> bool:
        """Whether the model runs over ranks (`ranks` or `hosts`)."""
        return self.ranks is not None or self.hosts is not None

    def store_options(self) -> dict[str, Any]:
        """What the block store is opened with (`blockstore.open_prefix_cache`)."""
        return {
            "block_size": self.block_size,
            "disk_budget": self.disk_budget,
            "cache_dir": self.cache_dir,
            "persist_dir": self.persist_dir,
        }

    def _engine_problem(self) -> str | None:
        if self.restore not in RESTORE_MODES:
            modes = ", ".join(map(repr, RESTORE_MODES))
            return f"restore must be one of {modes}, got {self.restore!r}"
        for name in ("parallel", "block_size", "max_prefill_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                return f"{name} must be an integer >= 1, got {value!r}"
        return None

    def _store_problem(self) -> str | None:
        if self.disk_budget is not None and (
            not isinstance(self.disk_budget, int) or self.disk_budget < 0
        ):
            return f"disk_budget must be bytes >= 0 or None, got {self.disk_budget!r}"
        if self.cache_dir is not None and not os.path.isdir(self.cache_dir):
            return (
                f"cache_dir {self.cache_dir!r} is not a directory; create it or pass None "
                "for the system temp folder"
            )
        if self.persist_dir is not None and (not self.store or self.disk_budget == 0):
            return (
                "persist_dir keeps the block store on disk; it needs store=True and a disk "
                "budget other than 0"
            )
        return None

    def _ranks_problem(self) -> str | None:
        if not self.sharded:
            return None if self.shard is None else "shard goes with ranks or hosts"
        if self.persist_dir is not None:
            return "persist_dir is not supported with ranks or hosts"
        if self.hosts is not None:
            if isinstance(self.hosts, str) or len(self.hosts) < 2:
                return "hosts needs at least two hosts (the first is this one)"
            if self.ranks not in (None, len(self.hosts)):
                return "hosts needs at least two hosts (the first is this one)"
        elif not isinstance(self.ranks, int) or isinstance(self.ranks, bool) or self.ranks < 2:
            return f"ranks must be an integer >= 2, got {self.ranks!r}"
        return None

"""The messages of the control channel (`channel`): one frozen dataclass per kind.

Rank 0 sends *step plans* (what every worker does next, in order: `Replay` runs each with
the handler its type names) and *questions* (a plan with an ``ask`` number, answered with
an `Answer`); a worker sends `Hello` once, `Alive` heart beats, its `Answer`s and, when it
fails, `Failed`. They travel as pickles of these classes (`channel.Link`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_nbengine.engine.config import EngineConfig

# --- rank 0 -> workers: starting ----------------------------------------------------------


@dataclass(frozen=True)
class Init:
    """Form the MLX ring (with rank 0)."""


@dataclass(frozen=True)
class Load:
    """Load this rank's shard of `model` (`shard`: tensor or pipeline) with the engine's
    `config` (its dtype; its block store options, opened at `Open`)."""

    model: str
    config: EngineConfig
    shard: str


@dataclass(frozen=True)
class Open:
    """Rank 0's fingerprint (the block keys): open this rank's own block store (if the
    config of `Load` has one)."""

    fingerprint: str


@dataclass(frozen=True)
class Stop:
    """End the worker."""


# --- rank 0 -> workers: the steps ---------------------------------------------------------


@dataclass(frozen=True)
class Idle:
    """The engine went idle: give MLX's pool back between steps."""


@dataclass(frozen=True)
class Probe:
    """Run the model's one-token record probe (every rank's collectives with rank 0's)."""


@dataclass(frozen=True)
class ClearNothing:
    """A no-op step that keeps the ranks' plans in order (`ShardedModel.clear_stores`)."""


@dataclass(frozen=True)
class Start:
    """Start sequence `cid` on cache `ref` from `source` (a restore, the hot cache), at
    `tokens` tokens."""

    ref: Any
    cid: int
    source: str | None
    tokens: int


@dataclass(frozen=True)
class Hot:
    """Keep cache `ref` as the hot cache, for `tokens`."""

    ref: Any
    tokens: list[int]


@dataclass(frozen=True)
class Free:
    """Forget cache `ref`."""

    ref: Any


@dataclass(frozen=True)
class Add:
    """Add cache `ref` to the decode batch."""

    ref: Any


@dataclass(frozen=True)
class AddGroup:
    """Add group prefill `ref`'s `n` rows to the decode batch."""

    ref: Any
    n: int


@dataclass(frozen=True)
class Remove:
    """Remove the decode batch's rows `indices`."""

    indices: list[int]


@dataclass(frozen=True)
class Clear:
    """Empty the decode batch."""


@dataclass(frozen=True)
class Single:
    """Keep a copy of the decode batch's row `index` as cache `ref`."""

    index: int
    ref: Any


@dataclass(frozen=True)
class Prefill:
    """Prefill `tokens` into cache `ref` (`last`: the prompt's last step)."""

    ref: Any
    tokens: list[int]
    last: bool


@dataclass(frozen=True)
class Group:
    """Prefill `rows` of the caches `refs` together into group cache `ref`."""

    refs: list[Any]
    rows: list[list[int]]
    ref: Any


@dataclass(frozen=True)
class Decode:
    """One decode step of the batch on `tokens`."""

    tokens: list[int]


@dataclass(frozen=True)
class Comm:
    """Measure the ring: `repeats` all-sums of `nbytes`."""

    nbytes: int
    repeats: int


@dataclass(frozen=True)
class Save:
    """Save block `block` (`keys`, `tokens`, the chain) of cache `ref` to this rank's store."""

    ref: Any
    keys: list[str]
    tokens: list[int]
    block: int
    chain: list[str] | None


@dataclass(frozen=True)
class Partial:
    """Keep cache `ref`'s partial block of `tokens` (a finished request's end)."""

    ref: Any
    tokens: list[int]


# --- rank 0 -> workers: questions (answered with an `Answer` of the same `ask`) -----------


@dataclass(frozen=True)
class Loaded:
    """Answer once every plan before it ran (loading, opening the store)."""

    ask: int = 0


@dataclass(frozen=True)
class Holds:
    """What of restore `plan` this rank's store holds."""

    plan: Any
    ask: int = 0


@dataclass(frozen=True)
class Restore:
    """Rebuild restore `plan` for sequence `cid`; answer the tokens rebuilt."""

    cid: int
    plan: Any
    ask: int = 0


@dataclass(frozen=True)
class ClearStore:
    """Empty this rank's store."""

    ask: int = 0


@dataclass(frozen=True)
class Store:
    """This rank's store figures."""

    ask: int = 0


Question = Loaded | Holds | Restore | ClearStore | Store

# --- workers -> rank 0 --------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """A worker's first message, after the secret: who it is."""

    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class Alive:
    """A heart beat."""


@dataclass(frozen=True)
class Answer:
    """A worker's answer to question `ask`."""

    ask: int
    value: Any = None


@dataclass(frozen=True)
class Failed:
    """A worker failed: its one-line `message` and the end of its traceback."""

    message: str
    trace: str = ""

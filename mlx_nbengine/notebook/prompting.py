"""From what a user wrote in a magic to what the engine is sent.

Everything here runs on the kernel's main thread, while the magic's cell runs, and
touches no engine: the magics in `mlx_nbengine.notebook.magics` call these to read their
line and cell, then submit the result.

Terms:

- *options*: the magic's line (``--max-tokens 8 --system "Be brief."``), split the
  way a POSIX shell would and read by the magic's `magic_arguments` parser.
- *size*: a byte count written for people (``4GB``, ``512MiB``, ``2G``).
- *interpolation* (``%%llm --interpolate``): ``{name}`` in the cell replaced by the
  user namespace's value; off by default because code prompts contain braces.
- *engine options*: the keyword arguments of ``Engine.load`` that `%load_model` was
  given (``parallel`` and ``block_size`` always; the others only when given;
  ``--no-store`` becomes ``store=False``, ``--revision REV`` ``revision="REV"``).
- *sampling options*: the keyword arguments of ``Engine.submit`` the user gave
  (``max_tokens``, ``temperature``, ``seed``, ``stop``); the others are left out so
  the engine's defaults stay the single source of truth.
- *prompt*: what ``Engine.submit`` receives: the text itself with ``--raw``, else a
  list of chat messages (``{"role": ..., "content": ...}``) for the chat template.
- *image input* (`ImageInput`, ``%%llm --image VALUE``): one picture the request shows
  the model. `VALUE` is a variable of the user namespace when it names one (a PIL image,
  a numpy array, the bytes of an encoded image, or a path), else a file path. `read_images`
  reads every one (`mlx_nbengine.models.images.load_image`) before anything is submitted,
  so a missing file, a file that is not an image or a variable that is not one is a
  one-line `UsageError` naming it; the engine then gets the RGB pictures.
- *chat turn* (`ChatTurn`): with ``--chat NAME``, the turn of the named conversation
  that the request answers; it is finished with the answer, or abandoned when the
  request fails, so the conversation never keeps a half-asked question.

Errors the user can fix raise IPython's `UsageError` with a message that says what
to write instead.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.utils.process import arg_split

from mlx_nbengine.engine.config import EngineConfig
from mlx_nbengine.errors import ImageError, InvalidRequestError
from mlx_nbengine.models.images import load_image
from mlx_nbengine.notebook.chat import Conversation, PendingTurnError, Turn

__all__ = [
    "ChatTurn",
    "ImageInput",
    "Prompt",
    "build_prompt",
    "engine_options",
    "interpolate",
    "parse_options",
    "parse_size",
    "read_images",
    "sampling_options",
]

# Text (with --raw) or chat messages.
Prompt = str | list[dict[str, str]]


def parse_options(func: Any, line: str, magic: str) -> Any:
    """Read `line` with the `magic_arguments` parser of `func`; name `magic` in errors."""
    # posix splitting, so `--system "Be brief."` arrives without its quotes.
    try:
        return func.parser.parse_args(arg_split(line, posix=True))
    except UsageError as exc:
        raise UsageError(f"{exc}. See `{magic}?` for the options.") from None
    except ValueError as exc:  # shlex: an unclosed quote
        raise UsageError(f"cannot read the options ({exc}); close the quotes") from None


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """Parse a byte size: '4GB' (decimal), '4GiB' or '4G' (binary), '512M', '1000000'."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise UsageError(
            f"cannot read the size {text!r}; write a number with an optional unit, "
            "like 4GB, 512MiB or 2G"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def interpolate(text: str, namespace: dict[str, Any]) -> str:
    """Substitute ``{name}`` (and ``{name.attr}``, ``{name[0]}``, format specs) from `namespace`.

    ``{{`` and ``}}`` stay literal braces. A missing name is a `UsageError`.
    """
    try:
        return string.Formatter().vformat(text, (), namespace)
    except KeyError as exc:
        raise UsageError(
            f"--interpolate: {exc.args[0]!r} is not defined; define it first, "
            "or write {{ and }} for literal braces"
        ) from None
    except (ValueError, IndexError, AttributeError) as exc:
        raise UsageError(f"--interpolate: {exc}; write {{{{ and }}}} for literal braces") from None


# The engine options' names as `%load_model`'s flags, for its one-line errors.
_FLAGS = {
    "persist_dir": "--persist",
    "store=True": "no --no-store",
    "block_size": "--block-size",
    "disk_budget": "--disk-budget",
    "cache_dir": "--cache-dir",
    "parallel": "--parallel",
}


def engine_options(args: Any) -> dict[str, Any]:
    """The keyword arguments for ``Engine.load`` from `%load_model`'s parsed `args`, checked
    by the engine's own `EngineConfig` (its one-line error, in the flags' names, is a
    `UsageError`)."""
    options: dict[str, Any] = {"parallel": args.parallel, "block_size": args.block_size}
    if args.disk_budget is not None:
        options["disk_budget"] = parse_size(args.disk_budget)
    if args.cache_dir is not None:
        options["cache_dir"] = os.path.expanduser(args.cache_dir)
    if args.dtype is not None:
        options["dtype"] = args.dtype
    if getattr(args, "no_store", False):
        options["store"] = False
    if getattr(args, "revision", None) is not None:
        options["revision"] = args.revision
    if getattr(args, "restore", None) is not None:
        options["restore"] = args.restore
    if getattr(args, "persist", None) is not None:
        options["persist_dir"] = os.path.expanduser(args.persist)
    options.update(rank_options(args))
    try:
        EngineConfig.of(**options)
    except InvalidRequestError as exc:
        message = str(exc)
        for name, flag in _FLAGS.items():
            message = message.replace(name, flag)
        raise UsageError(message) from None
    return options


def rank_options(args: Any) -> dict[str, Any]:
    """``ranks``, ``hosts`` and ``shard`` for ``Engine.load`` from `%load_model`'s
    ``--ranks N``, ``--hosts H1,H2,...`` and ``--shard tensor|pipeline``."""
    ranks, hosts, shard = (getattr(args, n, None) for n in ("ranks", "hosts", "shard"))
    options: dict[str, Any] = {}
    if ranks is not None and hosts is not None:
        raise UsageError("give --ranks N (local ranks) or --hosts H1,H2 (one rank per host)")
    if ranks is not None:
        if ranks < 2:
            raise UsageError("--ranks needs at least 2 (rank 0 is this kernel)")
        options["ranks"] = ranks
    if hosts is not None:
        names = [h.strip() for h in hosts.split(",") if h.strip()]
        if len(names) < 2:
            raise UsageError("--hosts needs at least two hosts, this machine first: H1,H2")
        options["hosts"] = names
    if shard is not None:
        if not options:
            raise UsageError("--shard goes with --ranks or --hosts")
        options["shard"] = shard
    return options


def sampling_options(args: Any) -> dict[str, Any]:
    """The sampling keyword arguments for ``Engine.submit`` among `args` (only those given)."""
    given = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "stop": args.stop,
    }
    return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One ``--image``: how the user named it, where it came from, the RGB picture read."""

    name: str  # the file name (a path) or the variable name
    value: str  # what was written after --image
    image: Any  # RGB PIL image
    variable: bool = False

    @property
    def width(self) -> int:
        return int(self.image.size[0])

    @property
    def height(self) -> int:
        return int(self.image.size[1])


def _image_error(message: str, index: int, source: str) -> UsageError:
    """One line for a `load_image` message, naming where the image came from."""
    message = " ".join(message.splitlines())
    label = f"image {index + 1}"
    if message.startswith(label):
        message = f"{label} ({source}){message[len(label) :]}"
    else:
        message = f"{label} ({source}): {message}"
    return UsageError(message)


def read_images(values: Sequence[str] | None, namespace: Mapping[str, Any]) -> list[ImageInput]:
    """The ``--image`` `values`, in order, each read into an RGB picture.

    A value that names a variable of `namespace` is that variable's value; any other is a
    file path (``~`` expanded). Whatever cannot be read is a one-line `UsageError` naming
    the image (its position, and its variable or file).
    """
    out: list[ImageInput] = []
    for index, value in enumerate(values or ()):
        variable = value.isidentifier() and value in namespace
        if variable:
            item, name = namespace[value], value
        else:
            path = Path(value).expanduser()
            if value.isidentifier() and not path.exists():
                raise UsageError(
                    f"image {index + 1}: {value!r} is neither a variable here nor "
                    "a file; define it, or give the path of an image file"
                )
            item, name = value, path.name or value
        try:
            image = load_image(item, index=index)
        except ImageError as exc:
            if not variable:  # load_image's message names the file already
                raise UsageError(" ".join(str(exc).splitlines())) from None
            raise _image_error(str(exc), index, f"variable {value}") from None
        out.append(ImageInput(name=name, value=value, image=image, variable=variable))
    return out


@dataclass
class ChatTurn:
    """The turn a `%%llm --chat` request answers, in its conversation."""

    conversation: Conversation
    turn: Turn

    def finish(self, answer: str) -> None:
        self.conversation.finish(self.turn, answer)

    def abandon(self) -> None:
        self.conversation.abandon(self.turn)


def build_prompt(
    text: str,
    *,
    raw: bool = False,
    system: str | None = None,
    conversation: Conversation | None = None,
    key: str | None = None,
    images: list[Any] | None = None,
) -> tuple[Prompt, ChatTurn | None]:
    """The prompt for `text` and, in a `conversation`, the chat turn it begins.

    `raw` sends `text` as is; otherwise it becomes the user message, after the
    `system` message if any. In a `conversation`, `key` names the turn (see
    `mlx_nbengine.notebook.chat.turn_key`): a known key replaces that turn and the later
    ones, and the turn keeps `images` (its message gets their image parts).
    """
    if raw:
        return text, None
    if conversation is None:
        messages = [{"role": "user", "content": text}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return messages, None
    try:
        turn, messages = conversation.begin(key, text, system=system, images=images)
    except PendingTurnError as exc:
        raise UsageError(str(exc)) from None
    return messages, ChatTurn(conversation, turn)

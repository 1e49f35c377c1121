"""The exceptions a user of mlx_nbengine can see, in one place.

Every class here is raised for a problem the user can fix, and its message says
what to do next. Internal bugs stay ordinary exceptions.

- `EngineError`: base of every mlx_nbengine error; catch it to catch them all.
- `ModelError`: a model could not be found, recognised, converted or loaded.
- `CacheError`: the prefix cache could not do what was asked (store, budget, scratch file).
- `InvalidRequestError` (`PromptTooLongError`, `ImageError`), `EngineClosedError`: raised
  in the caller by `Engine.submit` (and `Engine.load`'s options) for problems the caller can fix.
- `GrammarError`: a request's grammar (`Engine.submit(grammar=...)`) failed mid-way; that
  request ends with it.
- `SessionError`: a notebook session's operation the user can fix (no model loaded, an empty
  cell, a load that failed); the magics show its message as one line.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error mlx_nbengine raises on purpose."""


class ModelError(EngineError):
    """A model could not be resolved or loaded; the message names the problem."""


class ModelNotFoundError(ModelError):
    """The path or name given to `load` does not exist."""


class ModelConfigError(ModelError):
    """The model directory has no usable `config.json`."""


class UnsupportedModelError(ModelError):
    """The `model_type` (or GGUF architecture / tensor type) is not one we can run."""


class ModelWeightsError(ModelError):
    """The weight files are missing, truncated or do not match the architecture."""


class TokenizerError(ModelError):
    """The tokenizer files are missing or unreadable."""


class GGUFError(ModelError):
    """A GGUF file could not be read or converted."""


class DefaultModelMissingError(ModelError):
    """The package that embeds the default model is not installed."""


class CacheError(EngineError):
    """The prefix cache could not do what was asked."""


class InvalidRequestError(EngineError, ValueError):
    """A submit argument is out of range; the message names it and the allowed range."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context; shorten it."""


class ImageError(InvalidRequestError):
    """An image given to a request cannot be used: a missing file, a file that is not an
    image, an array of the wrong shape, too many pixels, or a model that reads text only."""


class GrammarError(EngineError):
    """A request's grammar matcher failed while it generated (a limit of the grammar engine,
    a token it refused); the request ends with this error, the others go on."""


class EngineClosedError(EngineError, RuntimeError):
    """The engine was closed; load a new one to submit more requests."""


class ModelNotCachedError(ModelNotFoundError):
    """A model id is not on this machine and cannot be downloaded now (offline, or the
    Hugging Face hub unreachable); the one-line message says how to get it."""


class AmbiguousModelError(ModelError):
    """A folder or repository holds several GGUF files; the message lists them to pick one."""


class ModelDownloadError(ModelError):
    """The Hugging Face hub refused or failed a download (gated repository, HTTP error)."""


class SessionError(EngineError):
    """A notebook session (`mlx_nbengine.notebook.session`) cannot do what was asked; the
    message is one line that says what to do next."""

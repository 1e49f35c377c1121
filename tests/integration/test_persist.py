"""`Engine.load(..., persist_dir=DIR)` / `%load_model --persist DIR`: the block store
outlives the process, for the same model only; a busy DIR, a full disk and an unload are
handled without losing an answer.

The restart test runs real second (and third) Python processes on a tiny model; the rest
runs engines in this process. Store-level faults are in tests/integration/test_store_faults.py.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from mlx_nbengine.cache import blobfile as blobfile_module
from mlx_nbengine.cache import persist
from mlx_nbengine.cache.kinds import RECORD_FORMAT
from mlx_nbengine.cache.store import BlockStore
from mlx_nbengine.engine import Engine
from mlx_nbengine.notebook import magics as magics_mod
from mlx_nbengine.testing import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(70)]  # 4 whole blocks of 16 and 6 tokens
EDITED = PROMPT[:40] + [(t + 1) % 500 + 2 for t in PROMPT[40:]]  # changed from token 40

CHILD = textwrap.dedent(
    """
    import json, sys
    from mlx_nbengine.engine import Engine

    model, store, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with Engine.load(model, block_size=16, persist_dir=store) as engine:
        completion = engine.submit(prompt, max_tokens=8).result(timeout=120)
        stats = engine.stats()
    report = completion.report
    print(json.dumps({
        "source": report.restore_source,
        "restored": report.restored_tokens,
        "edit_at": report.edit_at,
        "tokens": completion.tokens,
        "sources": [b.source for b in report.blocks],
        "persistent": stats.get("persistent"),
        "records_at_open": stats.get("records_at_open"),
        "note": stats.get("store_note"),
    }))
    """
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("persist-model") / "llama")


def in_new_process(model: Path, store: Path, prompt: list[int]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(store), json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_process_restores_the_blocks_a_previous_one_stored(model, tmp_path):
    store = tmp_path / "store"
    first = in_new_process(model, store, PROMPT)
    assert first["persistent"] and first["records_at_open"] == 0 and first["restored"] == 0
    assert set(first["sources"]) == {"computed"}

    second = in_new_process(model, store, PROMPT)
    assert second["source"] == "disk" and second["persistent"] and not second["note"]
    assert second["records_at_open"] > 0
    # Every whole block, and the partial one through the follower index kept on disk:
    # everything but the last prompt token.
    assert second["restored"] == len(PROMPT) - 1
    assert second["sources"][:4] == ["disk"] * 4
    assert second["tokens"] == first["tokens"]  # greedy: the same answer

    # An edit after a restart restores up to its first changed token (followers on disk).
    third = in_new_process(model, store, EDITED)
    assert third["source"] == "disk" and third["edit_at"] == 40 and third["restored"] == 40

    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    assert sorted(os.listdir(store)) == sorted(
        [persist.DATA_FILE, persist.INDEX_FILE, persist.LOCK_FILE]
    )
    for name in os.listdir(store):
        assert stat.S_IMODE(os.stat(store / name).st_mode) == 0o600


@pytest.fixture(scope="module")
def stored(model, tmp_path_factory) -> Path:
    """A persistent store holding PROMPT's blocks, written by the model at block size 16."""
    store = tmp_path_factory.mktemp("stored") / "store"
    with Engine.load(model, block_size=16, persist_dir=store) as engine:
        engine.submit(PROMPT, max_tokens=4).result(timeout=120)
    return store


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("seed1") / "llama", seed=1)


@pytest.mark.parametrize("variant", ["seed", "dtype", "block_size"])
def test_another_model_dtype_or_block_size_never_hits_and_sets_the_store_aside(
    variant, model, other_seed, stored, tmp_path
):
    store = tmp_path / "store"
    shutil.copytree(stored, store)
    load = {
        "seed": lambda: Engine.load(other_seed, block_size=16, persist_dir=store),
        "dtype": lambda: Engine.load(model, block_size=16, dtype="float16", persist_dir=store),
        "block_size": lambda: Engine.load(model, block_size=32, persist_dir=store),
    }[variant]
    with load() as engine:
        assert "set aside" in (engine.store_note or "")
        report = engine.submit(PROMPT, max_tokens=4).result(timeout=120).report
        assert report.restore_source is None and report.restored_tokens == 0
        assert all(block.source == "computed" for block in report.blocks)
        assert engine.stats()["records_at_open"] == 0
    aside = [n for n in os.listdir(store) if n.startswith(persist.SET_ASIDE_PREFIX)]
    assert len(aside) == 1 and persist.INDEX_FILE in os.listdir(store / aside[0])


def test_a_store_of_the_previous_record_format_is_set_aside(model, stored, tmp_path):
    # Each record kind's version is part of the store's identity (kinds.RECORD_FORMAT): a
    # store whose window records kept only a block's last W tokens is moved aside whole.
    store = tmp_path / "store"
    shutil.copytree(stored, store)
    index = store / persist.INDEX_FILE
    data = index.read_bytes()
    header, start = persist.decode_header(data)
    assert header["identity"]["record_format"] == RECORD_FORMAT
    old = {**header["identity"], "record_format": "mlx_nbengine.record.v1"}
    index.write_bytes(
        persist.encode_header(store_id=header["store_id"], identity=old) + data[start:]
    )
    with Engine.load(model, block_size=16, persist_dir=store) as engine:
        assert "set aside" in (engine.store_note or "")
        assert engine.stats()["records_at_open"] == 0
    aside = [n for n in os.listdir(store) if n.startswith(persist.SET_ASIDE_PREFIX)]
    assert len(aside) == 1 and persist.INDEX_FILE in os.listdir(store / aside[0])


def test_close_leaves_the_dir_consistent_and_unlocked_and_nothing_without_persist(model, tmp_path):
    store, scratch = tmp_path / "store", tmp_path / "scratch"
    scratch.mkdir()
    with Engine.load(model, block_size=16, persist_dir=store, cache_dir=scratch) as engine:
        engine.submit(PROMPT, max_tokens=4).result(timeout=120)
        engine.wait_for_saves(timeout=60)
        records = engine.stats()["records"]
    assert records > 0 and os.listdir(scratch) == []
    with open(store / persist.LOCK_FILE) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    state = persist.read_index(store / persist.INDEX_FILE)
    assert state.end == state.size and len(state.puts) == records
    assert state.entries == records + len(state.followers)  # compacted on close

    with Engine.load(model, block_size=16, cache_dir=scratch) as engine:
        engine.submit(PROMPT, max_tokens=4).result(timeout=120)
        stats = engine.stats()
        assert stats["persistent"] is False and stats["store_note"] == ""
        assert engine.store_note is None
    assert os.listdir(scratch) == []


def test_two_engines_on_one_dir_the_second_runs_ephemeral_and_says_so(model, tmp_path):
    store = tmp_path / "store"
    with Engine.load(model, block_size=16, persist_dir=store) as first:
        with Engine.load(model, block_size=16, persist_dir=store, cache_dir=tmp_path) as second:
            assert first.stats()["persistent"] and not second.stats()["persistent"]
            note = second.store_note
            assert f"in use by another process (pid {os.getpid()})" in note
            assert "temporary store" in note and "\n" not in note
            assert second.stats()["store_note"] == note
            second.submit(PROMPT, max_tokens=4).result(timeout=120)
            first.submit(PROMPT, max_tokens=4).result(timeout=120)
    assert sorted(os.listdir(tmp_path)) == ["store"]


def test_a_full_disk_turns_saving_off_warns_once_and_generation_goes_on(
    model, tmp_path, monkeypatch
):
    store = tmp_path / "store"
    with Engine.load(model, block_size=16, persist_dir=store) as engine:
        engine.submit(PROMPT, max_tokens=4).result(timeout=120)
        engine.wait_for_saves(timeout=60)
        assert engine.store_warning() is None and engine.stats()["saving"]

        def full_disk(fd, data, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(blobfile_module.os, "pwrite", full_disk)
        other = engine.submit(EDITED[::-1], max_tokens=4).result(timeout=120)
        assert len(other.tokens) == 4
        engine.wait_for_saves(timeout=60)
        stats = engine.stats()
        assert stats["saving"] is False and "No space" in stats["saving_error"]
        warning = engine.store_warning()
        assert warning and "saving to the block store is off" in warning
        assert engine.store_warning() is None  # once
        # Reads of complete records keep working.
        again = engine.submit(PROMPT, max_tokens=4).result(timeout=120)
        assert again.report.restore_source in ("disk", "memory")
        engine.clear_cache()  # frees the space: saving on again
        assert engine.stats()["saving"]
        monkeypatch.undo()


def test_persist_needs_a_disk_store(model, tmp_path):
    from mlx_nbengine.engine import InvalidRequestError
    from mlx_nbengine.notebook.prompting import engine_options

    for options in ({"store": False}, {"disk_budget": 0}):
        with pytest.raises(InvalidRequestError, match="persist_dir"):
            Engine.load(model, persist_dir=tmp_path / "s", **options)
    assert not (tmp_path / "s").exists()
    args = magics_mod.LLMMagics.load_model.parser.parse_args(
        [str(model), "--persist", "~/somewhere", "--block-size", "16"]
    )
    assert engine_options(args)["persist_dir"] == os.path.expanduser("~/somewhere")
    args.no_store = True
    with pytest.raises(UsageError, match="--persist"):
        engine_options(args)


# -- the notebook face -----------------------------------------------------------------------


@pytest.fixture
def ip():
    shell = InteractiveShell.instance()
    magics_mod.unload_ipython_extension(shell)
    magics_mod.load_ipython_extension(shell)
    yield shell
    magics_mod.unload_ipython_extension(shell)


def cell(ip, source: str) -> str:
    with capture_output() as cap:
        result = ip.run_cell(source)
    assert result.success, result.error_in_exec or result.error_before_exec
    shown = [str(o.data.get("text/plain", "")) for o in cap.outputs]
    return cap.stdout + "\n".join(shown)


def test_load_model_persist_option_and_the_busy_dir_line(ip, model, tmp_path):
    store = tmp_path / "store"
    out = cell(ip, f"%load_model {model} --block-size 16 --persist {store}")
    assert "in use" not in out
    magics = getattr(ip, magics_mod._MAGICS_KEY)
    assert magics.session.options["persist_dir"] == str(store)
    assert magics.session.engine.stats()["persistent"]
    cell(ip, "%unload_model")
    with BlockStore(persist_dir=store, identity={"other": "holder"}, budget_bytes=1 << 20):
        out = cell(ip, f"%load_model {model} --block-size 16 --persist {store}")
        lines = [line for line in out.splitlines() if "in use by another process" in line]
        assert len(lines) == 1 and "temporary store" in lines[0]
        status = cell(ip, "%llm_status")
        assert "persist dir" in status and "store note" in status


def test_the_cell_that_first_sees_saving_off_shows_one_warning(ip, model, tmp_path, monkeypatch):
    store = tmp_path / "store"
    cell(ip, f"%load_model {model} --block-size 16 --persist {store}")
    engine = getattr(ip, magics_mod._MAGICS_KEY).session.engine

    def io_error(fd, data, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(blobfile_module.os, "pwrite", io_error)
    words = " ".join(f"word{i}" for i in range(60))
    outputs = [cell(ip, f"%%llm --raw --max-tokens 4\n{words}")]
    engine.wait_for_saves(timeout=60)
    outputs += [cell(ip, f"%%llm --raw --max-tokens 4\n{i} {words}") for i in range(2)]
    monkeypatch.undo()
    warnings = [line for out in outputs for line in out.splitlines() if "saving to the" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ")
    assert "Input/output error" in warnings[0]

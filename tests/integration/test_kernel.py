"""The magics in a real IPython kernel, driven over ZeroMQ with jupyter_client.

One kernel per module (``python -m ipykernel_launcher`` from this interpreter, so no
installed kernelspec is needed) loads the extension and a tiny random-weight llama with
16-token blocks, its scratch file in a temporary directory. The tests then check what a
front end sees on the IOPub channel: display messages carrying the executing cell's
``parent_header``, the kernel's interrupt cancelling a request (one line, no traceback),
concurrent ``--bg`` cells, restored blocks after an edit, the widgets' comm messages (the
block strip under every answer, the ``--blocks`` map, the ``%llm_cache`` store view),
``%unload_model`` removing the scratch file, and ``%llm_models`` listing (and
``%load_model ORG/NAME`` loading) a model from a Hugging Face cache.

The kernel runs offline (``HF_HUB_OFFLINE=1``) with its own HOME, hub cache and conversion
cache in a temporary directory; the hub cache holds the tiny llama as ``org/tiny-llama``.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

from jupyter_client import KernelManager  # noqa: E402
from kernelwatch import REPO, check_alive, kernel_manager, shut_down  # noqa: E402

BLOCK = 16
# About 130 tokens of the tiny tokenizer: 8 whole 16-token blocks and a tail.
LONG_PROMPT = "\n".join(
    [
        "The Eiffel Tower is located in the city of Paris, the capital of France.",
        "A block of two hundred and fifty six tokens is cached on disk and restored later.",
        "Notebook users edit long prompts and run the cell again; the answer starts at once.",
        "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
        "Machine learning models predict the next token from the tokens that came before.",
        "The weather today is sunny with a light breeze from the west; tomorrow it may rain.",
    ]
)


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
INTERRUPTED_LINE = "interrupted: generation cancelled; the partial answer is kept above"


@dataclass
class Cell:
    """One execute_request and what came back for it."""

    msg_id: str
    reply: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)  # IOPub messages with this parent

    def of_type(self, *types: str) -> list[dict]:
        return [m for m in self.messages if m["msg_type"] in types]

    @property
    def stdout(self) -> str:
        """stdout and stderr together."""
        return "".join(m["content"]["text"] for m in self.of_type("stream"))

    def answers(self) -> list[dict]:
        """The display and display updates of this cell's answer (not of its widgets)."""
        shown = self.of_type("display_data", "update_display_data")
        return [m for m in shown if WIDGET_VIEW not in m["content"]["data"]]

    def final_data(self) -> dict:
        """The mimebundle of the answer's last display or display update."""
        shown = self.answers()
        return shown[-1]["content"]["data"] if shown else {}

    def final_text(self) -> str:
        """text/plain of the answer's last display or display update."""
        return self.final_data().get("text/plain", "")

    def widgets(self, behaviour: str) -> list[dict]:
        """comm_open messages of this cell's widgets of `behaviour` ("strip", "map", "store")."""
        return [
            m
            for m in self.of_type("comm_open")
            if m["content"]["data"]["state"].get("_behaviour") == behaviour
        ]

    def widget_displays(self) -> list[dict]:
        """The widget views this cell displayed, in order."""
        return [m for m in self.of_type("display_data") if WIDGET_VIEW in m["content"]["data"]]


class Kernel:
    """A started kernel and its client; `log` keeps every IOPub message in arrival order.

    Every wait checks about once a second that the kernel lives, and fails at once with
    `KernelDied` ("the kernel died (signal 4: SIGILL)") when it does not.
    """

    def __init__(self, km: KernelManager) -> None:
        self.km = km
        self.kc = km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=120)
        except RuntimeError:
            check_alive(km)
            raise
        self.log: list[dict] = []
        self._checked = time.monotonic()

    def check_alive(self) -> None:
        """Raise `KernelDied` if the kernel's process has ended (at most once a second)."""
        if time.monotonic() - self._checked >= 1:
            self._checked = time.monotonic()
            check_alive(self.km)

    def send(self, code: str, *, cell_id: str | None = None) -> str:
        content = {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": False,
        }
        metadata = {"cellId": cell_id} if cell_id else {}
        msg = self.kc.session.msg("execute_request", content, metadata=metadata)
        self.kc.shell_channel.send(msg)
        return msg["header"]["msg_id"]

    def pump(self, timeout: float = 0.05) -> None:
        """Move every IOPub message waiting now into `log`."""
        while True:
            try:
                self.log.append(self.kc.get_iopub_msg(timeout=timeout))
            except Exception:  # queue.Empty from the client
                return

    def wait_reply(self, msg_id: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            self.pump(0.01)
            try:
                reply = self.kc.get_shell_msg(timeout=0.05)
            except Exception:
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply
        raise TimeoutError(f"no execute_reply for {msg_id} in {timeout} s")

    def wait_idle(self, msg_id: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(self._is_idle(m, msg_id) for m in self.log):
                return
            self.check_alive()
            self.pump(0.05)
        raise TimeoutError(f"kernel not idle after {msg_id} in {timeout} s")

    @staticmethod
    def _is_idle(m: dict, msg_id: str) -> bool:
        return (
            m["msg_type"] == "status"
            and m["parent_header"].get("msg_id") == msg_id
            and m["content"]["execution_state"] == "idle"
        )

    def cell(self, msg_id: str) -> Cell:
        return Cell(msg_id, messages=[m for m in self.log if parent_of(m) == msg_id])

    def run(self, code: str, *, cell_id: str | None = None, timeout: float = 120) -> Cell:
        msg_id = self.send(code, cell_id=cell_id)
        reply = self.wait_reply(msg_id, timeout)
        self.wait_idle(msg_id, timeout)
        cell = self.cell(msg_id)
        cell.reply = reply
        return cell

    def ok(self, code: str, **kwargs) -> Cell:
        cell = self.run(code, **kwargs)
        content = cell.reply["content"]
        assert content["status"] == "ok", (content.get("ename"), content.get("evalue"))
        errors = [m["content"]["text"] for m in cell.of_type("stream")]
        assert not any("UsageError" in e for e in errors), errors
        return cell

    def value(self, expression: str) -> str:
        return self.ok(f"print({expression})").stdout.strip()

    def close(self) -> None:
        """Stop the kernel (if it still runs) and remove its connection file."""
        try:
            self.kc.stop_channels()
        finally:
            shut_down(self.km)


def parent_of(m: dict) -> str | None:
    return m["parent_header"].get("msg_id")


def comm_id(opened: dict) -> str:
    return opened["content"]["comm_id"]


def state_updates(kernel: Kernel, widget: str) -> list[dict]:
    """Every state update the kernel sent for the widget (comm id), in order, any parent."""
    return [
        m
        for m in kernel.log
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == widget
        and m["content"]["data"].get("method") == "update"
    ]


def widget_state(kernel: Kernel, opened: dict) -> dict:
    """The widget's state now: its comm_open state with every later update applied."""
    state = dict(opened["content"]["data"]["state"])
    for m in state_updates(kernel, comm_id(opened)):
        state.update(m["content"]["data"]["state"])
    return state


def the_strip(kernel: Kernel, cell: Cell) -> dict:
    """The final state of the cell's (one) block strip."""
    (opened,) = cell.widgets("strip")
    return widget_state(kernel, opened)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scratch")


HUB_ID = "org/tiny-llama"


@pytest.fixture(scope="module")
def machine(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """The kernel's environment: its own HOME, hub cache (holding `HUB_ID`) and caches."""
    root = tmp_path_factory.mktemp("machine")
    (root / "home").mkdir()
    from mlx_nbengine.testing import add_to_hub_cache

    add_to_hub_cache(root / "hf" / "hub", HUB_ID, sorted(tiny_model_dir("llama").iterdir()))
    return {
        "HOME": str(root / "home"),
        "HF_HOME": str(root / "hf"),
        "HF_HUB_CACHE": str(root / "hf" / "hub"),
        "HF_HUB_OFFLINE": "1",
        "MLX_NBENGINE_HOME": str(root / "mlx_nbengine"),
    }


@pytest.fixture(scope="module")
def kernel(tiny_model_dir, tmp_path_factory, cache_dir, machine):
    model = tiny_model_dir("llama")
    km = kernel_manager(tmp_path_factory.mktemp("kernel"), env=machine)
    km.start_kernel(cwd=str(REPO))
    k = Kernel(km)
    try:
        k.ok("%load_ext mlx_nbengine")
        k.ok(f"%load_model {model} --block-size {BLOCK} --cache-dir {cache_dir} --parallel 4")
        yield k
    finally:
        k.close()


def display_ids(cell: Cell) -> set[str]:
    """The display id of the cell's answer (its widgets' displays left out)."""
    return {m["content"]["transient"]["display_id"] for m in cell.answers()}


def test_llm_models_lists_the_hub_cache_model_in_a_table(kernel, machine):
    cell = kernel.ok("%llm_models")
    data = cell.final_data()
    assert set(data) == {"text/plain", "text/html"}
    rows = re.findall(r"<tr>(.*?)</tr>", data["text/html"].split("<tbody>")[1])
    cells = {
        fields[0]: fields for fields in (re.findall(r"<td[^>]*>(.*?)</td>", row) for row in rows)
    }
    assert cells[HUB_ID][1:3] == ["hub cache", "text"]
    assert cells[HUB_ID][3].endswith("KiB") and cells[HUB_ID][4] == "-"
    assert f"looked in the Hugging Face cache ({machine['HF_HUB_CACHE']})" in data["text/html"]
    assert re.search(rf"^{re.escape(HUB_ID)} +hub cache +text ", data["text/plain"], re.M)


def test_streaming_updates_one_display_in_the_executing_cell(kernel):
    cell = kernel.ok("%%llm --max-tokens 400\nHello, who are you?")
    first = [m for m in cell.answers() if m["msg_type"] == "display_data"]
    updates = [m for m in cell.answers() if m["msg_type"] == "update_display_data"]
    assert len(first) == 1, "one display per answer"
    assert len(updates) >= 2, "the answer is updated in place while it streams"
    (display_id,) = display_ids(cell)
    assert {m["content"]["transient"]["display_id"] for m in updates} == {display_id}
    assert all(parent_of(m) == cell.msg_id for m in updates)
    # Throttled to about one update per 100 ms, however fast the tokens come.
    span = (updates[-1]["header"]["date"] - first[0]["header"]["date"]).total_seconds()
    assert len(updates) <= span / 0.1 + 3, (len(updates), span)
    final = updates[-1]["content"]["data"]
    assert set(final) == {"text/plain", "text/html"}
    assert re.search(
        r"\d+ prompt tokens(: [\d,]+ restored.*computed|, all computed); first token",
        final["text/plain"],
    )
    # Why it stopped, and how many tokens it made.
    assert re.search(r"; (end of text after|stopped at max tokens \()\d+", final["text/plain"])


def test_the_answer_is_the_models_text_escaped_in_a_pre_wrap_block(kernel):
    cell = kernel.ok("%%llm --raw -o raw --max-tokens 24\nLine one <em>\nLine two")
    answer = json.loads(kernel.value("__import__('json').dumps(raw.text)"))
    html_text = cell.final_data()["text/html"]
    text_block = re.search(r'<pre class="mnb-text">(.*?)</pre>', html_text, re.S)
    assert text_block and text_block.group(1) == html.escape(answer)
    # The output carries its own stylesheet: the text wraps as written, in a saved notebook too.
    sheet = re.match(r"<style>(.*?)</style>", html_text, re.S)
    assert sheet and re.search(r"\.mnb-text\{[^}]*white-space: ?pre-wrap", sheet.group(1))
    # The summary line follows in its own line, outside the text.
    assert '<div class="mnb-status"' in html_text[text_block.end() :]


def test_markdown_option_renders_markdown(kernel):
    cell = kernel.ok("%%llm --markdown --max-tokens 8\nHello")
    assert set(cell.final_data()) == {"text/plain", "text/markdown"}


def test_o_stores_the_completion_in_the_user_namespace(kernel):
    kernel.ok("%%llm -o answer --max-tokens 8\nWhat is two plus two?")
    assert kernel.value("type(answer).__name__") == "Completion"
    assert kernel.value("answer.finish_reason in ('stop', 'length')") == "True"
    assert kernel.value("len(answer.tokens) <= 8") == "True"


def test_every_answer_has_a_block_strip_under_it_from_the_start(kernel):
    cell = kernel.ok(f"%%llm -o striped --max-tokens 4\nA strip of its own.\n{LONG_PROMPT}")
    n_prompt = int(kernel.value("len(striped.prompt_tokens)"))
    (opened,) = cell.widgets("strip")
    # Created when the request was submitted: every block laid out, none known yet.
    first = opened["content"]["data"]["state"]
    assert first["n_blocks"] == math.ceil(n_prompt / BLOCK)
    assert first["block_size"] == BLOCK and first["prompt_tokens"] == n_prompt
    assert first["blocks"] == []
    # Shown right under the answer, in the same cell.
    shown = cell.of_type("display_data")
    assert WIDGET_VIEW not in shown[0]["content"]["data"]
    assert shown[1]["content"]["data"][WIDGET_VIEW]["model_id"] == comm_id(opened)
    assert parent_of(opened) == cell.msg_id


def test_the_block_strip_fills_in_while_the_prompt_is_read(kernel):
    cell = kernel.ok(f"%%llm -o live --max-tokens 4\nA live strip.\n{LONG_PROMPT}")
    (opened,) = cell.widgets("strip")
    with_blocks = [
        m
        for m in state_updates(kernel, comm_id(opened))
        if "blocks" in m["content"]["data"]["state"]
    ]
    assert len(with_blocks) > 1, "one update per block as it becomes known"
    assert all(parent_of(m) == cell.msg_id for m in with_blocks)
    # The first block showed before the answer's last update.
    answer_dates = [m["header"]["date"] for m in cell.answers()]
    assert with_blocks[0]["header"]["date"] < answer_dates[-1]
    # A prompt never seen: every block computed, the last one the tail.
    state = the_strip(kernel, cell)
    assert len(state["blocks"]) == state["n_blocks"]
    kinds = [b["display"] for b in state["blocks"]]
    assert set(kinds[:-1]) == {"computed"} and kinds[-1] == "tail"
    # Why each was computed: its first block differs from stored ones after the shared chat
    # template tokens ("edited"), or nothing like it was stored ("new"); later ones follow.
    assert {b["reason"] for b in state["blocks"][:-1]} <= {"new", "edited", "after_miss"}
    assert state["blocks"][0]["head"], "the block's first words"


def test_rerunning_an_edited_cell_reports_restored_blocks(kernel):
    kernel.ok(f"%%llm -o before --max-tokens 4\n{LONG_PROMPT}\nSummarize this text.")
    # Something unrelated in between, so the edit is served by the disk store.
    kernel.ok("%%llm --max-tokens 4\nHi")
    cell = kernel.ok(f"%%llm -o after --max-tokens 4\n{LONG_PROMPT}\nTranslate this text.")
    assert int(kernel.value("len(after.prompt_tokens)")) > 2 * BLOCK
    restored = int(kernel.value("after.report.restored_tokens"))
    assert restored >= 2 * BLOCK
    match = re.search(r"([\d,]+) restored \((\d+) blocks? from (memory|disk)", cell.final_text())
    assert match, cell.final_text()
    assert int(match.group(1).replace(",", "")) == restored


def test_the_strip_of_an_edited_rerun_shows_restored_blocks_and_the_edit(kernel):
    kernel.ok(f"%%llm --max-tokens 4\n{LONG_PROMPT}\nWhat is this text about?")
    kernel.ok("%%llm --max-tokens 4\nHello")
    cell = kernel.ok(f"%%llm -o edited --max-tokens 4\n{LONG_PROMPT}\nWho wrote this text?")
    edit_at = int(kernel.value("edited.report.edit_at"))
    state = the_strip(kernel, cell)
    blocks = state["blocks"]
    assert len(blocks) == state["n_blocks"]
    edit_block = edit_at // BLOCK
    assert state["edit"]["position"] == edit_at and state["edit"]["block"] == edit_block
    # Before the edit: read from disk (a llama has only kv records); from it on: computed.
    assert {(b["display"], b["reason"]) for b in blocks[:edit_block]} == {("disk", "kv")}
    assert blocks[edit_block]["reason"] in ("edited", "tail")
    assert {b["display"] for b in blocks[edit_block:]} <= {"computed", "tail"}
    assert blocks[-1]["display"] == "tail"


def test_blocks_shows_the_block_map_after_the_answer(kernel):
    cell = kernel.ok(f"%%llm --blocks -o mapped --max-tokens 4\n{LONG_PROMPT}\nA map, please.")
    n_prompt = int(kernel.value("len(mapped.prompt_tokens)"))
    (opened,) = cell.widgets("map")
    state = widget_state(kernel, opened)
    assert len(state["blocks"]) == math.ceil(n_prompt / BLOCK)
    assert state["layer_kinds"] == ["kv", "kv"]  # the tiny llama's two layers
    assert all(b["head"] for b in state["blocks"])
    # answer, strip, map: in that order, the map's bundle with its static picture.
    views = cell.widget_displays()
    assert [v["content"]["data"][WIDGET_VIEW]["model_id"] for v in views][-1] == comm_id(opened)
    assert 'class="mnb-root mnb-map"' in views[-1]["content"]["data"]["text/html"]


def test_rerunning_a_chat_cell_with_the_same_cell_id_replaces_its_turn(kernel):
    kernel.ok("%%llm --chat c -o t1 --max-tokens 4\nFirst question", cell_id="cell-a")
    kernel.ok("%%llm --chat c -o t2 --max-tokens 4\nSecond question", cell_id="cell-b")
    kernel.ok("%%llm --chat c -o t3 --max-tokens 4\nFirst question again", cell_id="cell-a")
    turns = "get_ipython()._mlx_nbengine_magics.session.chats.get('c').turns"
    assert kernel.value(f"[t.user for t in {turns}]") == "['First question again']"
    assert kernel.value("len(t3.prompt_tokens) < len(t2.prompt_tokens)") == "True"


def test_interrupt_cancels_a_long_generation_and_the_kernel_stays_usable(kernel):
    msg_id = kernel.send("%%llm -o partial --max-tokens 6000\nTell me a very long story.")
    deadline = time.monotonic() + 60
    while not kernel.cell(msg_id).of_type("update_display_data"):
        assert time.monotonic() < deadline, "no streamed update before the interrupt"
        kernel.pump(0.05)
    time.sleep(0.3)
    kernel.km.interrupt_kernel()
    reply = kernel.wait_reply(msg_id, timeout=60)
    kernel.wait_idle(msg_id)
    assert reply["content"]["status"] == "error"  # so "Run all" stops here
    assert reply["content"]["ename"] == "GenerationInterrupted"  # a KeyboardInterrupt
    # One line under the kept answer, not the traceback of where the interrupt landed.
    assert reply["content"]["traceback"] == [INTERRUPTED_LINE]
    (error,) = kernel.cell(msg_id).of_type("error")
    assert error["content"]["traceback"] == [INTERRUPTED_LINE]
    assert kernel.value("partial.finish_reason") == "cancelled"
    assert 0 < int(kernel.value("len(partial.tokens)")) < 6000
    assert "[interrupted]" in kernel.cell(msg_id).final_text()
    # The kernel still answers, and the engine has no request left running.
    kernel.ok("%%llm -o again --max-tokens 4\nHi")
    assert kernel.value("again.finish_reason") in ("stop", "length")
    engine = "get_ipython()._mlx_nbengine_magics.session.engine"
    assert kernel.value(f"{engine}.stats()['active'], {engine}.stats()['queued']") == "0 0"


def test_background_cells_run_concurrently_into_their_own_cells(kernel):
    started = time.monotonic()
    # Long enough answers that neither ends before both cells have returned, however fast
    # the machine decodes the tiny model (600 tokens once finished first on a quiet one).
    first = kernel.ok("%%llm --bg -o job1 --max-tokens 4000\nTell me a story about a fox.")
    second = kernel.ok("%%llm --bg -o job2 --max-tokens 4000\nTell me a story about a dog.")
    # Both cells returned before either answer was done.
    assert kernel.value("job1.done() or job2.done()") == "False"
    kernel.ok("r1, r2 = job1.result(timeout=200), job2.result(timeout=200)")
    kernel.pump(0.2)
    assert time.monotonic() - started < 240
    ids = {}
    for cell in (first, second):
        (ids[cell.msg_id],) = display_ids(cell)
    updates = [m for m in kernel.log if m["msg_type"] == "update_display_data"]
    for cell in (first, second):
        mine = [m for m in updates if m["content"]["transient"]["display_id"] == ids[cell.msg_id]]
        assert mine, "the background thread updated the display"
        # set_thread_parent: every update carries the parent header of the cell that made it.
        assert {parent_of(m) for m in mine} == {cell.msg_id}
        assert "prompt tokens" in mine[-1]["content"]["data"]["text/plain"]
        # The strip, filled in from the background thread, also reaches this cell.
        (strip,) = cell.widgets("strip")
        strip_updates = state_updates(kernel, comm_id(strip))
        assert strip_updates and {parent_of(m) for m in strip_updates} == {cell.msg_id}
        state = widget_state(kernel, strip)
        assert len(state["blocks"]) == state["n_blocks"]
    # Concurrent: the second answer streamed before the first one had finished.
    order = [m["content"]["transient"]["display_id"] for m in updates]
    last_of_first = max(i for i, d in enumerate(order) if d == ids[first.msg_id])
    first_of_second = min(i for i, d in enumerate(order) if d == ids[second.msg_id])
    assert first_of_second < last_of_first


def test_usage_errors_are_one_line(kernel):
    cell = kernel.run("%%llm --no-such-option\nHi")
    content = cell.reply["content"]
    assert content["status"] == "error" and content["ename"] == "UsageError"
    shown = cell.of_type("error")
    assert not shown or len(shown[-1]["content"]["traceback"]) == 1


def test_llm_cache_shows_the_store_view(kernel):
    cell = kernel.ok("%llm_cache")
    (opened,) = cell.widgets("store")
    view = opened["content"]["data"]["state"]["view"]
    assert view["blocks_held"] > 0 and view["blocks_restored"] > 0
    assert view["block_size"] == BLOCK
    (shown,) = cell.widget_displays()
    data = shown["content"]["data"]
    assert 'class="mnb-root mnb-store"' in data["text/html"]
    assert data["text/plain"].startswith("Block store: ")


def test_llm_status_names_the_loaded_model_and_its_type(kernel, tiny_model_dir):
    cell = kernel.ok("%llm_status")
    text = cell.final_text()
    assert f"model                     {tiny_model_dir('llama')} (llama)" in text


def open_files_under(pid: int, directory: Path) -> list[str]:
    """Files the process `pid` holds open under `directory`, unlinked ones included.

    The scratch file is created unlinked (it never shows in a directory listing), so we
    look at the kernel's file descriptors: on Linux their /proc links read
    "<dir>/#<inode> (deleted)"; elsewhere psutil lists the open paths.
    """
    prefix = str(directory.resolve())
    proc_fd = Path(f"/proc/{pid}/fd")
    if proc_fd.is_dir():
        targets = []
        for fd in proc_fd.iterdir():
            try:
                targets.append(os.readlink(fd))
            except OSError:  # closed meanwhile
                continue
    else:
        import psutil

        targets = [f.path for f in psutil.Process(pid).open_files()]
    return [t for t in targets if t.startswith(prefix)]


def test_unload_model_removes_the_scratch_file(kernel, cache_dir):
    pid = kernel.km.provisioner.process.pid
    assert open_files_under(pid, cache_dir), "the kernel holds the scratch file while loaded"
    assert (
        int(kernel.value("get_ipython()._mlx_nbengine_magics.session.engine.stats()['file_size']"))
        > 0
    )
    kernel.ok("%unload_model")
    assert open_files_under(pid, cache_dir) == []
    assert list(cache_dir.iterdir()) == []
    cell = kernel.run("%%llm\nHi")
    assert cell.reply["content"]["ename"] == "UsageError"


def test_a_model_that_fails_to_load_is_one_short_error(kernel, tmp_path):
    cell = kernel.run(f"%load_model {tmp_path / 'no-such-model'}")
    content = cell.reply["content"]
    assert content["status"] == "error" and content["ename"] == "UsageError"
    (line,) = cell.stdout.strip().splitlines()  # stdout and stderr
    assert line.startswith("UsageError: could not load")
    assert not cell.of_type("error"), "no traceback"


def test_a_model_in_the_hub_cache_loads_by_its_id(kernel, tmp_path):
    cell = kernel.ok(f"%load_model {HUB_ID} --block-size {BLOCK} --cache-dir {tmp_path}")
    assert cell.final_text().startswith(f"loaded {HUB_ID} (llama, text) in ")
    snapshot = "get_ipython()._mlx_nbengine_magics.session.engine.model.path"
    assert kernel.value(f"{snapshot}.parent.name") == "snapshots"
    kernel.ok("%%llm -o by_id --max-tokens 4\nHello")
    assert kernel.value("by_id.finish_reason") in ("stop", "length")
    assert f"model                     {HUB_ID} (llama)" in kernel.ok("%llm_status").final_text()
    kernel.ok("%unload_model")

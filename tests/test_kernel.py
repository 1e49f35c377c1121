"""The magics in a real IPython kernel, driven over ZeroMQ with jupyter_client.

One kernel per module (``python -m ipykernel_launcher`` from this interpreter, so no
installed kernelspec is needed) loads the extension and a tiny random-weight llama with
16-token blocks, its scratch file in a temporary directory. The tests then check what a
front end sees on the IOPub channel: display messages carrying the executing cell's
``parent_header``, the kernel's interrupt cancelling a request, concurrent ``--bg`` cells,
restored blocks after an edit, and ``%unload_model`` removing the scratch file.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

from jupyter_client import KernelManager  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
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


def kernel_manager(tmp: Path, *, env: dict[str, str] | None = None) -> KernelManager:
    """A KernelManager for this interpreter's ipykernel, whatever kernelspecs are installed."""
    spec_dir = tmp / "kernels" / "mlx-nbengine-test"
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mlx_nbengine test",
        "language": "python",
        "env": {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        | (env or {}),
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelManager(
        kernel_name="mlx-nbengine-test",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp / "kernels")]),
    )


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

    def final_text(self) -> str:
        """text/plain of the last display or display update of this cell."""
        shown = self.of_type("display_data", "update_display_data")
        return shown[-1]["content"]["data"]["text/plain"] if shown else ""


class Kernel:
    """A started kernel and its client; `log` keeps every IOPub message in arrival order."""

    def __init__(self, km: KernelManager) -> None:
        self.km = km
        self.kc = km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.log: list[dict] = []

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
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def parent_of(m: dict) -> str | None:
    return m["parent_header"].get("msg_id")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scratch")


@pytest.fixture(scope="module")
def kernel(tiny_model_dir, tmp_path_factory, cache_dir):
    model = tiny_model_dir("llama")
    km = kernel_manager(tmp_path_factory.mktemp("kernel"))
    km.start_kernel(cwd=str(REPO))
    k = Kernel(km)
    try:
        k.ok("%load_ext mlx_nbengine")
        k.ok(f"%load_model {model} --block-size {BLOCK} --cache-dir {cache_dir} --parallel 4")
        yield k
    finally:
        k.close()


def display_ids(cell: Cell) -> set[str]:
    return {m["content"]["transient"]["display_id"] for m in cell.of_type("display_data")}


def test_streaming_updates_one_display_in_the_executing_cell(kernel):
    cell = kernel.ok("%%llm --max-tokens 400\nHello, who are you?")
    first = cell.of_type("display_data")
    updates = cell.of_type("update_display_data")
    assert len(first) == 1, "one display per answer"
    assert len(updates) >= 2, "the answer is updated in place while it streams"
    (display_id,) = display_ids(cell)
    assert {m["content"]["transient"]["display_id"] for m in updates} == {display_id}
    assert all(parent_of(m) == cell.msg_id for m in updates)
    # Throttled to about one update per 100 ms, however fast the tokens come.
    span = (updates[-1]["header"]["date"] - first[0]["header"]["date"]).total_seconds()
    assert len(updates) <= span / 0.1 + 3, (len(updates), span)
    final = updates[-1]["content"]["data"]
    assert set(final) == {"text/plain", "text/markdown"}
    assert re.search(
        r"\d+ prompt tokens: [\d,]+ restored.*computed; first token", final["text/plain"]
    )


def test_o_stores_the_completion_in_the_user_namespace(kernel):
    kernel.ok("%%llm -o answer --max-tokens 8\nWhat is two plus two?")
    assert kernel.value("type(answer).__name__") == "Completion"
    assert kernel.value("answer.finish_reason in ('stop', 'length')") == "True"
    assert kernel.value("len(answer.tokens) <= 8") == "True"


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
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
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
    first = kernel.ok("%%llm --bg -o job1 --max-tokens 600\nTell me a story about a fox.")
    second = kernel.ok("%%llm --bg -o job2 --max-tokens 600\nTell me a story about a dog.")
    # Both cells returned before either answer was done.
    assert kernel.value("job1.done() or job2.done()") == "False"
    kernel.ok("r1, r2 = job1.result(timeout=120), job2.result(timeout=120)")
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

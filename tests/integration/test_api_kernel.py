"""`%llm_serve` in a real IPython kernel, with the real `openai` client in this process.

One kernel for the module (the one `test_kernel` drives: a tiny llama, 16-token blocks, four
slots) serves on 127.0.0.1 at a free port (``--port 0``). The tests check the agent view
(its rows fill in over the widget's comm as API requests come), a ``%%llm`` cell and an API
request running at once on the one engine, the one-line errors, and that ``%llm_serve
stop``, ``%unload_model`` and ``%load_model`` of another model stop the server.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("jupyter_client")

from kernelwatch import REPO, kernel_manager  # noqa: E402  (tests/ on sys.path)
from test_kernel import BLOCK, WIDGET_VIEW, Kernel, widget_state  # noqa: E402

from mlx_nbengine import kernels  # noqa: E402

SESSION = "get_ipython()._mlx_nbengine_magics.session"


def with_built_kernels(home: Path) -> Path:
    """`home`, a new cache home, given the CPU kernels this test session built: the kernel
    loads its model without building them again (a minute or more on two cores)."""
    status = kernels.status()
    if status.active:
        built = Path(status.module).parent
        shutil.copytree(built, home / "kernels" / built.name)
    return home


@pytest.fixture(scope="module")
def kernel(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    home = tmp_path_factory.mktemp("api-home")
    cache_home = with_built_kernels(home / "mnb")
    env = {"HOME": str(home), "HF_HUB_OFFLINE": "1", "MLX_NBENGINE_HOME": str(cache_home)}
    km = kernel_manager(tmp_path_factory.mktemp("api-kernel"), env=env)
    km.start_kernel(cwd=str(REPO))
    k = Kernel(km)
    try:
        k.ok("%load_ext mlx_nbengine")
        # Where the kernels were not built here, the kernel builds them: time for that.
        k.ok(f"%load_model {model} --block-size {BLOCK} --parallel 4", timeout=600)
        yield k
    finally:
        k.close()


def serve(kernel: Kernel, options: str = "--port 0"):
    """Start `%llm_serve`; return the cell and the server's base URL."""
    cell = kernel.ok(f"%llm_serve {options}")
    url = kernel.value(f"{SESSION}.server.url")
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    return cell, url


def model_name(kernel: Kernel) -> str:
    return kernel.value(f"{SESSION}.engine.model_name")


def the_view(kernel: Kernel, cell) -> dict:
    (opened,) = cell.widgets("agent")
    return widget_state(kernel, opened)


def wait_for(predicate, timeout: float = 30, kernel: Kernel | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kernel is not None:
            kernel.pump(0.05)
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/models", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def test_llm_serve_shows_the_agent_view_and_its_rows_fill_in(kernel):
    cell, url = serve(kernel)
    try:
        (shown,) = cell.widget_displays()
        assert WIDGET_VIEW in shown["content"]["data"]
        assert url in shown["content"]["data"]["text/plain"]
        state = the_view(kernel, cell)
        assert state["url"] == url
        assert "from openai import OpenAI" in state["snippet"] and url in state["snippet"]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        name = model_name(kernel)
        question = [{"role": "user", "content": "The Eiffel Tower is located in Paris. " * 6}]
        for _ in range(2):  # the second restores the first's blocks
            reply = client.chat.completions.create(
                model=name, messages=question, max_tokens=6, temperature=0
            )
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cached > 0

        def two_finished_rows():
            rows = the_view(kernel, cell)["rows"]
            return rows if len(rows) == 2 and all(r["finish"] == "length" for r in rows) else None

        rows = wait_for(two_finished_rows, kernel=kernel)
        first, second = rows
        assert second["prompt"] == reply.usage.prompt_tokens
        assert second["memory"] + second["disk"] == cached
        assert second["computed"] == reply.usage.prompt_tokens - cached
        assert second["endpoint"] == "chat/completions"
        assert second["ttft"] is not None and second["tps"] > 0
        assert first["memory"] + first["disk"] == 0
        markup = the_view(kernel, cell)["markup"]
        assert markup.count('class="mnb-agent-row"') == 2
        assert "mnb-strip" in markup
        assert 'data-display="memory"' in markup or 'data-display="disk"' in markup
        assert "mnb-map" in markup  # the block map behind a click
        # %llm_serve alone shows the view again, with the same rows.
        again = kernel.ok("%llm_serve")
        assert len(the_view(kernel, again)["rows"]) == 2
    finally:
        kernel.ok("%llm_serve stop")
    assert refused(url)


# Run in the kernel: a thread holds the engine's generation thread between two steps
# (`Engine.on_model_thread`) until `_release_when(n)` sees n requests queued behind it.
HOLD = f"""
import threading as _threading, time as _time
_engine = {SESSION}.engine
_entered, _release = _threading.Event(), _threading.Event()
def _hold():
    _entered.set()
    _release.wait(60)
def _release_when(n):
    deadline = _time.monotonic() + 60
    while _engine.stats()["queued"] < n and _time.monotonic() < deadline:
        _time.sleep(0.01)
    _release.set()
_threading.Thread(target=_engine.on_model_thread, args=(_hold,), daemon=True).start()
assert _entered.wait(30)
"""


def test_a_cell_and_an_api_request_run_at_once(kernel):
    """The agent's 1,500-token answer and a 24-token cell decode in the same steps: both are
    admitted in one turn (the generation thread held until both are queued), so the cell
    ends 1,476 steps before the answer, on a machine of any speed."""
    _, url = serve(kernel)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        name = model_name(kernel)
        got: list[str] = []
        state = {"finish": None}

        def agent() -> None:
            stream = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "Tell me a long story."}],
                max_tokens=1500,
                temperature=0,
                stream=True,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got.append(chunk.choices[0].delta.content)
                if chunk.choices and chunk.choices[0].finish_reason:
                    state["finish"] = chunk.choices[0].finish_reason

        kernel.ok(HOLD)
        thread = threading.Thread(target=agent)
        try:
            thread.start()
            # The agent's request is in the engine, waiting, before the cell begins.
            wait_for(lambda: kernel.value(f"{SESSION}.engine.stats()['queued']") == "1")
            assert got == []
            kernel.ok("_threading.Thread(target=_release_when, args=(2,), daemon=True).start()")
            cell = kernel.ok("%%llm --max-tokens 24 -o cell_answer\nWhat is the capital of France?")
        finally:
            kernel.ok("_release.set()")  # never left held, whatever failed
        assert cell.reply["content"]["status"] == "ok"
        assert kernel.value("len(cell_answer.tokens)") == "24"
        # The cell ended while the agent's answer was still decoding.
        assert kernel.value(f"{SESSION}.engine.stats()['active']") == "1"
        thread.join(120)
        assert state["finish"] == "length"
        assert got
    finally:
        kernel.ok("%llm_serve stop")


def test_one_line_errors(kernel):
    for line, words in [
        ("%llm_serve --host 0.0.0.0 --port 0", "--api-key"),
        ("%llm_serve stop", "not running"),
        ("%llm_serve sideways", "invalid choice"),
    ]:
        cell = kernel.run(line)
        text = cell.stdout + "".join(m["content"].get("evalue", "") for m in cell.of_type("error"))
        assert words in text, (line, text)
        assert "Traceback" not in text
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cell = kernel.run(f"%llm_serve --port {port}")
        lines = [ln for ln in cell.stdout.splitlines() if ln.strip()]
        assert lines == [
            f"UsageError: port {port} is in use on 127.0.0.1; pick another with --port N"
        ]


def test_unload_and_load_of_another_model_stop_the_server(kernel, tiny_model_dir):
    _, url = serve(kernel)
    kernel.ok("%unload_model")
    assert refused(url)
    assert kernel.value(f"{SESSION}.server") == "None"
    kernel.ok(f"%load_model {tiny_model_dir('llama')} --block-size {BLOCK}")
    _, url = serve(kernel)
    kernel.ok(f"%load_model {tiny_model_dir('gemma3_text')} --block-size {BLOCK}")
    assert refused(url)
    # Closing the engine any other way stops it too (the server's watcher).
    _, url = serve(kernel)
    kernel.ok(f"{SESSION}.engine.close()")
    wait_for(lambda: refused(url), timeout=10)


def test_in_terminal_ipython_the_view_is_text_with_the_url_and_snippet(tiny_model_dir, capsys):
    from IPython.core.interactiveshell import InteractiveShell

    from mlx_nbengine.notebook import magics as magics_mod

    shell = InteractiveShell.instance()
    magics_mod.unload_ipython_extension(shell)
    magics_mod.load_ipython_extension(shell)
    try:
        shell.run_line_magic("load_model", f"{tiny_model_dir('llama')} --block-size {BLOCK}")
        capsys.readouterr()
        shell.run_line_magic("llm_serve", "--port 0")
        server = shell._mlx_nbengine_magics.session.server
        shown = capsys.readouterr().out
        assert f"at {server.url}" in shown and "from openai import OpenAI" in shown
        assert "--api-key" not in shown  # no key: the snippet says any string does
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        name = shell._mlx_nbengine_magics.session.engine.model_name
        # Greedy: sampled at the API's default temperature of 1, the tiny model's end token
        # came among the 3 once in a while, and the row said finish=stop.
        client.completions.create(model=name, prompt="The quick", max_tokens=3, temperature=0)
        shell.run_line_magic("llm_serve", "")
        again = capsys.readouterr().out
        assert "serving" in again and "finish=length" in again
        shell.run_line_magic("llm_serve", "stop")
        assert f"stopped serving at {server.url}" in capsys.readouterr().out
        assert refused(server.url)
    finally:
        magics_mod.unload_ipython_extension(shell)

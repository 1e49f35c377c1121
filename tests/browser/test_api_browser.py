"""The agent view in a real JupyterLab: `%llm_serve`'s rows appear as API requests come.

JupyterLab starts on loopback (`lab_server.lab_server`) and Chromium (driven by Playwright)
opens a notebook that loads a tiny random-weight llama with 16-token blocks and runs
``%llm_serve`` on a free port. This process then sends API requests with the real `openai`
client: a long chat, the same chat again (its blocks restored) and a completion. The test
reads the view's DOM (``tr.mnb-agent-row > td[data-name]``, the strips' ``.mnb-block``
cells under them), clicks the restored request's strip (its block map opens), and saves a
screenshot of the cell (``agent-view.png``; copied to ``$MLX_NBENGINE_SCREENSHOTS`` when set,
e.g. ``docs/images`` for the README). Without Chromium or Playwright the module is skipped
(under ``CI=true`` the run fails instead; see ``needs.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from needs import PLAYWRIGHT_MISSING, chromium, module  # tests/ is on sys.path

sync_api = module("playwright.sync_api", PLAYWRIGHT_MISSING)
openai = pytest.importorskip("openai")

CHROMIUM = chromium()

from lab_server import free_port, lab_server, notebook_json  # noqa: E402
from test_browser import WAIT_MS, run_cell, wait_kernel_idle  # noqa: E402
from test_kernel import BLOCK, LONG_PROMPT  # noqa: E402

READ_ROWS = """(index) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
  return [...cell.querySelectorAll('tr.mnb-agent-row')].map((row) => {
    const out = {};
    for (const td of row.querySelectorAll('td[data-name]')) out[td.dataset.name] = td.textContent;
    const strip = row.nextElementSibling;
    out.kinds = strip && strip.classList.contains('mnb-agent-strip')
      ? [...strip.querySelectorAll('.mnb-strip .mnb-block')].map((b) => b.dataset.display) : [];
    return out;
  });
}"""


@dataclass
class Seen:
    rows: list[dict]
    answers: dict = field(default_factory=dict)
    map_rows: int = 0
    static_roots: int = -1
    screenshot: Path | None = None


@pytest.fixture(scope="module")
def seen(tiny_model_dir, tmp_path_factory) -> Seen:
    model = tiny_model_dir("llama")
    tmp = tmp_path_factory.mktemp("api-browser")
    out = tmp / "screenshots"
    out.mkdir()
    port = free_port()
    cells = [
        f"%load_ext mlx_nbengine\n%load_model tiny-llama --block-size {BLOCK}",
        f"%llm_serve --port {port}",
    ]
    kernel_env = {"MLX_NBENGINE_HOME": str(tmp / "cache-home")}
    with lab_server(tmp / "lab", kernel_extra_env=kernel_env) as server:
        shutil.copytree(model, server.root / "tiny-llama")
        (server.root / "agent.ipynb").write_text(json.dumps(notebook_json(cells)))
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            )
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                page.set_default_timeout(WAIT_MS)
                try:
                    page.goto(server.notebook_url("agent.ipynb"), timeout=WAIT_MS)
                    wait_kernel_idle(page)
                    page.evaluate("() => { window.jupyterapp.shell.collapseLeft(); }")
                    run_cell(page, 0)
                    run_cell(page, 1)
                    page.wait_for_selector(".jp-Notebook .jp-Cell >> nth=1 >> .mnb-agent")
                    client = openai.OpenAI(
                        base_url=f"http://127.0.0.1:{port}/v1",
                        api_key="none",
                        max_retries=0,
                        timeout=120,
                    )
                    name = client.models.list().data[0].id
                    question = [
                        {"role": "system", "content": "You are a coding agent."},
                        {"role": "user", "content": f"{LONG_PROMPT}\nSummarize this text."},
                    ]
                    answers = {}
                    for key in ("cold", "restored"):
                        reply = client.chat.completions.create(
                            model=name, messages=question, max_tokens=8, temperature=0
                        )
                        answers[key] = reply.usage
                    stream = client.completions.create(  # greedy: no end token by chance
                        model=name,
                        prompt="The quick brown fox",
                        max_tokens=8,
                        stream=True,
                        temperature=0,
                    )
                    answers["completion"] = "".join(c.choices[0].text for c in stream if c.choices)
                    page.wait_for_function(
                        f"(i) => ({READ_ROWS})(i).length === 3 && "
                        f"({READ_ROWS})(i).every((r) => r.finish === 'length')",
                        arg=1,
                    )
                    rows = page.evaluate(READ_ROWS, 1)
                    cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
                    cell.evaluate("(e) => e.scrollIntoView({block: 'start'})")
                    page.wait_for_timeout(300)
                    shot = out / "agent-view.png"
                    cell.screenshot(path=shot)
                    # The restored request's strip opens its block map.
                    restored = page.locator(
                        ".jp-Notebook .jp-Cell >> nth=1 >> details.mnb-agent-blocks"
                    ).nth(1)
                    restored.locator("summary").click()
                    page.wait_for_timeout(300)
                    map_rows = restored.locator(".mnb-map tr.mnb-block").count()
                    static_roots = page.evaluate(
                        """() => [...document.querySelectorAll('.mnb-agent')].filter(
                          (e) => e.closest('.jp-RenderedHTMLCommon')).length"""
                    )
                except Exception:
                    page.screenshot(path=out / "failure.png")
                    raise
            finally:
                browser.close()
    if os.environ.get("MLX_NBENGINE_SCREENSHOTS"):
        target = Path(os.environ["MLX_NBENGINE_SCREENSHOTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(shot, target / shot.name)
    return Seen(rows, answers, map_rows, static_roots, shot)


def number(text: str) -> int:
    return int(text.replace(",", ""))


def test_a_row_per_api_request_newest_first(seen):
    apis = [r["api"] for r in seen.rows]
    assert apis == ["completions", "chat completions", "chat completions"]
    assert all(r["client"].startswith("openai-python ") for r in seen.rows)
    # The same chat twice is one conversation; the completion starts another.
    assert seen.rows[1]["conversation"] == seen.rows[2]["conversation"] != "-"
    assert seen.rows[0]["conversation"] not in ("-", seen.rows[1]["conversation"])
    assert all(r["finish"] == "length" for r in seen.rows)
    assert all(r["time"].count(":") == 2 for r in seen.rows)


def test_the_rows_figures_are_the_api_usage(seen):
    completion, restored, cold = seen.rows
    assert number(cold["prompt"]) == seen.answers["cold"].prompt_tokens
    assert number(cold["memory"]) + number(cold["disk"]) == 0
    cached = seen.answers["restored"].prompt_tokens_details.cached_tokens
    assert cached > 0
    assert number(restored["memory"]) + number(restored["disk"]) == cached
    assert number(restored["computed"]) == seen.answers["restored"].prompt_tokens - cached
    assert restored["ttft"].endswith("s") and float(restored["tps"].replace(",", "")) > 0


def test_each_row_has_its_block_strip_and_a_click_opens_its_block_map(seen):
    completion, restored, cold = seen.rows
    assert set(cold["kinds"]) <= {"computed", "tail"} and cold["kinds"][-1] == "tail"
    assert {"memory", "disk"} & set(restored["kinds"])
    assert seen.map_rows == len(restored["kinds"])


def test_the_view_is_the_live_widget_and_the_screenshot_is_saved(seen):
    assert seen.static_roots == 0
    assert seen.screenshot.stat().st_size > 10_000

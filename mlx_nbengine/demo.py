"""The main job: `python -m mlx_nbengine demo` tells the product's story in a terminal.

Terms:

- *story*: `notebooks/quickstart.ipynb` (shipped inside the package as
  `mlx_nbengine/examples/quickstart.ipynb`): load a model, ask, a long document prompt,
  the same document with its question edited, the block map, the store view, background
  cells.
- *notebook run* (the default): the story executed headless with nbclient in a kernel of
  this interpreter, a progress line per cell; the executed notebook (outputs and widget
  state), its HTML export (`mlx_nbengine.notebook.export`: the block pictures need no
  kernel and no network) and the kernel's log are written into the output folder. A kernel
  that dies (a native library's SIGILL) ends the run within about a second: one line naming
  the signal and the cell, then the lines of the kernel's log that tell why (the Python stack
  at the fatal signal); Ctrl-C ends it with one line and exit code 130. Either way the kernel
  is shut down and its connection file (in a temporary folder) removed.
- *quick run* (``--quick``): the story's `%%llm` cells sent straight to an `Engine` (no
  kernel, no notebook), with each answer's blocks drawn as one line of letters.
- *row*: one `%%llm` answer of the story: prompt tokens, tokens restored (from memory /
  from disk), tokens computed, time to first token (`summary.answer_facts`). The notebook
  face puts these facts in each answer display's metadata; the notebook run reads them
  back from the saved notebook, the quick run takes them from its completions.
- *document*: answers whose prompts share their first block (the same long document) are
  one document; an answer that restored tokens gets its *speed-up* against the document's
  first answer that restored none (its cold run).

The conversion of a GGUF model (the default model's first use) happens here, before the
story starts, so its progress bar shows in the terminal.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_nbengine.engine import Engine
from mlx_nbengine.engine.results import Report
from mlx_nbengine.models.loader import resolve
from mlx_nbengine.notebook.export import notebook_to_html
from mlx_nbengine.notebook.summary import ANSWER_METADATA_KEY, answer_facts, summary_line

__all__ = [
    "CellFailed",
    "DemoInterrupted",
    "KernelDied",
    "Row",
    "exit_description",
    "quickstart_path",
    "rows_from_notebook",
    "run_notebook",
    "run_quick",
    "table",
]

DEFAULT_OUT = "mlx-nbengine-demo"
CELL_TIMEOUT_S = 1800


def quickstart_path() -> Path:
    """The story notebook: the packaged copy, else the repository's (a source checkout)."""
    packaged = Path(__file__).resolve().parent / "examples" / "quickstart.ipynb"
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


@dataclass
class Row:
    """One `%%llm` answer of the story (see the module docstring)."""

    label: str
    prompt_tokens: int
    from_memory: int
    from_disk: int
    computed: int
    ttft_s: float | None
    document: str | None = None
    speedup: float | None = None

    @property
    def restored(self) -> int:
        return self.from_memory + self.from_disk

    @classmethod
    def from_metadata(cls, label: str, meta: dict[str, Any]) -> Row:
        return cls(
            label=label,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            from_memory=int(meta.get("restored_memory", 0)),
            from_disk=int(meta.get("restored_disk", 0)),
            computed=int(meta.get("computed", 0)),
            ttft_s=meta.get("ttft_s"),
            document=meta.get("document"),
        )


def add_speedups(rows: list[Row]) -> list[Row]:
    """Each re-run's speed-up over its document's cold run (see the module docstring)."""
    cold: dict[str, Row] = {}
    for row in rows:
        if row.document is None or not row.ttft_s:
            continue
        first = cold.get(row.document)
        if row.restored == 0:
            cold.setdefault(row.document, row)
        elif first is not None and first.ttft_s:
            row.speedup = first.ttft_s / row.ttft_s
    return rows


def table(rows: list[Row]) -> str:
    """The closing table, aligned for a terminal."""
    head = ("answer", "prompt", "restored mem/disk", "computed", "first token", "speed-up")
    body = [
        (
            row.label,
            f"{row.prompt_tokens:,}",
            f"{row.from_memory:,} / {row.from_disk:,}",
            f"{row.computed:,}",
            "-" if row.ttft_s is None else f"{row.ttft_s:.2f} s",
            "-" if row.speedup is None else f"{row.speedup:.1f}x",
        )
        for row in rows
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = []
    for i, r in enumerate([head, *body]):
        cells = [r[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell_label(source: str, index: int) -> str:
    first = source.strip().splitlines()[0] if source.strip() else ""
    words = first.split()
    if "-o" in words and words.index("-o") + 1 < len(words):
        return words[words.index("-o") + 1]
    return f"cell {index + 1}"


def rows_from_notebook(nb: Any) -> list[Row]:
    """The story's rows from an executed notebook's answer metadata, in cell order."""
    rows = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.lstrip().startswith("%%llm"):
            continue
        for output in cell.get("outputs", []):
            meta = output.get("metadata", {}).get(ANSWER_METADATA_KEY)
            if meta:
                rows.append(Row.from_metadata(_cell_label(cell.source, index), meta))
    return add_speedups(rows)


# -- the notebook run --------------------------------------------------------------------------


class KernelDied(Exception):
    """The notebook run's kernel died: `line` says how and in which cell, `log_tail` holds
    the lines of its log (`log_path`) that tell why."""

    def __init__(self, line: str, log_tail: list[str], log_path: Path) -> None:
        super().__init__(line)
        self.line, self.log_tail, self.log_path = line, log_tail, log_path


class CellFailed(Exception):
    """A cell of the notebook run raised an error in the kernel (the message names it)."""


class DemoInterrupted(Exception):
    """Ctrl-C (or SIGTERM) stopped the notebook run; `exit_code` is 128 + the signal."""

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.exit_code = exit_code


def exit_description(returncode: int | None) -> str:
    """How a process ended, from its return code: "signal 4: SIGILL", "exit code 1"."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
        return f"signal {-returncode}: {name}"
    return f"exit code {returncode}"


def log_tail(path: Path, n: int = 10) -> list[str]:
    """The kernel log's lines that tell why it died: from its last ``Fatal Python error``
    (the signal and the innermost frames of the stack), else its last lines; `n` non-empty
    lines at most, none when the file cannot be read."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    lines = [line for line in text.splitlines() if line.strip()]
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    return lines[fatal[-1] :][:n] if fatal else lines[-n:]


def prepare_out(out_dir: Path) -> None:
    """Create the output folder (and check it is writable) or say why not: `OSError`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PermissionError(13, "Permission denied", str(out_dir))


# A fatal signal in the kernel (SIGILL, SIGSEGV in a native library) writes the Python
# stacks into the kernel's log (its stderr before ipykernel captured it), which the demo
# shows when the kernel dies. Run at the kernel's start, leaving no names behind.
_FAULT_STACKS = (
    "__import__('faulthandler').enable(__import__('io').open(getattr(__import__('sys').stderr,"
    " '_original_stdstream_copy', None) or 2, 'w', closefd=False), all_threads=False)"
)


def _kernel_manager(workdir: Path, model: str) -> Any:
    # A kernel of this very interpreter, whatever kernelspecs the machine has installed.
    # The asynchronous manager: nbclient then checks every second that the kernel lives (a
    # blocking client would wait out the cell timeout for a kernel that died). Its
    # connection file lives in `workdir`, removed with it whatever happens.
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = workdir / "kernels" / "mlx-nbengine-demo"
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [
            sys.executable,
            "-m",
            "ipykernel_launcher",
            "-f",
            "{connection_file}",
            f"--IPKernelApp.exec_lines={_FAULT_STACKS}",
        ],
        "display_name": "mlx_nbengine demo",
        "language": "python",
        "env": {"MLX_NBENGINE_DEMO_MODEL": model, "TRANSFORMERS_VERBOSITY": "error"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return AsyncKernelManager(
        kernel_name="mlx-nbengine-demo",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(workdir / "kernels")]),
        connection_file=str(workdir / "kernel-connection.json"),
    )


def _with_model(nb: Any, model: str) -> None:
    # The story loads `default`; another model is swapped into its %load_model line.
    if model == "default":
        return
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("%load_model default"):
            cell.source = cell.source.replace("default", json.dumps(model), 1)


def _first_line(source: str, width: int = 48) -> str:
    line = source.strip().splitlines()[0] if source.strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


@dataclass
class _Run:
    """Where the notebook run is: the cell running now, the kernel's process, a signal."""

    where: str = "while starting the kernel"
    process: Any = None
    mid_line: bool = False  # a progress line waits for its time
    stopped_by: int | None = None  # the signal (SIGINT, SIGTERM) that stopped the run

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()


def _stop_signals() -> list[int]:
    # Ctrl-C and SIGTERM stop the run (and shut the kernel down) where Python's defaults are
    # in place; a signal the caller ignores (a background job's SIGINT) stays ignored.
    if threading.current_thread() is not threading.main_thread():
        return []
    wanted = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    return [s for s, default in wanted.items() if signal.getsignal(s) is default]


async def _execute(
    client: Any, km: Any, nb: Any, run: _Run, *, log: Any, cwd: Path, stop: list[int], echo
) -> None:
    """Start the kernel, execute the code cells one by one, shut the kernel down."""
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if run.stopped_by is None and task is not None:
            run.stopped_by = signum
            task.cancel()

    for signum in stop:
        loop.add_signal_handler(signum, on_signal, signum)
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    try:
        await km.start_kernel(stdout=log, stderr=log, cwd=str(cwd))
        run.process = km.provisioner.process
        await client.async_start_new_kernel_client()
        started = time.monotonic()
        for n, index in enumerate(code_cells, 1):
            cell = nb.cells[index]
            run.where = f"at cell {n}: {_first_line(cell.source, 72)}"
            echo(f"[{n:>2}/{len(code_cells)}] {_first_line(cell.source)}", end="", flush=True)
            run.mid_line = True
            t = time.monotonic()
            try:
                await client.async_execute_cell(cell, index, store_history=True)
            except CellExecutionError as e:
                raise CellFailed(f"cell {n} raised {e.ename}: {e.evalue}") from None
            except CellTimeoutError:
                raise CellFailed(f"cell {n} ran past {CELL_TIMEOUT_S} s") from None
            echo(f"  {time.monotonic() - t:.1f} s", flush=True)
            run.mid_line = False
        client.set_widgets_metadata()
        echo(f"ran {len(code_cells)} cells in {time.monotonic() - started:.0f} s")
    finally:
        try:
            await _shut_down(client, km)
        finally:
            for signum in stop:
                loop.remove_signal_handler(signum)


async def _shut_down(client: Any, km: Any) -> None:
    # Gracefully (an interrupt, a shutdown request, then SIGTERM and SIGKILL after
    # `shutdown_wait_time`), then the connection file and sockets go.
    try:
        if km.has_kernel and await km.is_alive():
            await km.shutdown_kernel(now=False)
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
            client.kc = None
        await km.cleanup_resources()


def run_notebook(
    out_dir: Path, *, model: str = "default", notebook: Path | None = None, echo=print
) -> list[Row]:
    """Execute the story notebook into `out_dir` (notebook + HTML); return its rows.

    Raises `KernelDied` within about a second of the kernel's death, `CellFailed` for a
    cell's error and `DemoInterrupted` for Ctrl-C (SIGINT) or SIGTERM; the kernel is shut
    down and its connection file removed in every case.
    """
    import nbformat
    from nbclient import NotebookClient

    source = notebook or quickstart_path()
    nb = nbformat.read(source, as_version=4)
    _with_model(nb, model)
    prepare_out(out_dir)
    log_path = out_dir / "kernel.log"
    run = _Run()
    stop = _stop_signals()
    with tempfile.TemporaryDirectory(prefix="mlx-nbengine-demo-") as tmp:
        km = _kernel_manager(Path(tmp), model)
        km.shutdown_wait_time = 4.0
        client = NotebookClient(
            nb,
            km=km,
            timeout=CELL_TIMEOUT_S,
            store_widget_state=True,
            resources={"metadata": {"path": str(out_dir)}},
        )
        # The kernel's own log lines (transport warnings...) go to a file, not the terminal.
        with open(log_path, "w", encoding="utf-8") as log:
            coroutine = _execute(client, km, nb, run, log=log, cwd=out_dir, stop=stop, echo=echo)
            try:
                asyncio.run(coroutine)
            except BaseException as e:
                if run.mid_line:  # the lines that follow say why it has no time
                    echo("", flush=True)
                if isinstance(e, CellFailed):
                    raise
                if run.stopped_by is not None:
                    name = "interrupted" if run.stopped_by == signal.SIGINT else "terminated"
                    line = f"{name}: the demo stopped {run.where}"
                    raise DemoInterrupted(line, 128 + run.stopped_by) from None
                code = run.returncode()
                if code is None or isinstance(e, KeyboardInterrupt):
                    raise
                where = run.where.replace("at cell", "while running cell", 1)
                line = f"the kernel died ({exit_description(code)}) {where}"
                raise KernelDied(line, log_tail(log_path), log_path) from None
    executed = out_dir / source.name
    nbformat.write(nb, executed)
    html = notebook_to_html(nb, path=executed)
    (out_dir / source.with_suffix(".html").name).write_text(html, encoding="utf-8")
    return rows_from_notebook(nb)


# -- the quick run -----------------------------------------------------------------------------


def _story_cells(notebook: Path) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The story's literal variables (`doc = '''...'''`) and its plain `%%llm` cells."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    names: dict[str, Any] = {}
    cells: list[tuple[str, str]] = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        text = cell.source
        if text.startswith("%%llm"):
            line, _, body = text.partition("\n")
            if "--bg" not in line.split() and "--chat" not in line:
                cells.append((line[len("%%llm") :].strip(), body))
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        names[target.id] = node.value.value
    return names, cells


_LETTERS = {"memory": "M", "disk": "D", "computed": "C"}


def block_letters(report: Report, *, n_prompt: int) -> str:
    """One letter a block: M(emory), D(isk), C(omputed), T(ail, `BlockReport.is_tail`)."""
    letters = []
    for block in report.blocks:
        letters.append("T" if block.is_tail(n_prompt) else _LETTERS.get(block.source, "?"))
    return "".join(letters)


def run_quick(*, model: str = "default", notebook: Path | None = None, echo=print) -> list[Row]:
    """Send the story's `%%llm` cells straight to an engine; return their rows."""
    # Lazy: the magics and prompting import IPython, which only this path needs.
    from mlx_nbengine.notebook.magics import LLMMagics
    from mlx_nbengine.notebook.prompting import (
        build_prompt,
        interpolate,
        parse_options,
        sampling_options,
    )

    names, cells = _story_cells(notebook or quickstart_path())
    rows: list[Row] = []
    with Engine.load(model) as engine:
        raw = not engine.model.has_chat_template
        for index, (line, body) in enumerate(cells):
            args = parse_options(LLMMagics.llm, line, "%%llm")
            text = body.strip()
            if args.interpolate:
                text = interpolate(text, names)
            prompt, _ = build_prompt(text, raw=raw or args.raw, system=args.system)
            done = engine.submit(prompt, **sampling_options(args)).result()
            row = Row.from_metadata(args.output or f"answer {index + 1}", answer_facts(done))
            rows.append(row)
            letters = block_letters(done.report, n_prompt=row.prompt_tokens)
            echo(f"{row.label:<10} {letters}  {summary_line(done)}")
    echo("blocks: M from memory, D from disk, C computed, T the tail (always computed)")
    return add_speedups(rows)


def main(args: Any) -> int:
    """`python -m mlx_nbengine demo [--quick] [--out DIR] [--model M] [--notebook NB]`.

    Every way the run can end early is one line on stderr and a non-zero exit: a folder
    that cannot be created (before any model is resolved), a kernel that died (with the
    lines of its log that tell why), a cell's error, Ctrl-C (130), SIGTERM (143).
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    echo = print
    notebook = Path(args.notebook) if getattr(args, "notebook", None) else None
    if notebook is not None and not notebook.is_file():
        print(f"error: no notebook at {notebook}", file=sys.stderr)
        return 1
    out = Path(args.out)
    if not args.quick:
        try:
            prepare_out(out)
        except OSError as e:
            print(
                f"error: cannot create the output folder {out}: {e.strerror or e}", file=sys.stderr
            )
            return 1
    # Converting first, here, shows the conversion's progress bar in this terminal.
    resolve(args.model)
    if args.quick:
        rows = run_quick(model=args.model, notebook=notebook, echo=echo)
    else:
        try:
            rows = run_notebook(out, model=args.model, notebook=notebook, echo=echo)
        except KernelDied as e:
            sys.stdout.flush()
            print(e.line, file=sys.stderr)
            if e.log_tail:
                print(f"from its log ({e.log_path}):", file=sys.stderr)
                for line in e.log_tail:
                    print(f"  {line}", file=sys.stderr)
            return 1
        except CellFailed as e:
            sys.stdout.flush()
            print(f"error: {e}", file=sys.stderr)
            return 1
        except DemoInterrupted as e:
            sys.stdout.flush()
            print(e, file=sys.stderr)
            return e.exit_code
        name = (notebook or quickstart_path()).stem
        echo(f"wrote {out / (name + '.ipynb')} and {out / (name + '.html')}")
    if rows:
        echo("")
        echo(table(rows))
    return 0

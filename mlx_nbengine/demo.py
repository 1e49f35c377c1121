"""The main job: `python -m mlx_nbengine demo` tells the product's story in a terminal.

Terms:

- *story*: `notebooks/quickstart.ipynb` (shipped inside the package as
  `mlx_nbengine/examples/quickstart.ipynb`): load a model, ask, a long document prompt,
  the same document with its question edited, the block map, the store view, background
  cells.
- *notebook run* (the default): the story executed headless with nbclient in a kernel of
  this interpreter, a progress line per cell; the executed notebook (outputs and widget
  state), its HTML export (`mlx_nbengine.notebook.export`: the block pictures need no
  kernel and no network) and the kernel's log are written into the output folder.
- *quick run* (``--quick``): the story's `%%llm` cells sent straight to an `Engine` (no
  kernel, no notebook), with each answer's blocks drawn as one line of letters.
- *row*: one `%%llm` answer of the story: prompt tokens, tokens restored (from memory /
  from disk), tokens computed, time to first token (`render.answer_facts`). The notebook
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
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_nbengine.notebook.render import ANSWER_METADATA_KEY, answer_facts

__all__ = [
    "Row",
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


def _kernel_manager(workdir: Path, model: str) -> Any:
    # A kernel of this very interpreter, whatever kernelspecs the machine has installed.
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = workdir / "kernels" / "mlx-nbengine-demo"
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mlx_nbengine demo",
        "language": "python",
        "env": {"MLX_NBENGINE_DEMO_MODEL": model, "TRANSFORMERS_VERBOSITY": "error"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelManager(
        kernel_name="mlx-nbengine-demo",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(workdir / "kernels")]),
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


def run_notebook(
    out_dir: Path, *, model: str = "default", notebook: Path | None = None, echo=print
) -> list[Row]:
    """Execute the story notebook into `out_dir` (notebook + HTML); return its rows."""
    import nbformat
    from nbclient import NotebookClient

    from mlx_nbengine.notebook.export import notebook_to_html

    source = notebook or quickstart_path()
    nb = nbformat.read(source, as_version=4)
    _with_model(nb, model)
    out_dir.mkdir(parents=True, exist_ok=True)
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    with tempfile.TemporaryDirectory(prefix="mlx-nbengine-demo-") as tmp:
        client = NotebookClient(
            nb,
            km=_kernel_manager(Path(tmp), model),
            timeout=CELL_TIMEOUT_S,
            store_widget_state=True,
            resources={"metadata": {"path": str(out_dir)}},
        )
        started = time.monotonic()
        # The kernel's own log lines (transport warnings...) go to a file, not the terminal.
        log = open(out_dir / "kernel.log", "w", encoding="utf-8")
        with log, client.setup_kernel(stdout=log, stderr=log):
            for n, index in enumerate(code_cells, 1):
                cell = nb.cells[index]
                echo(f"[{n:>2}/{len(code_cells)}] {_first_line(cell.source)}", end="", flush=True)
                t = time.monotonic()
                client.execute_cell(cell, index, store_history=True)
                echo(f"  {time.monotonic() - t:.1f} s")
            client.set_widgets_metadata()
        echo(f"ran {len(code_cells)} cells in {time.monotonic() - started:.0f} s")
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


def block_letters(report: Any, *, n_prompt: int, block_size: int) -> str:
    """One letter a block: M(emory), D(isk), C(omputed), T(ail, the last block)."""
    letters = []
    n_blocks = -(-n_prompt // block_size)
    for block in report.blocks:
        tail = block.source == "computed" and block.index == n_blocks - 1
        letters.append("T" if tail else _LETTERS.get(block.source, "?"))
    return "".join(letters)


def run_quick(*, model: str = "default", notebook: Path | None = None, echo=print) -> list[Row]:
    """Send the story's `%%llm` cells straight to an engine; return their rows."""
    from mlx_nbengine.engine import Engine
    from mlx_nbengine.notebook.magics import LLMMagics
    from mlx_nbengine.notebook.prompting import (
        build_prompt,
        interpolate,
        parse_options,
        sampling_options,
    )
    from mlx_nbengine.notebook.render import summary_line

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
            letters = block_letters(
                done.report, n_prompt=row.prompt_tokens, block_size=engine.block_size
            )
            echo(f"{row.label:<10} {letters}  {summary_line(done)}")
    echo("blocks: M from memory, D from disk, C computed, T the tail (always computed)")
    return add_speedups(rows)


def main(args: Any) -> int:
    """`python -m mlx_nbengine demo [--quick] [--out DIR] [--model M]`."""
    from mlx_nbengine.models.loader import resolve

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    echo = print
    # Converting first, here, shows the conversion's progress bar in this terminal.
    resolve(args.model)
    if args.quick:
        rows = run_quick(model=args.model, echo=echo)
    else:
        out = Path(args.out)
        rows = run_notebook(out, model=args.model, echo=echo)
        echo(f"wrote {out / 'quickstart.ipynb'} and {out / 'quickstart.html'}")
    echo("")
    echo(table(rows))
    return 0

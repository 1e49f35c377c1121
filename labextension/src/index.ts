// mlx-nbengine's JupyterLab / Notebook 7 extension.
//
// 1. A `%%llm` cell's body is a prompt, not Python: JupyterLab edits a code cell in the
//    kernel's language, so it indents after a line ending in `:` (spaces the model then
//    reads) and colours words like `is` and `for`. Every code cell whose first line starts
//    with `%%llm` gets the plain-text mime type instead (no highlighting, and a new line
//    keeps the previous line's indent); when the first line changes back, the cell gets the
//    notebook's own mime type again. No other cell is touched.
// 2. The stop button of a foreground `%%llm` answer: the kernel's main thread is busy with
//    that cell, so the widget cannot be heard; it sends the DOM event `STOP_EVENT` and this
//    extension interrupts the kernel of the notebook holding it, as Kernel > Interrupt does.

import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICellModel } from '@jupyterlab/cells';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';

const PLAIN = 'text/plain';
const LLM_CELL = /^%%llm(\s|$)/;
const STOP_EVENT = 'mnb-stop';

// The cells this extension made plain text (to give them their mime type back).
const madePlain = new WeakSet<ICellModel>();

function follow(cell: ICellModel, panel: NotebookPanel): void {
  if (cell.type !== 'code') {
    return;
  }
  const update = (): void => {
    if (LLM_CELL.test(cell.sharedModel.getSource())) {
      madePlain.add(cell);
      if (cell.mimeType !== PLAIN) {
        cell.mimeType = PLAIN;
      }
    } else if (madePlain.has(cell)) {
      madePlain.delete(cell);
      cell.mimeType = panel.content.codeMimetype;
    }
  };
  cell.contentChanged.connect(update);
  // The notebook sets every code cell's mime type when a cell is added or the kernel's
  // language arrives; a `%%llm` cell goes back to plain text at once.
  cell.mimeTypeChanged.connect(update);
  update();
}

function watch(panel: NotebookPanel): void {
  const attach = (): void => {
    const model = panel.content.model;
    if (!model) {
      return;
    }
    for (const cell of model.cells) {
      follow(cell, panel);
    }
    model.cells.changed.connect((_, change) => {
      if (change.type === 'add' || change.type === 'set') {
        for (const cell of change.newValues) {
          follow(cell, panel);
        }
      }
    });
  };
  panel.content.modelChanged.connect(attach);
  attach();
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'mlx-nbengine:llm-cells',
  description: 'Edits %%llm cells as plain text; stop buttons interrupt their kernel.',
  autoStart: true,
  requires: [INotebookTracker],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker): void => {
    tracker.forEach(watch);
    tracker.widgetAdded.connect((_, panel) => watch(panel));
    document.addEventListener(STOP_EVENT, event => {
      const target = event.target;
      let found: NotebookPanel | null = null;
      tracker.forEach(panel => {
        if (target instanceof Node && panel.node.contains(target)) {
          found = panel;
        }
      });
      const kernel = (found as NotebookPanel | null)?.sessionContext.session?.kernel;
      if (kernel) {
        event.preventDefault();
        void kernel.interrupt();
      }
    });
  }
};

export default plugin;

// mlx_nbengine widgets: the behaviour of the block strip, block map and store view.
//
// Python draws every picture (mlx_nbengine/notebook/pictures.py and storepicture.py) and
// sends its HTML in the model's `markup`. This module puts that HTML on the page and, when
// it changes, patches the page in place: an element that keeps its tag keeps its node, so
// a strip's cells stay put while a prefill fills them in. It adds only what needs a
// browser: the strip's hover thumbnails (`previews`), the map's details panel on hover or
// click (`details`) and the scroll of its tall box. It holds no words: every phrase shown
// comes from Python. The model's `_behaviour` says which behaviour to add.

// The first element of `html`, parsed (null for none).
function parse(html) {
  const template = document.createElement("template");
  template.innerHTML = html || "";
  return template.content.firstElementChild;
}

// Make `node` look like `next`: same attributes and children, reusing every node whose
// tag (or text) still fits. Nodes this module added itself (`mnbOwn`) are left alone.
function patch(node, next) {
  if (node.nodeName !== next.nodeName) {
    node.replaceWith(next);
    return;
  }
  if (node.nodeType !== Node.ELEMENT_NODE) {
    if (node.nodeValue !== next.nodeValue) node.nodeValue = next.nodeValue;
    return;
  }
  for (const { name } of [...node.attributes]) {
    if (!next.hasAttribute(name)) node.removeAttribute(name);
  }
  for (const { name, value } of [...next.attributes]) {
    if (node.getAttribute(name) !== value) node.setAttribute(name, value);
  }
  const old = [...node.childNodes].filter((child) => !child.mnbOwn);
  const fresh = [...next.childNodes];
  fresh.forEach((child, i) => (i < old.length ? patch(old[i], child) : node.append(child)));
  for (const child of old.slice(fresh.length)) child.remove();
}

// --- strip --------------------------------------------------------------------------------

// Stop asks the kernel to stop the answer. A foreground answer's kernel is busy following
// it and hears no widget message, so the page's lab extension (labextension/) interrupts
// that notebook's kernel on the `mnb-stop` event, as Kernel > Interrupt does; a --bg
// answer's kernel is free, and the message reaches it. Copy puts the answer on the
// clipboard as the model wrote it, and says so for a moment.
function buttons(model, root) {
  const bar = document.createElement("div");
  bar.mnbOwn = true;
  root.append(bar);
  const draw = () => {
    const next = parse(model.get("controls"));
    if (!next) bar.replaceChildren();
    else if (bar.firstElementChild) patch(bar.firstElementChild, next);
    else bar.append(next);
  };
  const stop = (button) => {
    button.disabled = true; // a second interrupt would cut the wait for the partial answer
    if (model.get("stop_by") === "interrupt") {
      const event = new CustomEvent("mnb-stop", { bubbles: true, cancelable: true });
      if (!root.dispatchEvent(event)) return; // the extension interrupted the kernel
    }
    model.send({ action: "stop" });
  };
  const copied = (button) => {
    const label = button.textContent;
    button.textContent = button.dataset.done || label;
    setTimeout(() => (button.textContent = label), 1500);
  };
  const copy = (button) => {
    const text = model.get("answer") || "";
    const fallback = () => {
      const area = document.createElement("textarea");
      area.value = text;
      area.style.position = "fixed";
      area.style.opacity = "0";
      document.body.append(area);
      area.select();
      if (document.execCommand("copy")) copied(button);
      area.remove();
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(() => copied(button), fallback);
    } else fallback();
  };
  // Stop acts on the press, not the click: while the answer streams above it the button
  // moves down, and a release that lands after the next redraw falls on something else (no
  // click). The press disables it, so the click that may follow does nothing; a key press
  // (Enter, Space) still clicks it.
  const act = (event, stopOnly) => {
    const button = event.target.closest("button[data-action]");
    if (!button || button.disabled) return;
    if (button.dataset.action === "stop") stop(button);
    else if (button.dataset.action === "copy" && !stopOnly) copy(button);
  };
  bar.addEventListener("pointerdown", (event) => {
    if (event.button === 0) act(event, true);
  });
  bar.addEventListener("click", (event) => act(event, false));
  model.on("change:controls", draw);
  draw();
  return () => model.off("change:controls", draw);
}

// The strip's hover box: over an image block's cell, the thumbnails of its images. It
// floats on the page (fixed, a child of the document's body: the output area clips what
// overflows it), just above the cell, or below it where the window has no room above,
// kept inside the window, following the cell when the page scrolls; hidden elsewhere.
function strip(model, root) {
  const cleanup = buttons(model, root);
  const preview = document.createElement("div");
  preview.className = "mnb-root mnb-preview";
  preview.hidden = true;
  preview.setAttribute("aria-hidden", "true");
  preview.mnbStrip = root; // which strip it belongs to (tests find it so)
  document.body.append(preview);
  let current = null; // the cell whose images the preview shows
  const hide = () => {
    preview.hidden = true;
    current = null;
  };
  const place = () => {
    if (!current) return;
    const cell = current;
    const gap = 4;
    const box = cell.getBoundingClientRect();
    const { offsetWidth: width, offsetHeight: height } = preview;
    const above = box.top - gap - height;
    const top = above >= gap ? above : Math.min(box.bottom + gap, innerHeight - height - gap);
    const left = Math.min(box.left, innerWidth - width - gap);
    preview.style.left = `${Math.max(gap, left)}px`;
    preview.style.top = `${Math.max(gap, top)}px`;
  };
  const show = (cell) => {
    const ids = (cell.getAttribute("data-image") || "").split(" ").filter(Boolean);
    if (!ids.length) return hide();
    const thumbs = model.get("previews") || {};
    preview.innerHTML = ids.map((i) => thumbs[i] || "").join("");
    preview.hidden = false;
    current = cell;
    place();
  };
  // The block map under the same answer (`--blocks`), and its row for a cell.
  const mapRow = (cell) => {
    const outputs = root.closest(".jp-OutputArea");
    const index = cell.getAttribute("data-index");
    return outputs && outputs.querySelector(`.mnb-map tr.mnb-block[data-index="${index}"]`);
  };
  root.addEventListener("mouseover", (event) => {
    const cell = event.target.closest(".mnb-block");
    if (cell && root.contains(cell)) {
      show(cell);
      const row = mapRow(cell); // the map's details panel shows it too
      if (row) row.dispatchEvent(new MouseEvent("mouseover", { bubbles: true }));
    } else hide();
  });
  root.addEventListener("mouseleave", () => {
    hide();
    const map = root.closest(".jp-OutputArea")?.querySelector(".mnb-map");
    if (map) map.dispatchEvent(new MouseEvent("mouseleave"));
  });
  // A click selects the block in the map (a second click lets it go), as a row click does.
  root.addEventListener("click", (event) => {
    const cell = event.target.closest(".mnb-block");
    const row = cell && root.contains(cell) && mapRow(cell);
    if (!row) return;
    row.click();
    row.scrollIntoView({ block: "nearest" });
  });
  addEventListener("scroll", place, true); // the cell moved: the preview follows
  preview.addEventListener("load", place, true); // a thumbnail decoded: its size is known
  return {
    cleanup: () => {
      cleanup();
      removeEventListener("scroll", place, true);
      preview.remove();
    },
  };
}

// --- map ----------------------------------------------------------------------------------

// Hover shows a block in the details panel; a click (or Enter, or Space) pins it, a second
// click unpins it. With nothing pinned the panel shows Python's default (the edited block).
function map(model, root) {
  let selected = null;
  let observer = null;
  const show = (index) => {
    const panel = root.querySelector(".mnb-details");
    const details = model.get("details") || {};
    const next = parse(details[index === null ? "" : String(index)] ?? details[""]);
    if (panel && next) patch(panel, next);
  };
  const select = (index) => {
    selected = index;
    for (const row of root.querySelectorAll("tr.mnb-block")) {
      if (Number(row.dataset.index) === index) row.setAttribute("aria-selected", "true");
      else row.removeAttribute("aria-selected");
    }
    show(index);
  };
  const rowOf = (event) => {
    const row = event.target.closest("tr.mnb-block[data-index]");
    return row && root.contains(row) ? Number(row.dataset.index) : null;
  };
  const onOver = (event) => {
    const index = rowOf(event);
    if (index !== null) show(index);
    else if (!event.target.closest(".mnb-scroll")) show(selected);
  };
  const onClick = (event) => {
    const index = rowOf(event);
    if (index !== null) select(selected === index ? null : index);
  };
  root.addEventListener("mouseover", onOver);
  root.addEventListener("focusin", onOver);
  root.addEventListener("mouseleave", () => show(selected));
  root.addEventListener("click", onClick);
  root.addEventListener("keydown", (event) => {
    if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      onClick(event);
    }
  });
  const update = () => {
    const known = root.querySelector(`tr.mnb-block[data-index="${selected}"]`);
    select(known ? selected : null);
    if (observer) observer.disconnect();
    const box = root.querySelector(".mnb-scroll[data-tall]");
    const row = box && box.querySelector("tr.mnb-block[data-open]");
    observer = row ? openAt(box, row, [...box.querySelectorAll("tr.mnb-block")].at(-1)) : null;
  };
  update();
  return { update, cleanup: () => observer && observer.disconnect() };
}

// Scroll the tall rows' box (only it, never the page) so that `row` sits near its top: up
// to three rows of restored context above it, fewer where that would push the `last` row
// (the tail) out of sight. The box has no size until it is on the page, so wait for one;
// returns the observer waiting (null when done at once).
function openAt(box, row, last) {
  const place = () => {
    const head = box.querySelector("thead");
    const headHeight = head ? head.getBoundingClientRect().height : 0;
    const top = row.getBoundingClientRect().top;
    const span = last.getBoundingClientRect().bottom - top;
    const room = box.clientHeight - headHeight - span;
    const context = Math.max(0, Math.min(3 * row.getBoundingClientRect().height, room));
    box.scrollTop += top - box.getBoundingClientRect().top - headHeight - context;
  };
  if (box.isConnected && box.clientHeight) {
    place();
    return null;
  }
  const observer = new ResizeObserver(() => {
    if (box.clientHeight) {
      observer.disconnect();
      place();
    }
  });
  observer.observe(box);
  return observer;
}

// --- entry point --------------------------------------------------------------------------

const BEHAVIOURS = { strip, map, store: () => ({}) };

function render({ model, el }) {
  const root = parse(model.get("markup")) || document.createElement("div");
  el.append(root);
  const behaviour = (BEHAVIOURS[model.get("_behaviour")] || BEHAVIOURS.store)(model, root);
  const update = () => {
    const next = parse(model.get("markup"));
    if (next) patch(root, next);
    if (behaviour.update) behaviour.update();
  };
  model.on("change:markup", update);
  return () => {
    model.off("change:markup", update);
    if (behaviour.cleanup) behaviour.cleanup();
  };
}

export default { render };

// mlx_nbengine widgets: block strip, block map and store view (one anywidget ES module).
//
// The Python traitlets are the truth; this module only draws them, with the same DOM
// (class names and data- attributes) as the static HTML that mlx_nbengine/notebook/widgets.py
// writes, so browser tests and exported notebooks share selectors. The model's `_kind`
// says which picture to draw. Model text is only ever set as text (never as HTML).

const KINDS = [
  ["memory", "M", "memory"],
  ["disk", "D", "disk"],
  ["computed", "C", "computed"],
  ["tail", "T", "tail"],
  ["pending", "", "pending"],
];
const LETTER = Object.fromEntries(KINDS.map(([kind, letter]) => [kind, letter]));

const REASONS = {
  hot: "kept in memory from the previous request",
  new: "never seen",
  edited: "edited",
  evicted: "evicted from the store",
  store_off: "no block store",
  after_miss: "after a computed block",
  tail: "last tokens, computed to start the answer",
  window: "window or state records dropped",
  none: "nothing to read",
};

// Above this many blocks the cells shrink and drop their letters.
const DENSE_BLOCKS = 256;

const FIGURES = [
  ["blocks_held", "blocks held"],
  ["bytes_held", "bytes held"],
  ["file_size", "scratch file"],
  ["blocks_restored", "blocks restored"],
  ["blocks_computed", "blocks computed"],
  ["blocks_evicted", "blocks evicted"],
  ["requests", "requests"],
];

// [history key, label, colour variable, SVG dash pattern]: the dash patterns tell the
// lines apart without colour; the legend draws the same ones.
const SERIES = [
  ["restored", "restored", "--mnb-disk", ""],
  ["computed", "computed", "--mnb-computed", "7 3"],
  ["evicted", "evicted", "--mnb-evicted", "2 2"],
];

// The request axis labels every request up to ALL_TICKS of them, else about AXIS_TICKS.
const ALL_TICKS = 12;
const AXIS_TICKS = 6;

// Above this many rows the live map's rows scroll in a tall box that opens at the first
// computed block; up to it every row shows, the edited and tail ones included.
const TALL_ROWS = 40;

// --- formatting ---------------------------------------------------------------------------

const int = (n) => Math.trunc(Number(n) || 0).toLocaleString("en-US");

function bytes(n) {
  let value = Number(n) || 0;
  for (const unit of ["B", "KiB", "MiB", "GiB", "TiB"]) {
    if (Math.abs(value) < 1024 || unit === "TiB") {
      return unit === "B" ? `${Math.trunc(value)} B` : `${value.toFixed(1)} ${unit}`;
    }
    value /= 1024;
  }
}

function seconds(s) {
  s = Number(s) || 0;
  if (s < 0.01) return `${(s * 1000).toFixed(1)} ms`;
  if (s < 59.995) return `${s.toFixed(2)} s`;
  const whole = Math.round(s);
  return `${Math.floor(whole / 60)} min ${whole % 60} s`;
}

// `v` with `digits` decimals, halves rounded up: as the static HTML writes it (Python's
// format and toFixed round some halves apart).
function fixed(v, digits) {
  const scale = 10 ** digits;
  return (Math.floor(v * scale + 0.5) / scale).toFixed(digits);
}

const plural = (n, word) => `${int(n)} ${n === 1 ? word : word + "s"}`;

const kindOf = (block) => String(block.kind || block.source || "pending");

// [restored, computed] tokens of a block; a memory or disk block without a count (a dict
// saved before token-exact restore) is restored whole.
function tokenSplit(block) {
  const whole = (v) => Math.trunc(Number(v) || 0);
  const length = Math.max(0, whole(block.end) - whole(block.start));
  let restored = whole(block.restored);
  if (!restored) restored = block.source === "memory" || block.source === "disk" ? length : 0;
  restored = Math.min(length, Math.max(0, restored));
  return [restored, length - restored];
}

// Tokens restored of a partly restored block (computed, its first tokens restored); else 0.
function partly(block) {
  if (!block || block.source === "memory" || block.source === "disk") return 0;
  const [restored, computed] = tokenSplit(block);
  return computed ? restored : 0;
}

// Where a partly restored block's restored tokens came from (null for another block): the
// source of the block before it (one prefix, one source), disk for a prompt's first block.
function partOf(block, before) {
  if (!partly(block)) return null;
  const source = before ? before.source : null;
  return source === "memory" || source === "disk" ? source : "disk";
}

function splitWords(block) {
  const [restored, computed] = tokenSplit(block);
  return `${int(restored)} restored + ${int(computed)} computed`;
}

// withPart false leaves out a partly restored block's "(first n tokens restored)", where
// the words around the phrase say so already.
function reasonPhrase(block, edit, withPart = true) {
  const reason = String(block.reason || "");
  let phrase = reason;
  if (reason === "edited" && edit && edit.block === block.index) {
    phrase = `edited at token ${int(edit.position)}`;
  } else if (reason in REASONS) {
    phrase = REASONS[reason];
  } else if (block.source === "disk" && reason) {
    phrase = "read " + reason.split("+").join(" + ");
  }
  const restored = withPart ? partly(block) : 0;
  if (restored) {
    const first = restored === 1 ? "first token" : `first ${int(restored)} tokens`;
    phrase = phrase ? `${phrase} (${first} restored)` : `${first} restored`;
  }
  return phrase;
}

function words(block) {
  const head = block.head || "";
  const last = block.last || "";
  if (head && last) return `“${head} … ${last}”`;
  return head || last ? `“${head || last}”` : "";
}

function tip(block, edit) {
  let source = String(block.source || "");
  if (partly(block)) {
    const [restored, computed] = tokenSplit(block);
    source =
      `${int(restored)} of ${int(restored + computed)} tokens restored, ` +
      `${int(computed)} computed`;
  }
  const parts = [`block ${block.index}`, `tokens ${int(block.start)}–${int(block.end)}`, source];
  const phrase = reasonPhrase(block, edit, false);
  if (phrase) parts.push(phrase);
  parts.push(seconds(block.seconds));
  const text = words(block);
  if (text) parts.push(text);
  return parts.join(" · ");
}

// --- images -------------------------------------------------------------------------------

// The indices of the images whose tokens overlap `block` (its dict's `images`), sorted.
function imageIds(block) {
  if (!block) return [];
  return [...new Set((block.images || []).map((i) => Math.trunc(Number(i))))].sort((a, b) => a - b);
}

// The image dict of `index` among the widget's `images` (undefined when not known).
function imageOf(index, images) {
  return (images || []).find((im, i) => Number(im.index ?? i) === index);
}

// "image 1: cat.png" (or "image 1" where the image's name is not known).
function imageLabel(index, images) {
  const name = String(imageOf(index, images)?.name || "");
  return name ? `image ${index + 1}: ${name}` : `image ${index + 1}`;
}

const imageTip = (block, images) => imageIds(block).map((i) => imageLabel(i, images)).join(", ");

// A thumbnail with its caption ("cat.png · 640x480"); the caption alone without a picture.
function thumb(index, images) {
  const image = imageOf(index, images);
  const label = imageLabel(index, images);
  const caption = image
    ? `${image.name || `image ${index + 1}`} · ${int(image.width)}x${int(image.height)}`
    : label;
  const src = image && String(image.src || "").startsWith("data:image/") ? image.src : null;
  return h(
    "figure",
    { class: "mnb-thumb", "data-image-index": index },
    src ? h("img", { src, alt: label, title: label }) : "",
    h("figcaption", {}, caption),
  );
}

// A map row's marks of the images its block holds: "image 1"... (name on hover).
function imageChips(block, images) {
  return imageIds(block).map((i) => [
    h(
      "span",
      { class: "mnb-img-chip", "data-image-index": i, title: imageLabel(i, images) },
      h("span", { class: "mnb-img-mark", "aria-hidden": "true" }),
      `image ${i + 1}`,
    ),
    " ",
  ]);
}

// Each record kind once, in the order kv, window, state (others after, as met).
function recordKinds(layerKinds) {
  const order = ["kv", "window", "state"];
  const rank = (k) => (order.includes(k) ? order.indexOf(k) : order.length);
  return [...new Set(layerKinds.map(String))].sort((a, b) => rank(a) - rank(b));
}

// --- DOM ----------------------------------------------------------------------------------

// h("div", {class: "x", "data-kind": "disk"}, "text", child...): strings become text nodes.
function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined && value !== false) {
      node.setAttribute(name, String(value));
    }
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === "") continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const SVG = "http://www.w3.org/2000/svg";

function s(tag, attrs = {}, text = "") {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text) node.textContent = text;
  return node;
}

function byIndex(blocks) {
  const known = new Map();
  for (const block of blocks || []) known.set(Number(block.index), block);
  return known;
}

function kindCounts(blocks, nBlocks) {
  const counts = Object.fromEntries(KINDS.map(([kind]) => [kind, 0]));
  for (const block of blocks || []) counts[kindOf(block)] = (counts[kindOf(block)] || 0) + 1;
  const known = (blocks || []).length;
  counts.pending = Math.max(0, nBlocks - known);
  return counts;
}

// A partly restored block's restored share: a fill from the bottom of its cell.
function fill(share) {
  return h("span", { class: "mnb-fill", style: `--mnb-share: ${fixed(share, 3)}` });
}

function share(block) {
  const [restored, computed] = tokenSplit(block);
  return restored / Math.max(1, restored + computed);
}

// One key per kind with its count; a key for the partly restored blocks when there are
// (`parts`: each one's part), its swatch filled like theirs; a key for the `nImages` image
// blocks when there are.
function legend(counts, parts = [], nImages = 0) {
  const keys = KINDS.map(([kind, letter, label]) =>
    h(
      "span",
      { class: "mnb-key", "data-kind": kind, "data-count": counts[kind] || 0 },
      h("span", { class: "mnb-swatch", "data-kind": kind }, letter),
      `${label} `,
      h("b", { class: "mnb-count" }, int(counts[kind] || 0)),
    ),
  );
  if (parts.length) {
    keys.push(
      h(
        "span",
        { class: "mnb-key", "data-part": parts[0], "data-count": parts.length },
        h(
          "span",
          { class: "mnb-swatch", "data-kind": "computed", "data-part": parts[0] },
          fill(0.5),
        ),
        "partly restored ",
        h("b", { class: "mnb-count" }, int(parts.length)),
      ),
    );
  }
  if (nImages) {
    keys.push(
      h(
        "span",
        { class: "mnb-key", "data-images": "true", "data-count": nImages },
        h("span", { class: "mnb-img-mark", "aria-hidden": "true" }),
        "image blocks ",
        h("b", { class: "mnb-count" }, int(nImages)),
      ),
    );
  }
  return h("div", { class: "mnb-legend" }, keys);
}

function editBox(edit) {
  if (!edit) return null;
  return h(
    "div",
    { class: "mnb-edit", "data-position": edit.position, "data-block": edit.block },
    h(
      "span",
      { class: "mnb-edit-label" },
      `first change at token ${int(edit.position)} (block ${edit.block})`,
    ),
    " ",
    h(
      "span",
      { class: "mnb-edit-words" },
      "…",
      h("span", { class: "mnb-before" }, edit.before || ""),
      h("span", { class: "mnb-caret", "aria-label": "changed here" }, "▍"),
      h("span", { class: "mnb-after" }, edit.after || ""),
      "…",
    ),
    " ",
    h("span", { class: "mnb-edit-note" }, "blocks from here on were recomputed"),
  );
}

// Set one cell's look from its block (or pending) and the block before it; touch only
// what changed.
function paintCell(cell, index, block, edit, before, images) {
  const kind = block ? kindOf(block) : "pending";
  const part = block ? partOf(block, before) : null;
  const ids = imageIds(block);
  let title = block ? tip(block, edit) : `block ${index} · pending`;
  if (ids.length) title += ` · ${imageTip(block, images)}`;
  const attrs = {
    "data-kind": kind,
    "data-reason": block ? String(block.reason || "") : "",
    "data-edit": block && edit && edit.block === index ? "true" : null,
    "data-restored": block ? String(tokenSplit(block)[0]) : null,
    "data-part": part,
    "data-image": ids.length ? ids.join(" ") : null,
    title,
  };
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null) cell.removeAttribute(name);
    else if (cell.getAttribute(name) !== value) cell.setAttribute(name, value);
  }
  const letter = block ? (LETTER[kind] ?? "?") : "";
  const look = part ? `${letter}|${fixed(share(block), 3)}` : letter;
  if (cell.mnbLook !== look) {
    cell.mnbLook = look;
    cell.replaceChildren(...(part ? [fill(share(block))] : []), letter);
  }
}

function cellGrid(n) {
  const grid = h("div", { class: n > DENSE_BLOCKS ? "mnb-cells mnb-dense" : "mnb-cells" });
  const cells = [];
  for (let i = 0; i < n; i++) {
    const cell = h("div", { class: "mnb-block", "data-index": i });
    cells.push(cell);
    grid.append(cell);
  }
  return { grid, cells };
}

// --- strip --------------------------------------------------------------------------------

// The strip's hover box: over an image block's cell, the thumbnails of its images, just
// under the cell (kept inside the strip); hidden elsewhere.
function watchImages(root, state) {
  const show = (cell) => {
    const ids = (cell.getAttribute("data-image") || "").split(" ").filter(Boolean).map(Number);
    if (!ids.length) return hide();
    state.preview.replaceChildren(...ids.map((i) => thumb(i, state.images)));
    state.preview.hidden = false;
    const maxLeft = Math.max(0, root.clientWidth - state.preview.offsetWidth);
    state.preview.style.left = `${Math.min(cell.offsetLeft, maxLeft)}px`;
    state.preview.style.top = `${cell.offsetTop + cell.offsetHeight + 4}px`;
  };
  const hide = () => {
    state.preview.hidden = true;
  };
  root.addEventListener("mouseover", (event) => {
    const cell = event.target.closest(".mnb-block");
    if (cell && root.contains(cell)) show(cell);
    else hide();
  });
  root.addEventListener("mouseleave", hide);
}

function drawStrip(model, root, state) {
  const blocks = model.get("blocks") || [];
  const edit = model.get("edit");
  const images = model.get("images") || [];
  state.images = images;
  if (!state.preview) {
    state.preview = h("div", { class: "mnb-preview", hidden: true, "aria-hidden": "true" });
    watchImages(root, state);
  }
  const known = byIndex(blocks);
  const n = Math.max(model.get("n_blocks") || 0, known.size ? Math.max(...known.keys()) + 1 : 0);
  if (state.n !== n) {
    // Lay out every cell at once, so the strip does not move while blocks arrive.
    state.n = n;
    const { grid, cells } = cellGrid(n);
    state.cells = cells;
    state.foot = h("div", { class: "mnb-foot" });
    state.edit = h("div");
    root.replaceChildren(grid, state.foot, state.edit, state.preview);
    root.setAttribute("data-n-blocks", n);
  }
  state.cells.forEach((cell, i) =>
    paintCell(cell, i, known.get(i), edit, known.get(i - 1), images),
  );
  const parts = [...known.keys()]
    .sort((a, b) => a - b)
    .map((i) => partOf(known.get(i), known.get(i - 1)))
    .filter(Boolean);
  let caption = plural(n, "block");
  const blockSize = model.get("block_size");
  const promptTokens = model.get("prompt_tokens");
  if (blockSize) caption += ` of ${int(blockSize)} tokens`;
  if (promptTokens) caption += ` · ${plural(promptTokens, "prompt token")}`;
  const nImages = blocks.filter((block) => imageIds(block).length).length;
  state.foot.replaceChildren(
    legend(kindCounts(blocks, n), parts, nImages),
    h("span", { class: "mnb-caption" }, caption),
  );
  // show_edit false: the cell stays marked, the banner is left to a block map below.
  const box = model.get("show_edit") === false ? null : editBox(edit);
  state.edit.replaceWith((state.edit = box || h("div", { hidden: true })));
}

// --- map ----------------------------------------------------------------------------------

function recordChips(block, layerKinds) {
  const records = (block.records || []).map(String);
  if (block.source !== "disk") return [h("span", { class: "mnb-dim" }, "—")];
  const kinds = layerKinds.length ? layerKinds : records;
  return kinds.map((kind) => {
    const read = records.includes(kind);
    return h(
      "span",
      {
        class: "mnb-rec",
        "data-record": kind,
        "data-read": String(read),
        title: `${kind} records ${read ? "read" : "not needed"}`,
      },
      kind,
    );
  });
}

function textCell(block, images) {
  const parts = [imageChips(block, images)];
  if (block.head) parts.push(h("q", { class: "mnb-head" }, block.head));
  if (block.last) {
    // A no-break space: a wrapped row breaks after the ellipsis, never before it.
    parts.push("\u00a0", h("span", { class: "mnb-dim" }, "…"), " ");
    parts.push(h("q", { class: "mnb-last" }, block.last));
  }
  return parts;
}

function swatch(block, part) {
  const kind = kindOf(block);
  return h(
    "span",
    { class: "mnb-swatch", "data-kind": kind, "data-part": part },
    part ? fill(share(block)) : "",
    LETTER[kind] ?? "?",
  );
}

function row(block, edit, layerKinds, before, images) {
  const kind = kindOf(block);
  const part = partOf(block, before);
  const ids = imageIds(block);
  return h(
    "tr",
    {
      class: "mnb-block",
      "data-index": block.index,
      "data-kind": kind,
      "data-reason": String(block.reason || ""),
      "data-edit": edit && edit.block === block.index ? "true" : null,
      "data-restored": String(tokenSplit(block)[0]),
      "data-part": part,
      "data-image": ids.length ? ids.join(" ") : null,
      // Rows are the map's way in to the details panel, by keyboard as well.
      tabindex: 0,
    },
    h("td", { class: "mnb-num" }, String(block.index)),
    h("td", { class: "mnb-num mnb-range" }, `${int(block.start)}–${int(block.end)}`),
    h("td", { class: "mnb-text" }, textCell(block, images)),
    // A partly restored block's source says how its tokens split.
    h("td", { class: "mnb-source" }, swatch(block, part), " ",
      part ? splitWords(block) : String(block.source || "")),
    h("td", { class: "mnb-reason" }, reasonPhrase(block, edit)),
    h("td", { class: "mnb-num" }, seconds(block.seconds)),
    h("td", { class: "mnb-records" }, recordChips(block, layerKinds)),
  );
}

function details(block, edit, layerKinds, before, images) {
  if (!block) {
    return [h("span", { class: "mnb-dim" }, "Hover or click a block to see where it came from.")];
  }
  const part = partOf(block, before);
  const [restored, computed] = tokenSplit(block);
  const length = restored + computed;
  // Pairs per row (the list is laid out in two columns): range and time, source and
  // reason, first and last words, then the records.
  const count = part ? `${int(length)} tokens: ${splitWords(block)}` : plural(length, "token");
  const items = [
    ["tokens", `${int(block.start)}–${int(block.end)} (${count})`],
    ["time", seconds(block.seconds)],
    ["source", String(block.source || "")],
    ["reason", reasonPhrase(block, edit) || "—"],
    ["first words", block.head || "—"],
    ["last words", block.last || "—"],
  ];
  if (layerKinds.length || (block.records || []).length) {
    const read = (block.records || []).map(String);
    const kinds = layerKinds.length ? layerKinds : read;
    let text = "all made now";
    if (block.source === "disk") {
      text = kinds.map((k) => `${k} ${read.includes(k) ? "read" : "not needed"}`).join(", ");
    } else if (block.source === "memory") {
      text = "none read: the live cache was reused";
    } else if (part === "memory") {
      text =
        `the live cache's first ${plural(restored, "token")} reused, ` +
        `the other ${int(computed)} made now`;
    } else if (part) {
      text =
        `read for the first ${plural(restored, "token")}, ` +
        `made now for the other ${int(computed)}`;
    }
    items.push(["records", text]);
  }
  const ids = imageIds(block);
  if (ids.length) items.push(["images", imageTip(block, images)]);
  return [
    h("div", { class: "mnb-details-title" }, swatch(block, part), ` block ${block.index}`),
    h("dl", {}, items.map(([term, value]) => [h("dt", {}, term), h("dd", {}, value)])),
    ids.length ? h("div", { class: "mnb-details-images" }, ids.map((i) => thumb(i, images))) : "",
  ];
}

function drawMap(model, root, state) {
  const blocks = [...(model.get("blocks") || [])].sort((a, b) => a.index - b.index);
  const edit = model.get("edit");
  const layerKinds = recordKinds(model.get("layer_kinds") || []);
  const images = model.get("images") || [];
  const known = byIndex(blocks);
  const n = blocks.length;
  let head = `Block map · ${plural(n, "block")}`;
  const blockSize = model.get("block_size");
  const promptTokens = model.get("prompt_tokens");
  if (blockSize) head += ` of ${int(blockSize)} tokens`;
  if (promptTokens) head += ` · ${plural(promptTokens, "prompt token")}`;
  if (layerKinds.length) head += ` · layer kinds: ${layerKinds.join(" + ")}`;

  // No strip of cells: the answer's strip is drawn just above the map.
  const panel = h("div", { class: "mnb-details", "aria-live": "polite" });
  const rows = blocks.map((block) =>
    row(block, edit, layerKinds, known.get(block.index - 1), images),
  );
  const rowOf = new Map(rows.map((r) => [Number(r.getAttribute("data-index")), r]));
  const tall = n > TALL_ROWS;
  const table = h(
    "div",
    { class: "mnb-scroll", "data-tall": tall ? "true" : null },
    h(
      "table",
      { class: "mnb-table" },
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          h("th", { class: "mnb-num" }, "block"),
          h("th", { class: "mnb-num" }, "tokens"),
          h("th", {}, "text"),
          h("th", {}, "source"),
          h("th", {}, "reason"),
          h("th", { class: "mnb-num" }, "time"),
          h("th", {}, "records"),
        ),
      ),
      h("tbody", {}, rows),
    ),
  );

  // Hover shows a block; a click pins it (click again to unpin).
  const show = (index) => {
    const block = known.get(index);
    panel.replaceChildren(...details(block, edit, layerKinds, known.get(index - 1), images));
    // An image block's thumbnails sit on the panel's right: room for them.
    const ids = imageIds(block);
    if (ids.length) {
      panel.setAttribute("data-image", ids.join(" "));
      panel.style.setProperty("--mnb-images", String(ids.length));
    } else {
      panel.removeAttribute("data-image");
      panel.style.removeProperty("--mnb-images");
    }
  };
  const select = (index) => {
    state.selected = index;
    for (const node of rows) node.removeAttribute("aria-selected");
    if (index !== null && known.has(index)) rowOf.get(index).setAttribute("aria-selected", "true");
    show(index ?? (edit ? edit.block : null));
  };
  const indexOf = (event) => {
    const target = event.target.closest("[data-index]");
    return target && root.contains(target) ? Number(target.getAttribute("data-index")) : null;
  };
  const onOver = (event) => {
    const index = indexOf(event);
    if (index !== null) show(index);
  };
  const onLeave = () => show(state.selected ?? (edit ? edit.block : null));
  const onClick = (event) => {
    const index = indexOf(event);
    if (index === null) return;
    select(state.selected === index ? null : index);
  };
  const onKey = (event) => {
    if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      onClick(event);
    }
  };
  table.addEventListener("mouseover", onOver);
  table.addEventListener("focusin", onOver);
  table.addEventListener("mouseleave", onLeave);
  table.addEventListener("click", onClick);
  table.addEventListener("keydown", onKey);

  root.setAttribute("data-n-blocks", n);
  root.replaceChildren(
    h("div", { class: "mnb-title" }, head),
    editBox(edit) || "",
    panel,
    table,
  );
  select(state.selected !== undefined && known.has(state.selected) ? state.selected : null);
  if (state.observer) state.observer.disconnect();
  state.observer = null;
  if (tall) {
    const first = blocks.find((block) => block.source === "computed");
    if (first) state.observer = openAt(table, rowOf.get(Number(first.index)), rows.at(-1));
  }
}

// Scroll the tall rows' box (only it, never the page) so that `row` sits near its top: up
// to three rows of restored context above it, fewer where that would push the `last` row
// (the tail) out of sight. The box has no size until it is on the page, so wait for one;
// returns the observer waiting (null when done at once).
function openAt(box, row, last) {
  if (!row) return null;
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

// --- store --------------------------------------------------------------------------------

function figureValue(name, view) {
  const get = (key) => view[key];
  switch (name) {
    case "bytes_held": {
      const budget = Number(get("budget_bytes")) || 0;
      return [bytes(get("bytes_held")), budget ? `of ${bytes(budget)} budget` : "no disk budget"];
    }
    case "file_size":
      return [bytes(get("file_size")), `${bytes(get("free_bytes"))} free for reuse`];
    case "blocks_restored":
      return [int(get("blocks_restored")), `${int(get("tokens_restored"))} tokens`];
    case "blocks_computed":
      return [int(get("blocks_computed")), `${int(get("tokens_computed"))} tokens`];
    case "blocks_evicted":
      return [int(get("blocks_evicted")), plural(Number(get("records_evicted")) || 0, "record")];
    case "blocks_held":
      return [int(get("blocks_held")), plural(Number(get("records")) || 0, "record")];
    default:
      return [int(get(name)), ""];
  }
}

// The requests (numbered from 1) that the chart's x axis labels, of `n`: every one up to
// ALL_TICKS; beyond, the first, the last and the multiples of a round step between them:
// the smallest step (1, 2, 2.5 or 5 times a power of ten, a whole number) that makes at
// most AXIS_TICKS + 1 labels. A multiple within half a step of the first or the last is
// left out, so that no two labels crowd each other.
function requestTicks(n) {
  if (n <= ALL_TICKS) return Array.from({ length: n }, (_, i) => i + 1);
  for (let scale = 1; ; scale *= 10) {
    for (const m of [1, 2, 2.5, 5]) {
      const step = m * scale;
      if (!Number.isInteger(step)) continue;
      const ticks = [1];
      for (let r = step; r < n; r += step) {
        if (r - 1 > step / 2 && n - r > step / 2) ticks.push(r);
      }
      ticks.push(n);
      if (ticks.length <= AXIS_TICKS + 1) return ticks;
    }
  }
}

// The history as step lines: x is the request (each history point gets an equal band, in
// order), y the running total of blocks restored, computed and evicted. Not seconds since
// load: loading the model takes most of that time and would squeeze every request into the
// right edge. Each band draws its point's totals across its width, so one request is a line.
function chart(history) {
  const [w, ht, left, bottom, top, right] = [480, 146, 44, 34, 8, 10];
  const label = {
    role: "img",
    "aria-label": "blocks restored, computed and evicted, by request",
  };
  const points = (history || []).filter((p) => p && typeof p === "object");
  if (!points.length) {
    // A one-line chart: no empty plot area before the first request.
    const empty = s("svg", {
      class: "mnb-chart",
      "data-empty": "true",
      viewBox: `0 0 ${w} 24`,
      ...label,
    });
    empty.append(s("text", { class: "mnb-axis", x: 0, y: 16 }, "no requests yet"));
    return empty;
  }
  const n = points.length;
  const svg = s("svg", {
    class: "mnb-chart",
    "data-x": "requests",
    "data-points": n,
    viewBox: `0 0 ${w} ${ht}`,
    ...label,
  });
  const value = (p, key) => Math.trunc(Number(p[key]) || 0);
  const yMax = Math.max(...points.flatMap((p) => SERIES.map(([k]) => value(p, k)))) || 1;
  const plotW = w - left - right;
  const plotH = ht - top - bottom;
  const x = (i) => left + (plotW * i) / n;
  const y = (v) => top + plotH * (1 - v / yMax);
  const f = (v) => fixed(v, 1);
  // Each label under the middle of its request's band; the axis title on a line below.
  const tick = (r) =>
    s(
      "text",
      {
        class: "mnb-axis mnb-tick",
        "data-request": r,
        x: f(x(r - 0.5)),
        y: top + plotH + 13,
        "text-anchor": "middle",
      },
      int(r),
    );
  svg.append(
    s("line", { class: "mnb-grid", x1: left, y1: f(y(0)), x2: w - right, y2: f(y(0)) }),
    s("line", { class: "mnb-grid", x1: left, y1: f(y(yMax)), x2: w - right, y2: f(y(yMax)) }),
    s("text", { class: "mnb-axis", x: left - 6, y: f(y(0) + 4), "text-anchor": "end" }, "0"),
    s("text", { class: "mnb-axis", x: left - 6, y: f(y(yMax) + 4), "text-anchor": "end" },
      int(yMax)),
    s("text", { class: "mnb-axis", x: left - 6, y: f(y(yMax) + 15), "text-anchor": "end" },
      "blocks"),
    ...requestTicks(n).map(tick),
    s(
      "text",
      {
        class: "mnb-axis mnb-axis-title",
        x: f(left + plotW / 2),
        y: ht - 4,
        "text-anchor": "middle",
      },
      "requests",
    ),
  );
  points.forEach((p, i) => {
    // One hover target per request: its totals in words.
    const band = s("rect", {
      class: "mnb-band",
      x: f(x(i)),
      y: top,
      width: f(x(i + 1) - x(i)),
      height: plotH,
      fill: "transparent",
    });
    const totals = SERIES.map(([k, lbl]) => `${int(value(p, k))} ${lbl}`).join(" · ");
    band.append(s("title", {}, `request ${i + 1}: ${totals}`));
    svg.append(band);
  });
  for (const [key, label, colour, dash] of SERIES) {
    const coords = points.flatMap((p, i) => {
      const v = f(y(value(p, key)));
      return [`${f(x(i))},${v}`, `${f(x(i + 1))},${v}`];
    });
    const line = s("polyline", {
      class: "mnb-series",
      "data-series": key,
      fill: "none",
      style: `stroke: var(${colour})`,
      "stroke-width": 2,
      points: coords.join(" "),
    });
    if (dash) line.setAttribute("stroke-dasharray", dash);
    line.append(s("title", {}, `${label}: ${int(value(points[n - 1], key))} blocks`));
    svg.append(line);
  }
  return svg;
}

function chartLegend() {
  // Each key draws a piece of its series' line: the same colour and dash pattern.
  return h(
    "div",
    { class: "mnb-legend" },
    SERIES.map(([key, label, colour, dash]) => {
      const swatch = s("svg", { class: "mnb-line", viewBox: "0 0 20 4", "aria-hidden": "true" });
      const line = s("line", {
        x1: 0,
        y1: 2,
        x2: 20,
        y2: 2,
        style: `stroke: var(${colour})`,
        "stroke-width": 2,
      });
      if (dash) line.setAttribute("stroke-dasharray", dash);
      swatch.append(line);
      return h("span", { class: "mnb-key", "data-series": key }, swatch, label);
    }),
  );
}

function drawStore(model, root) {
  const view = model.get("view") || {};
  let title = "Block store";
  if (view.model) title += ` · ${view.model}`;
  if (view.block_size) title += ` · blocks of ${int(view.block_size)} tokens`;
  const figures = FIGURES.map(([name, label]) => {
    const [value, detail] = figureValue(name, view);
    return h(
      "div",
      { class: "mnb-figure", "data-name": name },
      h("span", { class: "mnb-label" }, label),
      h("span", { class: "mnb-value" }, value),
      detail ? h("span", { class: "mnb-detail" }, detail) : "",
    );
  });
  const held = Number(view.bytes_held) || 0;
  const budget = Number(view.budget_bytes) || 0;
  const share = budget ? Math.min(1, held / budget) : 0;
  const bar = budget
    ? [
        h(
          "div",
          {
            class: "mnb-bar",
            "data-share": share.toFixed(4),
            title: `bytes held: ${bytes(held)} of ${bytes(budget)}`,
          },
          h("span", { class: "mnb-bar-fill", style: `width: ${(share * 100).toFixed(1)}%` }),
        ),
        h(
          "div",
          { class: "mnb-bar-label" },
          `${bytes(held)} held of ${bytes(budget)} budget (${(share * 100).toFixed(1)} %)`,
        ),
      ]
    : [];
  const kindRows = Object.entries(view.by_kind || {})
    .filter(([, v]) => v && typeof v === "object" && (v.records || v.bytes))
    .map(([k, v]) =>
      h(
        "tr",
        { "data-record": k },
        h("td", {}, k),
        h("td", { class: "mnb-num" }, int(v.records)),
        h("td", { class: "mnb-num" }, bytes(v.bytes)),
      ),
    );
  const kinds = kindRows.length
    ? h(
        "table",
        { class: "mnb-table mnb-kinds" },
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            h("th", {}, "record kind"),
            h("th", { class: "mnb-num" }, "records"),
            h("th", { class: "mnb-num" }, "bytes"),
          ),
        ),
        h("tbody", {}, kindRows),
      )
    : h("p", { class: "mnb-empty" }, "no records held");
  const evictions = (view.recent_evictions || []).filter((e) => e && typeof e === "object");
  const evicted = evictions.length
    ? h(
        "ul",
        { class: "mnb-evictions" },
        evictions.map((e) =>
          h(
            "li",
            { "data-record": e.kind || "" },
            h("span", { class: "mnb-num mnb-time" }, seconds(e.t)),
            h("span", { class: "mnb-rec", "data-read": "true" }, e.kind || ""),
            h("span", { class: "mnb-num" }, bytes(e.bytes)),
            h("q", { class: "mnb-head" }, e.text || ""),
          ),
        ),
      )
    : h("p", { class: "mnb-empty" }, "no evictions yet");
  root.replaceChildren(
    h("div", { class: "mnb-title" }, title),
    view.backend
      ? h(
          "div",
          { class: "mnb-sub" },
          view.backend === "off" ? "no block store: every block is computed" : String(view.backend),
        )
      : "",
    h("div", { class: "mnb-figures" }, figures),
    ...bar,
    h(
      "div",
      { class: "mnb-panels" },
      h(
        "div",
        { class: "mnb-panel" },
        h("div", { class: "mnb-subtitle" }, "blocks by request (running totals)"),
        chart(view.history),
        (view.history || []).length ? chartLegend() : "",
      ),
      h(
        "div",
        { class: "mnb-panel" },
        h("div", { class: "mnb-subtitle" }, "records by kind"),
        kinds,
        h("div", { class: "mnb-subtitle" }, "latest evictions"),
        evicted,
      ),
    ),
  );
}

// --- entry point --------------------------------------------------------------------------

const VIEWS = {
  strip: {
    draw: drawStrip,
    traits: ["n_blocks", "block_size", "prompt_tokens", "blocks", "edit", "show_edit", "images"],
  },
  map: {
    draw: drawMap,
    traits: ["blocks", "edit", "block_size", "prompt_tokens", "layer_kinds", "images"],
  },
  store: { draw: drawStore, traits: ["view"] },
};

function render({ model, el }) {
  const kind = model.get("_kind");
  const view = VIEWS[kind];
  if (!view) {
    el.textContent = `mlx_nbengine: unknown widget kind ${JSON.stringify(kind)}`;
    return;
  }
  const root = h("div", { class: `mnb-root mnb-${kind}` });
  el.append(root);
  const state = {};
  const update = () => view.draw(model, root, state);
  update();
  for (const name of view.traits) model.on(`change:${name}`, update);
  return () => {
    for (const name of view.traits) model.off(`change:${name}`, update);
    if (state.observer) state.observer.disconnect();
  };
}

export default { render };

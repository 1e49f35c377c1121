"""The notebook's widgets: block dicts, their HTML, the widget classes, the ES module, a real run.

HTML (static, or the live markup a widget sends its ES module) is read back with the
standard library's HTML parser into a list of elements (tag, attributes, own text), so the
tests check the DOM contract's selectors (classes and data- attributes) rather than
spelling. A tiny real model draws a prompt and an edited re-run; the ES module runs in
Chromium with a stand-in for anywidget's model.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import needs  # tests/ is on sys.path
import pytest
from fakes import block, block_report

from mlx_nbengine.engine.results import Report
from mlx_nbengine.notebook import widgets
from mlx_nbengine.notebook.blockinfo import (
    block_dict,
    block_dicts,
    edit_dict,
    first_words,
    last_words,
    report_edit,
)
from mlx_nbengine.notebook.widgets import (
    BlockMap,
    BlockStrip,
    StoreView,
    map_html,
    reason_phrase,
    store_html,
    strip_html,
)

REPO = Path(__file__).resolve().parents[2]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
VOID = {"br", "hr", "img", "input", "meta", "link", "line", "polyline"}


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    text: str = ""
    parent: Element | None = None

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def within(self, cls: str) -> bool:
        node = self.parent
        while node is not None:
            if cls in node.classes:
                return True
            node = node.parent
        return False

    def within_node(self, ancestor: Element) -> bool:
        node = self.parent
        while node is not None and node is not ancestor:
            node = node.parent
        return node is ancestor

    def all_text(self, elements: list[Element]) -> str:
        """This element's text with its descendants' text, in document order."""
        out = [self.text]
        for e in elements:
            node = e.parent
            while node is not None and node is not self:
                node = node.parent
            if node is self:
                out.append(e.text)
        return " ".join(t for t in out if t)


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self.stack: list[Element] = []
        self.style = False

    def handle_starttag(self, tag, attrs):
        parent = self.stack[-1] if self.stack else None
        element = Element(tag, {k: v or "" for k, v in attrs}, parent=parent)
        self.elements.append(element)
        self.style = tag == "style"
        if tag not in VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag, attrs):
        parent = self.stack[-1] if self.stack else None
        self.elements.append(Element(tag, {k: v or "" for k, v in attrs}, parent=parent))

    def handle_endtag(self, tag):
        self.style = False
        while self.stack:
            if self.stack.pop().tag == tag:
                break

    def handle_data(self, data):
        if self.stack and not self.style:
            self.stack[-1].text += data


def parse(html: str) -> list[Element]:
    collector = _Collect()
    collector.feed(html)
    return collector.elements


def select(elements: list[Element], cls: str, *, within: str | None = None) -> list[Element]:
    return [e for e in elements if cls in e.classes and (within is None or e.within(within))]


def rerun_blocks() -> list[dict]:
    """Blocks of a re-run edited in block 3: restored before it, computed from it on."""
    return [
        block(0, "memory", reason="hot", records=()),
        block(1),
        block(2, records=("kv", "window"), reason="kv+window"),
        block(3, "computed", reason="edited", records=()),
        block(4, "computed", reason="after_miss", records=()),
        block(5, "computed", display="tail", reason="tail", records=(), end=85),
    ]


EDIT = {"position": 53, "block": 3, "before": "words before", "after": "changed words"}


def cut_blocks(*, first: str = "disk") -> list[dict]:
    """Blocks of a re-run restored to the token: `first`, then disk, then block 2 edited at
    token 44 (its first 12 tokens restored, 4 computed), then the tail."""
    reason, records = ("hot", ()) if first == "memory" else ("kv", ("kv",))
    return [
        block(0, first, reason=reason, records=records, restored=16),
        block(1, first, reason=reason, records=records, restored=16),
        block(2, "computed", reason="edited", records=(), restored=12),
        block(3, "computed", display="tail", reason="tail", records=(), end=60, restored=0),
    ]


CUT_EDIT = {"position": 44, "block": 2, "before": "words before", "after": "changed words"}


def long_blocks(n: int, edited: int) -> list[dict]:
    """`n` blocks of a re-run edited in block `edited`: read from disk before it, computed
    from it on, the last one the tail."""
    out = [block(i) for i in range(edited)]
    out.append(block(edited, "computed", reason="edited", records=()))
    out += [block(i, "computed", reason="after_miss", records=()) for i in range(edited + 1, n)]
    out[-1] = block(n - 1, "computed", display="tail", reason="tail", records=())
    return out


def store_view(**extra) -> dict:
    view = {
        "model": "tiny",
        "block_size": 16,
        "blocks_held": 12,
        "records": 24,
        "bytes_held": 3 * 2**20,
        "budget_bytes": 12 * 2**20,
        "file_size": 4 * 2**20,
        "free_bytes": 2**30,
        "backend": "scratch file",
        "by_kind": {
            "kv": {"records": 12, "bytes": 2 * 2**20},
            "window": {"records": 12, "bytes": 2**20},
            "state": {"records": 0, "bytes": 0},
        },
        "blocks_restored": 30,
        "blocks_computed": 20,
        "tokens_restored": 480,
        "tokens_computed": 310,
        "blocks_evicted": 2,
        "records_evicted": 4,
        "requests": 5,
        "history": [
            {"t": 1.0, "restored": 0, "computed": 6, "evicted": 0},
            {"t": 4.5, "restored": 30, "computed": 20, "evicted": 2},
        ],
        "recent_evictions": [
            {"t": 4.4, "kind": "kv", "bytes": 4096, "text": "Once <em>upon</em> a time"},
            {"t": 4.3, "kind": "window", "bytes": 2048, "text": ""},
        ],
    }
    view.update(extra)
    return view


# --- blockinfo ------------------------------------------------------------------------------


def test_an_image_run_reads_as_its_picture_label_in_the_blocks_words():
    from mlx_nbengine.engine.events import BlockEvent

    # Ids 1-4 are words, 9 is the image placeholder; picture 1 spans tokens 2:1026.
    tokens = [1, 2] + [9] * 1024 + [3, 4]
    words = {1: "Describe", 2: "this", 3: "in", 4: "words", 9: "<|image_pad|>"}

    def decode(ids):
        return " ".join(words[i] for i in ids)

    def block(start, end):
        event = BlockEvent(index=0, start=start, end=end, source="computed", seconds=0.0,
                           reason="new")  # fmt: skip
        return block_dict(event, decode=decode, tokens=tokens, spans=[(2, 1026)])

    whole = block(0, len(tokens))
    assert (whole["head"], whole["last"]) == (
        "Describe this [picture 1: 1,024 image tokens]",
        "in words",
    )
    inside = block(512, 768)
    assert (inside["head"], inside["last"]) == ("[picture 1: 1,024 image tokens]", "")
    assert "image_pad" not in str(block(0, 300))


def test_block_dict_reads_an_engine_block_event():
    from mlx_nbengine.engine.events import BlockEvent

    event = BlockEvent(
        index=2, start=32, end=48, source="disk", seconds=0.5, reason="kv+window",
        records=("kv", "window"), restored=16,
    )  # fmt: skip
    d = block_dict(event)
    assert d == {
        "index": 2,
        "start": 32,
        "end": 48,
        "source": "disk",
        "display": "disk",
        "reason": "kv+window",
        "records": ["kv", "window"],
        "restored": 16,
        "seconds": 0.5,
        "head": "",
        "last": "",
        "images": [],  # a text block
    }
    json.dumps(d)  # JSON-ready: it syncs to the browser and saves with the notebook


def test_block_dict_counts_the_restored_tokens_of_a_partly_restored_block():
    from mlx_nbengine.engine.events import BlockEvent

    cut = BlockEvent(
        index=3, start=768, end=859, source="computed", seconds=0.9, reason="tail",
        edit_at=852, restored=84,
    )  # fmt: skip
    assert block_dict(cut)["restored"] == 84
    assert block_dict(cut)["display"] == "tail"  # still computed: its last tokens were
    new = block_report(4, "computed")
    assert block_dict(new)["restored"] == 0


def test_block_dict_kind_is_tail_for_the_last_computed_block():
    tokens = list(range(40))
    tail = block_report(2, "computed", end=40)
    assert block_dict(tail, tokens=tokens)["display"] == "tail"
    named = block_report(1, "computed", reason="tail")
    assert block_dict(named)["display"] == "tail"
    middle = block_report(1, "computed")
    assert block_dict(middle, tokens=tokens)["display"] == "computed"


def test_block_dict_holds_the_first_and_last_words_of_the_block_text():
    text = "zero one two three four five six seven eight nine ten eleven".split()
    tokens = list(range(len(text)))

    def decode(ids):
        return " ".join(text[i] for i in ids)

    event = block_report(0, end=12)
    d = block_dict(event, decode=decode, tokens=tokens)
    assert (d["head"], d["last"]) == ("zero one two three", "eight nine ten eleven")
    short = block_report(0, end=3)
    d = block_dict(short, decode=decode, tokens=tokens)
    assert (d["head"], d["last"]) == ("zero one", "two")


def test_block_words_never_fail_and_cut_long_words():
    def broken(ids):
        raise ValueError("no such token")

    event = block_report(0, end=2)
    assert block_dict(event, decode=broken, tokens=[1, 2])["head"] == ""
    assert first_words("x" * 100).endswith("…") and len(first_words("x" * 100)) <= 25
    assert last_words("\ufffd end of it") == "end of it"


# A vocabulary whose decode keeps special tokens, as a tokenizer's plain decode does.
VOCAB = ["<bos>", "<|im_start|>", "<|im_end|>", "user", "\n", "The", " quick", " brown", " fox"]
SPECIAL = {0, 1, 2}


def decode_vocab(ids):
    return "".join(VOCAB[i] for i in ids)


def test_block_words_leave_out_the_special_tokens_the_caller_names():
    tokens = [0, 1, 3, 4, 5, 6, 7, 8, 2]
    event = block_report(0, end=9)
    kept = block_dict(event, decode=decode_vocab, tokens=tokens)
    assert "<bos>" in kept["head"]  # without `special`: what decode gives
    d = block_dict(event, decode=decode_vocab, tokens=tokens, special=SPECIAL)
    assert (d["head"], d["last"]) == ("user The quick", "brown fox")
    (listed,) = block_dicts([event], decode=decode_vocab, tokens=tokens, special=[0, 1, 2])
    assert listed == d  # a list (a tokenizer's all_special_ids) works as well as a set


def test_a_block_of_special_tokens_only_has_no_words():
    event = block_report(0, end=2)
    d = block_dict(event, decode=decode_vocab, tokens=[0, 1], special=SPECIAL)
    assert (d["head"], d["last"]) == ("", "")


def test_edit_words_leave_out_special_tokens():
    tokens = [0, 1, 3, 4, 5, 2, 1, 6, 7, 8, 2]
    edit = edit_dict(7, tokens, decode=decode_vocab, block_size=4, special=SPECIAL)
    assert edit == {"position": 7, "block": 1, "before": "user The", "after": "quick brown fox"}
    report = Report(edit_at=7)
    assert report_edit(report, tokens, decode=decode_vocab, block_size=4, special=SPECIAL) == edit


def test_block_words_leave_out_a_real_tokenizers_special_tokens(tmp_path):
    from tokenizers import Tokenizer

    from mlx_nbengine.testing import SPECIAL_TOKENS, make_tiny_tokenizer

    tok = Tokenizer.from_file(str(make_tiny_tokenizer(tmp_path) / "tokenizer.json"))
    tokens = tok.encode("<|im_start|>user\nThe quick brown fox<|im_end|>").ids
    special = [tok.token_to_id(t) for t in SPECIAL_TOKENS]

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)

    event = block_report(0, end=len(tokens))
    assert "<bos>" in block_dict(event, decode=decode, tokens=tokens)["head"]
    d = block_dict(event, decode=decode, tokens=tokens, special=special)
    words = f"{d['head']} {d['last']}"
    assert "<" not in words and words.split() == ["user", "The", "quick", "brown", "fox"]


def test_block_dicts_are_in_index_order():
    events = [block_report(i) for i in (2, 0, 1)]
    assert [b["index"] for b in block_dicts(events)] == [0, 1, 2]


def test_edit_dict_names_the_block_and_the_words_around_the_change():
    words = [f"w{i}" for i in range(40)]

    def decode(ids):
        return " ".join(words[i] for i in ids)

    edit = edit_dict(20, list(range(40)), decode=decode, block_size=16)
    assert edit == {
        "position": 20,
        "block": 1,
        "before": "w15 w16 w17 w18 w19",
        "after": "w20 w21 w22 w23 w24",
    }


def test_report_edit_is_none_without_a_change():
    assert report_edit(Report(), [1, 2], decode=None, block_size=16) is None
    edit = report_edit(Report(edit_at=17), [1] * 40, decode=None, block_size=16)
    assert edit == {"position": 17, "block": 1, "before": "", "after": ""}


# --- static HTML ----------------------------------------------------------------------------


def test_strip_html_draws_one_cell_per_block_with_pending_cells_for_the_rest():
    blocks = rerun_blocks()[:3]
    elements = parse(strip_html(blocks, n_blocks=6, block_size=16, prompt_tokens=85))
    (root,) = select(elements, "mnb-strip")
    assert root.tag == "div" and root.attrs["data-n-blocks"] == "6"
    cells = select(elements, "mnb-block", within="mnb-strip")
    assert [c.attrs["data-index"] for c in cells] == [str(i) for i in range(6)]
    assert [c.attrs["data-display"] for c in cells] == ["memory", "disk", "disk"] + ["pending"] * 3
    assert [c.attrs["data-reason"] for c in cells[:3]] == ["hot", "kv", "kv+window"]
    assert [c.text for c in cells[:3]] == ["M", "D", "D"]  # letters, not colour alone


def test_strip_legend_names_every_kind_with_its_count():
    elements = parse(strip_html(rerun_blocks(), n_blocks=6))
    (legend,) = select(elements, "mnb-legend")
    keys = {k.attrs["data-display"]: k.attrs["data-count"] for k in select(elements, "mnb-key")}
    assert keys == {"memory": "1", "disk": "2", "computed": "2", "tail": "1", "pending": "0"}
    assert "computed" in legend.all_text(elements)


def test_strip_marks_the_edited_block_and_the_words_around_the_change():
    elements = parse(strip_html(rerun_blocks(), n_blocks=6, edit=EDIT))
    cells = select(elements, "mnb-block")
    assert [c.attrs.get("data-edit") for c in cells] == [None, None, None, "true", None, None]
    (edit,) = select(elements, "mnb-edit")
    assert edit.attrs["data-position"] == "53"
    text = edit.all_text(elements)
    assert "53" in text and "words before" in text and "changed words" in text


def test_strip_without_show_edit_marks_the_cell_but_leaves_the_banner_to_the_map():
    elements = parse(strip_html(rerun_blocks(), n_blocks=6, edit=EDIT, show_edit=False))
    assert not select(elements, "mnb-edit")
    cells = select(elements, "mnb-block")
    assert [c.attrs.get("data-edit") for c in cells] == [None, None, None, "true", None, None]
    strip = BlockStrip(n_blocks=6, blocks=rerun_blocks(), edit=EDIT, show_edit=False)
    assert not select(parse(strip.html()), "mnb-edit")
    assert strip.get_state()["show_edit"] is False  # the live widget reads it too
    assert select(
        parse(BlockStrip(n_blocks=6, blocks=rerun_blocks(), edit=EDIT).html()), "mnb-edit"
    )


def test_cells_describe_their_block_on_hover():
    (cell,) = [c for c in select(parse(strip_html(rerun_blocks())), "mnb-block") if c.text == "T"]
    title = cell.attrs["title"]
    assert "tokens 80–85" in title and "computed" in title and "“first words 5" in title


def test_model_text_is_escaped_everywhere():
    hostile = '<em>x</em><script>alert("hi")</script>'
    blocks = [block(0, head=hostile, last="a & b <u>"), block(1, "computed", reason="new")]
    edit = {"position": 17, "block": 1, "before": "<i>before", "after": "</div>after"}
    view = store_view(recent_evictions=[{"t": 1, "kind": "kv", "bytes": 1, "text": hostile}])
    for html in (
        strip_html(blocks, n_blocks=2, edit=edit),
        map_html(blocks, edit=edit, layer_kinds=["kv"]),
        store_html(view),
    ):
        tags = {e.tag for e in parse(html)}
        assert not tags & {"em", "script", "i", "u"}, tags
        assert "<script>" not in html and "</div>after" not in html
    texts = [e.text for e in parse(map_html(blocks, edit=edit))]
    assert hostile in texts and "a & b <u>" in texts  # shown as written


def test_static_html_has_no_javascript():
    for html in (
        strip_html(rerun_blocks(), n_blocks=6, edit=EDIT),
        map_html(rerun_blocks(), edit=EDIT),
        store_html(store_view()),
    ):
        elements = parse(html)
        assert "script" not in {e.tag for e in elements}
        assert not any(name.startswith("on") for e in elements for name in e.attrs)
        assert elements[0].tag == "style"  # self-contained: the widgets' CSS comes along


def test_map_html_has_one_row_per_block_with_its_range_words_source_and_reason():
    elements = parse(map_html(rerun_blocks(), block_size=16, prompt_tokens=85, edit=EDIT))
    (root,) = select(elements, "mnb-map")
    rows = select(elements, "mnb-block", within="mnb-map")
    assert [r.tag for r in rows] == ["tr"] * 6
    assert [r.attrs["data-display"] for r in rows] == [
        "memory", "disk", "disk", "computed", "computed", "tail",
    ]  # fmt: skip
    assert [r.attrs["data-reason"] for r in rows] == [
        "hot", "kv", "kv+window", "edited", "after_miss", "tail",
    ]  # fmt: skip
    text = rows[3].all_text(elements)
    for part in ("48–64", "first words 3", "last words 3", "computed", "edited at token 53"):
        assert part in text, (part, text)
    assert rows[3].attrs["data-edit"] == "true"
    assert select(elements, "mnb-edit")[0].attrs["data-position"] == "53"


def _css_rules() -> list[tuple[str, str]]:
    """(selectors, declarations) of each rule in the widgets' CSS, comments left out."""
    css = re.sub(r"/\*.*?\*/", "", (REPO / "widgets" / "blocks.css").read_text(), flags=re.S)
    css = re.sub(r"@media[^{]*\{((?:[^{}]*\{[^{}]*\})*)\s*\}", r"\1", css)
    return [(sel.strip(), body) for sel, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css)]


def test_static_map_shows_every_row_without_a_height_limit():
    many = [block(i) for i in range(widgets.TALL_ROWS + 20)]
    html = map_html(many)
    rows = select(parse(html), "mnb-block", within="mnb-map")
    assert len(rows) == len(many)
    # Only the live map of a long prompt scrolls (data-tall is in its live markup only).
    assert not [e for e in parse(html) if "data-tall" in e.attrs]
    for selectors, body in _css_rules():
        if "max-height" in body:
            assert all('[data-tall="true"]' in s for s in selectors.split(",")), selectors


def test_map_words_wrap_instead_of_being_cut_short():
    for selectors, body in _css_rules():
        if "mnb-text" in selectors or "mnb-reason" in selectors:
            assert "ellipsis" not in body and "overflow: hidden" not in body, selectors
    rules = dict(_css_rules())
    assert "white-space: normal" in rules[".mnb-root table.mnb-table td.mnb-text"]
    assert "white-space: normal" in rules[".mnb-root table.mnb-table td.mnb-reason"]


def test_map_draws_no_strip_of_its_own():
    # The answer's strip is just above the map: the map is its title, edit and rows.
    elements = parse(map_html(rerun_blocks(), edit=EDIT))
    blocks = select(elements, "mnb-block", within="mnb-map")
    assert [b.tag for b in blocks] == ["tr"] * 6  # `.mnb-map .mnb-block` is the rows only
    for cls in ("mnb-cells", "mnb-cell", "mnb-legend", "mnb-foot"):
        assert not select(elements, cls), cls
    assert select(elements, "mnb-title") and select(elements, "mnb-edit")


def test_map_shows_which_layer_kinds_each_restored_block_read():
    elements = parse(map_html(rerun_blocks(), layer_kinds=["kv", "window"]))
    rows = select(elements, "mnb-block")
    chips = {
        r.attrs["data-index"]: {
            c.attrs["data-record"]: c.attrs["data-read"]
            for c in select(elements, "mnb-rec")
            if c.parent is not None and c.parent.parent is r
        }
        for r in rows
    }
    assert chips["1"] == {"kv": "true", "window": "false"}
    assert chips["2"] == {"kv": "true", "window": "true"}
    assert chips["0"] == chips["3"] == {}  # memory and computed blocks read no records


def test_reason_phrases_are_words():
    assert reason_phrase(block(0, records=("kv", "window"))) == "read kv + window"
    assert reason_phrase(block(3, "computed", reason="edited"), EDIT) == "edited at token 53"
    assert reason_phrase(block(4, "computed", reason="edited"), EDIT) == "edited"
    assert reason_phrase(block(4, "computed", reason="after_miss")) == "after a computed block"


def test_reason_phrase_of_a_partly_restored_block_says_how_much_was_restored():
    edited, tail = cut_blocks()[2], {**cut_blocks()[3], "restored": 1}
    assert reason_phrase(edited, CUT_EDIT) == "edited at token 44 (first 12 tokens restored)"
    assert reason_phrase(tail) == "last tokens, computed to start the answer (first token restored)"
    assert reason_phrase(cut_blocks()[0]) == "read kv"  # a whole block says nothing more


# --- partly restored blocks -------------------------------------------------------------------


def test_strip_fills_a_partly_restored_cell_with_its_restored_share():
    elements = parse(strip_html(cut_blocks(), n_blocks=4, edit=CUT_EDIT))
    cells = select(elements, "mnb-block", within="mnb-strip")
    cut = cells[2]
    # Its kind and letter stay: it was computed from the edit on.
    assert (cut.attrs["data-display"], cut.text) == ("computed", "C")
    assert cut.attrs["data-restored"] == "12" and cut.attrs["data-part"] == "disk"
    (fill,) = [e for e in select(elements, "mnb-fill") if e.parent is cut]
    assert fill.attrs["style"] == "--mnb-share: 0.750"
    assert "12 of 16 tokens restored, 4 computed" in cut.attrs["title"]
    assert [c.attrs["data-restored"] for c in cells] == ["16", "16", "12", "0"]
    assert [c.attrs.get("data-part") for c in cells] == [None, None, "disk", None]


def test_restored_blocks_draw_whole_and_computed_blocks_empty():
    # Memory and disk blocks are restored whole, computed ones not at all (none cut).
    cells = select(parse(strip_html(rerun_blocks(), n_blocks=6)), "mnb-block")
    assert [c.attrs["data-restored"] for c in cells] == ["16", "16", "16", "0", "0", "0"]
    assert not [c for c in cells if "data-part" in c.attrs]
    assert widgets.token_split(block(1)) == (16, 0)


def test_a_partly_restored_cell_takes_the_colour_of_the_restore_before_it():
    elements = parse(strip_html(cut_blocks(first="memory"), n_blocks=4))
    assert select(elements, "mnb-block")[2].attrs["data-part"] == "memory"
    first = [block(0, "computed", reason="edited", records=(), restored=5)]
    assert select(parse(strip_html(first)), "mnb-block")[0].attrs["data-part"] == "disk"


def test_strip_legend_has_a_key_for_partly_restored_blocks_only_when_there_are():
    elements = parse(strip_html(cut_blocks(), n_blocks=4))
    (key,) = [k for k in select(elements, "mnb-key") if "data-part" in k.attrs]
    assert key.attrs["data-count"] == "1" and "partly restored" in key.all_text(elements)
    keys = select(parse(strip_html(rerun_blocks(), n_blocks=6)), "mnb-key")
    assert not [k for k in keys if "data-part" in k.attrs]


def test_strip_legend_draws_the_partly_restored_swatch_like_the_cell():
    elements = parse(strip_html(cut_blocks(), n_blocks=4))
    cut = select(elements, "mnb-block", within="mnb-strip")[2]
    (key,) = [k for k in select(elements, "mnb-key") if "data-part" in k.attrs]
    (swatch,) = [e for e in select(elements, "mnb-swatch") if e.parent is key]
    assert (swatch.attrs["data-display"], swatch.text) == (cut.attrs["data-display"], cut.text)
    (fill,) = [e for e in select(elements, "mnb-fill") if e.parent is swatch]
    (cut_fill,) = [e for e in select(elements, "mnb-fill") if e.parent is cut]
    assert fill.attrs["style"] == cut_fill.attrs["style"]


def test_strip_legend_has_a_key_for_the_edited_cells_ring_only_with_an_edit():
    elements = parse(strip_html(cut_blocks(), n_blocks=4, edit=CUT_EDIT))
    (key,) = [k for k in select(elements, "mnb-key") if k.attrs.get("data-edit") == "true"]
    assert "first change" in key.all_text(elements)
    assert [e for e in select(elements, "mnb-swatch") if e.attrs.get("data-edit") == "true"]
    keys = select(parse(strip_html(cut_blocks(), n_blocks=4)), "mnb-key")
    assert not [k for k in keys if "data-edit" in k.attrs]


def test_map_row_of_a_partly_restored_block_splits_its_tokens():
    elements = parse(map_html(cut_blocks(), edit=CUT_EDIT, layer_kinds=["kv"]))
    rows = select(elements, "mnb-block", within="mnb-map")
    cut = rows[2]
    assert (cut.attrs["data-display"], cut.attrs["data-restored"]) == ("computed", "12")
    text = cut.all_text(elements)
    assert "12 restored + 4 computed" in text
    assert "edited at token 44 (first 12 tokens restored)" in text
    assert "restored" not in rows[3].all_text(elements).replace("first words", "")


def test_reason_phrases_are_the_engines_own():
    from mlx_nbengine.engine.events import REASONS

    for reason, phrase in REASONS.items():
        assert reason_phrase(block(0, "computed", reason=reason)) == phrase


def test_store_html_shows_each_figure_under_a_word_label():
    elements = parse(store_html(store_view()))
    (root,) = select(elements, "mnb-store")
    figures = {f.attrs["data-name"]: f.all_text(elements) for f in select(elements, "mnb-figure")}
    assert set(figures) >= {"blocks_held", "bytes_held", "file_size", "blocks_evicted"}
    assert "blocks held" in figures["blocks_held"] and "12" in figures["blocks_held"]
    assert "bytes held" in figures["bytes_held"] and "3.0 MiB" in figures["bytes_held"]
    assert "12.0 MiB" in figures["bytes_held"]  # against the budget
    visible = " ".join(e.text for e in elements)
    assert not re.search(r"\b[a-z]+_[a-z_]+\b", visible), "a raw key is shown"


def test_store_html_draws_the_budget_bar_chart_kinds_and_evictions():
    elements = parse(store_html(store_view()))
    (bar,) = select(elements, "mnb-bar")
    assert bar.attrs["data-share"] == "0.2500"
    (chart,) = select(elements, "mnb-chart")
    assert chart.tag == "svg"
    series = {e.attrs["data-series"] for e in elements if e.tag == "polyline"}
    assert series == {"restored", "computed", "evicted"}
    kinds = [e.attrs["data-record"] for e in elements if e.tag == "tr" and "data-record" in e.attrs]
    assert kinds == ["kv", "window"]  # a kind with no records is no row
    items = [e for e in elements if e.tag == "li" and e.within("mnb-evictions")]
    assert len(items) == 2 and "Once <em>upon</em> a time" in items[0].all_text(elements)


def _series_x(elements: list[Element]) -> dict[str, list[float]]:
    return {
        e.attrs["data-series"]: [float(xy.split(",")[0]) for xy in e.attrs["points"].split()]
        for e in elements
        if e.tag == "polyline"
    }


def test_store_chart_spaces_requests_evenly_whatever_their_times():
    # Loading takes most of the time since load: the first request comes late, the rest fast.
    history = [
        {"t": 60.0, "restored": 0, "computed": 10, "evicted": 0},
        {"t": 60.5, "restored": 9, "computed": 11, "evicted": 0},
        {"t": 61.0, "restored": 19, "computed": 12, "evicted": 3},
    ]
    elements = parse(store_html(store_view(history=history)))
    (chart,) = select(elements, "mnb-chart")
    assert chart.attrs["data-x"] == "requests" and chart.attrs["data-points"] == "3"
    for xs in _series_x(elements).values():
        edges = sorted(set(xs))
        steps = {round(b - a, 1) for a, b in zip(edges, edges[1:], strict=False)}
        assert len(edges) == 4 and len(steps) == 1, edges  # one even band per request
    labels = [e.text for e in elements if e.tag == "text" and e.parent is chart]
    assert "requests" in labels and "blocks" in labels and not any("load" in t for t in labels)
    assert [t.text for t in select(elements, "mnb-tick")] == ["1", "2", "3"]


def _history(n: int) -> list[dict]:
    return [{"t": float(i), "restored": i, "computed": 2 * i, "evicted": 0} for i in range(n)]


@pytest.mark.parametrize("n", [1, 5, 12])
def test_store_chart_labels_every_request_up_to_twelve(n):
    elements = parse(store_html(store_view(history=_history(n))))
    assert [t.text for t in select(elements, "mnb-tick")] == [str(r) for r in range(1, n + 1)]


@pytest.mark.parametrize("n", [13, 14, 40, 61, 99, 160, 200])
def test_store_chart_labels_about_six_evenly_spaced_requests_beyond_twelve(n):
    elements = parse(store_html(store_view(history=_history(n))))
    ticks = [int(t.attrs["data-request"]) for t in select(elements, "mnb-tick")]
    assert ticks[0] == 1 and ticks[-1] == n and 4 <= len(ticks) <= 7, ticks
    inner = ticks[1:-1]
    steps = {b - a for a, b in zip(inner, inner[1:], strict=False)}
    assert len(steps) <= 1, ticks  # one round step between the first and the last
    assert widgets.request_ticks(n) == ticks


def test_store_chart_axis_title_sits_below_the_tick_labels():
    for n in (1, 3, 12, 40):
        elements = parse(store_html(store_view(history=_history(n))))
        (title,) = select(elements, "mnb-axis-title")
        tick_ys = {float(t.attrs["y"]) for t in select(elements, "mnb-tick")}
        assert len(tick_ys) == 1 and float(title.attrs["y"]) >= max(tick_ys) + 10, n


def test_store_chart_y_axis_title_runs_along_the_axis_apart_from_its_labels():
    elements = parse(store_html(store_view(history=_history(5))))
    (title,) = select(elements, "mnb-axis-y")
    assert title.text == "blocks" and title.attrs["transform"] == "rotate(-90)"
    # Rotated: its x is minus the height on the page, between the labels 0 and the top.
    ys = sorted(float(t.attrs["y"]) for t in elements if t.tag == "text" and t.text in {"0", "8"})
    assert ys[0] + 10 < -float(title.attrs["x"]) < ys[-1] - 10


def test_store_chart_of_one_request_draws_a_line_across():
    history = [{"t": 9.0, "restored": 0, "computed": 13, "evicted": 0}]
    elements = parse(store_html(store_view(history=history)))
    for key, xs in _series_x(elements).items():
        assert max(xs) - min(xs) > 100, key  # a visible line, not a lone corner
    assert "requests" in [e.text for e in elements if e.tag == "text"]


def test_store_chart_legend_draws_each_series_colour_and_dash_pattern():
    elements = parse(store_html(store_view()))

    def look(line: Element) -> tuple[str, str]:
        return line.attrs["style"], line.attrs.get("stroke-dasharray", "")

    series = {e.attrs["data-series"]: look(e) for e in elements if e.tag == "polyline"}
    keys = {
        e.parent.parent.attrs["data-series"]: look(e)
        for e in elements
        if e.tag == "line" and e.within("mnb-legend")
    }
    assert keys == series
    assert len({dash for _, dash in series.values()}) == 3  # told apart without colour


def test_store_html_tables_have_no_empty_header_row():
    for view in (store_view(), store_view(by_kind={}, recent_evictions=[], history=[]), {}):
        elements = parse(store_html(view))
        for th in (e for e in elements if e.tag == "th"):
            assert th.text.strip(), "a header cell without a label"
        for tr in (e for e in elements if e.tag == "tr"):
            assert tr.all_text(elements).strip(), "an empty row"


def test_store_html_of_an_unused_store_says_so():
    elements = parse(store_html(store_view(history=[], recent_evictions=[], by_kind={})))
    text = " ".join(e.text for e in elements)
    assert "no requests yet" in text and "no evictions yet" in text and "no records held" in text
    assert "no block store" in " ".join(e.text for e in parse(store_html({"backend": "off"})))


# --- widget classes -------------------------------------------------------------------------


def test_strip_add_block_keeps_index_order_and_replaces_a_known_block():
    strip = BlockStrip(n_blocks=3, block_size=16, prompt_tokens=40)
    strip.add_block(block(2, "computed", display="tail", reason="tail"))
    strip.add_block(block(0))
    strip.add_block(block(0, "memory", reason="hot"))
    assert [(b["index"], b["source"]) for b in strip.blocks] == [(0, "memory"), (2, "computed")]


def test_strip_add_block_from_many_threads_loses_nothing():
    strip = BlockStrip(n_blocks=64)
    threads = [
        threading.Thread(target=lambda i=i: [strip.add_block(block(i * 8 + j)) for j in range(8)])
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [b["index"] for b in strip.blocks] == list(range(64))


def buttons(strip: BlockStrip) -> list[str]:
    return re.findall(r'data-action="(\w+)"', strip.controls)


def test_strip_shows_a_stop_button_while_its_answer_runs_then_a_copy_button():
    strip = BlockStrip(n_blocks=2, block_size=16)
    assert buttons(strip) == []
    strip.stoppable("message", lambda: None)
    assert buttons(strip) == ["stop"]
    strip.ended("Once upon a <time>")
    assert buttons(strip) == ["copy"] and strip.answer == "Once upon a <time>"
    assert "data-action" not in strip.html(), "no buttons in the static picture"


def front_end_says(widget, content: dict) -> None:
    """`content` arrives as the ES module's ``model.send(content)`` (through the comm)."""
    data = {"method": "custom", "content": content}
    widget.comm.handle_msg({"content": {"data": data}, "buffers": []})


def test_strip_stop_message_calls_the_stop_only_while_running():
    stops = []
    strip = BlockStrip(n_blocks=1, block_size=16)
    strip.stoppable("message", lambda: stops.append(1))
    front_end_says(strip, {"action": "stop"})
    assert stops == [1]
    strip.ended("")
    front_end_says(strip, {"action": "stop"})
    assert stops == [1], "an ended answer is not stopped again"


def test_strip_set_edit_marks_and_clears():
    strip = BlockStrip(n_blocks=6, blocks=rerun_blocks())
    strip.set_edit(EDIT)
    assert strip.edit == EDIT and 'data-position="53"' in strip.html()
    strip.set_edit(None)
    assert strip.edit is None and "mnb-edit" not in strip.html().split("</style>")[1]


@pytest.mark.parametrize(
    "make",
    [
        lambda: BlockStrip(n_blocks=6, block_size=16, blocks=rerun_blocks(), edit=EDIT),
        lambda: BlockMap(blocks=rerun_blocks(), edit=EDIT, layer_kinds=["kv", "window"]),
        lambda: StoreView(view=store_view()),
    ],
    ids=["strip", "map", "store"],
)
def test_every_widget_bundle_has_the_live_view_static_html_and_text(make):
    widget = make()
    data, _ = widget._repr_mimebundle_()
    assert data[WIDGET_VIEW]["model_id"] == widget.model_id
    assert data["text/html"] == widget.html()
    assert data["text/plain"].strip()
    assert widget._behaviour in {"strip", "map", "store"}
    assert widget.get_state()["_behaviour"] == widget._behaviour  # the front end's dispatch


def test_live_markup_is_the_static_picture_without_its_style():
    strip = BlockStrip(n_blocks=6, block_size=16, blocks=rerun_blocks(), edit=EDIT)
    store = StoreView(view=store_view())
    for widget in (strip, store):
        style, picture = widget.html().split("</style>", 1)
        assert style.startswith("<style>") and widget.markup == picture
    block_map = BlockMap(blocks=rerun_blocks(), edit=EDIT)
    panel = 'class="mnb-details"'
    assert panel in block_map.markup and panel not in block_map.html()


def test_widget_markup_follows_its_data():
    strip = BlockStrip(n_blocks=3, block_size=16)
    pending = r'class="mnb-block" data-index="\d" data-display="pending"'
    assert len(re.findall(pending, strip.markup)) == 3
    strip.add_block(block(0))
    assert 'data-index="0" data-display="disk"' in strip.markup
    strip.set_edit({"position": 3, "block": 0, "before": "a", "after": "b"})
    assert 'class="mnb-edit" data-position="3"' in strip.markup
    store = StoreView()
    store.view = store_view()
    assert 'data-name="blocks_held"' in store.markup and "12 blocks held" in store.text()


def test_map_details_show_the_edited_block_by_default_else_a_hint():
    block_map = BlockMap(blocks=rerun_blocks(), edit=EDIT, layer_kinds=["kv", "window"])
    assert set(block_map.details) == {"", "0", "1", "2", "3", "4", "5"}
    assert block_map.details[""] == block_map.details["3"]
    (title,) = select(parse(block_map.details["2"]), "mnb-details-title")
    assert title.text.strip() == "block 2"
    assert "kv read, window read" in block_map.details["2"]
    assert "Hover or click a block" in BlockMap(blocks=rerun_blocks()).details[""]


def test_live_map_of_a_long_prompt_marks_its_tall_box_and_the_row_it_opens_at():
    n, edited = widgets.TALL_ROWS + 8, widgets.TALL_ROWS + 2
    elements = parse(BlockMap(blocks=long_blocks(n, edited)).markup)
    (box,) = select(elements, "mnb-scroll")
    assert box.attrs["data-tall"] == "true"
    assert [r.attrs["data-index"] for r in elements if "data-open" in r.attrs] == [str(edited)]
    assert all(r.attrs.get("tabindex") == "0" for r in select(elements, "mnb-block"))
    short = parse(BlockMap(blocks=rerun_blocks()).markup)
    assert not [e for e in short if "data-tall" in e.attrs or "data-open" in e.attrs]


def test_widget_state_is_json_ready():
    for widget in (
        BlockStrip(n_blocks=6, blocks=rerun_blocks(), edit=EDIT),
        BlockMap(blocks=rerun_blocks(), layer_kinds=["kv"]),
        StoreView(view=store_view()),
    ):
        json.dumps(widget.get_state())


def test_widgets_load_their_front_end_from_the_widgets_folder():
    strip = BlockStrip()
    assert strip._esm == (REPO / "widgets" / "blocks.js").read_text(encoding="utf-8")
    assert strip._css == (REPO / "widgets" / "blocks.css").read_text(encoding="utf-8")


def test_front_end_holds_no_words_of_its_own():
    # Every phrase comes from Python; the ES module only adds behaviour.
    from mlx_nbengine.engine.events import KEPT_BOUNDARY, REASONS
    from mlx_nbengine.notebook.storepicture import FIGURES

    js = (REPO / "widgets" / "blocks.js").read_text(encoding="utf-8")
    code = "\n".join(line for line in js.splitlines() if not line.lstrip().startswith("//"))
    strings = [a or b for a, b in re.findall(r'"([^"]*)"|`([^`]*)`', code)]
    words = [*REASONS.values(), *KEPT_BOUNDARY.values(), *(label for _, label in FIGURES)]
    words += [label for _, label in widgets.DISPLAYS.values()]
    words += ["Hover or click", "first change at token", "image", "tokens", "restored"]
    # Words as words: "details" holds no "tail", "data-image" no image's name.
    said = [w for w in words for s in strings if re.search(rf"(?<![\w-]){re.escape(w)}\b", s)]
    assert strings and said == []


def test_front_end_module_parses():
    # --check parses without running it, as an ES module (read from stdin).
    node = needs.node()  # skips without node (fails under CI=true)
    src = REPO / "widgets" / "blocks.js"
    out = subprocess.run(
        [node, "--input-type=module", "--check"],
        input=src.read_text(encoding="utf-8"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr


# --- image blocks ---------------------------------------------------------------------------


def image_inputs() -> list[SimpleNamespace]:
    """Two images as `%%llm --image` reads them: a name and an RGB picture."""
    from PIL import Image

    return [
        SimpleNamespace(name="cat.png", image=Image.new("RGB", (640, 480), (200, 120, 40))),
        SimpleNamespace(name="<b>dog</b>.jpg", image=Image.new("RGB", (30, 90), (40, 90, 200))),
    ]


def image_blocks() -> list[dict]:
    """A prompt whose image 0 spans blocks 1-2, image 1 starts in block 2, text after."""
    return [
        block(0, "computed", reason="new", records=()),
        block(1, "computed", reason="new", records=(), images=[0]),
        block(2, "computed", reason="new", records=(), images=[0, 1]),
        block(3, "computed", display="tail", reason="tail", records=(), end=60),
    ]


def test_block_dict_reads_the_images_of_an_image_block():
    from mlx_nbengine.engine.events import BlockEvent

    event = BlockEvent(index=1, start=16, end=32, source="computed", seconds=0.1, reason="new")
    assert block_dict(event)["images"] == []
    # A block's `images` (a BlockEvent is a BlockReport), sorted, each once.
    image_block = block_report(1, "computed", images=(2, 0, 2))
    assert block_dict(image_block)["images"] == [0, 2]


def test_image_dicts_hold_each_images_name_size_and_a_64px_thumbnail():
    import base64
    import io

    from PIL import Image

    from mlx_nbengine.notebook.blockinfo import image_dicts

    dicts = image_dicts(image_inputs())
    assert [(d["index"], d["name"], d["width"], d["height"]) for d in dicts] == [
        (0, "cat.png", 640, 480),
        (1, "<b>dog</b>.jpg", 30, 90),
    ]
    thumbs = []
    for d in dicts:
        prefix, data = d["src"].split(",", 1)
        assert prefix == "data:image/png;base64"
        thumbs.append(Image.open(io.BytesIO(base64.b64decode(data))).size)
    assert thumbs == [(64, 48), (21, 64)]
    json.dumps(dicts)


def test_strip_marks_image_blocks_and_names_their_images_on_hover():
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    html = strip_html(image_blocks(), n_blocks=5, images=images)
    elements = parse(html)
    cells = select(elements, "mnb-block", within="mnb-strip")
    assert [c.attrs.get("data-image") for c in cells] == [None, "0", "0 1", None, None]
    assert cells[1].attrs["title"].endswith(" · image 1: cat.png")
    assert cells[2].attrs["title"].endswith(" · image 1: cat.png, image 2: <b>dog</b>.jpg")
    assert "image" not in cells[0].attrs["title"]
    assert [c.text for c in cells[:4]] == ["C", "C", "C", "T"]  # the mark is no text
    assert "<b>dog" not in html  # names are escaped
    # The legend explains the mark, with the number of image blocks.
    (key,) = [k for k in select(elements, "mnb-key") if "data-images" in k.attrs]
    assert key.attrs["data-count"] == "2" and "image blocks" in key.all_text(elements)
    # Without image blocks there is no such key.
    keys = select(parse(strip_html(rerun_blocks(), n_blocks=6)), "mnb-key")
    assert not [k for k in keys if "data-images" in k.attrs]
    # Without the image dicts the title still says which image.
    cells = select(parse(strip_html(image_blocks()[1:2])), "mnb-block")
    (cell,) = [c for c in cells if c.attrs["data-index"] == "1"]
    assert cell.attrs["title"].endswith(" · image 1")


def test_image_blocks_have_a_visible_mark_in_light_and_dark_themes():
    rules = dict(_css_rules())
    (mark,) = [
        body for sel, body in rules.items() if "[data-image]::after" in sel and "content" in body
    ]
    assert 'content:""' in mark.replace(" ", "") and "position:absolute" in mark.replace(" ", "")
    (glyph,) = [body for sel, body in rules.items() if sel.startswith(".mnb-img-mark,")]
    # Drawn in the theme's text colour on the theme's background: readable in both themes.
    assert "var(--mnb-fg)" in glyph and "var(--mnb-bg)" in glyph


def test_map_rows_of_image_blocks_carry_their_images():
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    elements = parse(map_html(image_blocks(), images=images))
    rows = select(elements, "mnb-block", within="mnb-map")
    assert [r.attrs.get("data-image") for r in rows] == [None, "0", "0 1", None]
    chips = select(elements, "mnb-img-chip")
    assert [(c.attrs["data-image-index"], c.attrs["title"]) for c in chips] == [
        ("0", "image 1: cat.png"),
        ("0", "image 1: cat.png"),
        ("1", "image 2: <b>dog</b>.jpg"),
    ]
    assert all(c.within("mnb-text") for c in chips)
    assert [c.all_text(elements) for c in chips] == ["image 1", "image 1", "image 2"]
    assert "data-index" not in " ".join(" ".join(c.attrs) for c in chips)  # rows own that


def test_strip_and_map_widgets_take_the_images_and_mention_them_in_their_text():
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    strip = BlockStrip(n_blocks=4, blocks=image_blocks(), images=images)
    block_map = BlockMap(blocks=image_blocks(), images=images)
    for widget in (strip, block_map):
        state = widget.get_state()
        assert state["images"] == images  # synced to the front end
        json.dumps(state)
        assert 'data-image="0 1"' in widget.html()
        assert widget._repr_mimebundle_()[0]["text/html"] == widget.html()
    assert strip.text() == (
        "4 prompt blocks: 3 computed, 1 tail; 2 image blocks "
        "(image 1: cat.png, image 2: <b>dog</b>.jpg)"
    )
    lines = block_map.text().splitlines()
    assert lines[0].startswith("Block map: 4 blocks; 2 image blocks")
    assert lines[2].endswith("[image 1: cat.png]")
    assert lines[3].endswith("[image 1: cat.png, image 2: <b>dog</b>.jpg]")
    assert "[" not in lines[1] and "[" not in lines[4]
    # No images: no traitlet content, no mention.
    assert BlockStrip(n_blocks=1).images == [] and BlockMap().images == []
    assert "image" not in BlockStrip(n_blocks=6, blocks=rerun_blocks()).text()


def test_strip_previews_hold_each_images_thumbnail_with_its_caption():
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    strip = BlockStrip(n_blocks=4, images=images)
    assert set(strip.previews) == {"0", "1"}
    figure = parse(strip.previews["1"])
    assert figure[1].attrs["src"] == images[1]["src"]  # (figure, img, figcaption)
    assert figure[2].text == "<b>dog</b>.jpg · 30x90"  # escaped: shown as written
    # An image named by a block but not given: its caption alone, no picture.
    strip.add_block(block(0, "computed", reason="new", records=(), images=[2]))
    assert [e.tag for e in parse(strip.previews["2"])] == ["figure", "figcaption"]


# --- a real run -----------------------------------------------------------------------------

SENTENCE = "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. "


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    from mlx_nbengine import Engine

    engine = Engine.load(tiny_model_dir("llama"), block_size=16, cache_dir=tmp_path)
    yield engine
    engine.close()


def _run(engine, prompt):
    from mlx_nbengine.engine import BlockEvent, Finished

    request = engine.submit(prompt, max_tokens=2)
    tokens = request.prompt_tokens
    strip = BlockStrip(
        n_blocks=-(-len(tokens) // engine.block_size),
        block_size=engine.block_size,
        prompt_tokens=len(tokens),
    )
    decode = engine.model.tokenizer.decode
    completion = None
    for event in request.stream():
        if isinstance(event, BlockEvent):
            strip.add_block(block_dict(event, decode=decode, tokens=tokens))
        elif isinstance(event, Finished):
            completion = event.completion
    return strip, completion, decode


def test_a_real_edited_rerun_draws_restored_blocks_then_computed_ones(engine):
    original = SENTENCE * 12
    edited = original.replace("lazy dog", "sleepy cat", 8).replace("sleepy cat", "lazy dog", 7)
    _, first, _ = _run(engine, original)
    strip, completion, decode = _run(engine, edited)
    tokens, report = completion.prompt_tokens, completion.report
    n_blocks = -(-len(tokens) // 16)
    assert n_blocks >= 8
    assert [b["index"] for b in strip.blocks] == list(range(n_blocks))
    cells = select(parse(strip.html()), "mnb-block")
    assert len(cells) == n_blocks and "pending" not in {c.attrs["data-display"] for c in cells}

    # The first changed token, found from the two prompts' ids.
    position = next(
        i for i, (a, b) in enumerate(zip(first.prompt_tokens, tokens, strict=False)) if a != b
    )
    edit = edit_dict(position, tokens, decode=decode, block_size=16)
    block_map = BlockMap(
        blocks=block_dicts(report.blocks, decode=decode, tokens=tokens),
        edit=edit,
        block_size=16,
        prompt_tokens=len(tokens),
    )
    sources = [b["source"] for b in block_map.blocks]
    edited_block = position // 16
    assert all(s != "computed" for s in sources[:edited_block]), sources
    assert all(s == "computed" for s in sources[edited_block:]), sources
    assert block_map.blocks[-1]["display"] == "tail"
    assert [b["source"] for b in strip.blocks] == sources  # live events agree with the report
    assert block_map.blocks[0]["head"]  # real words from the tokenizer
    special = engine.model.text_tokenizer.all_special_ids
    (first_block,) = block_dicts(report.blocks[:1], decode=decode, tokens=tokens, special=special)
    assert tokens[0] in special and "<" not in first_block["head"]  # no <bos> shown
    assert "sleepy" in edit["after"]

    rows = select(parse(block_map.html()), "mnb-block")
    assert len(rows) == n_blocks
    assert report.edit_at == position
    assert block_map.blocks[edited_block]["reason"] == "edited"
    assert {b["reason"] for b in block_map.blocks[edited_block + 1 : -1]} <= {"after_miss"}
    assert rows[edited_block].attrs["data-reason"] == "edited"


def test_a_real_rerun_edited_inside_a_block_draws_it_partly_restored(engine):
    _run(engine, SENTENCE * 4 + "Summarize this text in one line.")
    strip, completion, _ = _run(engine, SENTENCE * 4 + "Summarize this text in two lines.")
    report = completion.report
    (cut,) = [b for b in strip.blocks if b["source"] == "computed" and b["restored"]]
    # Restored to the token: up to the first changed one, inside its block.
    assert cut["start"] < report.edit_at < cut["end"]
    assert cut["restored"] == report.edit_at - cut["start"]
    assert [b["restored"] for b in strip.blocks[: cut["index"]]] == [16] * cut["index"]
    elements = parse(strip.html())
    cell = select(elements, "mnb-block")[cut["index"]]
    assert cell.attrs["data-restored"] == str(cut["restored"])
    assert cell.attrs["data-part"] in {"memory", "disk"}
    computed = cut["end"] - cut["start"] - cut["restored"]
    assert (
        f"{cut['restored']} of {cut['end'] - cut['start']} tokens restored" in cell.attrs["title"]
    )
    assert f"{computed} computed" in cell.attrs["title"]


def test_a_real_store_view_draws_the_engines_cache_view(engine):
    _run(engine, SENTENCE * 4)
    view = engine.cache_view()
    elements = parse(StoreView(view=view).html())
    figures = {f.attrs["data-name"]: f.all_text(elements) for f in select(elements, "mnb-figure")}
    assert f"{view['blocks_held']:,}" in figures["blocks_held"]
    assert len([e for e in elements if e.tag == "polyline"]) == 3  # one request: a chart
    json.dumps(StoreView(view=view).get_state())


# --- the front end in a browser -------------------------------------------------------------

# The ES module with a stand-in for anywidget's model (get/on/off, and set to drive it).
PAGE = """<!doctype html><meta charset="utf-8"><style>{css}</style><body>
<script type="module">
import widget from "data:text/javascript;base64,{esm}";
window.models = {{}};
window.els = {{}};
// attach false: render into an element not yet on the page (as a notebook may), so the
// test can attach it later with window.attach(name).
window.draw = (name, state, attach = true) => {{
  const handlers = {{}};
  const model = {{
    get: (key) => state[key],
    on: (event, f) => (handlers[event] ||= []).push(f),
    off: (event, f) => (handlers[event] = (handlers[event] || []).filter((g) => g !== f)),
    // One message of several traitlets: every value first, then the change events.
    set: (values) => {{
      Object.assign(state, values);
      Object.keys(values).forEach((key) => (handlers["change:" + key] || []).forEach((f) => f()));
    }},
  }};
  const el = document.createElement("div");
  el.id = name;
  if (attach) document.body.append(el);
  window.models[name] = model;
  window.els[name] = el;
  widget.render({{ model, el }});
}};
window.attach = (name) => document.body.append(window.els[name]);
window.ready = true;
</script>"""

READ_CELLS = """(sel) => [...document.querySelectorAll(sel)].map((e) => [
  e.dataset.index, e.dataset.display, e.dataset.reason, e.dataset.edit || null,
  e.getAttribute("title"), e.textContent])"""


def synced(widget) -> dict:
    """The widget's state as the browser gets it (its ES module and CSS left out)."""
    return {k: v for k, v in widget.get_state().items() if k not in ("_esm", "_css")}


def draw(page, name, widget, *, attach=True) -> None:
    page.evaluate("([n, s, a]) => window.draw(n, s, a)", [name, synced(widget), attach])


def resync(page, name, widget) -> None:
    """Send the widget's new state, as one comm message would."""
    page.evaluate("([n, s]) => window.models[n].set(s)", [name, synced(widget)])


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    # Without Playwright or a system Chromium: skipped, failed under CI=true.
    sync_api = needs.module("playwright.sync_api", needs.PLAYWRIGHT_MISSING)
    chromium = needs.chromium()
    import base64

    esm = base64.b64encode((REPO / "widgets" / "blocks.js").read_bytes()).decode()
    css = (REPO / "widgets" / "blocks.css").read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("page") / "widgets.html"
    path.write_text(PAGE.format(css=css, esm=esm), encoding="utf-8")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function("window.ready === true", timeout=30_000)
        yield page
        browser.close()
        assert not errors, errors


def _static_cells(html: str, cls: str) -> list[list]:
    return [
        [e.attrs["data-index"], e.attrs["data-display"], e.attrs["data-reason"],
         e.attrs.get("data-edit"), e.attrs.get("title"), e.text]
        for e in select(parse(html), cls)
    ]  # fmt: skip


def test_live_strip_shows_the_picture_python_drew(page):
    strip = BlockStrip(n_blocks=6, block_size=16, prompt_tokens=85, blocks=rerun_blocks()[:2])
    draw(page, "strip", strip)
    live = page.evaluate(READ_CELLS, "#strip .mnb-strip .mnb-block")
    assert live == _static_cells(strip.html(), "mnb-block")
    assert [c[1] for c in live] == ["memory", "disk"] + ["pending"] * 4
    assert page.inner_text("#strip .mnb-caption") == "6 blocks of 16 tokens · 85 prompt tokens"


def test_live_strip_fills_in_block_by_block_without_moving(page):
    strip = BlockStrip(n_blocks=6, block_size=16, prompt_tokens=85)
    draw(page, "filling", strip)
    places = (
        "() => [...document.querySelectorAll('#filling .mnb-block')]"
        ".map((e) => { const r = e.getBoundingClientRect(); return [r.x, r.y]; })"
    )
    before = page.evaluate(places)
    page.evaluate("window.cells = [...document.querySelectorAll('#filling .mnb-block')]")
    for b in rerun_blocks():
        strip.add_block(b)
        resync(page, "filling", strip)
        display = page.get_attribute(
            f"#filling .mnb-block[data-index='{b['index']}']", "data-display"
        )
        assert display == b["display"]
    strip.set_edit(EDIT)
    resync(page, "filling", strip)
    assert page.evaluate(places) == before  # fixed cells laid out for all blocks from the start
    same = (
        "() => [...document.querySelectorAll('#filling .mnb-block')]"
        ".every((e, i) => e === window.cells[i])"
    )
    assert page.evaluate(same)  # the cells were filled in, never replaced
    live = page.evaluate(READ_CELLS, "#filling .mnb-block")
    assert live == _static_cells(strip.html(), "mnb-block")
    assert page.evaluate("document.querySelector('#filling .mnb-edit').dataset.position") == "53"


def test_live_map_hover_shows_a_block_and_a_click_pins_it(page):
    block_map = BlockMap(blocks=rerun_blocks(), edit=EDIT, block_size=16, prompt_tokens=85,
                         layer_kinds=["window", "kv", "kv"])  # fmt: skip
    draw(page, "map", block_map)
    (title,) = select(parse(block_map.html()), "mnb-title")
    assert page.inner_text("#map .mnb-title") == title.text
    # No strip of its own: the answer's strip is just above it.
    assert page.locator("#map .mnb-map :is(.mnb-cells, .mnb-legend)").count() == 0
    # With nothing chosen the details show the edited block; hovering a row shows another.
    assert "block 3" in page.inner_text("#map .mnb-details")
    page.hover("#map tr.mnb-block[data-index='2']")
    details = page.inner_text("#map .mnb-details")
    assert "block 2" in details and "32–48" in details and "window read" in details
    page.click("#map tr.mnb-block[data-index='1']")
    page.mouse.move(0, 0)
    assert "block 1" in page.inner_text("#map .mnb-details")
    assert page.get_attribute("#map tr.mnb-block[data-index='1']", "aria-selected") == "true"
    assert page.get_attribute("#map tr.mnb-block[data-index='3']", "data-edit") == "true"
    page.click("#map tr.mnb-block[data-index='1']")  # a second click unpins it
    page.mouse.move(0, 0)
    assert "block 3" in page.inner_text("#map .mnb-details")
    assert page.get_attribute("#map tr.mnb-block[data-index='1']", "aria-selected") is None


def test_live_map_rows_open_the_details_by_keyboard(page):
    draw(page, "keys", BlockMap(blocks=rerun_blocks(), edit=EDIT, layer_kinds=["kv"]))
    page.focus("#keys tr.mnb-block[data-index='0']")
    assert "block 0" in page.inner_text("#keys .mnb-details")
    page.keyboard.press("Enter")
    assert page.get_attribute("#keys tr.mnb-block[data-index='0']", "aria-selected") == "true"


def test_live_map_details_of_a_partly_restored_block_split_its_tokens(page):
    draw(page, "cutmap", BlockMap(blocks=cut_blocks(), edit=CUT_EDIT, block_size=16,
                                  prompt_tokens=60, layer_kinds=["kv"]))  # fmt: skip
    assert "12 restored + 4 computed" in page.inner_text("#cutmap tr.mnb-block[data-index='2']")
    details = page.inner_text("#cutmap .mnb-details")  # the edited block, nothing chosen
    assert "16 tokens: 12 restored + 4 computed" in details
    assert "(first 12 tokens restored)" in details
    assert "read for the first 12 tokens, made now for the other 4" in details
    fill = page.get_attribute("#cutmap .mnb-details .mnb-fill", "style")
    assert fill == "--mnb-share: 0.750"


def test_live_store_view_shows_model_text_as_written(page):
    draw(page, "store", StoreView(view=store_view()))
    figures = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll('#store .mnb-figure')]"
        ".map((f) => [f.dataset.name, f.querySelector('.mnb-value').textContent]))"
    )
    assert figures["blocks_held"] == "12" and figures["bytes_held"] == "3.0 MiB"
    assert page.evaluate("document.querySelectorAll('#store svg.mnb-chart polyline').length") == 3
    assert page.evaluate("document.querySelectorAll('#store .mnb-evictions li').length") == 2
    text = page.inner_text("#store")
    assert "Once <em>upon</em> a time" in text  # model text shown as written
    assert page.evaluate("document.querySelectorAll('#store em').length") == 0


def test_live_store_view_follows_a_new_view(page):
    view = StoreView(view={})
    draw(page, "grows", view)
    assert page.locator("#grows svg.mnb-chart[data-empty]").count() == 1
    view.view = store_view()
    resync(page, "grows", view)
    assert page.get_attribute("#grows svg.mnb-chart", "data-points") == "2"
    dashes = page.evaluate(
        "() => [...document.querySelectorAll('#grows .mnb-legend line')]"
        ".map((l) => l.getAttribute('stroke-dasharray'))"
    )
    assert dashes == [None, "7 3", "2 2"]


def test_live_strip_without_show_edit_marks_the_cell_but_shows_no_banner(page):
    strip = BlockStrip(n_blocks=6, blocks=rerun_blocks(), edit=EDIT, show_edit=False)
    draw(page, "quiet", strip)
    assert page.locator("#quiet .mnb-edit").count() == 0
    assert page.get_attribute("#quiet .mnb-block[data-index='3']", "data-edit") == "true"
    strip.show_edit = True
    resync(page, "quiet", strip)
    assert page.get_attribute("#quiet .mnb-edit", "data-position") == "53"


# Where each of a map's rows lies against its rows' box: -1 above, 0 inside, 1 below.
ROW_PLACES = """(id) => {
  const box = document.querySelector(`#${id} .mnb-scroll`).getBoundingClientRect();
  const head = document.querySelector(`#${id} thead`).getBoundingClientRect().height;
  return [...document.querySelectorAll(`#${id} tr.mnb-block`)].map((row) => {
    const r = row.getBoundingClientRect();
    return r.bottom <= box.top + head + 1 ? -1 : r.top >= box.bottom - 1 ? 1 : 0;
  });
}"""


def _draw_map(page, name, blocks, edited, *, attach=True):
    edit = {"position": edited * 16 + 2, "block": edited, "before": "a", "after": "b"}
    block_map = BlockMap(blocks=blocks, edit=edit, block_size=16,
                         prompt_tokens=16 * len(blocks), layer_kinds=["kv"])  # fmt: skip
    draw(page, name, block_map, attach=attach)


def test_live_map_of_up_to_forty_blocks_shows_every_row(page):
    n = widgets.TALL_ROWS
    _draw_map(page, "forty", long_blocks(n, n - 4), n - 4)
    assert page.get_attribute("#forty .mnb-scroll", "data-tall") is None
    assert page.evaluate(ROW_PLACES, "forty") == [0] * n  # the edited and tail rows too


@pytest.mark.parametrize("attach", [True, False], ids=["on-the-page", "attached-later"])
def test_live_map_of_a_long_prompt_opens_at_its_first_computed_block(page, attach):
    name = f"long-{attach}".lower()
    n, edited = widgets.TALL_ROWS + 40, widgets.TALL_ROWS + 32
    _draw_map(page, name, long_blocks(n, edited), edited, attach=attach)
    if not attach:
        page.evaluate("(n) => window.attach(n)", name)
        page.wait_for_function(
            "(n) => document.querySelector(`#${n} .mnb-scroll`).scrollTop > 0", arg=name
        )
    assert page.get_attribute(f"#{name} .mnb-scroll", "data-tall") == "true"
    places = page.evaluate(ROW_PLACES, name)
    assert places[edited:] == [0] * (n - edited)  # from the edit to the tail, in sight
    assert places[0] == -1 and places[edited - 1] == 0  # restored context just above


# A notebook page's own table and list rules, with the selectors JupyterLab and nbconvert
# use for rendered HTML output, placed after the widgets' CSS so only specificity can win.
PAGE_RULES = """
.jp-RenderedHTMLCommon table { table-layout: fixed; margin: 0 auto 1em; border: none; }
.jp-RenderedHTMLCommon td, .jp-RenderedHTMLCommon th, .jp-RenderedHTMLCommon tr {
  padding: 0.5em; line-height: normal; white-space: normal; max-width: none; border: none; }
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td,
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon th,
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon tr { text-align: right; }
.jp-RenderedHTMLCommon tbody tr:nth-child(odd) { background: rgb(255, 0, 0); }
.jp-RenderedHTMLCommon ul:not(.list-inline) { padding-left: 2em; }
.jp-RenderedHTMLCommon ul { list-style: disc; }
"""

READ_STYLES = """(id) => {
  const style = (sel, prop) => getComputedStyle(document.querySelector(`#${id} ${sel}`))[prop];
  const table = document.querySelector(`#${id} .mnb-map table`).getBoundingClientRect();
  const text = document.querySelector(`#${id} td.mnb-text`).getBoundingClientRect();
  return {
    layout: style(".mnb-map table", "tableLayout"),
    text: [style("td.mnb-text", "textAlign"), style("td.mnb-text", "whiteSpace")],
    range: style("td.mnb-range", "textAlign"),
    source: [style("td.mnb-text + td", "textAlign"), style("td.mnb-text + td", "whiteSpace")],
    header: style(".mnb-map th:nth-child(3)", "textAlign"),
    stripes: style(".mnb-map tbody tr", "backgroundColor"),
    list: [style(".mnb-evictions", "paddingLeft"), style(".mnb-evictions", "listStyleType")],
    textShare: text.width / table.width,
  };
}"""


def test_static_tables_keep_their_own_alignment_and_widths_on_a_notebook_page(page):
    html = map_html(rerun_blocks(), edit=EDIT, layer_kinds=["kv"]) + store_html(store_view())
    page.evaluate(
        """([html, rules]) => {
          const out = document.createElement("div");
          out.id = "rendered";
          out.className = "jp-RenderedHTMLCommon jp-OutputArea-output";
          out.style.width = "1000px";
          out.innerHTML = html;
          const style = document.createElement("style");
          style.textContent = rules;
          document.body.append(out, style);
        }""",
        [html, PAGE_RULES],
    )
    styles = page.evaluate(READ_STYLES, "rendered")
    assert styles["layout"] == "auto"
    assert styles["text"] == ["left", "normal"]  # words wrap, never cut
    assert styles["range"] == "right" and styles["header"] == "left"
    assert styles["source"] == ["left", "nowrap"]
    assert styles["stripes"] != "rgb(255, 0, 0)"
    assert styles["list"] == ["0px", "none"]
    assert styles["textShare"] > 0.25  # not one of seven equal fixed columns


def test_map_names_each_layer_kind_once_when_given_one_per_layer():
    html = map_html(rerun_blocks(), layer_kinds=["window", "kv", "window", "kv"])
    (title,) = select(parse(html), "mnb-title")
    assert title.text.endswith("layer kinds: kv + window")
    chips = [e.attrs["data-record"] for e in select(parse(html), "mnb-rec")]
    assert chips[:2] == ["kv", "window"] and len(chips) == 4  # two disk blocks, two kinds


READ_IMAGE_CELLS = """(sel) => [...document.querySelectorAll(sel)].map((e) => [
  e.dataset.index, e.dataset.image || null, e.getAttribute("title"), e.textContent,
  getComputedStyle(e, "::after").content])"""


# The floating preview of the strip drawn in `#id`: hidden, its figures, and whether its
# box lies inside the window (None: no preview).
PREVIEW = """(id) => {
  const root = document.querySelector(`#${id} .mnb-strip`);
  const box = [...document.querySelectorAll('.mnb-preview')].find((e) => e.mnbStrip === root);
  if (!box) return null;
  const r = box.getBoundingClientRect();
  return {
    hidden: box.hidden,
    figures: [...box.querySelectorAll('figure')].map((f) => [f.dataset.imageIndex,
      f.querySelector('img').getAttribute('src'), f.textContent]),
    inside: r.left >= 0 && r.top >= 0 && r.right <= innerWidth && r.bottom <= innerHeight,
    height: r.height,
  };
}"""


def test_live_strip_marks_image_blocks_and_hover_shows_their_thumbnails(page):
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    strip = BlockStrip(n_blocks=5, block_size=16, prompt_tokens=60, blocks=image_blocks(),
                       images=images)  # fmt: skip
    draw(page, "imgstrip", strip)
    live = page.evaluate(READ_IMAGE_CELLS, "#imgstrip .mnb-block")
    static = [
        [e.attrs["data-index"], e.attrs.get("data-image"), e.attrs["title"], e.text]
        for e in select(parse(strip.html()), "mnb-block")
    ]
    assert [row[:4] for row in live] == static
    # The mark: a pseudo-element on image blocks only.
    assert [row[4] != "none" for row in live] == [False, True, True, False, False]
    assert page.get_attribute("#imgstrip .mnb-key[data-images]", "data-count") == "2"
    assert page.evaluate(PREVIEW, "imgstrip")["hidden"]
    page.hover("#imgstrip .mnb-block[data-index='2']")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.mnb-preview img')].every((i) => i.complete)"
    )
    shown = page.evaluate(PREVIEW, "imgstrip")
    assert not shown["hidden"] and shown["height"] > 60, "the whole thumbnail, never clipped"
    assert shown["inside"], "the preview lies inside the window"
    assert shown["figures"] == [
        ["0", images[0]["src"], "cat.png · 640x480"],
        ["1", images[1]["src"], "<b>dog</b>.jpg · 30x90"],
    ]
    page.hover("#imgstrip .mnb-block[data-index='0']")
    assert page.evaluate(PREVIEW, "imgstrip")["hidden"]  # a text block shows none
    page.hover("#imgstrip .mnb-block[data-index='1']")
    assert len(page.evaluate(PREVIEW, "imgstrip")["figures"]) == 1
    page.mouse.move(0, 0)
    assert page.evaluate(PREVIEW, "imgstrip")["hidden"]


def test_live_strip_keeps_its_preview_while_blocks_arrive(page):
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    strip = BlockStrip(n_blocks=5, block_size=16, prompt_tokens=60, images=images)
    draw(page, "imgfill", strip)
    strip.add_blocks(image_blocks())
    resync(page, "imgfill", strip)
    page.hover("#imgfill .mnb-block[data-index='1']")
    shown = page.evaluate(PREVIEW, "imgfill")
    assert not shown["hidden"] and shown["figures"]


def test_live_map_marks_image_rows_and_its_details_show_the_thumbnails(page):
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    block_map = BlockMap(blocks=image_blocks(), block_size=16, prompt_tokens=60,
                         layer_kinds=["kv"], images=images)  # fmt: skip
    draw(page, "imgmap", block_map)
    chips = page.evaluate(
        "() => [...document.querySelectorAll('#imgmap tr.mnb-block')].map((r) => "
        "[...r.querySelectorAll('.mnb-img-chip')].map((c) => c.getAttribute('title')))"
    )
    assert chips == [[], ["image 1: cat.png"], ["image 1: cat.png", "image 2: <b>dog</b>.jpg"], []]
    page.hover("#imgmap tr.mnb-block[data-index='2']")
    details = page.inner_text("#imgmap .mnb-details")
    assert "block 2" in details and "image 1: cat.png, image 2: <b>dog</b>.jpg" in details
    srcs = page.evaluate(
        "() => [...document.querySelectorAll('#imgmap .mnb-details img')].map((i) => i.src)"
    )
    assert srcs == [images[0]["src"], images[1]["src"]]
    page.hover("#imgmap tr.mnb-block[data-index='0']")
    assert page.locator("#imgmap .mnb-details img").count() == 0

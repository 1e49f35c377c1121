"""The notebook's widgets: block dicts, their HTML, the widget classes, the ES module, a real run.

HTML (static, or the live markup a widget sends its ES module) is read back with the
standard library's HTML parser into a list of elements (tag, attributes, own text), so the
tests check the DOM contract's selectors (classes and data- attributes) rather than
spelling. A tiny real model draws a prompt and an edited re-run; the ES module runs in
Chromium in tests/browser/test_widgets_page.py.
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
    assert fill.attrs["data-share"] == "15"  # twentieths: 12 of 16 restored
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
    assert fill.attrs["data-share"] == cut_fill.attrs["data-share"]


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
    # The colour comes from the stylesheet by data-series (test_stylesheets), the dash here.
    elements = parse(store_html(store_view()))

    def look(line: Element) -> str:
        return line.attrs.get("stroke-dasharray", "")

    series = {e.attrs["data-series"]: look(e) for e in elements if e.tag == "polyline"}
    keys = {
        e.parent.parent.attrs["data-series"]: look(e)
        for e in elements
        if e.tag == "line" and e.within("mnb-legend")
    }
    assert keys == series
    assert len(set(series.values())) == 3  # told apart without colour


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


def test_map_names_each_layer_kind_once_when_given_one_per_layer():
    html = map_html(rerun_blocks(), layer_kinds=["window", "kv", "window", "kv"])
    (title,) = select(parse(html), "mnb-title")
    assert title.text.endswith("layer kinds: kv + window")
    chips = [e.attrs["data-record"] for e in select(parse(html), "mnb-rec")]
    assert chips[:2] == ["kv", "window"] and len(chips) == 4  # two disk blocks, two kinds

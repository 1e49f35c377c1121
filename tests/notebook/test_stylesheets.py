"""The notebook's HTML carries CSS classes and data attributes only: every look comes from
the two stylesheets in ``widgets/`` (``blocks.css`` for the pictures and widgets,
``views.css`` for answers, images and tables), each display starting with its sheet as a
``<style>`` block, so a saved or exported notebook keeps its look."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from PIL import Image

from mlx_nbengine.models.sources import LocalModel
from mlx_nbengine.notebook import pictures, storepicture
from mlx_nbengine.notebook.answerview import AnswerView
from mlx_nbengine.notebook.imagesview import images_bundle
from mlx_nbengine.notebook.tables import key_value_bundle, models_bundle

NOTEBOOK = Path(pictures.__file__).resolve().parent


def test_no_module_of_the_notebook_writes_an_inline_style():
    # HTML is written in f-strings: an attribute would show as `style="` or `style=\"`.
    found = [
        f"{path.name}:{n}"
        for path in sorted(NOTEBOOK.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"""\bstyle=\\?["']""", line)
    ]
    assert not found, f"inline style attributes: {found}"


def test_blocks_css_has_a_rule_for_every_value_the_pictures_write():
    css = pictures.stylesheet("blocks.css")
    for k in range(1, pictures.FILL_STEPS):
        assert f'.mnb-fill[data-share="{k}"]{{--mnb-share: {k / pictures.FILL_STEPS:g};}}' in css
    for k in range(2, pictures.MAX_PANEL_IMAGES + 1):
        assert f'.mnb-details[data-images="{k}"]{{--mnb-images: {k};}}' in css
    for key, *_ in storepicture.SERIES:
        assert f'polyline[data-series="{key}"]{{stroke: var(' in css


def test_a_fill_is_never_drawn_empty_or_full():
    assert [pictures.fill_twentieths(r, 16 - r) for r in (0, 1, 8, 12, 15, 16)] == [
        1,
        1,
        10,
        15,
        19,
        19,
    ]


def _starts_with_views_css(markup: str) -> str:
    sheet = re.match(r"<style>(.*?)</style>", markup, re.S)
    assert sheet and sheet.group(1) == pictures.stylesheet("views.css")
    return markup[sheet.end() :]


def test_each_plain_display_starts_with_the_views_stylesheet():
    view = AnswerView(title="a title")
    view.text = "Line one <em>\nLine two"
    rest = _starts_with_views_css(view.html())
    assert rest.startswith('<div class="mnb-answer"><div class="mnb-title">a title</div>')
    assert '<pre class="mnb-text">Line one &lt;em&gt;\nLine two</pre>' in rest

    image = SimpleNamespace(name="cat.png", width=64, height=48, image=Image.new("RGB", (64, 48)))
    rest = _starts_with_views_css(images_bundle([image])["text/html"])
    assert rest.startswith('<div class="mnb-images"><figure class="mnb-image" data-index="0">')

    rest = _starts_with_views_css(key_value_bundle("cache", [("blocks", "3")])["text/html"])
    assert rest.startswith('<div class="mnb-kv"><div class="mnb-kv-title">cache</div>')


def test_views_css_styles_what_the_displays_write():
    css = pictures.stylesheet("views.css")
    for selector in (
        ".mnb-answer>.mnb-text{white-space: pre-wrap",
        ".mnb-answer>.mnb-status{",
        ".mnb-images>.mnb-image>img{",
        ".mnb-kv th{",
        '.mnb-models [data-align="right"]{text-align: right',
    ):
        assert selector in css, selector
    model = LocalModel(
        name="m",
        source="hub cache",
        path=Path("m"),
        category="gguf",
        size_bytes=2048,
        converted=True,
    )
    markup = models_bundle([model], looked_in="looked in here")["text/html"]
    rest = _starts_with_views_css(markup)
    assert '<th data-align="right">size</th>' in rest and "style=" not in rest

"""`%%llm --image` in a real IPython kernel with a tiny random-weight vision model.

One kernel per module (as in tests/integration/test_kernel.py, whose `Kernel` driver this reuses)
loads the extension and a tiny qwen2_vl model written by
`mlx_nbengine.testing.make_tiny_model`, then runs image cells: the cell's outputs must
hold the thumbnail display (``div.mnb-images``, a ``data:image/png`` ``<img>`` per image)
before the answer display, and the answer must finish with its summary line. Nothing is
faked here: the real `Engine` reads the image.
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("jupyter_client")

from kernelwatch import kernel_manager  # noqa: E402  (tests/ is on sys.path)
from test_kernel import (  # noqa: E402
    REPO,
    WIDGET_VIEW,
    Kernel,
    the_strip,
    widget_state,
)

# The summary line that ends a finished answer (see summary.summary_line).
SUMMARY = re.compile(
    r"\d[\d,]* prompt tokens(: [\d,]+ restored.*computed|, all computed); .*"
    r"(end of text after|stopped at max tokens \(|stopped after)"
)


def write_png(path: Path, width: int = 56, height: int = 56) -> Path:
    """A small RGB picture (a colour gradient with a square) saved as PNG."""
    import numpy as np
    from PIL import Image

    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    pixels[..., 1] = np.linspace(255, 0, height, dtype=np.uint8)[:, None]
    pixels[height // 4 : height // 2, width // 4 : width // 2, 2] = 255
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def vision_kernel(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("qwen2_vl")
    root = tmp_path_factory.mktemp("image-kernel")
    (root / "home").mkdir()
    env = {
        "HOME": str(root / "home"),
        "HF_HOME": str(root / "hf"),
        "HF_HUB_CACHE": str(root / "hf" / "hub"),
        "HF_HUB_OFFLINE": "1",
        "MLX_NBENGINE_HOME": str(root / "mlx_nbengine"),
    }
    km = kernel_manager(root, env=env)
    km.start_kernel(cwd=str(REPO))
    kernel = Kernel(km)
    try:
        kernel.ok("%load_ext mlx_nbengine")
        kernel.ok(f"%load_model {model} --block-size 16 --cache-dir {root} --parallel 2")
        yield kernel
    finally:
        kernel.close()


def displays(cell) -> list[dict]:
    """The cell's display_data messages that are not widget views, in order."""
    return [m for m in cell.of_type("display_data") if WIDGET_VIEW not in m["content"]["data"]]


def test_an_image_cell_shows_the_thumbnail_above_a_finished_answer(vision_kernel, tmp_path):
    from PIL import Image

    picture = write_png(tmp_path / "square.png")
    cell = vision_kernel.ok(
        f"%%llm --image {picture} --max-tokens 4\nWhat is in this picture?", timeout=300
    )
    shown = displays(cell)
    assert len(shown) >= 2, [m["content"]["data"].get("text/plain") for m in shown]
    images, answer = shown[0]["content"]["data"], shown[1]["content"]["data"]
    # The thumbnails come first ...
    assert images["text/plain"] == "[image 1: square.png, 56x56]"
    markup = images["text/html"]
    assert 'class="mnb-images"' in markup and '<figure class="mnb-image" data-index="0"' in markup
    (source,) = re.findall(r'<img src="data:image/png;base64,([^"]+)"', markup)
    assert Image.open(io.BytesIO(base64.b64decode(source))).size == (56, 56)
    assert "square.png · 56x56" in markup
    # ... then the answer, which finished: its last state ends with the summary line.
    assert '<div class="mnb-answer">' in answer["text/html"]
    assert shown[0]["header"]["date"] <= shown[1]["header"]["date"]
    assert SUMMARY.search(cell.final_text()), cell.final_text()
    assert "[failed]" not in cell.final_text()


def test_the_strip_and_block_map_mark_the_blocks_holding_the_image(vision_kernel):
    vision_kernel.ok(
        "import numpy as np\n"
        "photo = np.zeros((48, 64, 3), dtype=np.uint8)\n"
        "photo[:, :32] = (250, 200, 0)"
    )
    cell = vision_kernel.ok(
        "%%llm --image photo --blocks --max-tokens 2\nDescribe the colours.", timeout=300
    )
    assert displays(cell)[0]["content"]["data"]["text/plain"] == "[image 1: photo, 64x48]"
    assert SUMMARY.search(cell.final_text()), cell.final_text()
    strip = the_strip(vision_kernel, cell)
    (opened,) = cell.widgets("map")
    block_map = widget_state(vision_kernel, opened)
    for state in (strip, block_map):
        (image,) = state["images"]
        assert (image["index"], image["name"], image["width"], image["height"]) == (
            0,
            "photo",
            64,
            48,
        )
        assert image["src"].startswith("data:image/png;base64,")
        marked = [b["index"] for b in state["blocks"] if b["images"]]
        assert marked, "some block holds the image's tokens"
        assert all(b["images"] == [0] for b in state["blocks"] if b["images"])
        # The image's tokens are one run: its blocks are consecutive.
        assert marked == list(range(marked[0], marked[-1] + 1))

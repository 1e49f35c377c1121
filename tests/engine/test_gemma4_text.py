"""Gemma 4's text decoder (issue 35) on the engine: tiny ``gemma4_text`` models with what
E2B has (per-layer inputs; the last half of the layers reading the keys and values of an
earlier layer, so mlx-lm's cache list is shorter than the layers; double-wide MLPs there;
sliding and full attention with different head widths) decode the library's greedy tokens,
and an edited prompt restored from the block store gives a cold run's tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from restoring import restored_and_cold  # tests/ is on sys.path

from mlx_nbengine import Engine
from mlx_nbengine.models import load
from mlx_nbengine.testing import make_tiny_model, make_tiny_quantized_model


def greedy(model, prompt: list[int], n: int = 24) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for (token, _), _ in zip(steps, range(n), strict=False)]


def test_the_tiny_family_has_what_e2b_has(tmp_path):
    lm = load(make_tiny_model("gemma4_text", tmp_path / "m"))
    try:
        args = lm.model.args
        assert args.hidden_size_per_layer_input > 0 and args.num_kv_shared_layers == 3
        assert len(lm.model.make_cache()) == 3 < len(lm.model.layers) == 6
        assert {layer.self_attn.head_dim for layer in lm.model.layers} == {32, 64}
        widths = [layer.mlp.gate_proj.weight.shape[0] for layer in lm.model.layers]
        assert widths == [128] * 3 + [256] * 3  # double-wide where the KV is shared
    finally:
        lm.release_routes()


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q8"])
def test_a_tiny_gemma4_decodes_the_library_s_greedy_tokens(tmp_path, quantized):
    if quantized:
        path = make_tiny_quantized_model("gemma4_text", tmp_path / "q8", bits=8, group_size=32)
    else:
        path = make_tiny_model("gemma4_text", tmp_path / "f32")
    lm = load(path)
    try:
        assert lm.routing.names()  # our routes run it
        prompt = [2, *[5 + (i * 7) % 400 for i in range(300)]]  # past the 64-token window
        ours = greedy(lm.model, prompt)
        with lm.routing.suspended():
            library = greedy(lm.model, prompt)
        assert ours == library
    finally:
        lm.release_routes()


def test_an_edited_gemma4_prompt_restores_to_a_cold_runs_tokens(tmp_path):
    path = make_tiny_model("gemma4_text", tmp_path / "m")
    prompt = [2, *[5 + (i * 11) % 400 for i in range(700)]]
    edited = [*prompt[:600], 9, *prompt[601:]]
    warm, cold = restored_and_cold(path, tmp_path, prompt, edited)
    # Two whole blocks before the edit come back from disk, windows and shared layers alike.
    assert warm.report.restore_source == "disk"
    assert [b.source for b in warm.report.blocks[:3]] == ["disk", "disk", "computed"]
    assert warm.tokens == cold.tokens


def test_the_engine_gives_the_librarys_tokens_over_many_prefill_steps(tmp_path):
    # A prefill step that samples nothing evaluates only the caches: the layers reading
    # earlier layers' keys and values write none, so MLX computes them for the final
    # step only. The tokens are still the library's, computed layer by layer throughout.
    path = make_tiny_model("gemma4_text", tmp_path / "m")
    prompt = [2, *[5 + (i * 13) % 400 for i in range(600)]]
    with Engine.load(path, block_size=64, cache_dir=tmp_path) as engine:
        done = engine.submit(prompt, max_tokens=10).result(timeout=300)
        lm = engine.model
        with lm.routing.suspended():
            library = greedy(lm.model, prompt, 10)
    assert len(done.report.blocks) >= 9  # many blocks, many steps
    assert done.tokens == library

"""Prefill steps (`engine.steps`) as a request sees them: where a model's records can all be
taken after a step that crossed a block boundary, an appended turn (a restore that ends
inside a block, then new tokens) is one model call, and every block it completed is stored
as if it had been computed block by block; a recurrent model whose states cannot be tapped
inside a step still steps from boundary to boundary."""

from __future__ import annotations

import pytest

from mlx_nbengine import Engine
from mlx_nbengine.engine import Progress
from mlx_nbengine.testing import make_tiny_model

BS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        fam: make_tiny_model(fam, root / fam, sliding_window=24) for fam in ("llama", "gemma3_text")
    }


def prefill_steps(engine: Engine, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Where each prefill step of a request for `prompt` ended, and its tokens."""
    request = engine.submit(prompt, max_tokens=3)
    ends = [e.done for e in request.stream() if isinstance(e, Progress) and e.phase == "prefill"]
    return ends, request.result().tokens


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_an_appended_turn_is_one_prefill_step_across_block_boundaries(models, tmp_path, family):
    context = [2, *range(10, 10 + 3 * BS + 5)]  # ends inside block 3
    turn = context + list(range(200, 200 + 2 * BS + 7))  # crosses two boundaries
    with Engine.load(models[family], block_size=BS, cache_dir=tmp_path) as engine:
        prefill_steps(engine, context)
        engine.wait_for_saves()
        ends, tokens = prefill_steps(engine, turn)
        # Restored to the context's end, then one step to the token before the last, which
        # the decode step feeds: no step stops at a boundary on the way.
        restored = len(context) - 1
        steps = [e for e in ends if e > restored]
        assert steps[0] == len(turn) - 1 and all(e % BS for e in steps), ends
        engine.wait_for_saves()
        # The blocks the long step completed are stored: the same turn again restores them.
        stored = engine.submit(turn, max_tokens=3)
        assert stored.result().report.restored_tokens == len(turn) - 1
    with Engine.load(models[family], block_size=BS, store=False) as cold:
        assert cold.submit(turn, max_tokens=3).result().tokens == tokens

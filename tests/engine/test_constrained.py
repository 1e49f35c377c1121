"""Grammar-constrained decoding (`Engine.submit(grammar=...)`) on tiny random models.

A random model writes whatever its weights favour; under a grammar every token it gets is
one the grammar takes, so its output always matches, greedy or sampled, alone or batched
with unconstrained requests (which keep the tokens they get alone).
"""

from __future__ import annotations

import contextlib
import json
import threading

import jsonschema
import llguidance
import pytest

from mlx_nbengine import Engine
from mlx_nbengine.engine import InvalidRequestError, TextDelta
from mlx_nbengine.errors import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "unit", "days", "alerts"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def engine_factory(tiny_model_dir, tmp_path):
    engines = []

    def make(family="llama", **kwargs):
        kwargs.setdefault("block_size", 32)
        kwargs.setdefault("cache_dir", tmp_path)
        engine = Engine.load(tiny_model_dir(family), **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@contextlib.contextmanager
def arriving_together(engine):
    """Hold the generation thread so the requests submitted in the block arrive together."""
    entered, release = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(30)

    holder = threading.Thread(target=engine.on_model_thread, args=(hold,))
    holder.start()
    assert entered.wait(30)
    try:
        yield
    finally:
        release.set()
        holder.join()


def valid(done):
    value = json.loads(done.text)
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_a_greedy_constrained_request_matches_its_schema_and_stops_there(engine_factory, family):
    engine = engine_factory(family)
    done = engine.submit(PROMPT, max_tokens=200, grammar=GRAMMAR).result(timeout=120)
    valid(done)
    assert done.finish_reason == "stop" and done.stop_reason == "grammar"
    again = engine.submit(PROMPT, max_tokens=200, grammar=GRAMMAR).result(timeout=120)
    assert again.tokens == done.tokens  # greedy: the same tokens every time


def test_sampled_constrained_requests_match_and_repeat_by_seed(engine_factory):
    engine = engine_factory("llama")
    args = dict(max_tokens=200, grammar=GRAMMAR, temperature=1.5, top_p=0.95)
    runs = [engine.submit(PROMPT, seed=s, **args).result(timeout=120) for s in (1, 1, 2, 3)]
    for done in runs:
        valid(done)
    assert runs[0].tokens == runs[1].tokens
    assert len({tuple(d.tokens) for d in runs}) > 1  # the draws do differ by seed


def test_the_graph_sampling_path_masks_too(engine_factory):
    # The path GPUs take for sampled rows (forced on the CPU): constrained rows still are
    # drawn on the host, after their mask; an unconstrained sampled row keeps its draws.
    engine = engine_factory("llama", parallel=2)
    engine.internals.host_sampling = False
    free = dict(max_tokens=12, temperature=0.9, seed=4)
    alone = engine.submit(PROMPT, **free).result(timeout=120).tokens
    with arriving_together(engine):
        constrained = engine.submit(PROMPT, max_tokens=200, grammar=GRAMMAR, temperature=0.9)
        other = engine.submit(PROMPT, **free)
    valid(constrained.result(timeout=120))
    assert other.result(timeout=120).tokens == alone


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_unconstrained_request_batched_with_a_constrained_one_gets_its_own_tokens(
    engine_factory, temperature
):
    free = dict(max_tokens=40, temperature=temperature, seed=9)
    alone = engine_factory("gemma3_text", parallel=1).submit(PROMPT, **free)
    alone_tokens = alone.result(timeout=120).tokens
    engine = engine_factory("gemma3_text", parallel=4)
    with arriving_together(engine):
        constrained = engine.submit(PROMPT, max_tokens=200, grammar=GRAMMAR)
        other = engine.submit(PROMPT, **free)
    valid(constrained.result(timeout=120))
    assert other.result(timeout=120).tokens == alone_tokens
    assert engine.stats()["active"] == 0


def test_a_constrained_request_joining_a_decoding_batch(engine_factory):
    engine = engine_factory("llama", parallel=2)
    long = engine.submit(PROMPT, max_tokens=120)
    for event in long.stream(timeout=120):
        if isinstance(event, TextDelta):
            break
    done = engine.submit(PROMPT, max_tokens=200, grammar=GRAMMAR).result(timeout=120)
    valid(done)
    alone = engine_factory("llama", parallel=1).submit(PROMPT, max_tokens=120)
    assert long.result(timeout=120).tokens == alone.result(timeout=120).tokens


def test_a_lark_grammar_and_eos_where_the_grammar_may_end(engine_factory):
    engine = engine_factory("llama")
    # After "yes" or "no" the grammar is complete; after "maybe" it may go on ("s"), so
    # the mask also offers EOS there.
    grammar = 'start: "yes" | "no" | "maybe" "s"?'
    done = engine.submit("Answer:", max_tokens=20, grammar=grammar).result(timeout=120)
    assert done.text in ("yes", "no", "maybe", "maybes")
    assert done.finish_reason == "stop" and done.stop_reason in ("grammar", "eos")


def test_max_tokens_still_bounds_a_constrained_request(engine_factory):
    engine = engine_factory("llama")
    done = engine.submit("x", max_tokens=5, grammar="start: /[a-z]+/").result(timeout=120)
    assert done.finish_reason == "length" and len(done.tokens) == 5
    assert done.text.isalpha() and done.text.islower()


@pytest.mark.parametrize(
    "grammar",
    [
        "start: undefined_rule",
        '{"grammars": [{"lark_grammar": "start: ("}]}',
        "",
        42,
    ],
)
def test_a_bad_grammar_is_a_one_line_invalid_request(engine_factory, grammar):
    engine = engine_factory("llama")
    with pytest.raises(InvalidRequestError) as caught:
        engine.submit("x", grammar=grammar)
    message = str(caught.value)
    assert message and "\n" not in message and "grammar" in message
    assert engine.stats()["active"] == 0 and engine.stats()["queued"] == 0
    assert engine.submit("x", max_tokens=3).result(timeout=120).finish_reason == "length"


def test_cancel_mid_constraint_frees_the_slot(engine_factory):
    engine = engine_factory("llama", parallel=1)
    request = engine.submit("x", max_tokens=5000, grammar="start: /[a-z ]+/")
    deltas = 0
    for event in request.stream(timeout=120):
        deltas += isinstance(event, TextDelta)
        if deltas >= 3:
            break
    request.cancel()
    done = request.result(timeout=120)
    assert done.finish_reason == "cancelled"
    assert set(done.text) <= set("abcdefghijklmnopqrstuvwxyz ")
    after = engine.submit(PROMPT, max_tokens=200, grammar=GRAMMAR).result(timeout=120)
    valid(after)
    assert engine.stats()["active"] == 0


def test_a_matcher_that_fails_mid_way_fails_its_request_only(engine_factory, monkeypatch):
    engine = engine_factory("llama", parallel=2)
    make = engine._constraint

    def failing(grammar):
        # A real matcher, put in its error state (a token the grammar refuses) before the
        # request reaches the generation thread: its first step finds the error.
        constraint = make(grammar)
        assert not constraint.matcher.consume_token(engine.model.tokenizer.encode("z")[-1])
        return constraint

    monkeypatch.setattr(engine, "_constraint", failing)
    alone = engine.submit(PROMPT, max_tokens=30).result(timeout=120).tokens
    with arriving_together(engine):
        broken = engine.submit(PROMPT, max_tokens=200, grammar=GRAMMAR)
        other = engine.submit(PROMPT, max_tokens=30)
    with pytest.raises(GrammarError, match="grammar failed"):
        broken.result(timeout=120)
    assert other.result(timeout=120).tokens == alone
    assert engine.stats()["active"] == 0


def test_a_vision_models_text_requests_take_grammars_too(engine_factory):
    engine = engine_factory("qwen2_vl")
    done = engine.submit(PROMPT, max_tokens=200, grammar=GRAMMAR).result(timeout=120)
    valid(done)
    assert done.stop_reason == "grammar"


def test_a_sharded_engine_refuses_grammars_in_one_line(engine_factory):
    # The refusal is decided before anything reaches the ranks: checked here on a one-process
    # engine marked as sharded for the call.
    engine = engine_factory("llama")
    engine.sharded = object()
    try:
        with pytest.raises(InvalidRequestError, match="sharded") as caught:
            engine.submit("x", grammar=GRAMMAR)
    finally:
        engine.sharded = None
    assert "\n" not in str(caught.value)

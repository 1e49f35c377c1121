"""The scheduler driven turn by turn on this thread: no generation thread, no store.

Each test builds a `Runner` and a `Scheduler` around a tiny random llama, submits
sequences and calls `tick` itself, looking at the phases between turns. Every answer is
checked against whole-model greedy decoding of its prompt alone.
"""

from __future__ import annotations

import itertools
import random
import time

import mlx.core as mx
import pytest

from mlx_nbengine.engine.request import Request
from mlx_nbengine.engine.runner import Runner
from mlx_nbengine.engine.scheduler import Scheduler
from mlx_nbengine.engine.sequence import Phase, Sequence
from mlx_nbengine.engine.text import TextStream
from mlx_nbengine.models import load

BS = 16
BOS = 2
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load(tiny_model_dir("llama"))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [BOS] + [rng.randrange(5, 512) for _ in range(n - 1)]


def greedy(lm, tokens: list[int], n: int) -> list[int]:
    """`n` greedy tokens of `tokens` alone, through whole-model calls."""
    cache, out = lm.make_cache(), []
    x = mx.array([tokens], dtype=mx.uint32)
    for _ in range(n):
        token = mx.argmax(lm.model(x, cache=cache)[0, -1]).item()
        out.append(token)
        x = mx.array([[token]], dtype=mx.uint32)
    return out


def scheduler_for(lm, **kwargs) -> Scheduler:
    kwargs.setdefault("parallel", 4)
    kwargs.setdefault("max_prefill_step", 64)
    return Scheduler(Runner(lm), block_size=BS, **kwargs)


def submit(scheduler: Scheduler, lm, tokens: list[int], *, max_tokens: int) -> Sequence:
    seq = Sequence(
        request=Request(next(_ids), tokens, scheduler.cancel),
        prompt=tokens,
        max_tokens=max_tokens,
        sampling={"temperature": 0.0, "top_p": 1.0, "seed": None},
        greedy=True,
        text=TextStream(lm.tokenizer.detokenizer, []),
        eos=frozenset(),  # no early end: every answer runs to `max_tokens`
        block_size=BS,
        submitted_at=time.perf_counter(),
    )
    scheduler.submit(seq)
    return seq


def run_out(scheduler: Scheduler, seqs: list[Sequence], *, turns: int = 200) -> None:
    for _ in range(turns):
        if all(s.phase is Phase.DONE for s in seqs):
            return
        scheduler.tick()
    raise AssertionError("the sequences did not finish")


def tokens_of(seq: Sequence) -> list[int]:
    return seq.request.result(timeout=0).tokens


def test_a_burst_of_four_is_admitted_in_one_turn_and_each_answers_as_alone(lm):
    scheduler = scheduler_for(lm)
    prompts = [prompt(n, seed) for seed, n in enumerate((40, 45, 50, 60))]
    seqs = [submit(scheduler, lm, p, max_tokens=6) for p in prompts]
    extra = submit(scheduler, lm, prompt(30, 9), max_tokens=3)
    scheduler.tick()
    assert all(s.phase in (Phase.PREFILLING, Phase.DECODING) for s in seqs)
    assert extra.phase is Phase.WAITING  # a fifth finds no free slot
    assert scheduler.active == 4 and scheduler.queued == 1
    run_out(scheduler, [*seqs, extra])
    assert [tokens_of(s) for s in seqs] == [greedy(lm, p, 6) for p in prompts]
    assert tokens_of(extra) == greedy(lm, extra.prompt, 3)


def test_a_late_sequence_joins_while_the_first_keeps_decoding(lm):
    scheduler = scheduler_for(lm)
    first = submit(scheduler, lm, prompt(40, 1), max_tokens=20)
    while len(first.generated) < 3:
        scheduler.tick()
    late = submit(scheduler, lm, prompt(35, 2), max_tokens=5)
    while late.phase is not Phase.DECODING:
        before = len(first.generated)
        scheduler.tick()
        assert len(first.generated) > before  # every turn decodes the first too
    assert scheduler.decoder.members == [first, late]
    run_out(scheduler, [first, late])
    assert tokens_of(first) == greedy(lm, first.prompt, 20)
    assert tokens_of(late) == greedy(lm, late.prompt, 5)


def test_a_cancel_between_turns_ends_that_sequence_and_the_others_go_on(lm):
    scheduler = scheduler_for(lm)
    kept = submit(scheduler, lm, prompt(40, 3), max_tokens=12)
    dropped = submit(scheduler, lm, prompt(40, 4), max_tokens=12)
    while dropped.phase is not Phase.DECODING or len(dropped.generated) < 2:
        scheduler.tick()
    dropped.request.cancel()
    done = dropped.request.result(timeout=0)
    assert done.finish_reason == "cancelled" and 2 <= len(done.tokens) < 12
    assert done.tokens == greedy(lm, dropped.prompt, len(done.tokens))
    assert scheduler.decoder.members == [kept]
    run_out(scheduler, [kept])
    assert tokens_of(kept) == greedy(lm, kept.prompt, 12)


def test_final_steps_due_together_are_one_grouped_model_call(lm):
    scheduler = scheduler_for(lm)
    # Each prompt's prefill (all but its last token) lies inside its first block.
    prompts = [prompt(n, seed) for seed, n in enumerate((9, 12, 14), start=5)]
    seqs = [submit(scheduler, lm, p, max_tokens=4) for p in prompts]
    scheduler.tick()
    assert scheduler.group_prefills == 1
    assert all(s.phase is Phase.DECODING for s in seqs)
    assert scheduler.decoder.members == seqs  # they joined together, in order
    run_out(scheduler, seqs)
    assert [tokens_of(s) for s in seqs] == [greedy(lm, p, 4) for p in prompts]
    assert scheduler.group_prefills == 1


def test_a_prompt_that_extends_the_last_answer_is_restored_from_the_hot_cache(lm):
    scheduler = scheduler_for(lm)
    first = submit(scheduler, lm, prompt(40, 7), max_tokens=5)
    run_out(scheduler, [first])
    held = first.prompt + tokens_of(first)[:-1]  # the last answer token was never fed
    assert scheduler.hot.tokens == held
    follow = submit(scheduler, lm, held + prompt(12, 8)[1:], max_tokens=4)
    run_out(scheduler, [follow])
    report = follow.request.result(timeout=0).report
    assert report.restore_source == "memory" and report.restored_tokens == len(held)
    assert tokens_of(follow) == greedy(lm, follow.prompt, 4)

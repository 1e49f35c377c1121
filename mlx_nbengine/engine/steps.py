"""Prefill step planning: where a sequence's next model call ends, and which final steps
share one call. Pure functions of a sequence's prompt and cache length.

A *step* is ``(start, end)``: the prompt tokens one model call feeds. A checkpoint exists
at every boundary: where a model's records can all be taken after a step that crossed the
boundary (`across`: no recurrent state, or one the runner taps inside the step) a step runs
up to `max_step` tokens from wherever the cache ends, so an agent's next turn (a restore
that ended inside a block, then a few hundred new tokens) is one model call; otherwise steps
end on block boundaries (`cache.prefill_steps`) and a restore that ended inside a block
first reaches the next boundary. A sequence's *final step*
completes its prefill: it ends before the prompt's last token, which the decode step the
sequence joins feeds (or, alone and short, it takes that token too and samples there).

*Parity*: restored arrays are the stored ones, but the tokens after a restore are
computed in steps of other shapes than a cold run's (from a cut to the next boundary,
the last token alone), so their logits may differ from a cold run's in the last bits
(the README gives the measured differences).
"""

from __future__ import annotations

from collections.abc import Callable

from mlx_nbengine.cache import prefill_steps
from mlx_nbengine.engine.sequence import Sequence

# A sequence alone whose final prefill step is at most this many tokens (an edited question)
# takes its last prompt token into that step and samples there: one model call less. Only
# for short steps, since the output head may then be computed for every row of the step.
ALONE_FINAL_STEP = 32
# Padding tokens a prefill group may add per member beyond the first: a short step costs
# about one read of the weights, worth this many tokens of compute on small models.
GROUP_PAD_TOKENS = 64


def next_step(
    seq: Sequence,
    *,
    block_size: int,
    max_step: int,
    bidirectional: bool = False,
    image_ends: bool = False,
    alone: bool = False,
    across: bool = False,
) -> tuple[int, int]:
    """The tokens ``start:end`` of `seq`'s next prefill step, at most `max_step` long
    (whole blocks unless `across`). `bidirectional`: an image is computed in one call (a step ending
    inside one is stretched to its end); `image_ends`: a step ends at each image's end
    (a recurrent state exists only where a call ends); `alone`: no decode step to share;
    `across`: the step may cross block boundaries (see the module docstring).
    """
    pos, bs, n = len(seq.cache_tokens), block_size, len(seq.prompt)
    end = n - 1 if n > 1 else n  # the last prompt token is fed by a decode step
    if across:
        step_end = min(end, pos + max_step)
    elif pos % bs:
        step_end = min(end, (pos // bs + 1) * bs)
    else:
        step_end = prefill_steps(pos, end, block_size=bs, max_step=max_step)[0][1]
    if bidirectional:
        for span in seq.images:
            if span.cuts(step_end):
                step_end = span.end
        step_end = min(step_end, n)
    if image_ends:
        for span in seq.images:
            if pos < span.end < step_end and span.end % bs:
                step_end = span.end
    if alone and step_end == n - 1 and n - pos <= ALONE_FINAL_STEP:
        step_end = n  # the last token too, sampled from this step (see the constant)
    return pos, step_end


def final_step_group(
    ready: list[Sequence],
    step_of: Callable[[Sequence], tuple[int, int]],
    *,
    block_size: int,
) -> list[Sequence]:
    """The sequences of `ready` whose final steps (`step_of`) to feed in one call now:
    none, or at least two, each step inside one block, shortest first while the padding
    stays within `GROUP_PAD_TOKENS` per extra member."""
    if len(ready) < 2:
        return []
    steps = []
    for seq in ready:
        n, pos = len(seq.prompt), len(seq.cache_tokens)
        if n < 2 or pos >= n - 1:
            continue  # a one-token prompt, or nothing left to prefill: the single path
        start, end = step_of(seq)
        if end != n - 1 or end % block_size == 0 or start // block_size != (end - 1) // block_size:
            continue  # not its final step, or a block ends within it: a checkpoint is due
        steps.append((end - start, seq))
    steps.sort(key=lambda step: step[0])
    group: list[tuple[int, Sequence]] = []
    for length, seq in steps:
        trial = [*group, (length, seq)]
        padding = len(trial) * length - sum(n for n, _ in trial)
        if padding > GROUP_PAD_TOKENS * (len(trial) - 1):
            break
        group = trial
    return [seq for _, seq in group] if len(group) > 1 else []

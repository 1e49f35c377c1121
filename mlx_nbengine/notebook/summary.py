"""The words under a finished answer: the *summary line* (the block story of a request and
why it stopped, e.g. "2,048 prompt tokens: 1,792 restored (7 blocks from disk), 256 computed;
first token 0.41 s; 38 tok/s; end of text after 57 tokens"; "restored" appears only when
tokens really were restored, a cold prompt reads "2,048 prompt tokens, all computed"), the
*stop phrases*, and the *answer facts* a finished answer's display carries as metadata.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

from mlx_nbengine.engine.results import Completion
from mlx_nbengine.notebook.words import kept_boundary_phrase
from mlx_nbengine.notebook.words import plural as _plural

__all__ = [
    "ANSWER_METADATA_KEY",
    "answer_facts",
    "prefill_stop_phrase",
    "stop_phrase",
    "stopped_in_prefill",
    "summary_line",
]


def _restored_part(report: Any) -> str | None:
    """ "1,792 restored (7 blocks from disk)", or None when nothing was restored."""
    restored = int(getattr(report, "restored_tokens", 0) or 0)
    if restored <= 0:
        return None
    sources = Counter(getattr(block, "source", None) for block in report.blocks)
    counts = [(sources[s], s) for s in ("memory", "disk") if sources[s]]
    if counts:
        # "7 blocks from disk", or "2 blocks from memory, 5 from disk".
        (n, source), *rest = counts
        where = [f"{_plural(n, 'block')} from {source}", *(f"{m} from {s}" for m, s in rest)]
        return f"{restored:,} restored ({', '.join(where)})"
    # Tokens restored inside a block that still counts as computed (the hot cache of a
    # short prompt): true, but no block came back, so no block count is claimed.
    source = getattr(report, "restore_source", None)
    where = f" from {source}" if source else ""
    return f"{restored:,} restored{where} (part of a block)"


def stop_phrase(completion: Any) -> str:
    """Why generation stopped and how many tokens it made: "end of text after 57 tokens"."""
    n = len(completion.tokens)
    reason = completion.finish_reason
    if reason == "length":
        return f"stopped at max tokens ({n:,})"
    if reason == "cancelled":
        return f"cancelled after {_plural(n, 'token')}"
    stop = getattr(completion, "stop_reason", None)
    if stop == "eos":
        return f"end of text after {_plural(n, 'token')}"
    if stop:
        return f"stop string {stop!r} after {_plural(n, 'token')}"
    return f"stopped after {_plural(n, 'token')}"


def stopped_in_prefill(completion: Any) -> bool:
    """The request was cancelled before it generated a token (during its prefill)."""
    return completion.finish_reason == "cancelled" and not completion.tokens


def prefill_stop_phrase(completion: Any) -> str:
    """ "stopped during prefill at token 512 of 861; nothing generated" (the tokens
    restored, when any, before it)."""
    report = completion.report
    n_prompt = _n_prompt(completion)
    done = int(getattr(report, "restored_tokens", 0) or 0) + int(report.computed_tokens or 0)
    restored = _restored_part(report)
    where = f"at token {done:,} of {n_prompt:,}" if done else "before it began"
    stop = f"stopped during prefill {where}; nothing generated"
    return f"{restored}; {stop}" if restored else stop


def _n_prompt(completion: Any) -> int:
    # `prompt_tokens` is the list of prompt ids (an int is accepted too).
    n_prompt = completion.prompt_tokens
    return n_prompt if isinstance(n_prompt, int) else len(n_prompt)


def summary_line(completion: Any) -> str:
    """One line: where the prompt's tokens came from, speed, why generation stopped, and
    why a restore kept to a block boundary when a stored continuation shared more. A
    request stopped during its prefill says where (`prefill_stop_phrase`)."""
    if stopped_in_prefill(completion):
        return prefill_stop_phrase(completion)
    report = completion.report
    n_prompt = _n_prompt(completion)
    restored = _restored_part(report)
    if restored is None:
        head = f"{_plural(n_prompt, 'prompt token')}, all computed"
    else:
        head = (
            f"{_plural(n_prompt, 'prompt token')}: {restored}, {report.computed_tokens:,} computed"
        )
    parts = [head]
    if report.ttft_s is not None:
        parts.append(f"first token {report.ttft_s:.2f} s")
    if report.tokens_per_s:
        parts.append(f"{report.tokens_per_s:.0f} tok/s")
    parts.append(stop_phrase(completion))
    kept = getattr(report, "kept_boundary", None)
    if kept:
        parts.append(f"restore kept to a block boundary: {kept_boundary_phrase(kept)}")
    return "; ".join(parts)


ANSWER_METADATA_KEY = "mlx_nbengine"


def answer_facts(completion: Completion) -> dict[str, Any]:
    """What a finished answer's display carries as metadata (under `ANSWER_METADATA_KEY`):
    prompt tokens, tokens restored from memory and from disk, tokens computed, time to first
    token, and `document`, a digest of the prompt's first block (answers that share it are
    re-runs of one document; None for a prompt shorter than a block). The demo's table is
    read back from these in the saved notebook."""
    report = completion.report
    # The prompt's ids (a bare count is accepted too, as in `summary_line`).
    ids = completion.prompt_tokens
    prompt = [] if isinstance(ids, int) else list(ids)
    from_memory, from_disk = report.restored_split()
    blocks = report.blocks
    block_size = blocks[0].end - blocks[0].start if blocks else 0
    document = None
    if block_size and len(prompt) > block_size:
        head = ",".join(map(str, prompt[:block_size])).encode()
        document = hashlib.sha256(head).hexdigest()[:16]
    return {
        "prompt_tokens": ids if isinstance(ids, int) else len(prompt),
        "restored_memory": from_memory,
        "restored_disk": from_disk,
        "computed": report.computed_tokens,
        "ttft_s": report.ttft_s,
        "document": document,
    }

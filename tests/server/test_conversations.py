"""Conversations and cache misses (`mlx_nbengine.server.conversations`), and the agent view's
client, API and conversation columns and its miss line.

The units run on token lists: a prompt is text whose token ids are its characters' code
points, read back by a `Reader` whose `decode` is ``chr`` (the real type, its decode made
plain). The end-to-end tests serve a tiny random-weight llama whose chat template drops an
earlier turn's reasoning the way Qwen 3's does (`test_api.THINKING_TEMPLATE`) on 127.0.0.1,
and drive it with the real `openai` client: a second turn that drops the first's
``<think>`` is explained at the token where it leaves it, a changed tools list is named, and
the view's HTML shows the client and the miss line.
"""

from __future__ import annotations

import json
import threading

import pytest

from mlx_nbengine.server.conversations import (
    Conversations,
    Facts,
    Miss,
    Reader,
    Turn,
    api_name,
    client_name,
    common_prefix,
    label,
    request_facts,
    visible,
)
from mlx_nbengine.server.openai_shapes import Call

READER = Reader(decode=lambda ids: "".join(map(chr, ids)), block_size=16)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def chat_facts(system: str, *messages: str, tools=(), key=None, model="m") -> Facts:
    """The facts of a chat request with this system prompt, user/assistant messages (in
    turn) and tools (names)."""
    roles = ["user", "assistant"]
    body = [{"role": "system", "content": system}] + [
        {"role": roles[i % 2], "content": m} for i, m in enumerate(messages)
    ]
    call = Call(
        prompt=body,
        max_tokens=8,
        tools=[{"type": "function", "function": {"name": t, "parameters": {}}} for t in tools]
        or None,
    )
    request = {"model": model, **({"prompt_cache_key": key} if key else {})}
    return request_facts({}, request, call, endpoint="/v1/chat/completions")


def render(system: str, *messages: str, tools=(), think=True) -> str:
    """A template like Qwen 3's, as text: tools, the system prompt, the messages, and the
    generation prompt opening <think>. Earlier answers are given as they are sent back."""
    out = "".join(f"[tool {t}]" for t in tools) + f"<s>{system}</s>"
    for i, m in enumerate(messages):
        out += f"<{'u' if i % 2 == 0 else 'a'}>{m}</>"
    return out + ("<a><think>" if think else "<a>")


def finished(tracker, number, prompt, facts, answer, *, block_size=16):
    turn = Turn(number, ids(prompt), facts)
    tracker.place(turn, block_size=block_size)
    tracker.finish(turn, ids(answer))
    return turn


def second(tracker, prompt, facts, restored, **kwargs) -> tuple[Turn, Miss | None]:
    turn = Turn(2, ids(prompt), facts)
    tracker.place(turn, block_size=16)
    tracker.finish(turn, ids("ok"))
    return turn, tracker.explain(turn, restored, READER, **kwargs)


SYSTEM = "You are a careful coding agent. " * 2
QUESTION = "What is two plus two? " * 2


# -- facts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agent", "name"),
    [
        ("codex_exec/0.169.0 (Ubuntu 24.4.0; x86_64) xterm", "codex 0.169.0"),
        ("codex_cli_rs/0.40.0 (Mac OS 15.5.0; arm64) iTerm.app/3.5", "codex 0.40.0"),
        ("claude-cli/1.0.83 (external, cli)", "claude-cli 1.0.83"),
        ("OpenAI/Python 1.99.9", "openai-python 1.99.9"),
        ("Anthropic/Python 0.60.0", "anthropic-python 0.60.0"),
        ("opencode/0.5.1 ai-sdk/provider-utils/3.0.1", "opencode 0.5.1"),
        ("ai-sdk/openai-compatible/1.0.13 ai-sdk/provider-utils/3.0.9", "ai-sdk"),
        ("curl/8.5.0", "curl 8.5.0"),
        ("python-httpx/0.28.1", "python-httpx 0.28.1"),
        ("", ""),
        (None, ""),
    ],
)
def test_the_client_is_named_from_its_user_agent(agent, name):
    assert client_name(agent) == name


def test_the_api_is_named_from_its_endpoint():
    assert [api_name(f"/v1/{p}") for p in ("chat/completions", "completions")] == [
        "chat completions",
        "completions",
    ]
    assert api_name("/v1/responses") == "responses"
    assert api_name("/v1/messages") == "messages"


def test_request_facts_hold_digests_keys_and_tool_names_never_text():
    secret = "The password is swordfish."
    call = Call(
        prompt=[{"role": "developer", "content": secret}, {"role": "user", "content": secret}],
        max_tokens=4,
        tools=[{"type": "function", "function": {"name": "shell", "parameters": {}}}],
    )
    headers = {"user-agent": "claude-cli/1.0.83 (external, cli)"}
    body = {"model": "haiku", "metadata": {"user_id": "user_1_session_2"}}
    facts = request_facts(headers, body, call, endpoint="/v1/messages")
    assert facts.client == "claude-cli 1.0.83" and facts.api == "messages"
    assert facts.key == "metadata.user_id:user_1_session_2" and facts.model == "haiku"
    assert facts.chat and facts.system and len(facts.messages) == 1
    assert [name for name, _ in facts.tools] == ["shell"]
    assert "swordfish" not in repr(facts)
    # A prompt_cache_key wins over a session header; a session header alone is a key.
    keyed = request_facts({"session_id": "s"}, {"prompt_cache_key": "p"}, call)
    assert keyed.key == "prompt_cache_key:p"
    assert request_facts({"session_id": "s"}, {}, call).key == "session_id:s"
    following = request_facts({}, {"previous_response_id": "resp_1"}, call)
    assert following.previous_response_id == "resp_1" and following.key is None
    plain = request_facts({}, {}, Call(prompt="The quick", max_tokens=4))
    assert not plain.chat and plain.messages == () and plain.system is None


def test_request_facts_take_the_tools_the_template_is_shown_and_never_raise():
    tools = [{"type": "function", "function": {"name": "shell", "parameters": {}}}]
    hidden = Call(prompt=[{"role": "user", "content": "hi"}], max_tokens=4, tools=tools)
    hidden.tool_choice = "none"  # the template is not shown them
    assert request_facts({}, {}, hidden).tools == ()
    odd = Call(prompt=[{"role": "user", "content": object()}, "not a message"], max_tokens=4)
    facts = request_facts({"user-agent": "curl/8.5.0"}, {"metadata": [1]}, odd)
    assert facts.client == "curl 8.5.0" and facts.key is None and len(facts.messages) == 1


def test_helpers_labels_prefixes_and_escapes():
    assert [label(i) for i in (0, 1, 25, 26, 27, 701, 702)] == [
        "A",
        "B",
        "Z",
        "AA",
        "AB",
        "ZZ",
        "AAA",
    ]
    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, [*a[:700], -1, *a[701:]]) == 700
    assert common_prefix(a[10:20], a, 10) == 10
    assert common_prefix([], a) == 0
    assert visible('a\nb\t"c\\') == 'a\\nb\\t"c\\\\'


# -- grouping ----------------------------------------------------------------------------------


def test_a_chats_next_turn_joins_its_conversation_by_the_shared_prefix():
    tracker = Conversations()
    one = finished(tracker, 1, render(SYSTEM, QUESTION), chat_facts(SYSTEM, QUESTION), "four")
    again = render(SYSTEM, QUESTION, "four", "And three?")
    two = Turn(2, ids(again), chat_facts(SYSTEM, QUESTION, "four", "And three?"))
    assert tracker.place(two, block_size=16) == one.conversation == "A"
    assert two.grouped_by == "prefix"
    # A new chat under the same system prompt is a conversation of its own.
    other = Turn(3, ids(render(SYSTEM, "Hello there")), chat_facts(SYSTEM, "Hello there"))
    assert tracker.place(other, block_size=16) == "B" and other.grouped_by == ""
    # So is a prompt that shares too little (a few tokens, no whole block).
    short = Turn(4, ids(render("x", "y")), chat_facts("x", "y"))
    assert tracker.place(short, block_size=16) == "C"


def test_completions_join_by_the_shared_prefix_alone():
    tracker = Conversations()
    text = "The Eiffel Tower is located in the city of Paris. "
    finished(tracker, 1, text, Facts(), " It is tall.")
    two = Turn(2, ids(text + " It is tall. How tall?"), Facts())
    assert tracker.place(two) == "A"
    assert tracker.place(Turn(3, ids("The quick brown fox"), Facts())) == "B"


def test_a_key_groups_whatever_the_prompts_and_a_side_model_is_its_own_conversation():
    tracker = Conversations()
    key = "prompt_cache_key:abc"
    first = Turn(1, ids("first prompt"), chat_facts("s", "q", key=key))
    unrelated = Turn(2, ids("something else entirely"), chat_facts("t", "r", key=key))
    side = Turn(3, ids("first prompt"), chat_facts("s", "q", key=key, model="small"))
    assert [tracker.place(t) for t in (first, unrelated, side)] == ["A", "A", "B"]
    assert unrelated.grouped_by == "key"


def test_previous_response_id_names_the_turn_it_follows():
    tracker = Conversations()
    one = finished(tracker, 1, "hello", Facts(), "hi")
    two = Turn(2, ids("completely different"), Facts(previous_response_id="resp_1"))
    assert tracker.place(two, after=one) == "A"
    assert two.grouped_by == "previous_response_id" and tracker.previous(two) is one


def test_the_previous_turn_finished_before_this_one_came():
    tracker = Conversations()
    key = "session_id:s"
    one = Turn(1, ids(render(SYSTEM, QUESTION)), chat_facts(SYSTEM, QUESTION, key=key))
    tracker.place(one)
    two = Turn(2, ids(render(SYSTEM, QUESTION, "four", "more")), one.facts)
    tracker.place(two)
    tracker.finish(one, ids("four"))  # after two came: its answer was not in the cache yet
    tracker.finish(two, ids("ok"))
    assert tracker.previous(two) is None
    assert tracker.explain(two, 0, READER) is None


# -- explanations ------------------------------------------------------------------------------


def test_no_miss_when_the_turn_restored_all_the_previous_turn_held():
    tracker = Conversations()
    one = finished(tracker, 1, render(SYSTEM, QUESTION), chat_facts(SYSTEM, QUESTION), "four")
    prompt = render(SYSTEM, QUESTION) + "four</>" + "<u>more</><a><think>"
    _, miss = second(tracker, prompt, chat_facts(SYSTEM, QUESTION, "four", "more"), one.held)
    assert miss is None


def test_no_miss_when_the_previous_turn_held_less_than_a_block():
    tracker = Conversations()
    finished(tracker, 1, "<u>hi</>", Facts(key="k"), "<a>yo")
    _, miss = second(tracker, "<u>hi</><a>yo</><u>more</>", Facts(key="k"), 0)
    assert miss is None  # 10 tokens held, 16-token blocks


def test_reasoning_dropped_from_an_earlier_turn_is_named_at_its_token():
    tracker = Conversations()
    asked = render(SYSTEM, QUESTION)  # ends with the generation prompt's <think>
    one = finished(
        tracker, 1, asked, chat_facts(SYSTEM, QUESTION), "\nLet me add.\n</think>\nFour."
    )
    # The template renders the earlier answer without its reasoning.
    prompt = render(SYSTEM, QUESTION, "Four.", "And three?")
    at = len(asked) - len("<think>")
    restored = at  # a token-exact restore up to the change
    turn, miss = second(tracker, prompt, chat_facts(SYSTEM, QUESTION, "Four.", "And three?"), at)
    assert tracker.previous(turn) is one
    assert miss.cause == "reasoning" and miss.position == at
    assert miss.why == f"the client rewrote history at token {at:,}: <think>…</think> removed"
    assert miss.restored == restored and miss.expected == one.held and miss.previous == 1
    assert miss.before.endswith("</><a>") and miss.was.startswith("<think>")
    assert miss.now.startswith("Four.")


def test_a_change_inside_the_reasoning_is_the_reasoning_too():
    tracker = Conversations()
    asked = render(SYSTEM, QUESTION)
    finished(tracker, 1, asked, chat_facts(SYSTEM, QUESTION), "\nLet me add.\n</think>\nFour.")
    # An empty reasoning block kept in its place (some templates render one).
    prompt = asked + "\n\n</think>\nFour.</><u>And three?</><a><think>"
    _, miss = second(tracker, prompt, chat_facts(SYSTEM, QUESTION, "Four.", "And three?"), 0)
    assert miss.cause == "reasoning" and miss.position == len(asked) + 1


def test_an_answer_sent_back_otherwise_is_named():
    tracker = Conversations()
    asked = render(SYSTEM, QUESTION, think=False)
    one = finished(tracker, 1, asked, chat_facts(SYSTEM, QUESTION), "call add(a=1, b=2)</>")
    prompt = asked + "call add(b=2, a=1)</><u>go on</><a>"
    _, miss = second(tracker, prompt, chat_facts(SYSTEM, QUESTION, "x", "go on"), len(asked))
    at = len(asked) + len("call add(")
    assert miss.cause == "answer" and miss.position == at
    assert miss.why == (
        f"the client sent the previous answer back changed at token {at:,} "
        f"(its token 10 of {len(one.answer):,})"
    )
    assert miss.was.startswith("a=1") and miss.now.startswith("b=2")


def test_a_changed_tools_list_is_named_with_the_tools():
    tracker = Conversations()
    asked = render(SYSTEM, QUESTION, tools=["add"])
    finished(tracker, 1, asked, chat_facts(SYSTEM, QUESTION, tools=["add"], key="k"), "four")
    prompt = render(SYSTEM, QUESTION, "four", "more", tools=["add", "mul"])
    facts = chat_facts(SYSTEM, QUESTION, "four", "more", tools=["add", "mul"], key="k")
    _, miss = second(tracker, prompt, facts, 9)
    at = len("[tool add]")
    assert miss.cause == "tools" and miss.position == at
    assert miss.why == f"the tools list changed (first change at token {at})"
    assert miss.detail == "added: mul"
    assert "mul" not in json.dumps(miss.as_dict())  # names are prompt text: the view only
    assert miss.as_dict(text=True)["detail"] == "added: mul"


def test_a_changed_system_prompt_is_named():
    tracker = Conversations()
    asked = render(SYSTEM, QUESTION)
    finished(tracker, 1, asked, chat_facts(SYSTEM, QUESTION, key="k"), "four")
    other = SYSTEM.replace("careful", "CAREFUL")
    prompt = render(other, QUESTION, "four", "more")
    _, miss = second(tracker, prompt, chat_facts(other, QUESTION, "four", "more", key="k"), 16)
    at = len("<s>You are a ")
    assert miss.cause == "system" and miss.position == at
    assert miss.why == f"the system prompt changed (first change at token {at})"


def test_an_edited_earlier_message_is_named_with_its_place():
    tracker = Conversations()
    msgs = (QUESTION, "four", "Now three plus three?")
    asked = render(SYSTEM, *msgs)
    finished(tracker, 1, asked, chat_facts(SYSTEM, *msgs), "six")
    edited = (QUESTION, "FOUR", "Now three plus three?", "six", "more")
    prompt = render(SYSTEM, *edited)
    _, miss = second(tracker, prompt, chat_facts(SYSTEM, *edited), 0)
    at = asked.index("four")
    assert miss.cause == "edited" and miss.position == at
    assert miss.why == (
        f"an earlier message was edited (message 2, assistant) (first change at token {at})"
    )


def test_dropped_earlier_messages_are_named():
    tracker = Conversations()
    msgs = (QUESTION, "four", "Now three plus three?")
    finished(tracker, 1, render(SYSTEM, *msgs), chat_facts(SYSTEM, *msgs, key="k"), "six")
    prompt = render(SYSTEM, QUESTION)  # compacted: the later turns are gone
    _, miss = second(tracker, prompt, chat_facts(SYSTEM, QUESTION, key="k"), 0)
    assert miss.cause == "dropped" and miss.why.startswith("2 earlier messages were dropped")


def test_a_change_no_fact_explains_is_the_generic_line():
    tracker = Conversations()
    text = "The Eiffel Tower is located in the city of Paris. It is tall."
    finished(tracker, 1, text, Facts(), " Yes.")
    prompt = text.replace("tall", "high") + " Yes. How high?"
    at = text.index("tall")
    _, miss = second(tracker, prompt, Facts(), 16)
    assert miss.cause == "differs" and miss.position == at
    assert miss.why == f"the prompt differs from the previous turn at token {at}"


def test_a_kept_prefix_that_did_not_come_back_was_evicted_or_cut_at_a_boundary():
    asked = render(SYSTEM, QUESTION)
    prompt = asked + "four</><u>more</><a><think>"
    facts = chat_facts(SYSTEM, QUESTION, "four", "more")
    for kwargs, cause, why in [
        (
            {"reasons": ["evicted", "evicted", "tail"]},
            "evicted",
            "evicted from the store: the previous turn's tokens from 32 on are no longer stored",
        ),
        (
            {"kept_boundary": "block"},
            "boundary",
            "the restore kept to a block boundary at token 32 (the engine restores whole blocks)",
        ),
        (
            {"kept_boundary": "evicted"},
            "evicted",
            "evicted from the store: the previous turn's tokens from 32 on are no longer stored",
        ),
        (
            {"reasons": ["after_miss", "tail"]},
            "store",
            f"the store held 32 of the {len(asked) + 3} tokens the previous turn left in the cache",
        ),
    ]:
        tracker = Conversations()
        finished(tracker, 1, asked, chat_facts(SYSTEM, QUESTION), "four")
        _, miss = second(tracker, prompt, facts, 32, **kwargs)
        assert (miss.cause, miss.why, miss.position) == (cause, why, 32)
        assert miss.was == "" and miss.now == visible(prompt[32:40])


def test_a_miss_as_a_dict_holds_no_text_unless_asked():
    tracker = Conversations()
    asked = render(SYSTEM, QUESTION)
    finished(tracker, 1, asked, chat_facts(SYSTEM, QUESTION), "\nhmm</think>secret")
    prompt = render(SYSTEM, QUESTION, "secret", "more")
    _, miss = second(tracker, prompt, chat_facts(SYSTEM, QUESTION, "secret", "more"), 0)
    assert "secret" in miss.now
    assert set(miss.as_dict()) == {"cause", "position", "restored", "expected", "previous", "why"}
    assert "secret" not in json.dumps(miss.as_dict())
    assert miss.as_dict(text=True)["now"] == miss.now


def test_the_journal_explains_a_finished_turn_and_keeps_its_text_out_of_as_dict():
    from mlx_nbengine.engine.results import BlockReport, Completion, Report
    from mlx_nbengine.server.journal import Journal

    def run(journal, prompt, facts, answer):
        entry = journal.open("/v1/chat/completions")
        entry.tokens = ids(prompt)
        journal.admitted(entry, facts, READER)
        blocks = [BlockReport(0, 0, len(prompt), "computed", 0.0, "tail")]
        report = Report(blocks, restored_tokens=0, computed_tokens=len(prompt))
        journal.finish(entry, Completion(answer, ids(answer), ids(prompt), "stop", report))
        return entry

    for log_prompts in (False, True):
        journal = Journal(log_prompts=log_prompts)
        one = run(
            journal, render(SYSTEM, QUESTION), chat_facts(SYSTEM, QUESTION), "\nhm</think>Four."
        )
        prompt = render(SYSTEM, QUESTION, "Four.", "more")
        two = run(journal, prompt, chat_facts(SYSTEM, QUESTION, "Four.", "more"), "ok")
        assert (one.api, one.conversation, two.conversation) == ("chat completions", "A", "A")
        assert one.miss is None and two.miss.cause == "reasoning"
        assert two.answer_tokens == ids("ok")
        shown = json.dumps(two.as_dict())
        assert ("Four." in shown) is log_prompts and '"why"' in shown


# -- through a real server, with the real openai client -----------------------------------------

openai = pytest.importorskip("openai")

from mlx_nbengine.engine import Engine  # noqa: E402
from mlx_nbengine.server import ApiServer  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    from test_api import THINKING_TEMPLATE  # tests/ is on sys.path

    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    directory = make_tiny_model("llama", tmp_path_factory.mktemp("conversations-llama"))
    make_tiny_tokenizer(directory, chat_template=THINKING_TEMPLATE)
    with Engine.load(directory, block_size=BLOCK, parallel=2) as engine:
        with ApiServer(engine, port=0).start() as server:
            client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
            yield engine, server, client


def finished_entry(server, timeout: float = 30):
    """The newest journal entry once its request has finished."""
    entry = server.journal.entries()[-1]
    done = threading.Event()
    unwatch = server.journal.watch(lambda e: e is entry and e.finish and done.set())
    try:
        assert entry.finish is not None or done.wait(timeout), "the entry never finished"
    finally:
        unwatch()
    return entry


SYSTEM_LONG = (
    "The Eiffel Tower is located in the city of Paris, the capital of France. " * 2
    + "You are a careful coding agent."
)


@pytest.fixture(scope="module")
def dropped(thinking):
    """Two turns of one chat: the second drops the first's reasoning (the template does).
    (first entry, second entry, the second's cached tokens, the first's prompt tokens, the
    second's)."""
    engine, server, client = thinking
    lm, name = engine.model, engine.model_name
    first = [
        {"role": "system", "content": SYSTEM_LONG},
        {"role": "user", "content": "What is two plus two? " * 4},
    ]
    one = client.chat.completions.create(model=name, messages=first, max_tokens=12, temperature=0)
    entry_one = finished_entry(server)
    reasoning = one.choices[0].message.content or ""
    kept = [*first, {"role": "assistant", "content": f"{reasoning}\n</think>\n\nFour."}]
    third = [*kept, {"role": "user", "content": "And three plus three?"}]
    three = client.chat.completions.create(model=name, messages=third, max_tokens=4, temperature=0)
    entry = finished_entry(server)
    cached = three.usage.prompt_tokens_details.cached_tokens
    return entry_one, entry, cached, lm.apply_chat_template(first), lm.apply_chat_template(third)


def test_a_turn_that_drops_the_reasoning_is_explained_at_its_token(thinking, dropped):
    lm = thinking[0].model
    entry_one, entry, cached, prompt_one, prompt_three = dropped
    generated = prompt_one + entry_one.answer_tokens  # ends with the generation prompt's <think>
    at = 0
    while prompt_three[at] == generated[at]:
        at += 1
    assert at < len(prompt_one)  # it leaves the first turn at its <think>
    assert lm.decode(prompt_one[at:]).startswith("<think>")
    assert cached == at

    assert entry.conversation == entry_one.conversation != ""
    assert entry.client.startswith("openai-python ") and entry.api == "chat completions"
    miss = entry.miss
    assert miss is not None and miss.cause == "reasoning"
    assert miss.position == at and miss.previous == entry_one.number
    assert miss.why == f"the client rewrote history at token {at:,}: <think>…</think> removed"
    assert miss.restored == cached
    assert miss.expected == len(prompt_one) + len(entry_one.answer_tokens) - 1
    assert miss.was.startswith("<think>") and miss.now.startswith("Four.")
    assert miss.before.endswith("assistant\\n")  # escaped, as the model wrote it
    facts = entry.as_dict()
    assert facts["miss"]["why"] == miss.why and "before" not in facts["miss"]
    assert "Four." not in json.dumps(facts)  # no prompt text without log_prompts
    assert entry_one.miss is None


def test_a_changed_tools_list_is_named(thinking):
    engine, server, client = thinking
    name = engine.model_name

    def tool(name: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}

    question = [{"role": "user", "content": "Add one and two with the tool, please."}]
    key = {"prompt_cache_key": "session-tools"}
    client.chat.completions.create(
        model=name, messages=question, tools=[tool("add")], max_tokens=4, extra_body=key
    )
    entry_one = finished_entry(server)
    again = [
        *question,
        {"role": "assistant", "content": "Three."},
        {"role": "user", "content": "Go"},
    ]
    client.chat.completions.create(
        model=name,
        messages=again,
        tools=[tool("add"), tool("multiply")],
        max_tokens=4,
        extra_body=key,
    )
    entry = finished_entry(server)
    assert entry.conversation == entry_one.conversation
    miss = entry.miss
    assert miss is not None and miss.cause == "tools", miss
    assert miss.why.startswith("the tools list changed (first change at token ")
    assert miss.detail == "added: multiply"
    assert miss.position == entry.cached_tokens


def test_the_view_shows_the_client_the_conversation_and_the_miss_line(thinking, dropped):
    from mlx_nbengine.notebook.serving import row_of, rows_html, rows_text

    engine, server, _ = thinking
    entries = server.journal.entries()
    entry = dropped[1]
    assert entry.miss is not None
    rows = [row_of(e, engine, block_size=BLOCK) for e in entries]
    markup = rows_html(rows, url=server.url, snippet="")
    row = f'<tr class="mnb-agent-row" data-number="{entry.number}">'
    assert row in markup
    cells = markup.split(row, 1)[1].split("</tr>", 1)[0]
    assert f'<td data-name="client">{entry.client}</td>' in cells
    assert '<td data-name="api">chat completions</td>' in cells
    assert f'<td data-name="conversation">{entry.conversation}</td>' in cells
    # The row, its strip, then its miss line, before the next row.
    at = markup.index(row)
    strip = markup.index('<tr class="mnb-agent-strip">', at)
    start = markup.index(f'<tr class="mnb-agent-miss" data-number="{entry.number}">')
    following = markup.find('<tr class="mnb-agent-row"', at + len(row))
    assert at < strip < start and (following == -1 or start < following)
    line = markup[start:].split("</td></tr>", 1)[0]
    assert 'data-cause="reasoning"' in line and f'data-position="{entry.miss.position}"' in line
    assert "the client rewrote history at token" in line
    assert "&lt;think&gt;…&lt;/think&gt; removed" in line  # escaped, never a tag
    assert '<span class="mnb-after">Four.' in line
    assert "<think>" not in markup
    assert "missed: the client rewrote history" in rows_text(rows, url=server.url)


def test_the_messages_and_responses_apis_name_their_client_and_group_by_key(thinking):
    anthropic = pytest.importorskip("anthropic")
    engine, server, client = thinking
    name = engine.model_name
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="none")
    session = {"user_id": "user_1_account_2_session_3"}
    for text in ("Hello there, agent.", "Something else entirely, with no shared words."):
        claude.messages.create(
            model=name,
            max_tokens=2,
            messages=[{"role": "user", "content": text}],
            metadata=session,
        )
        finished_entry(server)
    first, second = server.journal.entries()[-2:]
    assert first.api == second.api == "messages"
    assert first.client.startswith("anthropic-python ")
    assert first.conversation == second.conversation  # the session groups, not the prompt
    for text in ("Hi.", "Another thing."):
        client.responses.create(
            model=name, input=text, max_output_tokens=16, prompt_cache_key="codex-session"
        )
        finished_entry(server)
    first, second = server.journal.entries()[-2:]
    assert first.api == second.api == "responses"
    assert first.client.startswith("openai-python ")
    assert first.conversation == second.conversation != server.journal.entries()[-3].conversation


def test_previous_response_id_joins_the_conversation_of_the_response_it_names(thinking):
    engine, server, client = thinking
    name = engine.model_name
    one = client.responses.create(model=name, input="Hi there.", max_output_tokens=16)
    entry_one = finished_entry(server)
    assert entry_one.response_id == one.id
    client.responses.create(
        model=name, input="Go on.", previous_response_id=one.id, max_output_tokens=16
    )
    entry = finished_entry(server)
    assert entry.conversation == entry_one.conversation != ""
    assert entry.turn.grouped_by == "previous_response_id"

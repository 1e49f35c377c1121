"""The OpenAI-compatible endpoint (`mlx_nbengine.server`) driven by the real `openai` client.

One tiny random-weight llama (16-token blocks, four slots) is served on 127.0.0.1 at a free
port for the module; the answers are compared with `Engine.submit` on the same engine (greedy,
so the same tokens). Other servers in the tests: one with an API key, one on a second engine
that is closed under it, one on a tiny llama whose chat template drops reasoning the way Qwen
3's does (the agent workflow) and reads ``tools``.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from mlx_nbengine.engine import Engine  # noqa: E402
from mlx_nbengine.server import ApiServer, Limits, ServeError  # noqa: E402

BLOCK = 16
BODY_LIMIT = 64 * 1024
MAX_MESSAGES = 8
LONG = (
    "The Eiffel Tower is located in the city of Paris, the capital of France. "
    "A block of two hundred and fifty six tokens is cached on disk and restored later. "
)

# A chat template of our own in the way of Qwen 3's: the generation prompt opens the
# reasoning (<think>), earlier assistant turns are rendered without it (what comes before
# </think> is dropped), and `tools` go into a system block when given.
THINKING_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\nTools:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>assistant\n{{ content | trim }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine.load(tiny_model_dir("llama"), block_size=BLOCK, parallel=4) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    limits = Limits(max_body_bytes=BODY_LIMIT, max_messages=MAX_MESSAGES, context=8192)
    srv = ApiServer(engine, port=0, limits=limits).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def messages(question: str) -> list[dict]:
    return [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": question},
    ]


def reference(engine, prompt, **kwargs):
    """The engine's own answer, cold (both caches emptied first)."""
    engine.clear_cache()
    done = engine.submit(prompt, **kwargs).result(timeout=60)
    engine.clear_cache()
    return done


def wait_idle(engine, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["active"] == 0 and stats["queued"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the engine still runs requests: {engine.stats()}")


def last_entry(server, timeout: float = 30):
    """The newest journal entry once its request has finished: the server writes a streamed
    answer's figures after the client may have read its last chunk."""
    entry = server.journal.entries()[-1]
    finished = threading.Event()
    unwatch = server.journal.watch(lambda e: e is entry and e.finish and finished.set())
    try:  # watched before it is read: a finish in between is seen either way
        assert entry.finish is not None or finished.wait(timeout), "the entry never finished"
    finally:
        unwatch()
    return entry


# -- answers ---------------------------------------------------------------------------------


def test_models_lists_the_loaded_model(client, engine):
    (model,) = client.models.list().data
    assert model.id == engine.model_name
    assert model.object == "model"


def test_chat_gives_the_engines_tokens(client, engine):
    msgs = messages("What is the capital of Italy?")
    want = reference(engine, msgs, max_tokens=20)
    got = client.chat.completions.create(
        model=engine.model_name, messages=msgs, max_tokens=20, temperature=0
    )
    (choice,) = got.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason == "length"
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.usage.prompt_tokens == len(want.prompt_tokens)
    assert got.usage.completion_tokens == len(want.tokens) == 20
    assert got.usage.total_tokens == got.usage.prompt_tokens + 20
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # cold
    entry = last_entry(engine_server(client))
    assert entry.completion_tokens == 20 and entry.finish == "length"


def engine_server(client):
    return _SERVERS[str(client.base_url)]


_SERVERS: dict[str, ApiServer] = {}


@pytest.fixture(scope="module", autouse=True)
def _remember(server, client):
    _SERVERS[str(client.base_url)] = server


def test_chat_streams_the_same_tokens_with_usage_and_done(client, engine, server):
    msgs = messages("Explain the weather today.")
    want = reference(engine, msgs, max_tokens=24)
    stream = client.chat.completions.create(
        model=engine.model_name,
        messages=msgs,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert not chunks[-1].choices
    assert usage.completion_tokens == 24 and usage.prompt_tokens == len(want.prompt_tokens)
    assert last_entry(server).finish == "length"


def test_the_stream_ends_with_done(server, engine):
    body = {
        "model": engine.model_name,
        "messages": messages("hello"),
        "max_tokens": 4,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert "usage" not in json.loads(lines[-2][6:])  # include_usage not asked


def test_completions_stream_and_not_give_the_engines_tokens(client, engine):
    want = reference(engine, "The quick brown fox", max_tokens=16)
    got = client.completions.create(
        model=engine.model_name, prompt="The quick brown fox", max_tokens=16, temperature=0
    )
    assert got.object == "text_completion"
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == 16
    assert got.usage.prompt_tokens == len(want.prompt_tokens)
    engine.clear_cache()
    stream = client.completions.create(
        model=engine.model_name,
        prompt="The quick brown fox",
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 16
    # Token ids as the prompt, like the engine takes them.
    ids = client.completions.create(
        model=engine.model_name, prompt=want.prompt_tokens, max_tokens=16, temperature=0
    )
    assert ids.choices[0].text == want.text


def test_stop_seed_and_top_p_reach_the_engine(client, engine):
    msgs = messages("Count to ten.")
    sampled = dict(max_tokens=12, temperature=0.9, top_p=0.8, seed=7)
    want = reference(engine, msgs, **sampled)
    got = client.chat.completions.create(model=engine.model_name, messages=msgs, **sampled)
    assert got.choices[0].message.content == want.text
    # A stop string from the greedy answer's middle cuts it there.
    greedy = reference(engine, msgs, max_tokens=20)
    stop = greedy.text[6:9]
    assert stop and stop not in greedy.text[:6]
    cut = client.chat.completions.create(
        model=engine.model_name, messages=msgs, max_tokens=20, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == greedy.text[: greedy.text.index(stop)]
    newer = client.chat.completions.create(
        model=engine.model_name, messages=msgs, max_completion_tokens=5, temperature=0
    )
    assert newer.usage.completion_tokens == 5


def test_a_repeated_prompt_reports_its_restored_tokens_as_cached(client, engine, server):
    engine.clear_cache()
    msgs = messages(LONG * 3 + "Summarize.")
    first = client.chat.completions.create(
        model=engine.model_name, messages=msgs, max_tokens=4, temperature=0
    )
    again = client.chat.completions.create(
        model=engine.model_name, messages=msgs, max_tokens=4, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    prompt = again.usage.prompt_tokens
    # Every whole block but the one holding the last token (computed to start the answer).
    assert cached >= (prompt - 1) // BLOCK * BLOCK - BLOCK and cached < prompt
    entry = last_entry(server)
    assert entry.restored_memory + entry.restored_disk == cached
    assert entry.computed == prompt - cached
    assert entry.blocks and sum(b.end - b.start for b in entry.blocks) == prompt


def test_four_concurrent_requests_batch_and_each_gives_its_own_tokens(client, engine):
    questions = [f"Question {n}: what is {n} plus {n}?" for n in range(4)]
    alone = [reference(engine, messages(q), max_tokens=48).text for q in questions]
    results: dict[int, str] = {}
    groups = engine.stats()["group_prefills"]

    def ask(n: int) -> None:
        got = client.chat.completions.create(
            model=engine.model_name, messages=messages(questions[n]), max_tokens=48, temperature=0
        )
        results[n] = got.choices[0].message.content

    # The generation thread held between steps until the server has submitted all four:
    # they reach it together however fast or slow this machine is (tests/engine/test_engine.py).
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(60)

    holder = threading.Thread(target=engine.on_model_thread, args=(hold,))
    holder.start()
    askers = [threading.Thread(target=ask, args=(n,)) for n in range(4)]
    try:
        assert entered.wait(30)
        for t in askers:
            t.start()
        deadline = time.monotonic() + 60
        while engine.stats()["queued"] < 4:
            assert time.monotonic() < deadline, f"the server never submitted all four: {results}"
            time.sleep(0.01)
    finally:
        release.set()
        holder.join()
    for t in askers:
        t.join(120)
    assert [results[n] for n in range(4)] == alone
    # Arrived together, they were prefilled in one call and joined the batch together.
    assert engine.stats()["group_prefills"] > groups, "the four requests never decoded together"


# -- cancellation --------------------------------------------------------------------------------


def test_a_streaming_client_that_disconnects_cancels_its_request(client, engine, server):
    wait_idle(engine)
    stream = client.chat.completions.create(
        model=engine.model_name,
        messages=messages("Tell me a very long story."),
        max_tokens=8000,
        temperature=0,
        stream=True,
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    assert engine.stats()["active"] == 1
    stream.close()  # the client goes away mid-answer
    wait_idle(engine)
    entry = last_entry(server)
    deadline = time.monotonic() + 10
    while entry.finish is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry.finish == "cancelled" and entry.status == 499
    # The slot is free: the next request is served at once.
    ok = client.chat.completions.create(
        model=engine.model_name, messages=messages("hi"), max_tokens=3, temperature=0
    )
    assert ok.usage.completion_tokens == 3


def test_a_plain_client_that_times_out_cancels_its_request(engine, server):
    wait_idle(engine)
    body = {
        "model": engine.model_name,
        "messages": messages("Tell me another very long story."),
        "max_tokens": 8000,
        "temperature": 0,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/chat/completions", json=body, timeout=0.5)
    wait_idle(engine)
    entry = last_entry(server)
    assert entry.finish == "cancelled"


# -- bad requests ------------------------------------------------------------------------------


def good_request_still_served(client, engine) -> None:
    ok = client.chat.completions.create(
        model=engine.model_name, messages=messages("hi"), max_tokens=2, temperature=0
    )
    assert ok.usage.completion_tokens == 2


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "\n" not in body["error"]["message"]
    return body["error"]


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=30, **kwargs)


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("temperature", "hot", "temperature"),
        ("temperature", 5, "temperature"),
        ("max_tokens", -1, "max_tokens"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", "12", "max_tokens"),
        ("top_p", [1], "top_p"),
        ("seed", 1.5, "seed"),
        ("stop", 3, "stop"),
        ("stream", "yes", "stream"),
        ("stream_options", "usage", "stream_options"),
        ("messages", "hello", "messages"),
        ("messages", [], "messages"),
        ("messages", [{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ("messages", [{"role": "user", "content": 5}], "messages[0].content"),
        ("n", 3, "n"),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_a_400(server, client, engine, field, value, param):
    body = {"model": engine.model_name, "messages": messages("hi"), "max_tokens": 2}
    body[field] = value
    response = post(server, "/chat/completions", json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    good_request_still_served(client, engine)


def test_the_openai_client_sees_the_errors_as_its_own(client, engine):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=engine.model_name, messages=messages("hi"), max_tokens=-5
        )
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == "max_tokens"
    good_request_still_served(client, engine)


def test_any_model_name_is_served_by_the_loaded_model_and_max_tokens_is_clamped(client, engine):
    """Agents send their vendors' model names and ask for 128,000 tokens: the loaded model
    answers, its answer names it, and max_tokens is cut to the context (never a 400)."""
    answer = client.chat.completions.create(
        model="claude-opus-5-5",
        messages=messages("hi"),
        max_tokens=128_000,
        temperature=0,
        stop=[" ", "e", "a", "o"],  # the tiny model soon writes one: no 8k-token answer
    )
    assert answer.model == engine.model_name
    assert answer.usage.completion_tokens >= 1
    short = client.chat.completions.create(
        model="gpt-9", messages=messages("hi"), max_tokens=2, temperature=0
    )
    assert short.model == engine.model_name and short.usage.completion_tokens == 2


def test_malformed_json_and_non_objects_are_400(server, client, engine):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        response = post(
            server, "/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, raw
        error_of(response)
    good_request_still_served(client, engine)


def test_a_body_over_the_limit_is_413(server, client, engine):
    body = {"model": engine.model_name, "messages": messages("x" * BODY_LIMIT)}
    response = post(server, "/chat/completions", json=body)
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"
    # Without a Content-Length too (a chunked upload is counted as it is read).
    chunks = iter(
        [json.dumps(body).encode()[i : i + 4096] for i in range(0, BODY_LIMIT + 200, 4096)]
    )
    json_type = {"content-type": "application/json"}
    response = post(server, "/chat/completions", content=chunks, headers=json_type)
    assert response.status_code == 413
    good_request_still_served(client, engine)


def test_too_many_messages_and_a_prompt_over_the_context_are_400(server, client, engine):
    many = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    response = post(
        server, "/chat/completions", json={"model": engine.model_name, "messages": many}
    )
    assert response.status_code == 400 and error_of(response)["param"] == "messages"
    long = post(
        server,
        "/completions",
        json={"model": engine.model_name, "prompt": list(range(5, 300)) * 30, "max_tokens": 2},
    )
    assert long.status_code == 400
    assert error_of(long)["code"] == "context_length_exceeded"
    good_request_still_served(client, engine)


def test_unknown_paths_methods_and_images_to_a_text_model(server, client, engine):
    assert post(server, "/embeddings", json={}).status_code == 404
    assert httpx.get(f"{server.url}/chat/completions", timeout=10).status_code == 405
    image = {
        "model": engine.model_name,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ],
    }
    response = post(server, "/chat/completions", json=image)
    assert response.status_code == 400
    assert "text only" in error_of(response)["message"]
    good_request_still_served(client, engine)


def test_text_parts_are_joined_and_developer_is_the_system_role(client, engine):
    parts = [
        {"role": "developer", "content": "You answer briefly."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is "},
                {"type": "text", "text": "two plus two?"},
            ],
        },
    ]
    plain = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is two plus two?"},
    ]
    want = reference(engine, plain, max_tokens=8)
    got = client.chat.completions.create(
        model=engine.model_name, messages=parts, max_tokens=8, temperature=0
    )
    assert got.choices[0].message.content == want.text


# -- the key, the host, the port, the engine's end ---------------------------------------


def test_the_api_key_is_enforced(engine):
    with ApiServer(engine, port=0, api_key="sesame").start() as srv:
        for key in ("wrong", "sesame2"):
            bad = openai.OpenAI(base_url=srv.url, api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as refused:
                bad.models.list()
            assert refused.value.status_code == 401
            assert refused.value.body["code"] == "invalid_api_key"
        missing = httpx.post(f"{srv.url}/chat/completions", json={}, timeout=10)
        assert missing.status_code == 401
        assert error_of(missing)["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=srv.url, api_key="sesame", max_retries=0)
        assert good.models.list().data[0].id == engine.model_name
        answer = good.chat.completions.create(
            model=engine.model_name, messages=messages("hi"), max_tokens=2, temperature=0
        )
        assert answer.usage.completion_tokens == 2


def test_a_network_host_needs_an_api_key(engine):
    with pytest.raises(ServeError, match="--api-key"):
        ApiServer(engine, host="0.0.0.0")
    assert ApiServer(engine, host="0.0.0.0", api_key="k").host == "0.0.0.0"
    ApiServer(engine, host="::1")  # loopback: no key needed
    ApiServer(engine, host="localhost")


def test_a_port_in_use_is_one_line(engine, server):
    with pytest.raises(ServeError) as taken:
        ApiServer(engine, port=server.port).start()
    message = str(taken.value)
    assert "\n" not in message and f"port {server.port} is in use" in message


def test_closing_the_engine_stops_its_server(tiny_model_dir):
    engine = Engine.load(tiny_model_dir("llama"), block_size=BLOCK, store=False)
    srv = ApiServer(engine, port=0).start()
    assert httpx.get(f"{srv.url}/models", timeout=10).status_code == 200
    engine.close()
    deadline = time.monotonic() + 10
    while srv.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/models", timeout=2)
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", srv.port))


def test_nothing_holding_the_prompt_is_logged(engine, client, caplog):
    secret = "The password is swordfish."
    with caplog.at_level("DEBUG"):
        client.chat.completions.create(
            model=engine.model_name, messages=messages(secret), max_tokens=2, temperature=0
        )
        with pytest.raises(openai.BadRequestError):  # an error's message too
            client.chat.completions.create(
                model=engine.model_name, messages=messages(secret), temperature=9
            )
    assert "swordfish" not in caplog.text
    for entry in engine_server(client).journal.entries():
        assert "swordfish" not in json.dumps(entry.as_dict())


# -- the agent workflow and tools -------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory):
    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    directory = make_tiny_model("llama", tmp_path_factory.mktemp("thinking-llama"))
    make_tiny_tokenizer(directory, chat_template=THINKING_TEMPLATE)
    with Engine.load(directory, block_size=BLOCK, parallel=2) as e:
        yield e


@pytest.fixture(scope="module")
def thinking(thinking_engine):
    srv = ApiServer(thinking_engine, port=0).start()
    yield srv, openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_agent_rewind_restores_up_to_the_end_of_the_kept_turn(thinking_engine, thinking):
    srv, client = thinking
    lm, name = thinking_engine.model, thinking_engine.model_name
    system = {"role": "system", "content": LONG * 2 + "You are a careful coding agent."}
    first = [system, {"role": "user", "content": "What is two plus two? " * 4}]
    # 1. system + user: the model reasons (the template opened <think>) and answers.
    one = client.chat.completions.create(model=name, messages=first, max_tokens=40, temperature=0)
    reasoning = one.choices[0].message.content
    answer = "Two plus two is four."
    # 2. the agent keeps the answer and drops the reasoning, the way Qwen 3's template does.
    kept = first + [{"role": "assistant", "content": f"{reasoning}\n</think>\n\n{answer}"}]
    third = kept + [{"role": "user", "content": "And three plus three?"}]
    # 3. the next request: everything up to the end of the kept turn comes back.
    three = client.chat.completions.create(model=name, messages=third, max_tokens=8, temperature=0)

    prompt_one = lm.apply_chat_template(first)
    prompt_three = lm.apply_chat_template(third)
    assert reasoning not in lm.decode(prompt_three)  # the template dropped it
    user_turn_end = len(lm.apply_chat_template(first, add_generation_prompt=False))
    generated = prompt_one + lm.encode(reasoning, add_special_tokens=False)
    shared = common_prefix(prompt_three, generated)
    assert user_turn_end <= shared < len(prompt_one)  # diverges at the dropped <think>
    assert one.usage.prompt_tokens == len(prompt_one)
    assert three.usage.prompt_tokens == len(prompt_three)
    cached = three.usage.prompt_tokens_details.cached_tokens
    assert cached == shared, (cached, shared, user_turn_end)
    entry = last_entry(srv)
    assert entry.restored_memory + entry.restored_disk == cached
    assert entry.computed == len(prompt_three) - cached


def test_tools_reach_a_chat_template_that_reads_them(thinking_engine, thinking, engine, client):
    _, thinking_client = thinking
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
            },
        }
    ]
    msgs = messages("Add one and two.")
    lm = thinking_engine.model
    with_tools = thinking_client.chat.completions.create(
        model=thinking_engine.model_name, messages=msgs, tools=tools, max_tokens=2, temperature=0
    )
    assert with_tools.usage.prompt_tokens == len(lm.apply_chat_template(msgs, tools=tools))
    assert with_tools.usage.prompt_tokens > len(lm.apply_chat_template(msgs))
    # A template that reads no tools never sees them (the request is still served).
    plain = client.chat.completions.create(
        model=engine.model_name, messages=msgs, tools=tools, max_tokens=2, temperature=0
    )
    assert plain.usage.prompt_tokens == len(engine.model.apply_chat_template(msgs))


# -- limits: idle connections, requests in flight ------------------------------------------------


def test_an_idle_connection_is_closed_after_the_idle_timeout(engine):
    with ApiServer(engine, port=0, idle_timeout_s=1).start() as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as conn:
            started = time.monotonic()
            assert conn.recv(1) == b""  # the server closed it; nothing was sent
            assert 0.5 < time.monotonic() - started < 8


def test_requests_over_the_in_flight_limit_get_429_and_the_server_recovers(engine):
    with ApiServer(engine, port=0, max_pending=1).start() as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
        long = client.chat.completions.create(
            model=engine.model_name,
            messages=messages("Tell me a long story."),
            max_tokens=8000,
            temperature=0,
            stream=True,
        )
        next(iter(long))  # the first request is in flight
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(
                model=engine.model_name, messages=messages("hi"), max_tokens=2
            )
        assert limited.value.status_code == 429
        long.close()
        wait_idle(engine)
        deadline = time.monotonic() + 10
        while srv.app.state.handlers.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        good_request_still_served(client, engine)


# -- images -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    from mlx_nbengine.testing import make_tiny_vlm

    directory = make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))
    with Engine.load(directory, block_size=BLOCK) as e:
        srv = ApiServer(e, port=0).start()
        yield e, openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
        srv.stop()


def png(seed: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_image_url_data_urls_reach_a_vision_model(vision):
    import base64

    engine, client = vision
    data = png(1)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    parts = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    want_messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is in this picture?"}, {"type": "image"}],
        }
    ]
    want = reference(engine, want_messages, images=[data], max_tokens=8)
    got = client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": parts}],
        max_tokens=8,
        temperature=0,
    )
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_tokens)
    again = client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": parts}],
        max_tokens=8,
        temperature=0,
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the repeated image restored
    not_data = [{"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}]
    with pytest.raises(openai.BadRequestError, match="data URLs"):
        client.chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": not_data}]
        )
    broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": broken}]
        )


def test_a_base_model_without_a_chat_template_reads_the_messages_as_plain_lines(tmp_path):
    from mlx_nbengine.server.calls import plain_chat
    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    directory = make_tiny_model("llama", tmp_path / "base-llama")
    make_tiny_tokenizer(directory, chat_template="")
    with Engine.load(directory, block_size=BLOCK, store=False) as base:
        assert not base.model.has_chat_template
        msgs = messages("What is two plus two?")
        assert plain_chat(msgs) == (
            "system: You answer briefly.\nuser: What is two plus two?\nassistant:"
        )
        tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
        called = [
            *msgs,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "4"},
        ]
        assert plain_chat(called, tools) == (
            'tools: [{"type":"function","function":{"name":"add","parameters":{}}}]\n'
            "system: You answer briefly.\nuser: What is two plus two?\n"
            'assistant: <tool_call>{"name": "add", "arguments": {}}</tool_call>\n'
            "tool: 4\nassistant:"
        )
        want = base.submit(plain_chat(msgs), max_tokens=8).result(timeout=60)
        with ApiServer(base, port=0).start() as srv:
            client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0)
            got = client.chat.completions.create(
                model=base.model_name, messages=msgs, max_tokens=8, temperature=0
            )
        assert got.choices[0].message.content == want.text
        assert got.usage.prompt_tokens == len(want.prompt_tokens)


def test_a_web_page_cannot_reach_the_loopback_server(server, client, engine):
    body = json.dumps({"model": engine.model_name, "messages": messages("hi"), "max_tokens": 2})
    # A form post (a "simple" cross-site request browsers send without asking first).
    form = post(server, "/chat/completions", content=body, headers={"content-type": "text/plain"})
    assert form.status_code == 415 and error_of(form)["type"] == "invalid_request_error"
    # A page whose own name was rebound to 127.0.0.1 sends its name as the Host.
    for path in ("/models", "/chat/completions"):
        rebound = httpx.request(
            "GET" if path == "/models" else "POST",
            f"{server.url}{path}",
            content=body,
            headers={"host": f"attacker.example:{server.port}", "content-type": "application/json"},
            timeout=10,
        )
        assert rebound.status_code == 403, path
    assert "access-control-allow-origin" not in form.headers
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "localhost"):
        ok = httpx.get(f"{server.url}/models", headers={"host": host}, timeout=10)
        assert ok.status_code == 200, host
    good_request_still_served(client, engine)

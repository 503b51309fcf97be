"""The server as real clients use it: the official ``openai`` client and LangChain's
``OpenAI`` / ``ChatOpenAI`` against a real uvicorn on 127.0.0.1 (tiny random pairs).

Chat (JSON and stream) equals ``Engine.generate`` on the conversation rendered by
transformers' own ``apply_chat_template``; ``n`` and ``best_of`` follow the documented
per-choice seeds; logprobs/top_logprobs equal log_softmax of the PyTorch target's logits;
echo, prompt lists, nulls, ``/v1/models/{id}``, the API key, CORS and the body limit."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed (in [dev])")

from serving import Server, get, post, post_stream, request  # noqa: E402

from specrt import Engine, GenerationConfig  # noqa: E402
from specrt.runtime.sampling import derive_seed  # noqa: E402

KEY = "sk-test-4f1d"
ORIGIN = "http://allowed.test"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Write fib(n)."}]


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return Engine(tiny_pair[2])


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(tiny_pair):
    """The target's tokenizer (for apply_chat_template) and its PyTorch log_softmax."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[1]), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_pair[1]), local_files_only=True).eval()

    def logprobs(ids):
        with torch.no_grad():
            x = model(torch.tensor([list(ids)])).logits[0].double().numpy()
        z = x - x.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    return tok, logprobs


@pytest.fixture(scope="module")
def secured(noisy_pair):
    """A second server: API key, CORS for one origin, a 4 KiB body limit, more workers than
    cores (the startup warning), log level info; the noisy pair has no chat template."""
    workers = (os.cpu_count() or 1) + 1
    s = Server(
        noisy_pair[1],
        "--api-key",
        KEY,
        "--allowed-origins",
        ORIGIN,
        "--max-body-bytes",
        "4096",
        "--workers",
        str(workers),
        "--model-name",
        "noisy",
        log_level="info",
    )
    s.workers = workers
    yield s
    s.stop()


def rendered(hf, messages):
    return hf[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# ---- chat ------------------------------------------------------------------------------
def test_chat_json_and_stream_equal_engine_on_the_rendered_prompt(client, engine, hf):
    text = rendered(hf, CHAT)
    assert text.startswith("<|endoftext|><|system|>You write Python.\n")  # the tiny template writes BOS itself
    ref = engine.generate(text, GenerationConfig(max_new_tokens=24, temperature=0))
    assert len(ref.text) > 5
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason == "length" and r.choices[0].logprobs is None
    assert r.usage.prompt_tokens == len(engine.codec.encode(text, add_special_tokens=False)) and r.usage.completion_tokens == 24

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=CHAT, max_completion_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # pieces, not one blob


def test_stream_chunks_carry_usage_null(tiny_server):
    for path, body in (("/v1/completions", dict(prompt="def f():")), ("/v1/chat/completions", dict(messages=CHAT))):
        status, events, done = post_stream(tiny_server.port, dict(body, max_tokens=8, temperature=0, stream_options={"include_usage": True}), path=path)
        assert status == 200 and done
        assert all("usage" in e and e["usage"] is None for e in events[:-1])
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
        _, plain, _ = post_stream(tiny_server.port, dict(body, max_tokens=8, temperature=0), path=path)
        assert all("usage" not in e for e in plain)  # without include_usage: no usage key at all, as OpenAI


def test_chat_n_logprobs_and_template_errors(client, engine, hf):
    text = rendered(hf, CHAT)
    ids = engine.codec.encode(text, add_special_tokens=False)
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0.9, seed=4, n=3, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    refs = [engine.generate(ids, GenerationConfig(max_new_tokens=10, temperature=0.9, seed=derive_seed(4, j))) for j in range(3)]
    assert [c.message.content for c in r.choices] == [x.text for x in refs]
    assert len({c.message.content for c in r.choices}) > 1  # distinct samples
    _, lp = hf
    for c, x in zip(r.choices, refs):
        ref = lp(ids + x.tokens)
        content = c.logprobs.content
        assert len(content) == len(x.tokens)
        for k, (tok, e) in enumerate(zip(x.tokens, content)):
            row = ref[len(ids) - 1 + k]
            assert e.logprob == pytest.approx(row[tok], abs=2e-4)  # raw distribution (T=1), not the warped one
            assert bytes(e.bytes) == engine.codec.token_bytes(tok)
            top = np.argsort(-row, kind="stable")[:2]
            assert [t.logprob for t in e.top_logprobs] == pytest.approx(list(row[top]), abs=2e-4)
            assert [bytes(t.bytes) for t in e.top_logprobs] == [engine.codec.token_bytes(int(t)) for t in top]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": "x"}], max_tokens=2)
    assert "this template knows no role tool" in e.value.body["message"] and e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.body["param"] == "tools" and "no tool-call format" in e.value.body["message"]  # the tiny template has none


# ---- completions: n, logprobs, echo, prompt lists, best_of, nulls -----------------------
def test_completion_logprobs_equal_the_target(client, engine, hf, tiny_server):
    _, lp = hf
    prompt = "def add(a, b):"
    ids = engine.prompt_ids(prompt)
    for settings in (dict(temperature=0), dict(temperature=0.8, seed=3, top_p=0.9)):
        ref = engine.generate(prompt, GenerationConfig(max_new_tokens=12, **settings))
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, logprobs=3, **settings)
        c = r.choices[0]
        assert c.text == ref.text
        rows = lp(ids + ref.tokens)[len(ids) - 1 :]
        assert c.logprobs.tokens == [engine.codec.token_text(t) for t in ref.tokens]
        assert c.logprobs.token_logprobs == pytest.approx([rows[k, t] for k, t in enumerate(ref.tokens)], abs=2e-4)
        for k, (t, top) in enumerate(zip(ref.tokens, c.logprobs.top_logprobs)):
            want = {engine.codec.token_text(int(i)): rows[k, i] for i in np.argsort(-rows[k], kind="stable")[:3]}
            want.setdefault(engine.codec.token_text(t), rows[k, t])  # the chosen token is always listed, as OpenAI
            assert top.keys() == want.keys() and list(top.values()) == pytest.approx([want[x] for x in top], abs=2e-4)
        assert c.logprobs.text_offset == [len(engine.codec.decode(ref.tokens[:k])) for k in range(len(ref.tokens))]
        events = post_stream(tiny_server.port, dict(prompt=prompt, max_tokens=12, logprobs=3, **settings))[1]
        streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
        assert sum((x["tokens"] for x in streamed), []) == c.logprobs.tokens
        assert sum((x["token_logprobs"] for x in streamed), []) == pytest.approx(c.logprobs.token_logprobs)
        assert sum((x["text_offset"] for x in streamed), []) == c.logprobs.text_offset


def test_echo_with_prompt_logprobs(client, engine, hf, tiny_server):
    _, lp = hf
    prompt = "import os\nimport sys\n"
    ids = engine.prompt_ids(prompt)
    ref = engine.generate(prompt, GenerationConfig(max_new_tokens=6, temperature=0))
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == prompt + ref.text
    rows = lp(ids + ref.tokens)
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None  # nothing precedes the first token
    assert c.logprobs.token_logprobs[1:] == pytest.approx([rows[k - 1, t] for k, t in enumerate(ids + ref.tokens) if k > 0], abs=2e-4)
    assert c.logprobs.tokens == [engine.codec.token_text(t) for t in ids + ref.tokens]
    assert c.logprobs.text_offset[len(ids)] == len(prompt) and c.logprobs.text_offset[:3] == [0, *[len(engine.codec.decode(ids[:k])) for k in (1, 2)]]
    only = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0).choices[0]
    assert only.text == prompt and only.logprobs.token_logprobs == c.logprobs.token_logprobs[: len(ids)]
    _, events, done = post_stream(tiny_server.port, dict(prompt=prompt, max_tokens=6, temperature=0, echo=True))
    assert done and events[0]["choices"][0]["text"] == prompt
    assert "".join(e["choices"][0]["text"] for e in events) == prompt + ref.text


def test_prompt_lists_and_n(client, engine, tiny_server):
    prompts = ["def add(a, b):", "for i in range(10):", "class Foo:"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0.7, seed=11, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    refs = []
    for c in r.choices:  # choice p * n + j: prompt p, seed derived for j
        p, j = divmod(c.index, 2)
        refs.append(engine.generate(prompts[p], GenerationConfig(max_new_tokens=8, temperature=0.7, seed=derive_seed(11, j))))
        assert c.text == refs[-1].text and c.finish_reason == refs[-1].finish_reason
    assert r.usage.prompt_tokens == sum(len(engine.prompt_ids(p)) for p in prompts)  # each prompt once
    assert r.usage.completion_tokens == sum(len(x.tokens) for x in refs)
    ids = [engine.prompt_ids(p) for p in prompts[:2]]
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in r2.choices] == [engine.generate(x, GenerationConfig(max_new_tokens=8, temperature=0)).text for x in ids]
    fresh = client.completions.create(model="tiny", prompt="x = ", max_tokens=16, temperature=1.0, n=4)  # seed null: fresh entropy per choice
    assert len({c.text for c in fresh.choices}) == 4
    _, events, done = post_stream(tiny_server.port, dict(prompt=prompts[:2], max_tokens=8, temperature=0.7, seed=11, n=2))
    assert done
    for c in r.choices[:4]:
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == c.index) == c.text
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["index"] == c.index][-1] == c.finish_reason


def test_best_of_returns_the_most_probable(client, engine):
    prompt = "def add(a, b):"
    cands = [engine.generate(prompt, GenerationConfig(max_new_tokens=10, temperature=1.0, seed=derive_seed(9, j), logprobs=0)) for j in range(4)]
    score = [sum(e.logprob for e in c.logprobs) for c in cands]
    order = sorted(range(4), key=lambda j: -score[j])
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=1.0, seed=9, n=2, best_of=4)
    assert [c.text for c in r.choices] == [cands[j].text for j in order[:2]]
    assert r.choices[0].logprobs is None  # not asked for: not shown
    assert r.usage.completion_tokens == sum(len(c.tokens) for c in cands)  # every generated token counts


def test_null_means_default(client, engine, tiny_server):
    nulls = dict(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None, frequency_penalty=None, logit_bias=None, stop=None, user=None)
    r = client.completions.create(model=None, prompt="def f():", max_tokens=None, echo=None, best_of=None, logprobs=None, seed=5, **nulls)
    want = engine.generate("def f():", GenerationConfig(max_new_tokens=16, temperature=1.0, top_p=1.0, seed=5))
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 16 and len(r.choices) == 1
    status, out, _ = post(
        tiny_server.port,
        dict(messages=CHAT, max_tokens=None, max_completion_tokens=None, logprobs=None, top_logprobs=None, seed=5, **nulls),
        path="/v1/chat/completions",
    )
    assert status == 200 and out["choices"][0]["finish_reason"] in ("stop", "length")
    ids = engine.codec.encode(rendered_text(engine), add_special_tokens=False)
    want = engine.generate(ids, GenerationConfig(max_new_tokens=engine.manifest.max_ctx - len(ids), temperature=1.0, seed=5))
    assert out["choices"][0]["message"]["content"] == want.text  # default max_tokens: the rest of the context


def rendered_text(engine):
    from specrt.runtime.chat import ChatTemplate

    return ChatTemplate(engine.chat_template, "t", {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}).render(CHAT)


def test_models_routes(client, tiny_server):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert int(tiny_server.started) <= models[0].created <= tiny_server.ready  # the server's start, not 0
    assert client.models.retrieve("tiny").created == models[0].created
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_docs_document_the_400_actually_returned(tiny_server):
    status, text = get(tiny_server.port, "/openapi.json")
    schema = json.loads(text)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"400", "401", "404", "413", "503"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    assert "422" not in text
    assert get(tiny_server.port, "/docs")[0] == 200
    status, out, _ = post(tiny_server.port, dict(prompt="x", max_tokens="many"))
    assert status == 400 and out["error"]["param"] == "max_tokens"


# ---- a server with an API key, CORS and a small body limit ------------------------------
def test_api_key(secured):
    bad = openai.OpenAI(base_url=secured.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="noisy", prompt="x", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key" and "sk-wrong" not in str(e.value.body)
    status, text, h = request(secured.port, "GET", "/v1/models")
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key" and h["www-authenticate"] == "Bearer"
    good = openai.OpenAI(base_url=secured.url, api_key=KEY, max_retries=0)
    assert len(good.completions.create(model="noisy", prompt="x", max_tokens=3, temperature=0).choices[0].text) > 0
    assert get(secured.port, "/health")[0] == 200 and get(secured.port, "/metrics")[0] == 200  # only /v1 needs the key


def test_cors_preflight(secured):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    status, _, h = request(secured.port, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 200 and h["access-control-allow-origin"] == ORIGIN and "POST" in h["access-control-allow-methods"]
    status, _, h = request(secured.port, "OPTIONS", "/v1/chat/completions", headers=dict(pre, Origin="http://evil.test"))
    assert status == 400 and "access-control-allow-origin" not in h
    status, _, h = request(
        secured.port, "POST", "/v1/completions", dict(prompt="x", max_tokens=1), headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    )
    assert status == 200 and h["access-control-allow-origin"] == ORIGIN


def test_body_limit_and_chat_without_template(secured):
    auth = {"Authorization": f"Bearer {KEY}"}
    t0 = time.perf_counter()
    status, out, _ = post(secured.port, dict(prompt="x" * 5000), headers=auth)
    assert status == 413 and out["error"]["code"] == "request_too_large" and "4096 bytes" in out["error"]["message"]
    assert time.perf_counter() - t0 < 5
    status, out, _ = post(secured.port, dict(messages=CHAT, max_tokens=2), headers=auth, path="/v1/chat/completions")
    assert status == 400 and out["error"]["code"] == "chat_template_missing"
    assert "has no chat template" in out["error"]["message"] and "--chat-template" in out["error"]["message"]


def test_startup_line_and_oversubscription_warning(secured, noisy_pair):
    log = secured.log_text()
    line = next(x for x in log.splitlines() if "specrt serve: model 'noisy'" in x)
    assert str(noisy_pair[1]) in line and "backend ort-cpu" in line and f"{secured.workers} worker(s) x 1 thread(s)" in line
    assert "chat template none" in line
    assert f"{secured.workers} worker(s) x 1 thread(s) = {secured.workers} threads on {secured.workers - 1} core(s): oversubscribed" in log


def test_chat_template_override(tiny_pair, tmp_path, engine):
    tpl = tmp_path / "plain.jinja"
    tpl.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    s = Server(tiny_pair[2], "--chat-template", str(tpl), "--model-name", "tiny")
    try:
        c = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
        want = engine.generate("system: You write Python.\nuser: Write fib(n).\nassistant:", GenerationConfig(max_new_tokens=8, temperature=0))
        assert r.choices[0].message.content == want.text
    finally:
        s.stop()


# ---- LangChain ------------------------------------------------------------------------
def test_langchain_openai_and_chat_openai(tiny_server, engine, hf):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (in [dev])")
    from langchain_core.messages import HumanMessage, SystemMessage

    prompts = ["def add(a, b):", "class Foo:", "import os"]
    want = [engine.generate(p, GenerationConfig(max_new_tokens=10, temperature=0)).text for p in prompts]
    llm = lc.OpenAI(base_url=tiny_server.url, api_key="unused", model="tiny", temperature=0, max_tokens=10, max_retries=0)
    assert llm.invoke(prompts[0]) == want[0]
    assert llm.batch(prompts) == want  # one request with a list of prompts
    assert "".join(llm.stream(prompts[1])) == want[1]

    chat = lc.ChatOpenAI(base_url=tiny_server.url, api_key="unused", model="tiny", temperature=0, max_tokens=10, max_retries=0)
    convs = [[SystemMessage("You write Python."), HumanMessage("Write fib(n).")], [HumanMessage("hello")]]
    want_chat = []
    for conv in convs:
        msgs = [{"role": "system" if isinstance(m, SystemMessage) else "user", "content": m.content} for m in conv]
        want_chat.append(engine.generate(rendered(hf, msgs), GenerationConfig(max_new_tokens=10, temperature=0)).text)
    assert chat.invoke(convs[0]).content == want_chat[0]
    assert [m.content for m in chat.batch(convs)] == want_chat
    parts = list(chat.stream(convs[1]))
    assert "".join(p.content for p in parts) == want_chat[1] and len(parts) > 2

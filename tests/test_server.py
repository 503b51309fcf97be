"""The HTTP server against a real uvicorn process on 127.0.0.1 (random free port): OpenAI
completions equal ``specrt generate``, streaming, stop strings, 32 concurrent clients,
4xx errors, metrics, and that a client that goes away frees its worker."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra (fastapi, uvicorn) is not installed: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the [serve] extra (fastapi, uvicorn) is not installed: pip install -e '.[serve]'")

from click.testing import CliRunner  # noqa: E402
from serving import HOST, Server, get, post, post_stream, read_metrics  # noqa: E402

from specrt import Engine, GenerationConfig  # noqa: E402
from specrt.cli import cli  # noqa: E402


def stream_text(events):
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def cli_generate(engine_dir, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=None, k_max=None, extra=()):
    """Text printed by ``specrt generate`` (click.echo adds one newline)."""
    args = [
        "generate",
        "--engines",
        str(engine_dir),
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(max_tokens),
        "--temperature",
        str(temperature),
        "--top-p",
        str(top_p),
        "--no-stats",
        *extra,
    ]
    if seed is not None:
        args += ["--seed", str(seed)]
    if k_max is not None:
        args += ["--k-max", str(k_max)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert res.output.endswith("\n")
    return res.output[:-1]


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return Engine(tiny_pair[2])


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def slow_server(tiny_pair):
    """One worker, a queue of 2, and 50 ms per streamed piece: disconnects land mid-generation."""
    s = Server(tiny_pair[2], "--workers", "1", "--max-queue", "2", "--round-delay", "0.05")
    yield s
    s.stop()


SETTINGS = [
    pytest.param(dict(temperature=0.0, k_max=4), id="greedy"),
    pytest.param(dict(temperature=0.8, top_p=0.9, seed=3), id="sampled"),
]


# ---- equal to `specrt generate` --------------------------------------------------------
@pytest.mark.parametrize("settings", SETTINGS)
def test_completion_and_stream_equal_cli_generate(server, tiny_pair, engine, settings):
    prompt, n = "def add(a, b):", 40
    expected = cli_generate(tiny_pair[2], prompt, n, **settings)
    ref = engine.generate(prompt, GenerationConfig(max_new_tokens=n, **settings))
    assert ref.text == expected and len(expected) > 10

    body = dict(model="tiny", prompt=prompt, max_tokens=n, **settings)
    status, out, _ = post(server.port, body)
    assert status == 200, out
    assert out["object"] == "text_completion" and out["model"] == "tiny" and out["id"].startswith("cmpl-")
    choice = out["choices"][0]
    assert choice["text"] == expected
    assert choice["finish_reason"] == ref.finish_reason == "length"
    u = out["usage"]
    assert u["prompt_tokens"] == len(engine.prompt_ids(prompt)) == ref.stats.prompt_tokens
    assert u["completion_tokens"] == len(ref.tokens) == n
    assert u["total_tokens"] == u["prompt_tokens"] + n
    sp = u["speculative"]
    # the same settings give the same rounds: statistics equal the in-process call's
    assert (sp["proposed"], sp["accepted"], sp["passes"]) == (ref.stats.proposed, ref.stats.accepted, ref.stats.passes)
    details = u["completion_tokens_details"]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (ref.stats.accepted, ref.stats.proposed - ref.stats.accepted)
    assert sp["accepted_hist"] == ref.stats.accepted_hist
    assert sp["acceptance_rate"] == pytest.approx(ref.stats.accepted / ref.stats.proposed, abs=1e-6)
    assert sp["mean_accepted"] == pytest.approx(ref.stats.accepted / ref.stats.passes, abs=1e-6)

    status, events, done = post_stream(server.port, dict(body, stream_options={"include_usage": True}))
    assert status == 200 and done
    assert stream_text(events) == expected
    text_chunks = [e for e in events if e["choices"] and e["choices"][0]["text"]]
    assert len(text_chunks) > 3  # pieces, not one blob
    assert all(e["choices"][0]["finish_reason"] is None for e in text_chunks)
    final = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == n
    assert events[-1]["usage"]["speculative"]["accepted"] == ref.stats.accepted
    assert len({e["id"] for e in events}) == 1


def test_stop_strings(server, engine, tiny_pair):
    prompt, n = "for i in range(10):", 60
    full = engine.generate(prompt, GenerationConfig(max_new_tokens=n, temperature=0.0)).text
    at = next(i for i in range(15, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    stop = full[at : at + 3]  # a piece from the middle of the output
    ref = engine.generate(prompt, GenerationConfig(max_new_tokens=n, temperature=0.0, stop=(stop,)))
    assert ref.text == full[: full.index(stop)] and ref.finish_reason == "stop"
    assert cli_generate(tiny_pair[2], prompt, n, extra=("--stop", stop, "--stop", "\u00a7never")) == ref.text

    body = dict(prompt=prompt, max_tokens=n, temperature=0, stop=[stop, "\u00a7never"])
    status, out, _ = post(server.port, body)
    assert status == 200, out
    assert out["choices"][0]["text"] == ref.text
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["speculative"]["stop_reason"] == stop
    assert out["usage"]["completion_tokens"] == len(ref.tokens) < n
    status, events, done = post_stream(server.port, body)
    assert status == 200 and done and stream_text(events) == ref.text
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


# ---- concurrency -----------------------------------------------------------------------
def test_32_concurrent_clients(server, engine):
    jobs = []
    for i in range(32):
        settings = dict(temperature=0.0) if i % 2 else dict(temperature=0.7, top_k=20, seed=100 + i)
        jobs.append((f"def f{i}(x):", 12 + i % 9, settings, i % 4 == 0))
    refs = [engine.generate(p, GenerationConfig(max_new_tokens=n, **s)) for p, n, s, _ in jobs]
    expected = [r.text for r in refs]
    before = read_metrics(server.port)

    def call(job):
        prompt, n, settings, streamed = job
        body = dict(prompt=prompt, max_tokens=n, **settings)
        if streamed:
            status, events, done = post_stream(server.port, body)
            assert done
            return status, stream_text(events)
        status, out, _ = post(server.port, body)
        return status, out["choices"][0]["text"]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(32) as ex:
        results = list(ex.map(call, jobs))
    wall = time.perf_counter() - t0
    assert [s for s, _ in results] == [200] * 32
    assert [t for _, t in results] == expected
    after = read_metrics(server.port)
    deadline = time.time() + 60  # a worker lowers the busy gauge just after it hands its last result over
    while after["specrt_workers_busy"] and time.time() < deadline:
        time.sleep(0.05)
        after = read_metrics(server.port)
    assert after['specrt_requests_total{outcome="ok"}'] - before['specrt_requests_total{outcome="ok"}'] == 32
    assert after["specrt_generation_tokens_total"] - before["specrt_generation_tokens_total"] == sum(len(r.tokens) for r in refs)
    assert after["specrt_workers_busy"] == 0 and after["specrt_queue_depth"] == 0
    print(f"32 concurrent clients: {wall:.2f} s")


# ---- errors ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, status, param, needle",
    [
        (b'{"prompt": "x", "max_tokens": 4', 400, None, "not valid JSON"),
        (b"not json at all", 400, None, "not valid JSON"),
        (b'["prompt", "x"]', 400, None, "must be a JSON object"),
        (
            json.dumps(dict(prompt="x", max_tokens=4, frobnicate=1)).encode(),
            400,
            "frobnicate",
            "frobnicate: unknown field; allowed fields: model, prompt, max_tokens",
        ),
        (json.dumps(dict(prompt="x", max_tokens=-1)).encode(), 400, "max_tokens", "max_tokens: Input should be greater than or equal to 0 (got -1)"),
        (json.dumps(dict(prompt="x", max_tokens="5")).encode(), 400, "max_tokens", "max_tokens: Input should be a valid integer"),
        (json.dumps(dict(max_tokens=4)).encode(), 400, "prompt", "prompt: required field missing"),
        (json.dumps(dict(prompt=5)).encode(), 400, "prompt", "prompt: must be a string, a list of token ids, or a list of those (got 5)"),
        (json.dumps(dict(prompt=["a", ""])).encode(), 400, "prompt", "prompt[1]: empty prompt"),
        (json.dumps(dict(prompt="")).encode(), 400, "prompt", "empty prompt"),
        (json.dumps(dict(prompt=[3] * 300)).encode(), 400, "prompt", "max_ctx=256, so a prompt may have at most 255"),
        (json.dumps(dict(prompt=[1, 10**6])).encode(), 400, "prompt", "prompt ids must be in 0.."),
        (json.dumps(dict(prompt="x", temperature=2.5)).encode(), 400, "temperature", "temperature: Input should be less than or equal to 2"),
        (json.dumps(dict(prompt="x", top_p=0)).encode(), 400, "top_p", "top_p: Input should be greater than 0"),
        (json.dumps(dict(prompt="x", seed=-1)).encode(), 400, "seed", "seed: Input should be greater than or equal to 0"),
        (json.dumps(dict(prompt="x", n=0)).encode(), 400, "n", "n: Input should be greater than or equal to 1 (got 0)"),
        (json.dumps(dict(prompt="x", n=2, best_of=1)).encode(), 400, "best_of", "best_of=1 must be >= n=2"),
        (json.dumps(dict(prompt="x", n=1, best_of=2, stream=True)).encode(), 400, "best_of", "best_of > n cannot be streamed"),
        (json.dumps(dict(prompt=["x"] * 20, n=4)).encode(), 400, "n", "this request asks for 80 generations; this server queues at most 64"),
        (json.dumps(dict(prompt="x", max_tokens=0)).encode(), 400, "max_tokens", "max_tokens=0 is allowed only with echo=true"),
        (json.dumps(dict(prompt="x", logprobs=6)).encode(), 400, "logprobs", "logprobs: Input should be less than or equal to 5 (got 6)"),
        (json.dumps(dict(prompt="x", presence_penalty=0.5)).encode(), 400, "presence_penalty", "only presence_penalty=0 (or null) is supported"),
        (json.dumps(dict(prompt="x", suffix="y")).encode(), 400, "suffix", "has no fill-in-the-middle tokens"),
        (json.dumps(dict(prompt="x" * 7000)).encode(), 400, "prompt", "prompt has 7000 characters; the context holds at most 255 prompt tokens"),
        (json.dumps(dict(prompt="x", stop=["a", "b", "c", "d", "e"])).encode(), 400, "stop", "at most 4 stop strings"),
        (json.dumps(dict(prompt="x", k_max=99)).encode(), 400, "k_max", "k_max=99; k_max must be an integer in 1..8"),
        (json.dumps(dict(prompt="x", threshold=1.5)).encode(), 400, "threshold", "threshold must be a number in [0, 1]"),
        (json.dumps(dict(prompt="x", stream_options={"include_usage": True})).encode(), 400, "stream_options", "only allowed with stream=true"),
        (json.dumps(dict(prompt="x", model="gpt-4")).encode(), 404, "model", "The model 'gpt-4' does not exist: this server serves 'tiny'"),
    ],
)
def test_bad_requests_get_4xx_json(server, raw, status, param, needle):
    got, out, _ = post(server.port, raw=raw)
    assert got == status, out
    assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param", "code"}
    assert needle in out["error"]["message"], out
    assert out["error"]["param"] == param
    assert out["error"]["type"] == "invalid_request_error"
    assert out["error"]["code"] == ("model_not_found" if status == 404 else None)


def test_other_routes(server):
    status, text = get(server.port, "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == "tiny"
    before = read_metrics(server.port)
    status, text = get(server.port, "/v1/completions")
    assert status == 405 and "not allowed" in json.loads(text)["error"]["message"]
    status, text = get(server.port, "/nope")
    assert status == 404 and "POST /v1/chat/completions" in json.loads(text)["error"]["message"]
    after = read_metrics(server.port)
    key = 'specrt_requests_total{outcome="invalid"}'
    assert after[key] - before[key] == 2  # 404 and 405 are requests too
    # a JSON body under another content type is not parsed: say so, not "got bytes"
    status, out, _ = post(server.port, raw=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"})
    assert status == 400 and "Content-Type: application/json" in out["error"]["message"], out
    _, stream_err, _ = post_stream(server.port, dict(prompt="x", max_tokens=-1))  # refused before the stream starts
    assert "max_tokens" in stream_err[0]["error"]["message"]


# ---- metrics ---------------------------------------------------------------------------
def test_metrics_count_what_the_responses_say(server, engine):
    before = read_metrics(server.port)
    prompts = ("import os", "class Foo:")
    outs = [post(server.port, dict(prompt=p, max_tokens=20, temperature=0))[1] for p in prompts]
    refs = [engine.generate(p, GenerationConfig(max_new_tokens=20, temperature=0)) for p in prompts]
    post(server.port, dict(prompt="x", max_tokens=-1))
    after = read_metrics(server.port)

    def delta(name):
        return after[name] - before[name]

    assert delta('specrt_requests_total{outcome="ok"}') == 2
    assert delta('specrt_requests_total{outcome="invalid"}') == 1
    assert delta("specrt_generation_tokens_total") == sum(o["usage"]["completion_tokens"] for o in outs) == 40
    assert delta("specrt_prompt_tokens_total") == sum(o["usage"]["prompt_tokens"] for o in outs)
    assert delta("specrt_draft_tokens_proposed_total") == sum(o["usage"]["speculative"]["proposed"] for o in outs)
    assert delta("specrt_draft_tokens_accepted_total") == sum(o["usage"]["speculative"]["accepted"] for o in outs)
    assert delta("specrt_e2e_request_latency_seconds_count") == 2
    assert delta("specrt_time_to_first_token_seconds_count") == 2  # non-streamed requests too
    assert delta("specrt_time_per_output_token_seconds_count") == 2
    assert delta('specrt_request_success_total{finished_reason="length"}') == 2
    assert after['specrt_e2e_request_latency_seconds_bucket{le="+Inf"}'] == after["specrt_e2e_request_latency_seconds_count"]
    assert after["specrt_acceptance_rate"] == pytest.approx(after["specrt_draft_tokens_accepted_total"] / after["specrt_draft_tokens_proposed_total"])
    assert after["specrt_mean_accepted_length"] == pytest.approx(after["specrt_draft_tokens_accepted_total"] / after["specrt_verify_passes_total"])
    assert after["specrt_workers"] == 2
    # acceptance per draft position i: passes that proposed / accepted more than i candidates
    for i in range(4):
        acc_i = sum(sum(o["usage"]["speculative"]["accepted_hist"][i + 1 :]) for o in outs)
        prop_i = sum(sum(r.stats.proposed_hist[i + 1 :]) for r in refs)
        assert delta(f'specrt_draft_tokens_accepted_by_position_total{{position="{i}"}}') == acc_i
        assert delta(f'specrt_draft_tokens_proposed_by_position_total{{position="{i}"}}') == prop_i
    assert sum(sum(r.stats.proposed_hist[1:]) for r in refs) > 0
    _, text = get(server.port, "/metrics")
    assert "# TYPE specrt_e2e_request_latency_seconds histogram" in text and "# TYPE specrt_requests_total counter" in text
    assert 'specrt_requests_total{model_name="tiny",outcome="ok"}' in text  # every series carries the model label
    assert "process_cpu_seconds_total" in text and "process_resident_memory_bytes" in text  # prometheus_client's process collector


# ---- disconnects and a full queue (one slow worker) ---------------------------------------
def open_stream(port, body):
    """Start a streamed completion on a raw socket; returns (socket, first bytes of the body)."""
    sock = socket.create_connection((HOST, port), timeout=30)
    data = json.dumps(dict(body, stream=True)).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_for(pred, port, timeout=10.0):
    deadline = time.time() + timeout
    while True:
        m = read_metrics(port)
        if pred(m):
            return m
        if time.time() > deadline:
            raise AssertionError(f"metrics never satisfied the condition: {m}")
        time.sleep(0.05)


CANCELLED = 'specrt_requests_total{outcome="cancelled"}'


def test_disconnected_stream_frees_its_worker(slow_server):
    port = slow_server.port
    before = read_metrics(port)
    sock = open_stream(port, dict(prompt="def add(a, b):", max_tokens=200, temperature=0))
    head = b""
    while b"data: {" not in head:  # the first text chunk: the generation is running
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200")
    assert read_metrics(port)["specrt_workers_busy"] == 1
    t0 = time.perf_counter()
    sock.close()  # 200 tokens at >= 50 ms a piece would hold the only worker for seconds
    m = wait_for(lambda m: m["specrt_workers_busy"] == 0 and m[CANCELLED] == before[CANCELLED] + 1, port)
    freed = time.perf_counter() - t0
    assert freed < 5.0, freed  # the whole generation takes seconds: ~200 rounds, 50 ms after each piece
    assert m['specrt_requests_total{outcome="ok"}'] == before['specrt_requests_total{outcome="ok"}']
    # the only worker serves the next request at once
    status, out, _ = post(port, dict(prompt="x", max_tokens=5, temperature=0), timeout=30)
    assert status == 200 and out["usage"]["completion_tokens"] == 5


def test_disconnected_non_streaming_request_frees_its_worker(slow_server):
    port = slow_server.port
    before = read_metrics(port)
    # queued behind a long stream on the only worker, so the client leaves while it waits
    blocker = open_stream(port, dict(prompt="a", max_tokens=200, temperature=0))
    wait_for(lambda m: m["specrt_workers_busy"] == 1, port)
    sock = socket.create_connection((HOST, port), timeout=30)
    data = json.dumps(dict(prompt="b", max_tokens=200, temperature=0)).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    wait_for(lambda m: m["specrt_queue_depth"] == 1, port)
    sock.close()  # gone while queued: the job is skipped
    blocker.close()
    m = wait_for(lambda m: m["specrt_workers_busy"] == 0 and m["specrt_queue_depth"] == 0 and m[CANCELLED] == before[CANCELLED] + 2, port)
    assert m['specrt_requests_total{outcome="ok"}'] == before['specrt_requests_total{outcome="ok"}']
    status, _, _ = post(port, dict(prompt="x", max_tokens=3), timeout=30)
    assert status == 200


def test_full_queue_answers_503(slow_server):
    port = slow_server.port
    socks = [open_stream(port, dict(prompt="def f():", max_tokens=200, temperature=0))]
    wait_for(lambda m: m["specrt_workers_busy"] == 1, port)
    socks += [open_stream(port, dict(prompt="def g():", max_tokens=200, temperature=0)) for _ in range(2)]
    wait_for(lambda m: m["specrt_queue_depth"] == 2, port)  # --max-queue 2: full
    status, out, headers = post(port, dict(prompt="x", max_tokens=3), timeout=30)
    assert status == 503 and out["error"]["type"] == "server_busy" and "2 generations already queued" in out["error"]["message"]
    assert headers.get("retry-after") == "1" or headers.get("Retry-After") == "1"
    for s in socks:
        s.close()
    wait_for(lambda m: m["specrt_workers_busy"] == 0 and m["specrt_queue_depth"] == 0, port)
    assert post(port, dict(prompt="x", max_tokens=3), timeout=30)[0] == 200


# ---- the base runtime without the extra ----------------------------------------------
def test_runtime_imports_and_serve_refuses_cleanly_without_the_extra(tiny_pair):
    code = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('fastapi', 'uvicorn', 'starlette', 'pydantic', 'jinja2', 'prometheus_client'):
                    raise ImportError('blocked by test: ' + name)
        sys.meta_path.insert(0, Block())
        from click.testing import CliRunner
        from specrt.cli import cli
        from specrt.runtime.serve import server
        from specrt import Engine
        res = CliRunner().invoke(cli, ['serve', '--engines', {str(tiny_pair[2])!r}, '--port', '0'])
        assert res.exit_code == 1, res.output
        assert "serving needs the [serve] extra" in res.output and "Traceback" not in res.output, res.output
        print('OK')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    assert out.stdout.strip().endswith("OK")


# ---- specrt.bench.load ---------------------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["--chat", "--stream"]], ids=["completions", "chat-stream"])
def test_load_test_script(server, extra, capsys):
    from specrt.bench import load as load_test

    before = read_metrics(server.port)
    s = load_test.main(["--url", f"http://{HOST}:{server.port}", "--requests", "6", "--concurrency", "2", "--max-tokens", "8", "--temperature", "0", *extra])
    after = read_metrics(server.port)
    assert s["ok"] == 6 and s["statuses"] == {"200": 6}
    assert s["endpoint"] == ("/v1/chat/completions" if extra else "/v1/completions")
    assert s["completion_tokens_per_s"] > 0 and s["latency_s"]["p50"] > 0
    assert (s["ttft_s"]["p50"] > 0) if extra else s["ttft_s"] is None
    proposed = after["specrt_draft_tokens_proposed_total"] - before["specrt_draft_tokens_proposed_total"]
    accepted = after["specrt_draft_tokens_accepted_total"] - before["specrt_draft_tokens_accepted_total"]
    assert proposed > 0 and s["acceptance_rate"] == round(accepted / proposed, 4)


def test_load_test_body_fields_reach_every_request(server):
    """``--body`` merges its fields into each request: ``speculative: false`` drafts nothing
    (the single-request target-only baseline of bench.load_vs_llama_server)."""
    from specrt.bench import load as load_test

    before = read_metrics(server.port)
    s = load_test.main(
        ["--url", f"http://{HOST}:{server.port}", "--requests", "3", "--concurrency", "1", "--max-tokens", "8", "--body", '{"speculative": false}']
    )
    after = read_metrics(server.port)
    assert s["ok"] == 3
    assert after["specrt_draft_tokens_proposed_total"] == before["specrt_draft_tokens_proposed_total"]
    assert s["completion_tokens_per_s"] > 0
    assert s["body"] == {"speculative": False}


@pytest.mark.parametrize(
    "body, why", [("[1]", "--body must be a JSON object"), ("{oops", "--body must be a JSON object"), ('{"stream": true}', "--body cannot set stream")]
)
def test_load_test_refuses_a_body_it_cannot_send(body, why, capsys):
    from specrt.bench import load as load_test

    with pytest.raises(SystemExit):
        load_test.parse_args(["--url", "http://127.0.0.1:1", "--body", body])
    assert why in capsys.readouterr().err

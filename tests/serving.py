"""A real ``specrt serve`` (uvicorn) in a subprocess on a free loopback port, and small HTTP
helpers, shared by the server tests."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import tempfile
import time

# the benches' loopback helpers, shared with the tests (re-exported: tests import them from here)
from specrt.bench.servers import HOST, free_port, read_metrics  # noqa: F401


class Server:
    """``specrt serve`` in a subprocess; its stdout+stderr go to a file (:attr:`log_text`),
    never to a pipe that could fill up and block the server."""

    def __init__(self, engines, *args: str, log_level: str = "warning", env=None):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "specrt.cli", "serve", "--engines", str(engines), "--host", HOST, "--port", str(self.port)]
        cmd += ["--log-level", log_level, "--threads", "1", *args]
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.time() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log_text()[-3000:]}")
            try:
                if get(self.port, "/health")[0] == 200:
                    self.ready = time.time()
                    return
            except OSError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("server did not come up in 120 s")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def log_text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def request(port, method, path, body=None, headers=None, raw: bytes | None = None, timeout=120):
    """One HTTP request; returns (status, body text, headers dict with lower-case names)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json"} if data is not None else {}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, r.read().decode(), {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def get(port, path):
    status, text, _ = request(port, "GET", path)
    return status, text


def post(port, body=None, raw: bytes | None = None, timeout=120, path="/v1/completions", headers=None):
    """POST a JSON body; returns (status, parsed JSON body, headers)."""
    status, text, h = request(port, "POST", path, body, headers, raw, timeout)
    return status, json.loads(text), h


def post_stream(port, body, timeout=120, path="/v1/completions", headers=None):
    """POST a streamed request; returns (status, [event dicts], saw [DONE])."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(dict(body, stream=True)).encode(), headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, [json.loads(r.read())], False
        assert r.getheader("content-type").startswith("text/event-stream")
        events, done = [], False
        for line in r:
            line = line.decode().rstrip("\n")
            if not line.startswith("data: "):
                assert line == "", line  # only data lines and blank separators
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            events.append(json.loads(data))
        return r.status, events, done
    finally:
        conn.close()

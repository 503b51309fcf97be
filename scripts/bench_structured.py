"""Structured output and tool calls on the real pair: specrt (speculative and target-only,
with and without the constraint) against llama-server (``--jinja``: ``response_format``
json_schema, ``tools``) on the same GGUF target, the same chat requests, one interleaved run.

Every row is a server answering OpenAI's ``/v1/chat/completions`` on 127.0.0.1, greedy
(``temperature`` 0), one request at a time; the time is the whole HTTP call (prefill
included). The tasks (``data/structured_tasks.jsonl``, written for this benchmark and never
tuned on) are JSON extractions with a schema (``response_format``) and coding-agent tool
turns (``tools``, ``tool_choice: "required"``, one call). Rows:

==================================== ======================================================
specrt target-only, free             the baseline: no constraint, ``speculative: false``
specrt target-only, constrained      the schema / the forced call, target alone
specrt speculative, constrained      the engine's defaults (draft model)
specrt speculative hybrid, constr.   ``drafter: hybrid`` (n-gram of the context, else the draft)
specrt speculative ngram, constr.    ``drafter: ngram`` (prompt lookup only: no draft prefill)
specrt speculative, free             no constraint
llama-server target-only, constr.    ``--jinja``; json_schema / tools through its own grammars
llama-server draft, constrained      ``--spec-draft-model`` (n-max 16, p-min 0.5: its best
                                     draft setting in make bench-real), same grammars
llama-server ngram-simple, constr.   ``--spec-type ngram-simple`` (its fastest mode there)
llama-server target-only, free       no constraint
==================================== ======================================================

llama-server is asked with ``cache_prompt: false`` and specrt serves with
``--prefix-cache-tokens 0``: every request runs cold (a task's prompt repeats across rows).
Each output is checked: JSON against its schema (``jsonschema``), a call's name against the tools and its arguments against that tool's schema; specrt's speculative
constrained outputs are compared with its target-only constrained ones token for token
(``usage.completion_tokens`` and text). Prints the table and writes JSON to ``--out``.

    python scripts/bench_structured.py --engines engines/qwen2.5-coder --repeats 3 --out bench_out/structured
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specrt.runtime.machine import machine_record, this_machine

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "specrt" / "gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: dict, timeout: float) -> tuple[int, dict, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return r.status, json.loads(data), time.perf_counter() - t0
    finally:
        conn.close()


def wait_up(proc, port: int, path: str, log: Path, limit: float = 300) -> None:
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}; see {log}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server on {port} did not come up; see {log}")


def start(cmd: list[str], port: int, health: str, log: Path, env: dict):
    f = open(log, "w")
    proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env)
    wait_up(proc, port, health, log)
    return proc


def stop_all(procs) -> None:
    """Terminate the server processes, then wait for each (killed after 20 s)."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def body_for(task: dict, constrained: bool, extra: dict) -> dict:
    body = dict(model=None, messages=task["messages"], temperature=0, max_tokens=256, **extra)
    if task["kind"] == "json":
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": task["id"], "schema": task["schema"], "strict": True}}
    else:
        body["tools"] = task["tools"]
        body["tool_choice"] = "required" if constrained else "auto"
        body["parallel_tool_calls"] = False
    return {k: v for k, v in body.items() if v is not None}


def check(task: dict, msg: dict) -> bool:
    """The output is what the constraint asks for (JSON of the schema; one known call with
    schema-valid arguments)."""
    import jsonschema

    try:
        if task["kind"] == "json":
            jsonschema.validate(json.loads(msg.get("content") or ""), task["schema"])
            return True
        calls = msg.get("tool_calls") or []
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in task["tools"]}
        for c in calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), tools[c["function"]["name"]])
        return bool(calls)
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def rows_def(has_llama: bool) -> list[dict]:
    rows = [
        dict(label="specrt target-only, free", server="specrt", constrained=False, extra=dict(speculative=False)),
        dict(label="specrt target-only, constrained", server="specrt", constrained=True, extra=dict(speculative=False)),
        dict(label="specrt speculative, constrained", server="specrt", constrained=True, extra={}),
        dict(label="specrt speculative hybrid, constrained", server="specrt", constrained=True, extra=dict(drafter="hybrid")),
        dict(label="specrt speculative ngram, constrained", server="specrt", constrained=True, extra=dict(drafter="ngram")),
        dict(label="specrt speculative, free", server="specrt", constrained=False, extra={}),
    ]
    if has_llama:
        ll = dict(cache_prompt=False)
        rows += [
            dict(label="llama-server target-only, constrained", server="llama", constrained=True, extra=ll),
            dict(label="llama-server draft, constrained", server="llama-draft", constrained=True, extra=ll),
            dict(label="llama-server ngram-simple, constrained", server="llama-ngram", constrained=True, extra=ll),
            dict(label="llama-server target-only, free", server="llama", constrained=False, extra=ll),
        ]
    return rows


def summarize(rows: list[dict], records: list[dict], tasks: list[dict]) -> list[dict]:
    """Per row, overall and per kind (json, tool): tok/s (tokens / seconds), the median
    seconds per request, valid outputs, and two ratios to specrt target-only free on the
    same task and repeat (medians): tok/s, and time per request (baseline seconds / row
    seconds: the time to the answer, whatever its length)."""
    base = {(r["task"], r["repeat"]): r for r in records if r["row"] == rows[0]["label"] and r["ok_http"]}

    def block(recs: list[dict], constrained: bool) -> dict:
        if not recs:
            return {}
        pairs = [(r, base[(r["task"], r["repeat"])]) for r in recs if (r["task"], r["repeat"]) in base]
        tok_s = [r["tok_s"] for r in recs]
        q = statistics.quantiles(tok_s, n=4, method="inclusive") if len(tok_s) > 1 else [tok_s[0]] * 3
        decode = [r["decode_tok_s"] for r in recs if r["decode_tok_s"]]
        return dict(
            n=len(recs),
            tokens=sum(r["tokens"] for r in recs),
            tok_s=sum(r["tokens"] for r in recs) / sum(r["seconds"] for r in recs),
            tok_s_median=statistics.median(tok_s),
            tok_s_q25_q75=[q[0], q[2]],
            seconds_per_request=statistics.median(r["seconds"] for r in recs),
            prefill_seconds=statistics.median(r["prefill_seconds"] for r in recs) if all(r["prefill_seconds"] is not None for r in recs) else None,
            decode_tok_s_median=statistics.median(decode) if decode else None,
            valid=sum(r["valid"] for r in recs) / len(recs) if constrained else None,
            tok_s_vs_base=statistics.median(r["tok_s"] / b["tok_s"] for r, b in pairs) if pairs else None,
            time_vs_base=statistics.median(b["seconds"] / r["seconds"] for r, b in pairs) if pairs else None,
            forced=sum(r.get("forced", 0) for r in recs),
        )

    out = []
    for row in rows:
        recs = [r for r in records if r["row"] == row["label"] and r["ok_http"]]
        d = dict(label=row["label"], **block(recs, row["constrained"]))
        d["by_kind"] = {k: block([r for r in recs if r["kind"] == k], row["constrained"]) for k in ("json", "tool")}
        out.append(d)
    return out


def table(summary: list[dict]) -> str:
    lines = [
        "| row | kind | s/request | tok/s | decode tok/s | valid | time vs specrt target-only free | tok/s vs specrt target-only free |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        for kind in ("json", "tool"):
            k = s["by_kind"].get(kind) or {}
            if not k:
                lines.append(f"| {s['label']} | {kind} | - | - | - | - | - | - |")
                continue
            v = "-" if k["valid"] is None else f"{100 * k['valid']:.0f}%"
            lines.append(
                f"| {s['label']} | {kind} | {k['seconds_per_request']:.2f} | {k['tok_s']:.2f} | {_f(k['decode_tok_s_median'])} | {v} | "
                f"{_f(k['time_vs_base'])}x | {_f(k['tok_s_vs_base'])}x |"
            )
    return "\n".join(lines)


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--tasks", default="data/structured_tasks.jsonl")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=".venv-llamacpp/bin/llama-server")
    ap.add_argument("--target-gguf", default=str(CACHE / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--draft-gguf", default=str(CACHE / "qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--limit", type=int, default=0, help="first N tasks only (0: all)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="bench_out/structured")
    a = ap.parse_args(argv)
    print(f"machine: {this_machine().describe()}", file=sys.stderr, flush=True)  # every figure below holds on this kind of CPU
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [json.loads(x) for x in (ROOT / a.tasks).read_text().splitlines() if x.strip()]
    tasks = tasks[: a.limit] if a.limit else tasks
    has_llama = Path(a.llama_server).is_file()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    procs, ports = {}, {}
    t_start, load_start = time.time(), os.getloadavg()
    try:
        ports["specrt"] = free_port()
        procs["specrt"] = start(
            [
                sys.executable,
                "-m",
                "specrt.cli",
                "serve",
                "--engines",
                a.engines,
                "--port",
                ports["specrt"],
                "--threads",
                a.threads,
                "--log-level",
                "warning",
                "--prefix-cache-tokens",
                0,
            ],
            ports["specrt"],
            "/health",
            out / "specrt.log",
            env,
        )
        if has_llama:
            common = [a.llama_server, "-m", a.target_gguf, "--jinja", "-t", a.threads, "-tb", a.threads, "-c", 4096, "-np", 1, "--host", "127.0.0.1"]
            for name, args in (
                ("llama", []),
                ("llama-draft", ["--spec-draft-model", a.draft_gguf, "--spec-draft-n-max", 16, "--spec-draft-p-min", 0.5, "--spec-draft-threads", a.threads]),
                ("llama-ngram", ["--spec-type", "ngram-simple"]),
            ):
                ports[name] = free_port()
                procs[name] = start(common + ["--port", ports[name], *args], ports[name], "/health", out / f"{name}.log", env)
        rows = rows_def(has_llama)
        records = []
        rng = random.Random(0)
        for rep in range(a.repeats):
            for task in tasks:
                order = list(rows)
                rng.shuffle(order)  # interleaved: every row meets the same machine state per task
                for row in order:
                    status, resp, dt = post(ports[row["server"]], body_for(task, row["constrained"], row["extra"]), a.timeout)
                    ok = status == 200
                    msg = resp["choices"][0]["message"] if ok else {}
                    usage = resp.get("usage", {}) if ok else {}
                    tokens = usage.get("completion_tokens", 0)
                    spec, timings = usage.get("speculative") or {}, resp.get("timings") or {} if ok else {}
                    prefill = spec.get("prefill_seconds") if spec else (timings.get("prompt_ms", 0) / 1e3 if timings else None)
                    records.append(
                        dict(
                            row=row["label"],
                            task=task["id"],
                            kind=task["kind"],
                            repeat=rep,
                            ok_http=ok,
                            status=status,
                            seconds=dt,
                            tokens=tokens,
                            tok_s=tokens / dt if dt else 0.0,
                            valid=check(task, msg) if ok else False,
                            finish=resp["choices"][0]["finish_reason"] if ok else None,
                            forced=spec.get("forced", 0),
                            prefill_seconds=prefill,
                            decode_tok_s=(tokens - 1) / (dt - prefill) if prefill is not None and dt > prefill and tokens > 1 else None,
                            text=msg.get("content"),
                            tool_calls=[(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []],
                            error=None if ok else resp.get("error"),
                        )
                    )
                    r = records[-1]
                    print(
                        f"rep {rep} {task['id']:<18} {row['label']:<40} {r['tokens']:4d} tok {dt:6.2f}s {r['tok_s']:6.2f} tok/s valid={r['valid']}", flush=True
                    )
    finally:
        stop_all(procs.values())
    summary = summarize(rows, records, tasks)
    # exactness: speculative constrained == target-only constrained, per task (first repeat)
    same = {}
    for lab in ("specrt speculative, constrained", "specrt speculative hybrid, constrained"):
        pairs = []
        for t in tasks:
            a_ = next((r for r in records if r["row"] == lab and r["task"] == t["id"] and r["repeat"] == 0), None)
            b_ = next((r for r in records if r["row"] == "specrt target-only, constrained" and r["task"] == t["id"] and r["repeat"] == 0), None)
            if a_ and b_:
                pairs.append((a_["text"], a_["tool_calls"], a_["tokens"]) == (b_["text"], b_["tool_calls"], b_["tokens"]))
        same[lab] = f"{sum(pairs)}/{len(pairs)}"
    result = dict(
        command=" ".join([Path(sys.executable).name] + sys.argv),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)),
        machine=dict(machine_record(), loadavg_start=load_start, loadavg_end=os.getloadavg()),
        threads=a.threads,
        repeats=a.repeats,
        tasks=len(tasks),
        seconds=time.time() - t_start,
        speculative_equals_target_only=same,
        summary=summary,
        records=records,
    )
    (out / "bench_structured.json").write_text(json.dumps(result, indent=1))
    (out / "table.md").write_text(table(summary) + "\n")
    print(table(summary))
    print("speculative constrained == target-only constrained:", same)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

    python -m specrt.bench.structured --engines engines/qwen2.5-coder --repeats 3 --out bench_out/structured
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from specrt.bench.common import GGUF_CACHE, command, say_machine, source_commit, write_json
from specrt.bench.kernel_step import llama_version
from specrt.bench.servers import free_port, post, start, start_llama_servers, stop_all
from specrt.runtime.machine import machine_record

ROOT = Path(__file__).resolve().parents[1]
CACHE = GGUF_CACHE


def body_for(task: dict, constrained: bool, extra: dict) -> dict:
    """The chat request of ``task``: greedy, 256 tokens at most, with its schema
    (``response_format``) or its tools (``tool_choice`` required when ``constrained``,
    else auto); ``extra`` fields added."""
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
    """The compared rows (label, server, constrained, extra request fields), specrt
    target-only free first (the baseline); llama-server's only when there is one."""
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
    """The markdown table of :func:`summarize`'s rows, one line per row and kind."""
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
    """``x`` with two decimals, "-" for None."""
    return "-" if x is None else f"{x:.2f}"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module's docstring); argparse exits on a bad one."""
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
    return ap.parse_args(argv)


def start_servers(a: argparse.Namespace, out: Path, env: dict, has_llama: bool, procs: dict, ports: dict) -> None:
    """specrt serve (prefix cache off: every request cold) and, when there is one, the three
    llama-server variants with ``--jinja``; into ``procs`` and ``ports``."""
    ports["specrt"] = free_port()
    cmd = [sys.executable, "-m", "specrt.cli", "serve", "--engines", a.engines, "--port", ports["specrt"], "--threads", a.threads]
    cmd += ["--log-level", "warning", "--prefix-cache-tokens", 0]
    procs["specrt"] = start(cmd, ports["specrt"], "/health", out / "specrt.log", env)
    if has_llama:
        start_llama_servers(a.llama_server, a.target_gguf, a.draft_gguf, a.threads, 4096, out, env, procs, ports, extra=["--jinja"])


def one_request(a: argparse.Namespace, task: dict, row: dict, port: int, rep: int) -> dict:
    """One chat request of ``task`` on ``row``'s server; its record (time, tokens, tok/s,
    validity, prefill seconds from specrt's usage or llama-server's timings, decode tok/s,
    the text and tool calls)."""
    status, resp, dt = post(port, body_for(task, row["constrained"], row["extra"]), a.timeout)
    ok = status == 200
    msg = resp["choices"][0]["message"] if ok else {}
    usage = resp.get("usage", {}) if ok else {}
    tokens = usage.get("completion_tokens", 0)
    spec, timings = usage.get("speculative") or {}, resp.get("timings") or {} if ok else {}
    prefill = spec.get("prefill_seconds") if spec else (timings.get("prompt_ms", 0) / 1e3 if timings else None)
    return dict(
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


def run_tasks(a: argparse.Namespace, rows: list[dict], tasks: list[dict], ports: dict) -> list[dict]:
    """Every task on every row, rows shuffled per task and repeat (interleaved: every row
    meets the same machine state per task); one record per request."""
    records = []
    rng = random.Random(0)
    for rep in range(a.repeats):
        for task in tasks:
            order = list(rows)
            rng.shuffle(order)
            for row in order:
                r = one_request(a, task, row, ports[row["server"]], rep)
                records.append(r)
                print(
                    f"rep {rep} {task['id']:<18} {row['label']:<40} {r['tokens']:4d} tok {r['seconds']:6.2f}s {r['tok_s']:6.2f} tok/s valid={r['valid']}",
                    flush=True,
                )
    return records


def speculative_equals_target_only(records: list[dict], tasks: list[dict]) -> dict[str, str]:
    """Exactness: per speculative constrained row, "equal/compared" tasks whose first-repeat
    output (text, tool calls, tokens) equals specrt target-only constrained's."""
    same = {}
    for lab in ("specrt speculative, constrained", "specrt speculative hybrid, constrained"):
        pairs = []
        for t in tasks:
            a_ = next((r for r in records if r["row"] == lab and r["task"] == t["id"] and r["repeat"] == 0), None)
            b_ = next((r for r in records if r["row"] == "specrt target-only, constrained" and r["task"] == t["id"] and r["repeat"] == 0), None)
            if a_ and b_:
                pairs.append((a_["text"], a_["tool_calls"], a_["tokens"]) == (b_["text"], b_["tool_calls"], b_["tokens"]))
        same[lab] = f"{sum(pairs)}/{len(pairs)}"
    return same


def main(argv=None) -> int:
    """Start the servers, run every task on every row, stop them; write
    bench_structured.json and table.md into ``--out`` and print the table. Returns 0."""
    a = parse_args(argv)
    say_machine()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [json.loads(x) for x in (ROOT / a.tasks).read_text().splitlines() if x.strip()]
    tasks = tasks[: a.limit] if a.limit else tasks
    has_llama = Path(a.llama_server).is_file()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    procs, ports = {}, {}
    t_start, load_start = time.time(), os.getloadavg()
    try:
        start_servers(a, out, env, has_llama, procs, ports)
        rows = rows_def(has_llama)
        records = run_tasks(a, rows, tasks, ports)
    finally:
        stop_all(procs.values())
    summary = summarize(rows, records, tasks)
    same = speculative_equals_target_only(records, tasks)
    result = dict(
        command=command(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)),
        specrt_commit=source_commit(),
        llama_cpp=llama_version(a.llama_server) if has_llama else None,
        machine=dict(machine_record(), loadavg_start=load_start, loadavg_end=os.getloadavg()),
        threads=a.threads,
        repeats=a.repeats,
        tasks=len(tasks),
        seconds=time.time() - t_start,
        speculative_equals_target_only=same,
        summary=summary,
        records=records,
    )
    write_json(out / "bench_structured.json", result)
    (out / "table.md").write_text(table(summary) + "\n")
    print(table(summary))
    print("speculative constrained == target-only constrained:", same)
    return 0


if __name__ == "__main__":
    sys.exit(main())

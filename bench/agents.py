"""Coding-agent conversations on the real pair: per-turn time to first token and total time,
specrt (prefix cache on and off; speculative, target-only, n-gram) against llama-server
(its slot prompt cache on; target-only, draft model, ngram-simple) on the same GGUF target,
and onnxruntime-genai (int4 from its model builder on the converted folders).

The conversations (``data/agent_conversations.jsonl``, written for this benchmark from this
repository's own files and test output) are scripted agent sessions: a system prompt, four
tool schemas, a task, then assistant tool calls and tool results (file contents, search hits,
test output). Each request is the whole history up to the next assistant message, as agents
send it (one request per assistant turn and one after the last tool result), rendered with
the engine's chat template (tools included) and sent to both servers as the same prompt
text to ``/v1/completions`` (streamed, greedy, ``max_tokens`` new tokens), so both see the
same tokens. The scripted history, not the generated reply, goes into the next request, so
every row answers the same requests.

Rows run a whole conversation each, in a shuffled order per conversation and repeat; before
a row's conversation its server answers an unrelated short prompt, so its first turn starts
cold. TTFT is the time to the first streamed text; total is the whole request. specrt's
outputs with the cache on are compared with the cache off, turn by turn (text equal).

onnxruntime-genai has no server and no prefix cache: its rows run in a worker process
(``bench/workers/ortgenai_worker.py``, its own venv) fed the prompt's token ids (the engine's
``tokenizer.json``, as specrt's server encodes a completion prompt), timed inside the
process (no HTTP: a slight advantage to it). Two ways a user runs it: a new generator per
request (cold), and one generator kept across a conversation's requests, rewound
(``Generator.rewind_to``) to the longest common prefix of its sequence and the next prompt
(its own chat example keeps the generator; the rewind is the best a user can do with its API).
The target-only kept outputs are compared with the cold ones (the speculative kept row has no
cold twin). Its TTFT is the time to its first computed token inside the worker (tokenizing
before and detokenizing after are not timed), where the HTTP rows' is the first streamed text. The build is cached in ``--ortgenai-models``
(shared with ``make bench-real``). ``--rows`` picks rows by substring.
Prints the table and writes JSON to ``--out``.

    python -m specrt.bench.agents --engines engines/qwen2.5-coder --out bench_out/agents
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
from specrt.bench.compare import Worker, build_ortgenai, venv_python
from specrt.bench.kernel_step import llama_version
from specrt.bench.servers import free_port, start, start_llama_servers, stop_all, stream
from specrt.runtime.machine import machine_record

ROOT = Path(__file__).resolve().parents[1]
FLUSH = "The quick brown fox jumps over the lazy dog. " * 4  # an unrelated prompt: each server's cache starts cold


def requests_of(conv: dict, template) -> list[str]:
    """The prompt text of each request of a conversation: the history before every assistant
    message, and the whole history after the last tool result."""
    from specrt.runtime.chat import normalize_messages

    msgs = conv["messages"]
    ends = [i for i, m in enumerate(msgs) if m["role"] == "assistant"] + [len(msgs)]
    return [template.render(normalize_messages(msgs[:e]), tools=conv["tools"]) for e in ends]


ROWS = [
    dict(label="specrt speculative, cache on", server="specrt", extra={}),
    dict(label="specrt speculative, cache off", server="specrt-nocache", extra={}),
    dict(label="specrt target-only, cache on", server="specrt", extra=dict(speculative=False)),
    # its own server: on the shared one, whichever row ran a conversation second found its
    # prompts in the prefix cache (the flush prompt does not evict them)
    dict(label="specrt ngram, cache on", server="specrt-ngram", extra=dict(drafter="ngram")),
    # its own server: the shared suffix index then holds only this row's requests (another
    # row's identical answers to the same conversations would draft it perfectly)
    dict(label="specrt suffix, cache on", server="specrt-suffix", extra=dict(drafter="suffix")),
    dict(label="specrt suffix-model, cache on", server="specrt-suffix-model", extra=dict(drafter="suffix-model")),
    dict(label="llama-server target-only, cache on", server="llama", extra=dict(cache_prompt=True)),
    dict(label="llama-server draft, cache on", server="llama-draft", extra=dict(cache_prompt=True)),
    dict(label="llama-server ngram-simple, cache on", server="llama-ngram", extra=dict(cache_prompt=True)),
    dict(label="ort-genai int4 target-only, new generator per request", server="ortgenai", extra=dict(op="run")),
    dict(label="ort-genai int4 target-only, generator kept", server="ortgenai", extra=dict(op="turn")),
    dict(label="ort-genai int4 speculative, generator kept", server="ortgenai-spec", extra=dict(op="turn")),
]
OG_COLD, OG_KEPT = ROWS[-3]["label"], ROWS[-2]["label"]


def summarize(records: list[dict], convs: list[str], labels: list[str]) -> list[dict]:
    """Per row: total seconds per conversation (median over repeats, summed over the
    conversations), median TTFT of the first turn and of the later turns, the later turns'
    TTFT over the first's, and tokens."""
    out = []
    for lab in labels:
        rs = [r for r in records if r["row"] == lab]
        if not rs:
            continue
        per_conv = {
            c: statistics.median([sum(r["seconds"] for r in rs if r["conv"] == c and r["repeat"] == k) for k in {r["repeat"] for r in rs}]) for c in convs
        }
        first = [r["ttft"] for r in rs if r["turn"] == 0]
        later = [r["ttft"] for r in rs if r["turn"] > 0]
        long_later = [r["ttft"] / r["cold_ttft"] for r in rs if r["turn"] > 0 and r["prompt_tokens"] >= 2000 and r.get("cold_ttft")]
        out.append(
            dict(
                row=lab,
                total_seconds=sum(per_conv.values()),
                per_conversation=per_conv,
                ttft_first_median=statistics.median(first),
                ttft_later_median=statistics.median(later),
                ttft_2000plus_over_cold_median=statistics.median(long_later) if long_later else None,
                tokens=sum(r["tokens"] for r in rs),
                cached_tokens=sum(r["cached_tokens"] or 0 for r in rs),
            )
        )
    return out


def table(summary: list[dict], ref: str | None) -> str:
    """The markdown table of :func:`summarize`'s rows, totals relative to the row ``ref``
    (None or absent: "-")."""
    base = next((s["total_seconds"] for s in summary if s["row"] == ref), None)
    n = len(summary[0]["per_conversation"]) if summary else 0
    lines = [
        f"| row | total s ({n} conversation{'s' if n != 1 else ''}) | vs "
        + (ref or "-")
        + " | TTFT turn 1 (median s) | TTFT later turns (median s) | later TTFT / cold TTFT, 2000+ tokens |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary:
        ratio = f"{s['total_seconds'] / base:.2f}x" if base else "-"
        r2k = f"{s['ttft_2000plus_over_cold_median']:.2f}" if s["ttft_2000plus_over_cold_median"] is not None else "-"
        lines.append(f"| {s['row']} | {s['total_seconds']:.1f} | {ratio} | {s['ttft_first_median']:.2f} | {s['ttft_later_median']:.2f} | {r2k} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module's docstring); argparse exits on a bad one."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--conversations", default="data/agent_conversations.jsonl")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--llama-server", default=".venv-llamacpp/bin/llama-server")
    ap.add_argument("--target-gguf", default=str(GGUF_CACHE / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--draft-gguf", default=str(GGUF_CACHE / "qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--ortgenai-python", default=".venv-ortgenai/bin/python")
    ap.add_argument("--ortgenai-models", default="bench_out/real_pair/anchors/ortgenai-int4", help="onnxruntime-genai's builds (cached)")
    ap.add_argument("--rows", default="", help="substrings separated by ;: run only the rows whose label holds one (default: all)")
    ap.add_argument("--out", default="bench_out/agents")
    return ap.parse_args(argv)


def start_servers(a: argparse.Namespace, out: Path, env: dict, has_llama: bool, procs: dict, ports: dict, need: set) -> None:
    """Those of the servers that rows use (``need``: server names): specrt serve with the
    prefix cache on (``specrt``) and off (``specrt-nocache``), one for the suffix drafter's
    row alone (``specrt-suffix``: its shared index sees no other row's answers) and one for
    the suffix-model drafter's (``specrt-suffix-model``) and the n-gram's (``specrt-ngram``),
    and the three llama-server
    variants when there is one; into ``procs`` and ``ports``. Raises what
    :func:`~specrt.bench.servers.start` raises."""
    for name, args in (
        ("specrt", []),
        ("specrt-nocache", ["--prefix-cache-tokens", "0"]),
        ("specrt-ngram", []),
        ("specrt-suffix", []),
        ("specrt-suffix-model", []),
    ):
        if name not in need:
            continue
        ports[name] = free_port()
        cmd = [sys.executable, "-m", "specrt.cli", "serve", "--engines", a.engines, "--port", ports[name], "--threads", a.threads, "--log-level", "warning"]
        # each row's drafter is its own (the requests are completions, which --agent-drafter never
        # touches; off all the same, so a row never measures the server's agent default)
        procs[name] = start(cmd + ["--agent-drafter", "engine"] + args, ports[name], "/health", out / f"{name}.log", env)
    if has_llama and any(n.startswith("llama") for n in need):
        start_llama_servers(a.llama_server, a.target_gguf, a.draft_gguf, a.threads, a.ctx, out, env, procs, ports)


def start_ortgenai(a: argparse.Namespace, out: Path, env: dict, rows: list[dict], procs: dict, k: int) -> dict:
    """onnxruntime-genai's workers for the rows that need them (``ortgenai``: the int4
    target; ``ortgenai-spec``: the speculative model drafting ``k`` tokens, the engine's
    ``k_max``), after its model builder (cached; offline). Returns ``{server: error}`` for
    those that cannot run (their rows are dropped); workers go into ``procs``."""
    need = {r["server"] for r in rows if r["server"].startswith("ortgenai")}
    if not need:
        return {}
    py = venv_python(a.ortgenai_python)
    if not py:
        return {n: f"no python at {a.ortgenai_python}: run `make bench-envs`" for n in need}
    root = Path(a.ortgenai_models).resolve()
    hf = {r: str(Path(g + ".hf")) for r, g in (("target", a.target_gguf), ("draft", a.draft_gguf))}
    build = build_ortgenai(py, hf["target"], hf["draft"], root, k, dict(env, HF_HUB_OFFLINE="1"), out / "ortgenai_build.log")
    if not build.get("speculative_config", {}).get("ok"):
        return {n: f"model builder: {json.dumps(build)[:400]}" for n in need}
    errors = {}
    for name in sorted(need):
        spec = name == "ortgenai-spec"
        init = dict(threads=a.threads, spinning=False, warmup=[], max_length=a.ctx, model_dir=str(root if spec else root / "target"))
        init["variant"] = dict(speculative=spec, max_draft_tokens=k)
        w = Worker(name, py, "ortgenai_worker.py", init, out, env)
        try:
            ans = w.recv(900)
        except RuntimeError as e:  # the worker died or hung while loading
            ans = dict(ready=False, error=str(e))
        if ans.get("ready"):
            procs[name] = w
        else:
            errors[name] = f"setup: {ans.get('error')}"
            w.close()
    return errors


def worker_turn(a: argparse.Namespace, row: dict, worker, codec, prompt: str) -> dict:
    """One request on an onnxruntime-genai worker: the prompt's ids (``codec``, a
    ``tokenizers.Tokenizer``), ``row["extra"]["op"]`` ("run": a new generator; "turn": the
    kept one, rewound); the same fields as :func:`one_turn`.

    Raises:
        RuntimeError: the worker answered an error or nothing in time."""
    ids = codec.encode(prompt, add_special_tokens=False).ids
    ans = worker.call({"op": row["extra"]["op"], "ids": ids, "max_new_tokens": a.max_tokens}, a.timeout)
    if not ans.get("ok"):
        raise RuntimeError(f"{row['label']}: {ans.get('error')}")
    return dict(
        prompt_tokens=len(ids),
        cached_tokens=ans.get("cached"),
        tokens=len(ans["tokens"]),
        ttft=ans["ttft"] if ans["ttft"] is not None else ans["seconds"],
        seconds=ans["seconds"],
        text=codec.decode(ans["tokens"], skip_special_tokens=False),
    )


def one_turn(a: argparse.Namespace, row: dict, port: int, prompt: str) -> dict:
    """One request of a conversation (streamed, greedy): the fields of its record that come
    from the answer (prompt, cached and new tokens from the usage or llama-server's
    timings; TTFT and total seconds; the text)."""
    body = dict(prompt=prompt, max_tokens=a.max_tokens, temperature=0, **row["extra"])
    if row["server"].startswith("specrt"):
        body["stream_options"] = {"include_usage": True}
    r = stream(port, "/v1/completions", body, a.timeout)
    u = r["usage"] or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and r["timings"]:
        cached = r["timings"].get("cache_n")
    return dict(
        prompt_tokens=u.get("prompt_tokens") or (r["timings"] or {}).get("prompt_n", 0) + (cached or 0),
        cached_tokens=cached,
        tokens=u.get("completion_tokens") or (r["timings"] or {}).get("predicted_n", 0),
        ttft=r["ttft"],
        seconds=r["seconds"],
        text=r["text"],
    )


def run_conversations(a: argparse.Namespace, rows: list[dict], convs: list[dict], prompts: dict, ports: dict, workers: dict, codec, failed: dict) -> list[dict]:
    """Every conversation on every row, rows shuffled per conversation and repeat, each
    row's server (or kept generator) flushed with an unrelated prompt first; one record per
    request. ``workers``: onnxruntime-genai's, by server name; ``codec``: their tokenizer. A
    request that fails (an HTTP error, a worker's error or silence) drops its row: its
    label and why go into ``failed`` and none of its records are returned."""
    records: list[dict] = []
    rng = random.Random(0)
    for rep in range(a.repeats):
        for conv in convs:
            order = list(rows)
            rng.shuffle(order)
            for row in order:
                if row["label"] in failed:
                    continue
                w = workers.get(row["server"])
                try:
                    if w is not None:
                        worker_turn(argparse.Namespace(**dict(vars(a), max_tokens=1)), row, w, codec, FLUSH)
                    else:
                        stream(ports[row["server"]], "/v1/completions", dict(prompt=FLUSH, max_tokens=1, temperature=0), a.timeout)
                    for turn, prompt in enumerate(prompts[conv["id"]]):
                        rec = dict(row=row["label"], conv=conv["id"], turn=turn, repeat=rep)
                        rec.update(worker_turn(a, row, w, codec, prompt) if w is not None else one_turn(a, row, ports[row["server"]], prompt))
                        records.append(rec)
                        print(
                            f"rep {rep} {conv['id']:<20} turn {turn} {row['label']:<38} prompt {rec['prompt_tokens']:5} cached {rec['cached_tokens']!s:>5} "
                            f"ttft {rec['ttft']:6.2f}s total {rec['seconds']:6.2f}s",
                            flush=True,
                        )
                except (RuntimeError, OSError) as e:  # a failed request drops its row (all its records), the others go on
                    failed[row["label"]] = f"{conv['id']}: {type(e).__name__}: {e}"[:500]
                    print(f"row dropped: {row['label']}: {failed[row['label']]}", flush=True)
    return [r for r in records if r["row"] not in failed]


def same_text(records: list[dict], kept: str, cold: str) -> dict[str, bool]:
    """``{"conv#turn#repeat": text of row kept == text of row cold}`` over the requests both ran."""
    base = {(x["conv"], x["turn"], x["repeat"]): x["text"] for x in records if x["row"] == cold}
    return {
        f"{r['conv']}#{r['turn']}#{r['repeat']}": base[k] == r["text"]
        for r in records
        if r["row"] == kept and (k := (r["conv"], r["turn"], r["repeat"])) in base
    }


def cache_on_equals_off(records: list[dict]) -> dict[str, bool]:
    """Sets each record's ``cold_ttft``: the TTFT of the same turn on its system's cold row
    (specrt rows: "specrt speculative, cache off"; onnxruntime-genai rows: a new generator per
    request; llama-server: None, it has no cold row); returns ``{"conv#turn#repeat": cache-on
    text == cache-off text}`` for specrt speculative (:func:`same_text`)."""
    cold_rows = {"specrt": "specrt speculative, cache off", "ort-genai": OG_COLD}
    cold = {(r["row"], r["conv"], r["turn"], r["repeat"]): r["ttft"] for r in records if r["row"] in cold_rows.values()}
    for r in records:
        base = cold_rows.get(r["row"].split(" ")[0])
        r["cold_ttft"] = cold.get((base, r["conv"], r["turn"], r["repeat"])) if base else None
    return same_text(records, "specrt speculative, cache on", "specrt speculative, cache off")


def main(argv=None) -> int:
    """Start the servers, run every conversation on every row, stop them; write
    bench_agents.json and table.md into ``--out`` and print the table. Returns 0."""
    a = parse_args(argv)
    say_machine()
    from specrt.runtime.chat import load_chat_template
    from specrt.runtime.manifest import load_manifest

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(a.engines)
    manifest = load_manifest(folder, verify_hashes=False)
    template = load_chat_template(folder / manifest.chat_template_file)
    convs = [json.loads(x) for x in (ROOT / a.conversations).read_text().splitlines() if x.strip()]
    prompts = {c["id"]: requests_of(c, template) for c in convs}
    has_llama = Path(a.llama_server).is_file()
    pick = [x.strip() for x in a.rows.split(";") if x.strip()]  # labels hold commas
    rows = [r for r in ROWS if (has_llama or not r["server"].startswith("llama")) and (not pick or any(x in r["label"] for x in pick))]
    if not rows:
        raise SystemExit(
            f"--rows {a.rows!r} picks no row; rows: {'; '.join(r['label'] for r in ROWS)}"
            + ("" if has_llama else " (no llama-server rows: none at --llama-server)")
        )
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    procs, ports, workers, skipped, failed = {}, {}, {}, {}, {}
    t_start, load_start = time.time(), os.getloadavg()
    k = int(manifest.defaults.get("k_max", 4))
    try:
        skipped = start_ortgenai(a, out, env, rows, workers, k)  # first: its model builder is the memory peak
        rows = [r for r in rows if r["server"] not in skipped]
        if not rows:
            raise SystemExit("no row can run: " + "; ".join(f"{n}: {w}" for n, w in skipped.items()))
        start_servers(a, out, env, has_llama, procs, ports, {r["server"] for r in rows})
        from tokenizers import Tokenizer

        codec = Tokenizer.from_file(str(folder / "tokenizer.json"))
        records = run_conversations(a, rows, convs, prompts, ports, workers, codec, failed)
    finally:
        stop_all(procs.values())
        for w in workers.values():
            w.close()
    same = cache_on_equals_off(records)
    og_same = same_text(records, OG_KEPT, OG_COLD)
    labels = [r["label"] for r in rows if r["label"] not in failed]
    summary = summarize(records, [c["id"] for c in convs], labels)
    # the reference: llama-server's draft row, else the first row that ran
    ref = next((x for x in ("llama-server draft, cache on", *labels) if x in labels), None)
    result = dict(
        command=command(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)),
        specrt_commit=source_commit(),
        llama_cpp=llama_version(a.llama_server) if has_llama else None,
        machine=dict(machine_record(), loadavg_start=load_start, loadavg_end=os.getloadavg()),
        threads=a.threads,
        repeats=a.repeats,
        max_tokens=a.max_tokens,
        conversations=[dict(id=c["id"], requests=len(prompts[c["id"]])) for c in convs],
        cached_equals_cold=f"{sum(same.values())}/{len(same)}",
        ortgenai_kept_equals_cold=f"{sum(og_same.values())}/{len(og_same)}",
        ortgenai_speculative_k=k,
        skipped_rows=skipped,
        failed_rows=failed,
        seconds=time.time() - t_start,
        summary=summary,
        records=records,
    )
    write_json(out / "bench_agents.json", result)
    (out / "table.md").write_text(table(summary, ref) + "\n")
    print(table(summary, ref))
    print("specrt cache on == cache off, per turn:", result["cached_equals_cold"], "" if same else "(no cache-off row: not compared)")
    print("onnxruntime-genai generator kept == new generator, per turn:", result["ortgenai_kept_equals_cold"])
    for name, why in {**skipped, **failed}.items():
        print(f"not run or dropped: {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

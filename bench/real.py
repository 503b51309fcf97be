"""``make bench-real``: specrt on the real pair against what a CPU user would run instead, in one
interleaved, repeated run, on the same two GGUF files.

Rows (each in its own worker process, bench/workers/, with the venv it needs):

  specrt target-only (exact width)    the 2-row step exactness by construction needs (the baseline)
  specrt target-only (fastest width)  1-row steps (``exact_widths=False``): what a target-only user runs
  specrt speculative                  the engine's tuned defaults (manifest)
  specrt ..., onnxruntime graph       where the target runs specrt's kernels: target-only and speculative
                                     on the folder's ONNX target (``backend="ort-cpu"``) in the same run
  llama-server target-only            the native server of llama-cpp-python 0.3.36's llama.cpp
  llama-server draft (best)           ``-md`` the draft GGUF; n-max x p-min x draft threads searched
  llama-server n-gram (best)          ngram-simple / ngram-mod / ngram-map-k / ngram-cache, searched
  llama-server n-gram + draft         the best of both together
  ort-genai int4 target-only / spec   onnxruntime-genai 0.18, its model builder on the converted folders
  OpenVINO int4 target-only / spec   OpenVINO GenAI LLMPipeline on optimum-cli int4 IR of the converted
                                     folders (group 128); its speculative mode at k and at a threshold
  HF generate / HF assisted           transformers on the dequantized folders (a few prompts, own phase)

"Best" settings of llama-server are searched first on tuning prompts that are not measured
(HumanEval 0..: the ones specrt's defaults were tuned on), and the winners enter the table.
Prompts: held-out HumanEval prompts (from ``--first``) in completion form, and the same
prompts in chat form (one user message through the target's chat template); every system
gets the same token ids. For each prompt every system runs once, in an order rotated per
prompt and repeat. Per row: tok/s (new tokens / call time, prefill included) median over
calls with [q25, q75], the ratio to the fastest llama-server row and to specrt target-only
(exact width) per prompt, output equal to its own system's target-only output, acceptance.

    python -m specrt.bench.real --engines engines/qwen2.5-coder --out docs/bench/real_pair
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from specrt.bench.common import command, logger, say_machine, write_json
from specrt.bench.compare import WORKERS, Worker, _build_step, build_ortgenai, call_row, run_record, summarize, venv_python
from specrt.bench.servers import DRAFT_SIMPLE
from specrt.runtime.machine import machine_record

ROOT = Path(__file__).resolve().parents[1]  # the repository (bench/ sits at its top)
BASE = "specrt target-only (exact width)"  # summarize() compares every row with this one
ORT_BASE = "specrt target-only, onnxruntime graph (exact width)"  # where the folder's target runs specrt's kernels
log = logger()


def prompt_sets(engine_dir: Path, prompts_file: Path, first: int, n: int) -> tuple[list, list]:
    """(labels, token ids): prompts ``first .. first + n`` in completion form, then in chat form."""
    from specrt import Engine
    from specrt.runtime.chat import ChatTemplate, special_token_strings

    e = Engine(engine_dir, verify_hashes=False)
    lines = prompts_file.read_text().splitlines()[first : first + n]
    code = [json.loads(x)["prompt"] for x in lines]
    tpl = ChatTemplate(e.chat_template, "engine", special_token_strings(e))
    labels = [f"completion {first + i}" for i in range(len(code))] + [f"chat {first + i}" for i in range(len(code))]
    ids = [e.prompt_ids(p) for p in code]
    ids += [e.codec.encode(tpl.render([{"role": "user", "content": "Complete this Python function:\n\n" + p}]), add_special_tokens=False) for p in code]
    return labels, ids


def run_rows(rows: list[dict], ids: list, labels: list, repeats: int, max_new: int, timeout: float, logs: Path, env: dict) -> dict:
    """Start every row's worker, run the prompts interleaved, close them; ``{label: [run]}``."""
    workers = {}
    for r in rows:
        log(f"starting {r['label']}")
        try:
            w = Worker(r["label"], r["python"], r["script"], r["init"], logs, env)
            ans = w.recv(900)
        except Exception as e:  # noqa: BLE001 - reported in the row
            r["status"], r["error"] = "failed", f"{type(e).__name__}: {e}"
            continue
        if not ans.get("ready"):
            r["status"], r["error"] = "failed", f"setup: {ans.get('error')}"
            w.close()
            continue
        r["status"], r["info"] = "ok", ans["info"]
        workers[r["label"]] = w
    runs: dict[str, list] = {r["label"]: [] for r in rows}
    live = [r for r in rows if r["label"] in workers]
    t0 = time.time()
    for rep in range(repeats):
        for i, x in enumerate(ids):
            order = [r for r in live if r["status"] == "ok"]
            shift = (i + rep) % max(1, len(order))
            for r in order[shift:] + order[:shift]:
                ans = call_row(workers[r["label"]], r, {"op": "run", "ids": x, "max_new_tokens": max_new}, timeout, labels[i])
                if ans is not None:
                    runs[r["label"]].append(run_record(i, rep, ans))
            log(f"repeat {rep + 1}/{repeats}, prompt {i + 1}/{len(ids)} ({labels[i]}): {time.time() - t0:.0f} s")
    for r in rows:
        w = workers.get(r["label"])
        if w is not None:
            try:
                r["peak_rss_mb"] = w.call({"op": "rss"}, 60).get("peak_rss_mb")
            except Exception:  # noqa: BLE001
                pass
            w.close()
    return runs


def row(label, system, python, script, init, own_base=None, error=None) -> dict:
    """One row of the table: ``script`` (a file of bench/workers/) run by ``python`` with
    ``init``; ``own_base`` the label of its own system's target-only row, ``error`` why it
    cannot run (it is then not started)."""
    return dict(label=label, system=system, python=python, script=script, init=init, own_base=own_base, status="pending", error=error, peak_rss_mb=None)


def search(candidates: list[dict], ids: list, labels: list, max_new: int, timeout: float, logs: Path, env: dict) -> list[dict]:
    """Each candidate llama-server setting on the tuning prompts; their tok/s, best first."""
    runs = run_rows(candidates, ids, labels, 1, max_new, timeout, logs, env)
    out = []
    for c in candidates:
        xs = runs[c["label"]]
        tps = sum(x["new_tokens"] for x in xs) / sum(x["seconds"] for x in xs) if xs else None
        out.append(dict(label=c["label"], args=c["init"]["variant"]["args"], tokens_per_second=tps, status=c["status"], error=c.get("error")))
    return sorted(out, key=lambda r: -(r["tokens_per_second"] or 0))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module's docstring); argparse exits on a bad one."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--prompts", default="data/humaneval_dev.jsonl")
    ap.add_argument("--first", type=int, default=20, help="first held-out prompt (the ones before it tuned the defaults)")
    ap.add_argument("--n", type=int, default=8, help="held-out prompts per form (completion, chat)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--search-prompts", type=int, default=2, help="tuning prompts per form for llama-server's settings (0: defaults only)")
    ap.add_argument("--hf-prompts", type=int, default=1, help="prompts per form for the transformers rows (0: skip)")
    ap.add_argument("--llama-python", default=".venv-llamacpp/bin/python")
    ap.add_argument("--llama-server", default=".venv-llamacpp/bin/llama-server")
    ap.add_argument("--ortgenai-python", default=".venv-ortgenai/bin/python")
    ap.add_argument("--openvino-python", default=".venv-openvino/bin/python")
    ap.add_argument("--ov-group-size", type=int, default=128, help="OpenVINO int4 group size (divides every layer width of the Qwen2.5 pair)")
    ap.add_argument("--ov-threshold", type=float, default=0.4, help="assistant_confidence_threshold of OpenVINO's threshold row")
    ap.add_argument("--skip", default="", help="comma-separated: llamaserver, ortgenai, openvino, hf")
    ap.add_argument(
        "--specrt-extra",
        default="model:adaptive,ngram:fixed,hybrid:adaptive",
        help="more specrt speculative rows, DRAFTER:adaptive|fixed comma-separated (drafters: model, ngram, hybrid)",
    )
    ap.add_argument("--llama-draft-args", default="", help="llama-server's draft-model settings, fixed (no search); DRAFT stands for the draft GGUF")
    ap.add_argument("--llama-ngram-args", default="", help="llama-server's n-gram settings, fixed (no search)")
    ap.add_argument("--call-timeout", type=float, default=900)
    ap.add_argument("--out", default="bench_out/real_pair")
    return ap.parse_args(argv)


def _context(a: argparse.Namespace) -> SimpleNamespace:
    """The run's fixed inputs: the engine folder and its GGUF sources (files and their
    converted HF folders in the cache), the prompts, the workers' environment, interpreters
    and the engine's speculative defaults.

    Raises:
        SystemExit: the engines were not exported from GGUF files.
    """
    from specrt.runtime.manifest import load_manifest

    c = SimpleNamespace(a=a, out=Path(a.out))
    c.logs = c.out / "logs"
    c.logs.mkdir(parents=True, exist_ok=True)
    c.skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    c.eng = Path(a.engines).resolve()
    c.m = load_manifest(c.eng, verify_hashes=False)
    src = c.m.extra.get("gguf", {})
    if not {"draft", "target"} <= set(src):
        raise SystemExit(f"{c.eng} was not exported from GGUF files (manifest extra.gguf); run `make real-pair`")
    cache = Path(os.environ.get("SPECRT_GGUF_CACHE") or Path.home() / ".cache" / "specrt" / "gguf")
    c.gguf = {r: str(cache / src[r]["file"]) for r in ("draft", "target")}
    c.hf = {r: str(cache / (src[r]["file"] + ".hf")) for r in ("draft", "target")}
    c.labels, c.ids = prompt_sets(c.eng, ROOT / a.prompts, a.first, a.n)
    c.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    c.env.pop("OMP_WAIT_POLICY", None)  # every system's own default (PASSIVE slowed llama.cpp 5x here)
    c.common = dict(threads=a.threads, spinning=False, warmup=[c.ids[0]])
    c.py, c.py_ll, c.py_og, c.py_ov = sys.executable, venv_python(a.llama_python), venv_python(a.ortgenai_python), venv_python(a.openvino_python)
    c.server = venv_python(a.llama_server)
    c.k, c.th = int(c.m.defaults.get("k_max", 4)), float(c.m.defaults.get("threshold", 0.0))
    c.srv = dict(c.common, gguf=c.gguf["target"], server=c.server, log_dir=str(c.logs.resolve()))
    return c


def _settings(c: SimpleNamespace) -> dict:
    """The ``settings`` block of bench_real.json."""
    a = c.a
    return dict(
        engines=str(c.eng),
        gguf=c.gguf,
        prompts=len(c.ids),
        prompt_labels=c.labels,
        repeats=a.repeats,
        max_new_tokens=a.max_new_tokens,
        threads=a.threads,
        spec_defaults=dict(k_max=c.k, threshold=c.th),
        command=command(),
        machine=machine_record(),
    )


def search_llama_server(c: SimpleNamespace, result: dict) -> dict:
    """Step 1: llama-server's draft and n-gram settings searched on tuning prompts that are
    not measured (into ``result["llama_server_search"]``); ``{"draft": args, "ngram": args}``
    of the winners (None each when not searched)."""
    a = c.a
    fixed = {"draft": a.llama_draft_args, "ngram": a.llama_ngram_args}
    best = {f: (_server_args(v, c.gguf["draft"]) if v else None) for f, v in fixed.items()}
    if "llamaserver" in c.skip or not (c.py_ll and c.server) or a.search_prompts <= 0 or all(best.values()):
        return best
    t_labels, t_ids = prompt_sets(c.eng, ROOT / a.prompts, 0, a.search_prompts)
    md = DRAFT_SIMPLE + ["--spec-draft-model", c.gguf["draft"]]
    cands = []
    for n_max in (4, 8, 16):
        for p_min in (0.0, 0.5, 0.8):
            cands.append(md + ["--spec-draft-n-max", n_max, "--spec-draft-p-min", p_min, "--spec-draft-threads", a.threads])
    cands.append(md + ["--spec-draft-n-max", 8, "--spec-draft-p-min", 0.5, "--spec-draft-threads", 1])
    grams = [
        ["--spec-type", "ngram-simple"],
        ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", 3, "--spec-ngram-simple-size-m", 8],
        ["--spec-type", "ngram-mod"],
        ["--spec-type", "ngram-map-k"],
        ["--spec-type", "ngram-cache"],
    ]
    srv = c.srv
    rows_d = [
        row(f"draft {' '.join(map(str, x[len(md) :]))}", "llama-server", c.py_ll, "llamacpp_worker.py", dict(srv, variant=dict(kind="server", args=x)))
        for x in cands
    ]
    rows_g = [
        row(f"ngram {' '.join(map(str, x))}", "llama-server", c.py_ll, "llamacpp_worker.py", dict(srv, variant=dict(kind="server", args=x))) for x in grams
    ]
    log(f"searching llama-server settings: {len(rows_d)} draft and {len(rows_g)} n-gram settings on {len(t_ids)} tuning prompts")
    result["llama_server_search"] = dict(draft=search(rows_d, t_ids, t_labels, 64, a.call_timeout, c.logs, c.env))
    result["llama_server_search"]["ngram"] = search(rows_g, t_ids, t_labels, 64, a.call_timeout, c.logs, c.env)
    return {f: best[f] or result["llama_server_search"][f][0]["args"] for f in ("draft", "ngram")}


def _server_args(text: str, draft: str) -> list:
    """``--llama-draft-args``/``--llama-ngram-args`` as llama-server arguments (``DRAFT`` is the
    draft GGUF's path)."""
    return [draft if x == "DRAFT" else x for x in shlex.split(text)]


def _without_spec_type(args: list) -> list:
    """``args`` less any ``--spec-type X`` pair (the combined row names both types once)."""
    out, skip = [], False
    for x in args:
        if skip:
            skip = False
        elif x == "--spec-type":
            skip = True
        else:
            out.append(x)
    return out


def specrt_rows(c: SimpleNamespace) -> list[dict]:
    """specrt's rows: target-only at the exact and the fastest width, speculative at the
    engine's defaults, and one per ``--specrt-extra`` drafter."""
    eng = str(c.eng)
    rows = [
        row(BASE, "specrt", c.py, "specrt_worker.py", dict(c.common, engines=eng, variant=dict(speculative=False))),
        row(
            "specrt target-only (fastest width)",
            "specrt",
            c.py,
            "specrt_worker.py",
            dict(c.common, engines=eng, variant=dict(speculative=False, exact_widths=False)),
        ),
        row(
            f"specrt speculative (k={c.k} th={c.th:g})",
            "specrt",
            c.py,
            "specrt_worker.py",
            dict(c.common, engines=eng, variant=dict(speculative=True)),
            own_base=BASE,
        ),
    ]
    if (c.m.extra.get("kernels") or {}).get("target") and not c.m.kernels_only():  # the target runs specrt's kernels: the onnxruntime graph beside them
        ort = dict(c.common, engines=eng, backend="ort-cpu")
        rows.append(row(ORT_BASE, "specrt", c.py, "specrt_worker.py", dict(ort, variant=dict(speculative=False))))
        rows.append(
            row(
                f"specrt speculative, onnxruntime graph (k={c.k} th={c.th:g})",
                "specrt",
                c.py,
                "specrt_worker.py",
                dict(ort, variant=dict(speculative=True)),
                own_base=ORT_BASE,
            )
        )
    for extra in (x for x in c.a.specrt_extra.split(",") if x.strip()):
        dr, _, ad = extra.partition(":")
        v = dict(speculative=True, drafter=dr, adaptive=ad == "adaptive")
        lab = f"specrt speculative {dr}{' adaptive' if ad == 'adaptive' else ''}"
        rows.append(row(lab, "specrt", c.py, "specrt_worker.py", dict(c.common, engines=eng, variant=v), own_base=BASE))
    return rows


def llama_server_rows(c: SimpleNamespace, best: dict) -> list[dict]:
    """llama-server's rows: target-only, the best draft and n-gram settings (or its
    defaults), and both together; each fails at once when there is no llama-server."""
    py_ll, srv, draft = c.py_ll, c.srv, c.gguf["draft"]
    miss = None if (c.py_ll and c.server) else f"no llama-server at {c.a.llama_server}: run `make bench-envs`"
    lb = "llama-server target-only"
    rows = [row(lb, "llama-server", py_ll, "llamacpp_worker.py", dict(srv, variant=dict(kind="server", args=[])), error=miss)]
    d_args = best["draft"] or DRAFT_SIMPLE + ["--spec-draft-model", draft]
    g_args = best["ngram"] or ["--spec-type", "ngram-simple"]
    for name, args in (("draft", d_args), ("n-gram", g_args)):
        label = f"llama-server {name} ({' '.join(map(str, args)).replace(draft, 'DRAFT')})"
        rows.append(row(label, "llama-server", py_ll, "llamacpp_worker.py", dict(srv, variant=dict(kind="server", args=args)), lb, miss))
    types = [g_args[g_args.index("--spec-type") + 1]] if "--spec-type" in g_args else []
    both = _without_spec_type(d_args) + ["--spec-type", ",".join(types + ["draft-simple"])] + _without_spec_type(g_args)
    rows.append(row("llama-server n-gram + draft", "llama-server", py_ll, "llamacpp_worker.py", dict(srv, variant=dict(kind="server", args=both)), lb, miss))
    return rows


def ortgenai_rows(c: SimpleNamespace, result: dict) -> list[dict]:
    """onnxruntime-genai's int4 rows (target-only, speculative at k), after its model
    builder made them from the converted folders (cached; the build record goes into
    ``result["ortgenai_build"]``)."""
    og_root = (c.out / "anchors" / "ortgenai-int4").resolve()
    miss = None if c.py_og else f"no python at {c.a.ortgenai_python}: run `make bench-envs`"
    if c.py_og:
        log("onnxruntime-genai: its model builder on the converted folders (cached) ...")
        build = build_ortgenai(c.py_og, c.hf["target"], c.hf["draft"], og_root, c.k, c.env, c.logs / "ortgenai_build.log")
        result["ortgenai_build"] = build
        if not build.get("speculative_config", {}).get("ok"):
            miss = f"model builder: {json.dumps(build)[:400]}"
    ob = "ort-genai int4 target-only"
    target = dict(c.common, model_dir=str(og_root / "target"), variant=dict(speculative=False))
    spec = dict(c.common, model_dir=str(og_root), variant=dict(speculative=True, max_draft_tokens=c.k))
    return [
        row(ob, "onnxruntime-genai", c.py_og, "ortgenai_worker.py", target, error=miss),
        row(f"ort-genai int4 speculative (k={c.k})", "onnxruntime-genai", c.py_og, "ortgenai_worker.py", spec, ob, miss),
    ]


def build_openvino(c: SimpleNamespace) -> dict:
    """optimum-cli's int4 IR of both converted folders into ``OUT/anchors/openvino-int4``
    (``openvino_worker.py --build``, cached by its stamps), through bench/compare.py's build
    step (log in ``logs/openvino_build.log``); the worker's build record (``target.ok``,
    ``draft.ok``, the error text otherwise)."""
    out = (c.out / "anchors" / "openvino-int4").resolve()
    cmd = [str(WORKERS / "openvino_worker.py"), "--build", "--target", c.hf["target"], "--draft", c.hf["draft"]]
    return _build_step(c, "openvino", c.py_ov, cmd + ["--out", str(out), "--group-size", str(c.a.ov_group_size)])


def openvino_rows(c: SimpleNamespace, result: dict) -> list[dict]:
    """OpenVINO GenAI's int4 rows (target-only; its draft-model speculative decoding at the
    engine's k and at ``--ov-threshold``), after optimum-cli made the IR from the converted
    folders (the build record goes into ``result["openvino_build"]``). Its int4 is its own
    requantization of the dequantized GGUF weights, as onnxruntime-genai's is: not the
    target's text."""
    miss = None if c.py_ov else f"no python at {c.a.openvino_python}: run `make .venv-openvino/.installed`"
    root = str((c.out / "anchors" / "openvino-int4").resolve())
    if c.py_ov:
        log("OpenVINO GenAI: optimum-cli int4 IR of the converted folders (cached) ...")
        b = result["openvino_build"] = build_openvino(c)
        bad = [f"{r}: {b.get(r, {}).get('error', 'not built')}" for r in ("target", "draft") if not b.get(r, {}).get("ok")]
        if bad:
            miss = "optimum-cli export openvino failed: " + "; ".join(bad)[:400]
    d = dict(c.common, target_dir=f"{root}/target", draft_dir=f"{root}/draft")
    ob = "OpenVINO int4 target-only"
    spec_k = dict(d, variant=dict(speculative=True, num_assistant_tokens=c.k))
    spec_th = dict(d, variant=dict(speculative=True, assistant_confidence_threshold=c.a.ov_threshold))
    return [
        row(ob, "openvino-genai", c.py_ov, "openvino_worker.py", dict(d, variant=dict(speculative=False)), error=miss),
        row(f"OpenVINO int4 speculative (k={c.k})", "openvino-genai", c.py_ov, "openvino_worker.py", spec_k, ob, miss),
        row(f"OpenVINO int4 speculative (th={c.a.ov_threshold:g})", "openvino-genai", c.py_ov, "openvino_worker.py", spec_th, ob, miss),
    ]


def hf_phase(c: SimpleNamespace, runs: dict) -> list[dict]:
    """Step 3: transformers on a few prompts of each form, in its own phase (a float32 1.5B
    model needs 6 GB); its runs join ``runs`` (prompt numbers of the whole set); its rows."""
    a = c.a
    sel = list(range(a.hf_prompts)) + list(range(a.n, a.n + a.hf_prompts))
    variant = dict(kind="assisted", num_assistant_tokens=c.k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=c.th)
    hf_rows = [
        row("HF generate (float32)", "transformers", c.py, "hf_worker.py", dict(c.common, target=c.hf["target"], variant=dict(kind="generate"))),
        row(
            f"HF assisted (k={c.k} th={c.th:g})",
            "transformers",
            c.py,
            "hf_worker.py",
            dict(c.common, target=c.hf["target"], draft=c.hf["draft"], variant=variant),
            own_base="HF generate (float32)",
        ),
    ]
    hf_runs = run_rows(hf_rows, [c.ids[i] for i in sel], [c.labels[i] for i in sel], 1, a.max_new_tokens, a.call_timeout * 4, c.logs, c.env)
    for lab, xs in hf_runs.items():
        runs[lab] = [dict(x, prompt=sel[x["prompt"]]) for x in xs]
    return hf_rows


def finish(c: SimpleNamespace, rows: list[dict], runs: dict, result: dict) -> None:
    """Summaries, the ratios to the fastest llama-server row and per prompt form; then
    bench_real.json, table.md (printed) and the plot in ``--out``."""
    summarize(rows, runs, len(c.ids), base=BASE)
    fastest = max((r for r in rows if r["system"] == "llama-server" and r.get("tokens_per_second")), key=lambda r: r["tokens_per_second"], default=None)
    for r in rows:
        if fastest and r.get("tokens_per_second"):
            r["ratio_to_fastest_llama_server"] = r["tokens_per_second"] / fastest["tokens_per_second"]
        for form in ("completion", "chat"):
            xs = [x for x in runs.get(r["label"], []) if c.labels[x["prompt"]].startswith(form)]
            if xs:
                r[f"{form}_tokens_per_second"] = sum(x["new_tokens"] for x in xs) / sum(x["seconds"] for x in xs)
        r.pop("python", None)
    result["rows"] = rows
    result["fastest_llama_server"] = fastest["label"] if fastest else None
    result["settings"]["loadavg_end"] = os.getloadavg()
    write_json(c.out / "bench_real.json", result, default=str)
    table = format_table(result)
    (c.out / "table.md").write_text(table + "\n")
    print(table)
    try:
        plot(result, c.out / "tokens_per_second.png")
    except ImportError as e:
        log(f"no plot ({e})")


def main(argv=None) -> int:
    """Search llama-server's settings, run every row interleaved, then transformers in its
    own phase; write bench_real.json, table.md and the plot. Returns 0.

    Raises:
        SystemExit: bad arguments, or engines not exported from GGUF files.
    """
    a = parse_args(argv)
    say_machine()
    c = _context(a)
    result: dict = dict(settings=_settings(c))
    # 1. llama-server's best settings, on tuning prompts that are not measured
    best = search_llama_server(c, result)
    # 2. the table: every row interleaved
    rows = specrt_rows(c)
    if "llamaserver" not in c.skip:
        rows += llama_server_rows(c, best)
    if "ortgenai" not in c.skip:
        rows += ortgenai_rows(c, result)
    if "openvino" not in c.skip:
        rows += openvino_rows(c, result)
    todo = [r for r in rows if not r["error"]]
    log(f"table: {len(todo)} rows x {len(c.ids)} prompts x {a.repeats} repeats")
    runs = run_rows(todo, c.ids, c.labels, a.repeats, a.max_new_tokens, a.call_timeout, c.logs, c.env)
    for r in rows:
        if r["error"] and r["status"] == "pending":
            r["status"] = "not run"
    # 3. transformers on a few prompts, in its own phase
    if "hf" not in c.skip and a.hf_prompts > 0:
        rows += hf_phase(c, runs)
    finish(c, rows, runs, result)
    return 0


def _f(v, spec=".2f"):
    """``v`` formatted, "-" for None."""
    return "-" if v is None else format(v, spec)


def format_table(result: dict) -> str:
    """The markdown table of the rows (the README leads its figures with it)."""
    s = result["settings"]
    lines = [
        "| system | tok/s all | completion | chat | per-call tok/s median [q25, q75] | vs fastest llama-server | vs specrt target-only (per prompt median) | = own target-only | acceptance | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if not r.get("tokens_per_second"):
            lines.append(f"| {r['label']} | - | - | - | - | - | - | - | - | {r['status']}: {(r.get('error') or '')[:160]} |")
            continue
        q = r["tokens_per_second_per_run"]
        own = f"{r['equal_to_own_target_only']}/{r['compared_prompts']}" if r.get("equal_to_own_target_only") is not None else "-"
        lines.append(
            f"| {r['label']} | {r['tokens_per_second']:.2f} | {_f(r.get('completion_tokens_per_second'))} | {_f(r.get('chat_tokens_per_second'))} | "
            f"{_f(q['median'])} [{_f(q['q25'])}, {_f(q['q75'])}] | {_f(r.get('ratio_to_fastest_llama_server'))}x | "
            f"{_f(r.get('ratio_to_specrt_target_only'))}x ({_f(r['ratio_per_prompt']['median'])}) | {own} | {_f(r.get('acceptance_rate'), '.3f')} | {_f(r.get('peak_rss_mb'), '.0f')} |"
        )
    lines.append("")
    lines.append(
        f"{s['prompts']} prompts ({s['prompts'] // 2} held-out HumanEval prompts in completion form and the same in chat form) x {s['repeats']} repeats, "
        f"{s['max_new_tokens']} new tokens, greedy, {s['threads']} threads; load average {s['machine']['loadavg_start'][0]:.1f} at the start, "
        f"{s['loadavg_end'][0]:.1f} at the end; tok/s = new tokens / call time (prefill included); transformers rows on fewer prompts."
    )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Horizontal bars of tok/s with the per-call quartiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("tokens_per_second")][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    for y, r in enumerate(rows):
        q = r["tokens_per_second_per_run"]
        ax.barh(y, r["tokens_per_second"], color="tab:blue" if r["system"] == "specrt" else "tab:gray")
        ax.errorbar(
            r["tokens_per_second"],
            y,
            xerr=[[max(0, r["tokens_per_second"] - q["q25"])], [max(0, q["q75"] - r["tokens_per_second"])]],
            color="black",
            capsize=3,
            fmt="none",
        )
        ax.text(max(r["tokens_per_second"], q["q75"]), y, f"  {r['tokens_per_second']:.1f}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["label"][:70] for r in rows], fontsize=7)
    s = result["settings"]
    ax.set_xlabel("tokens/s (prefill included; bars: per-call quartiles)")
    ax.set_title(f"Qwen2.5-Coder 0.5B -> 1.5B, {s['prompts']} prompts x {s['repeats']}, {s['max_new_tokens']} tokens, {s['threads']} threads", fontsize=9)
    ax.margins(x=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

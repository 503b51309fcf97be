"""Held-out perplexity and greedy agreement of the target's flavors, and their step cost: the
evidence for the default flavor (issue 31.3).

Systems, all on the same token ids (the first engine's tokenizer, which each export checked
against the GGUF's):

* specrt engine folders (``--engines``, repeatable; the first is the reference, the exact
  graph of the GGUF's own blocks), run by the runtime's own model class at its call widths;
* onnxruntime-genai model folders (``--ortgenai``: its model builder's int4 graph, the same
  file its generator runs), one call per window from an empty KV cache in a plain
  onnxruntime session of this venv;
* llama.cpp on the GGUF (``--gguf`` with ``--llama-python``, a python that imports
  llama-cpp-python: ``bench/workers/llamacpp_logits.py``).

Sets, none of them used for tuning: **code**: the held-out stdlib files (every 20th,
:mod:`specrt.runtime.lab.quality`); **prose**: the Python reference manual's text as the
stdlib ships it (``pydoc_data.topics``, topics sorted). Each is cut into ``--windows``
windows of ``--n-ctx`` tokens at an even stride, and as llama.cpp's ``llama-perplexity``
scores a chunk only its second half is scored (every scored token sees at least
``n_ctx / 2`` tokens of context). Perplexity = exp(mean negative log-likelihood), float64
log-softmax over the tokenizer's ids.

Figures per set and system: loss (nats/token), perplexity, its ratio to the reference's
with the standard error of the paired loss difference, and top-1 (teacher-forced greedy)
agreement between every two systems. Step cost (``--time-reps``): each specrt flavor's
target call of 1, of its ``min_q`` and of its default ``k_max + 1`` rows after a 512-token
prefill, median ms of interleaved repeats (``--time-only``: these alone). The choice: the specrt flavor with the fastest target-only step (its
``min_q``-row call, the step its exact target-only decoding makes) whose perplexity is
within ``--max-ppl-ratio`` (1.01) of the reference's on every set.

    python scripts/flavor_quality.py --engines engines/qwen2.5-coder --engines /tmp/specrt-requant \\
        --ortgenai bench_out/real_pair/anchors/ortgenai-int4/target \\
        --gguf ~/.cache/specrt/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --llama-python .venv-llamacpp/bin/python \\
        --out docs/bench/real_pair/flavor_quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_vs_llamacpp import llama_scores  # noqa: E402

from specrt.bench.common import command, say_machine, write_json  # noqa: E402
from specrt.runtime.backends import cpu_model  # noqa: E402
from specrt.runtime.backends.base import ThreadConfig  # noqa: E402
from specrt.runtime.lab.quality import Scores, encode_texts, heldout_windows, score_model, stdlib_heldout_texts  # noqa: E402
from specrt.runtime.machine import this_machine  # noqa: E402
from specrt.runtime.manifest import load_manifest  # noqa: E402


def prose_texts() -> list[str]:
    """The Python reference manual's topics as the stdlib ships them (``pydoc_data.topics``),
    sorted by topic name: English technical prose with grammar and code snippets."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


class OrtGenaiGraph:
    """onnxruntime-genai's model builder graph (``model.onnx`` of its folder) run by plain
    onnxruntime, one call per sequence from an empty KV cache: the runtime Model calls
    :func:`~specrt.runtime.lab.quality.score_model` makes (``max_q``, ``run(tokens, 0)``).

    Args:
        folder: the builder's output folder (``model.onnx`` and its weights).
        threads: intra-op threads.
        max_q: the longest sequence it will be given (one call each).
    """

    def __init__(self, folder: Path, threads: int, max_q: int):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        self.sess = ort.InferenceSession(str(Path(folder) / "model.onnx"), so, providers=["CPUExecutionProvider"])
        dec = json.loads((Path(folder) / "genai_config.json").read_text())["model"]["decoder"]
        # the past's head size is symbolic in the graph (kv_cache_dim): the config names it
        self.empty_past = np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
        self.past = [i.name for i in self.sess.get_inputs() if i.name.startswith("past_key_values")]
        self.max_q = max_q
        self.max_ctx = max_q

    def run(self, tokens, start: int) -> np.ndarray:
        """float32 logits ``[len(tokens), vocab]`` of ``tokens`` at positions 0.. (``start`` must be 0).

        Raises:
            ValueError: ``start`` is not 0 (this adapter keeps no KV cache between calls)."""
        if start != 0:
            raise ValueError(f"the onnxruntime-genai graph is scored one whole sequence per call, got start={start}")
        ids = np.asarray(tokens, np.int64)[None]
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for name in self.past:
            feed[name] = self.empty_past
        return self.sess.run(["logits"], feed)[0][0]


def paired(ref: Scores, got: Scores) -> dict:
    """``got`` against ``ref`` on the same positions (equal-length float64 log-probabilities):
    the loss change in nats/token (positive: ``got`` is worse), its standard error (paired per
    position, positions taken as independent: a lower bound, neighbouring positions of a
    window are correlated), the perplexity ratio ``exp(loss change)`` and top-1 agreement."""
    d = ref.logprob - got.logprob  # per-position loss change
    return dict(
        loss_delta=float(d.mean()),
        loss_delta_se=float(d.std(ddof=1) / np.sqrt(len(d))),
        ppl_ratio=float(np.exp(d.mean())),
        top1_agreement=float((ref.argmax == got.argmax).mean()),
    )


def step_ms(model, q: int, reps: int, prefill: int = 512) -> float:
    """Median ms of ``reps`` target calls of ``q`` rows at position ``prefill`` (the same rows
    rewritten each time) after a prefill of ``prefill`` tokens in ``model.max_q``-wide calls
    (``model.max_ctx`` must be >= ``prefill + q``; ``q`` is not checked against the
    flavor's ``min_q``: :func:`time_flavors` picks the widths)."""
    ids = list(range(1000, 1000 + prefill))
    for lo in range(0, prefill, model.max_q):
        model.run(ids[lo : lo + model.max_q], lo)
    toks = list(range(2000, 2000 + q))
    model.run(toks, prefill)  # warm
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        model.run(toks, prefill)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def choose(flavors: dict, sets: list[str], max_ratio: float) -> dict:
    """The specrt flavor with the fastest target-only step (a call of its narrowest exact
    width ``min_q``, the call its target-only decoding makes) among those whose perplexity
    ratio to the reference is at most ``max_ratio`` on every set.

    Args:
        flavors: label -> ``{"ppl_ratio": {set: ratio}, "min_q": q, "step_ms": {str(q): ms}}``
            (the reference with ratio 1.0 on every set).
        sets: the set names every ratio must meet.
        max_ratio: the perplexity bound (1.01: within 1%).

    Raises:
        ValueError: no flavor meets the bound (the reference's ratios are 1.0, so only a
            bound below 1 or a missing reference gets here).
    """
    ok = {k: v for k, v in flavors.items() if all(v["ppl_ratio"][s] <= max_ratio for s in sets)}
    if not ok:
        raise ValueError(f"no flavor within {max_ratio}x the reference's perplexity on every set")
    best = min(ok, key=lambda k: flavors[k]["step_ms"][str(flavors[k]["min_q"])])
    return dict(
        flavor=best,
        eligible=sorted(ok),
        rule=f"fastest target-only step (a call of the flavor's min_q rows) among flavors with perplexity <= {max_ratio}x the exact graph's on every set",
    )


def time_flavors(engines: list[str], threads: int, reps: int, rounds: int = 3) -> dict:
    """Each engine's target call cost: widths 1, its ``min_q`` (its target-only step) and its
    default ``k_max + 1`` (a verification pass), ``rounds`` interleaved rounds of
    :func:`step_ms` over ``reps`` calls. Returns folder -> ``{"min_q", "step_ms": {str(q):
    median ms}, "step_ms_rounds": {str(q): [ms per round]}}``."""
    models = {}
    for folder in engines:
        mm = load_manifest(folder)
        widths = sorted({1, mm.min_q(), min(mm.k_max, int(mm.defaults.get("k_max", 4))) + 1})
        models[folder] = (mm, cpu_model(Path(folder), mm.target, mm.max_ctx, mm.k_max + 1, ThreadConfig(threads)), widths)
    samples = {f: {q: [] for q in w} for f, (_, _, w) in models.items()}
    for _ in range(rounds):
        for f, (_, model, widths) in models.items():
            for q in widths:
                samples[f][q].append(step_ms(model, q, reps))
    out = {}
    for f, (mm, model, _) in models.items():
        out[f] = dict(
            min_q=mm.min_q(), step_ms={str(q): statistics.median(v) for q, v in samples[f].items()}, step_ms_rounds={str(q): v for q, v in samples[f].items()}
        )
        model.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", action="append", required=True, help="specrt engine folder (repeatable; the first is the reference)")
    ap.add_argument("--ortgenai", action="append", default=[], help="onnxruntime-genai model folder (repeatable)")
    ap.add_argument("--gguf", default=None, help="GGUF file for the llama.cpp row")
    ap.add_argument("--llama-python", default=None, help="python that imports llama-cpp-python")
    ap.add_argument("--windows", type=int, default=16, help="windows per set")
    ap.add_argument("--n-ctx", type=int, default=512, help="tokens per window (the second half is scored)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-reps", type=int, default=20, help="timed calls per flavor and width (0: no timing)")
    ap.add_argument("--max-ppl-ratio", type=float, default=1.01)
    ap.add_argument("--time-only", action="store_true", help="only the step costs of --engines (no scores, no choice)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    say_machine()
    t0 = time.time()
    if a.time_only:
        steps = time_flavors(a.engines, a.threads, a.time_reps or 20)
        rec = dict(command=command(), machine=this_machine().to_json(), loadavg_start=os.getloadavg(), systems=steps)
        for f, r in steps.items():
            print(f"{f:<40} min_q {r['min_q']} | " + ", ".join(f"q{q} {v:.1f} ms" for q, v in r["step_ms"].items()))
        rec["loadavg_end"], rec["seconds"] = os.getloadavg(), round(time.time() - t0, 1)
        if a.out:
            write_json(a.out, rec, default=float)
        return 0
    ref_folder = Path(a.engines[0])
    m = load_manifest(ref_folder)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ref_folder / m.tokenizer_file))
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    texts = {"code": stdlib_heldout_texts(), "prose": prose_texts()}
    wins = {s: heldout_windows(encode_texts(enc, t, m.eos_token_id), a.windows, a.n_ctx - 1).tolist() for s, t in texts.items()}
    first = a.n_ctx // 2
    scores: dict[str, dict[str, Scores]] = {}
    info: dict[str, dict] = {}
    for folder in a.engines:
        mm = load_manifest(folder)
        if mm.target.vocab_hash != m.target.vocab_hash:
            raise SystemExit(f"{folder} has another vocabulary than {ref_folder}: the systems must score the same token ids")
        model = cpu_model(Path(folder), mm.target, mm.max_ctx, max(256, mm.k_max + 1), ThreadConfig(a.threads))
        label = f"specrt {Path(folder).name} ({mm.target.precision}{', the GGUF blocks' if mm.target.quant.get('gguf_exact') else ''})"
        if label in scores:
            raise SystemExit(f"two engines would both be labelled {label!r}: give them folders of different names")
        scores[label] = {s: score_model(model, w, [first] * len(w), m.vocab_size, mm.min_q()) for s, w in wins.items()}
        info[label] = dict(kind="specrt", folder=str(folder), precision=mm.target.precision, gguf_exact=bool(mm.target.quant.get("gguf_exact")))
        model.close()
        print(f"[{time.time() - t0:.0f} s] scored {label}", file=sys.stderr, flush=True)
    for folder in a.ortgenai:
        g = OrtGenaiGraph(Path(folder), a.threads, a.n_ctx)
        label = f"onnxruntime-genai ({folder})"
        if label in scores:
            raise SystemExit(f"{folder} is given twice")
        scores[label] = {s: score_model(g, w, [first] * len(w), m.vocab_size) for s, w in wins.items()}
        info[label] = dict(kind="onnxruntime-genai model builder graph", folder=str(folder))
        del g
        print(f"[{time.time() - t0:.0f} s] scored {label}", file=sys.stderr, flush=True)
    if a.gguf:
        if not a.llama_python:
            raise SystemExit("--gguf needs --llama-python (a python that imports llama-cpp-python)")
        label = f"llama.cpp {Path(a.gguf).name}"
        scores[label] = {s: llama_scores(a.llama_python, a.gguf, w, [first] * len(w), a.threads, env=dict(os.environ))[0] for s, w in wins.items()}
        info[label] = dict(kind="llama.cpp (llama-cpp-python 0.3.36's vendored llama.cpp)", gguf=str(a.gguf))
        print(f"[{time.time() - t0:.0f} s] scored {label}", file=sys.stderr, flush=True)
    labels = list(scores)
    ref = labels[0]
    result = dict(
        command=command(),
        machine=this_machine().to_json(),
        loadavg_start=os.getloadavg(),
        sets={
            s: dict(
                source=("held-out stdlib files (every 20th)" if s == "code" else "pydoc_data.topics"),
                windows=len(w),
                n_ctx=a.n_ctx,
                scored_per_window=a.n_ctx - 1 - first,
            )
            for s, w in wins.items()
        },
        reference=ref,
        systems={},
        agreement={},
    )
    for lab in labels:
        rec = dict(info[lab])
        for s in wins:
            loss = float(-scores[lab][s].logprob.mean())
            rec[s] = dict(loss=loss, ppl=float(np.exp(loss)), positions=int(len(scores[lab][s].logprob)))
            if lab != ref:
                rec[s]["vs_reference"] = paired(scores[ref][s], scores[lab][s])
        result["systems"][lab] = rec
    for s in wins:
        result["agreement"][s] = {x: {y: float((scores[x][s].argmax == scores[y][s].argmax).mean()) for y in labels} for x in labels}
    if a.time_reps:
        flavors = {}
        for f, r in time_flavors(a.engines, a.threads, a.time_reps).items():
            lab = next(x for x in labels if info[x].get("folder") == str(f))
            result["systems"][lab].update(r)
            flavors[lab] = dict(
                ppl_ratio={s: result["systems"][lab][s].get("vs_reference", {}).get("ppl_ratio", 1.0) for s in wins}, min_q=r["min_q"], step_ms=r["step_ms"]
            )
        result["choice"] = choose(flavors, list(wins), a.max_ppl_ratio)
    result["loadavg_end"] = os.getloadavg()
    result["seconds"] = round(time.time() - t0, 1)
    for lab in labels:
        r = result["systems"][lab]
        cells = " | ".join(
            f"{s}: ppl {r[s]['ppl']:.4f}"
            + (f" ({r[s]['vs_reference']['ppl_ratio']:.4f}x, agree {r[s]['vs_reference']['top1_agreement']:.3f})" if "vs_reference" in r[s] else "")
            for s in wins
        )
        steps = " | step " + ", ".join(f"q{q} {v:.1f} ms" for q, v in r["step_ms"].items()) if "step_ms" in r else ""
        print(f"{lab:<52} {cells}{steps}")
    if "choice" in result:
        print(f"default: {result['choice']['flavor']} ({result['choice']['rule']})")
    if a.out:
        write_json(a.out, result, default=float)
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())

"""``specrt bench``: target-only vs speculative decoding on the same prompts, interleaved.

For every prompt, each configuration runs once per repeat, in an order rotated from
prompt to prompt (A B C, B C A, ...), so machine noise lands on all of them alike.
Reported per configuration: tokens/s (total new tokens / total wall time), speedup over
target-only (the same ratio, and the median and quartiles of per-prompt ratios),
acceptance rate, mean accepted length, time to first token, the share of distinct
4-grams in the outputs (a looping target inflates acceptance), how many outputs equal
the target-only output token for token, and the cost per committed token: wall time
(``ms_per_token``, prefill included) and target FLOPs executed after prefill
(``target_flops_per_token``, :mod:`specrt.runtime.flops`), with the target positions and
head rows behind them. Rows may differ only in the verification strategy
(``specrt bench --strategy full --strategy chunked --strategy lazy-head``): their outputs
are equal, their costs are not.

Greedy rows also list every *divergence* from target-only (``divergences``: prompt, the
first output position where the tokens differ, both tokens there, and the target-only
top-1 minus top-2 logit margin at that position, :func:`divergences`). With the engine's
exactness by construction (``Plan.min_q``) there should be none; a divergence at a tiny
margin is a near-tie the kernels rounded differently, any other is a bug. The guarantee
is never lost silently: the table prints every divergence.

Sampled configurations (``temperature > 0``) are compared with target-only *sampling*
with the same settings (the first config); their outputs are random draws, so
``equal_to_target`` is None for them (it means something only for greedy decoding).
"""

from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..config import GenerationConfig
from ..engine import Engine
from ..errors import InputError
from ..machine import Machine, this_machine
from ..stats import acceptance_rate, mean_accepted

__all__ = ["BenchConfig", "load_prompts", "prompt_tokens", "run_bench", "format_table", "distinct_4gram_share", "peak_rss_mb", "divergences", "top2_margin"]


@dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark: a label and the decoding settings."""

    label: str
    config: GenerationConfig


def load_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read a JSONL prompt file: one object per line with a string ``prompt`` field (the
    text as given), or a ``messages`` field (a chat: a non-empty list of ``{"role": str,
    "content": str}`` objects, rendered with the engine's chat template by
    :func:`prompt_tokens`).

    Returns:
        list of dicts (``task_id`` kept when present), at most ``limit``.

    Raises:
        InputError: unreadable file, or a line that is not such an object (named by number).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InputError(f"cannot read prompts file {path}: {e.strerror}") from None
    out = []
    want = 'each line must be a JSON object with a non-empty "prompt" string or a "messages" list of {"role", "content"} strings'
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{no}: not valid JSON ({e.msg}); {want}") from None
        ok = isinstance(obj, dict) and (
            (isinstance(obj.get("prompt"), str) and obj["prompt"])
            or (
                isinstance(obj.get("messages"), list)
                and obj["messages"]
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in obj["messages"])
            )
        )
        if not ok:
            raise InputError(f"{path}:{no}: {want}")
        out.append(obj)
        if limit and len(out) >= limit:
            break
    if not out:
        raise InputError(f"{path}: no prompts")
    return out


def distinct_4gram_share(tokens: Sequence[int]) -> float:
    """Distinct 4-grams / all 4-grams of a token sequence (1.0 = no repetition; nan if < 4 tokens)."""
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else math.nan


def _mean_finite(values: Sequence[float]) -> float:
    """Mean of the finite values (nan when there are none, without numpy's empty-slice warning)."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def peak_rss_mb() -> float:
    """Peak resident set size of this process's own memory since it started its program,
    MiB: Linux ``VmHWM`` (``/proc/self/status``). Not ``ru_maxrss``: across fork + exec it
    keeps the parent's peak (the kernel carries the old memory's high-water mark into the
    exec'd process), so a worker started by a large parent reported the parent's size.
    ``ru_maxrss`` (KiB) only where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(
    engine: Engine,
    prompts: list[dict],
    configs: Sequence[BenchConfig],
    repeats: int = 1,
    progress: Callable[[int, int], None] | None = None,
    trace=None,
) -> dict:
    """Run every config on every prompt, interleaved; the first config is the baseline.

    ``trace``: a :class:`~specrt.runtime.lab.trace.TraceWriter` that records every measured
    generation (the warm-up runs are not recorded).

    Returns:
        ``{"rows": [...], "prompts": n, ...}`` (JSON-ready; one row per config,
        :func:`_row`).
    """
    runs = _measure(engine, prompts, configs, repeats, progress, trace)
    base = runs[configs[0].label]
    base_tokens = {x["prompt"]: x["tokens"] for x in base if x["repeat"] == 0}
    base_time: dict = {}
    for x in base:
        base_time.setdefault((x["prompt"], x["repeat"]), x["seconds"])
    base_rate = sum(x["new_tokens"] for x in base) / sum(x["seconds"] for x in base)
    rows = [_row(c, runs[c.label], base_tokens, base_time, base_rate) for c in configs]
    ids_all = [prompt_tokens(engine, p) for p in prompts]
    for c, row in zip(configs, rows):
        if c.config.temperature == 0 and row is not rows[0]:
            got = {x["prompt"]: x["tokens"] for x in runs[c.label] if x["repeat"] == 0}
            row["divergences"] = divergences(engine, ids_all, base_tokens, got)
    return dict(
        engines=str(engine.folder),
        prompts=len(prompts),
        repeats=repeats,
        max_new_tokens=configs[0].config.max_new_tokens,
        peak_rss_mb=peak_rss_mb(),
        python=sys.version.split()[0],
        machine=this_machine().to_json(),  # the figures hold on this kind of CPU (runtime/machine.py)
        rows=rows,
    )


def top2_margin(row: np.ndarray, vocab: int) -> float:
    """Top-1 minus top-2 logit of one logits row (the tokenizer's ids only)."""
    two = np.partition(row[:vocab], vocab - 2)[vocab - 2 :]
    return float(two[1] - two[0])


def divergences(engine: Engine, ids_all: list[list[int]], base: dict[int, list[int]], got: dict[int, list[int]]) -> list[dict]:
    """Where greedy outputs ``got`` differ from the target-only outputs ``base`` (per prompt
    index): one record per differing prompt with the first differing output position, the
    two tokens there, and the target's top-2 margin at that position (the target run over
    the prompt and the target-only tokens before it, in calls no narrower than the engine's
    ``min_q``, i.e. the bits target-only decoding saw)."""
    from ..chunks import feed

    out = []
    manifest = engine.manifest
    for i, toks in sorted(got.items()):
        ref = base.get(i)
        if ref is None or toks == ref:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(ref, toks)) if a != b), min(len(ref), len(toks)))
        prefix = ids_all[i] + ref[:pos]
        margin = None
        if len(prefix) < manifest.max_ctx:
            with engine._lock:  # the target's KV buffers; no generation runs meanwhile
                margin = top2_margin(feed(engine.target, prefix, 0, engine.min_q, manifest.k_max + 1)[-1], manifest.vocab_size)
        out.append(
            dict(
                prompt=i,
                position=pos,
                target_only_token=ref[pos] if pos < len(ref) else None,
                token=toks[pos] if pos < len(toks) else None,
                target_top2_margin=margin,
            )
        )
    return out


def prompt_tokens(engine: Engine, prompt: dict) -> list[int]:
    """Token ids of one :func:`load_prompts` entry: ``prompt`` text as
    :meth:`Engine.prompt_ids` encodes it, ``messages`` rendered with the engine's chat template
    (:func:`specrt.runtime.chat.engine_chat_ids`).

    Raises:
        InputError: a ``messages`` entry and an engine folder without a chat template.
    """
    if "messages" in prompt and "prompt" not in prompt:
        from ..chat import engine_chat_ids

        return engine_chat_ids(engine, prompt["messages"])
    return engine.prompt_ids(prompt["prompt"])


def _measure(engine: Engine, prompts, configs, repeats: int, progress, trace) -> dict[str, list[dict]]:
    """Every (repeat, prompt, config) generation, the config order rotated per prompt; per
    config label, one dict of figures per generation. Every generation runs cold: the
    Engine's prefix cache is off meanwhile (the same prompt under the next config would
    otherwise reuse the last one's rows; docs/guide/prefix-cache.md)."""
    was, engine.prefix_cache, engine.cached = engine.prefix_cache, False, None
    try:
        return _measure_cold(engine, prompts, configs, repeats, progress, trace)
    finally:
        engine.prefix_cache = was


def _measure_cold(engine: Engine, prompts, configs, repeats: int, progress, trace) -> dict[str, list[dict]]:
    n = len(configs)
    runs: dict[str, list[dict]] = {c.label: [] for c in configs}
    total, done = len(prompts) * repeats * n, 0
    ids_all = [prompt_tokens(engine, p) for p in prompts]
    for c in configs:  # warm-up (first-call allocations in onnxruntime), not measured
        engine.generate(ids_all[0], replace(c.config, max_new_tokens=4))
    for r in range(repeats):
        for i, ids in enumerate(ids_all):
            shift = (i + r) % n
            for c in list(configs[shift:]) + list(configs[:shift]):
                res = engine.generate(ids, c.config, trace=trace)
                s = res.stats
                runs[c.label].append(
                    dict(
                        prompt=i,
                        repeat=r,
                        tokens=res.tokens,
                        new_tokens=s.new_tokens,
                        seconds=s.total_seconds,
                        ttft=s.ttft_seconds,
                        proposed=s.proposed,
                        accepted=s.accepted,
                        passes=s.passes,
                        hist=s.accepted_hist,
                        draft_seconds=s.draft_seconds,
                        target_seconds=s.target_seconds,
                        target_calls=s.target_calls,
                        target_positions=s.target_positions,
                        head_rows=s.head_rows,
                        target_flops=s.target_flops,
                    )
                )
                done += 1
                if progress:
                    progress(done, total)
    return runs


def _row(c: BenchConfig, xs: list[dict], base_tokens: dict, base_time: dict, base_rate: float) -> dict:
    """One table row: the config's generations summed and compared with the baseline's."""
    tok = sum(x["new_tokens"] for x in xs)
    sec = sum(x["seconds"] for x in xs)
    per_prompt = np.array([base_time[(x["prompt"], x["repeat"])] / x["seconds"] * x["new_tokens"] / max(1, len(base_tokens[x["prompt"]])) for x in xs])
    proposed = sum(x["proposed"] for x in xs)
    accepted = sum(x["accepted"] for x in xs)
    passes = sum(x["passes"] for x in xs)
    rate, per_pass = acceptance_rate(accepted, proposed), mean_accepted(accepted, passes)
    after_prefill = max(1, tok - len(xs))  # tokens committed by verification passes
    hist = np.sum([np.pad(x["hist"], (0, 65 - len(x["hist"]))) for x in xs], axis=0)
    last = int(np.nonzero(hist)[0].max()) + 1 if hist.any() else 1
    cfg = c.config
    return dict(
        label=c.label,
        k_max=cfg.k_max,
        threshold=cfg.threshold,
        speculative=cfg.speculative,
        temperature=cfg.temperature,
        strategy=cfg.strategy,
        chunk_bound=cfg.chunk_bound,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        seed=cfg.seed,
        tokens=tok,
        seconds=sec,
        tokens_per_second=tok / sec,
        speedup=(tok / sec) / base_rate,
        speedup_per_prompt_median=float(np.median(per_prompt)),
        speedup_per_prompt_q25=float(np.percentile(per_prompt, 25)),
        speedup_per_prompt_q75=float(np.percentile(per_prompt, 75)),
        acceptance_rate=None if math.isnan(rate) else rate,
        mean_accepted=None if math.isnan(per_pass) else per_pass,
        tokens_per_pass=(tok - len(xs)) / passes if passes else None,
        ms_per_token=1000 * sec / tok,
        target_flops_per_token=sum(x["target_flops"] for x in xs) / after_prefill,
        target_positions_per_token=sum(x["target_positions"] for x in xs) / after_prefill,
        head_rows_per_token=sum(x["head_rows"] for x in xs) / after_prefill,
        target_calls_per_pass=sum(x["target_calls"] for x in xs) / passes if passes else None,
        ttft_ms_median=1000 * float(np.median([x["ttft"] for x in xs])),
        draft_share=sum(x["draft_seconds"] for x in xs) / sec,
        distinct_4gram=_mean_finite([distinct_4gram_share(x["tokens"]) for x in xs if x["repeat"] == 0]),
        equal_to_target=None if cfg.temperature > 0 else sum(x["tokens"] == base_tokens[x["prompt"]] for x in xs if x["repeat"] == 0),
        accepted_hist=hist[:last].tolist(),
    )


def format_table(result: dict) -> str:
    """A fixed-width text table of ``run_bench``'s rows (``MFLOP/tok``: target FLOPs
    executed after prefill per token committed after prefill, in 1e6)."""
    w = max(22, 2 + max(len(r["label"]) for r in result["rows"]))
    head = (
        f"{'config':<{w}}{'tok/s':>9}{'speedup':>9}{'med [q25,q75]':>20}{'accept':>8}{'acc/pass':>9}{'ms/tok':>8}"
        f"{'MFLOP/tok':>10}{'ttft ms':>9}{'4gram':>7}{'=target':>9}"
    )
    lines = [head, "-" * len(head)]
    machine = Machine.from_json(result.get("machine"))
    if machine:
        lines.insert(0, f"machine: {machine.describe()}")
    for r in result["rows"]:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        mal = f"{r['mean_accepted']:.2f}" if r["speculative"] else "-"
        spread = f"{r['speedup_per_prompt_median']:.2f} [{r['speedup_per_prompt_q25']:.2f},{r['speedup_per_prompt_q75']:.2f}]"
        eq = f"{r['equal_to_target']:>5}/{result['prompts']:<3}" if r.get("equal_to_target") is not None else f"{'-':>5} {'':<3}"
        lines.append(
            f"{r['label']:<{w}}{r['tokens_per_second']:>9.1f}{r['speedup']:>8.2f}x{spread:>20}{acc:>8}{mal:>9}"
            f"{r['ms_per_token']:>8.2f}{r['target_flops_per_token'] / 1e6:>10.2f}"
            f"{r['ttft_ms_median']:>9.1f}{r['distinct_4gram']:>7.2f}{eq}"
        )
    on = f", backend {result['backend']}" if result.get("backend") else ""  # the kernels or the graph: a newcomer sees which ran
    lines.append(
        f"prompts {result['prompts']} x {result['repeats']} repeats, {result['max_new_tokens']} new tokens, peak RSS {result['peak_rss_mb']:.0f} MiB{on}"
    )
    for r in result["rows"]:
        for d in r.get("divergences") or []:
            mg = "-" if d["target_top2_margin"] is None else f"{d['target_top2_margin']:.3g}"
            lines.append(
                f"DIVERGENCE {r['label']}: prompt {d['prompt']} output position {d['position']}: target-only {d['target_only_token']}, "
                f"this row {d['token']}; target-only top-2 margin there {mg}"
            )
    r0 = result["rows"][0]
    if r0.get("temperature"):
        lines.append(f"sampling: temperature {r0['temperature']:g}, top_k {r0['top_k']}, top_p {r0['top_p']:g}, seed {r0['seed']} (all rows)")
    return "\n".join(lines)

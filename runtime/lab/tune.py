"""``specrt tune``: choose k_max, threshold and verification strategy by measured tokens/s
on a validation prompt set, and write them into the engine's manifest.

With the models (:func:`tune`), in this order:

1. ``calibrate`` (optional): fit the draft's confidence temperature on the validation
   prompts (:mod:`specrt.runtime.calibration`); the sweep then uses it, so a threshold
   reads as a probability of acceptance.
2. Measure per-call costs on this machine (:func:`specrt.runtime.costs.measure_costs`): the target's pass at
   each width q = 1..k_max+1 and the draft's q = 1 call, interleaved in a random order,
   repeated, medians.
3. Record a wide trace (the engine's largest k_max, threshold 0) on the prompts
   (:mod:`specrt.runtime.trace`); the cost model's prediction for every setting is its
   offline replay with the measured costs.
4. Sweep threshold x k_max x strategy (x drafter x adaptive k, when given) plus
   target-only on every prompt, interleaved (the
   order of the settings rotates from prompt to prompt and repeat to repeat,
   :func:`specrt.runtime.bench.run_bench`), and pick the highest measured tokens/s.
5. Confirm: the chosen setting, the best fixed-k threshold-0 setting and target-only again,
   interleaved, in fresh runs (the sweep's maximum is biased upwards by noise; the
   confirmation is not).
6. Write the chosen defaults into ``manifest.json`` (atomically, file hashes untouched;
   :func:`write_defaults`), and JSON results and plots.

From a trace (:func:`tune_from_trace`): steps 3-4 by replay only, nothing measured.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..config import STRATEGIES, GenerationConfig, check_k_max, check_strategy, check_threshold
from ..costs import measure_costs
from ..errors import InputError
from ..machine import Machine
from ..manifest import write_defaults  # noqa: F401  (re-exported: tune writes its choice with it)

__all__ = [
    "check_grid",
    "measure_costs",
    "Setting",
    "tune",
    "replay_baseline_seconds",
    "tune_from_trace",
    "format_table",
    "plot_results",
    "chosen_defaults",
]

Progress = Callable[[str, int, int], None]  # (phase label, done, total)


def check_grid(ks: Sequence[int], thresholds: Sequence[float], strategies: Sequence[str], k_range: tuple[int, int]) -> None:
    """Validate a sweep grid with the config checks (:mod:`specrt.runtime.config`).

    Raises:
        InputError: an empty list, a k_max outside ``k_range``, a threshold outside [0, 1]
            (or not a number), or an unknown strategy; the message names the value and
            what is allowed.
    """
    if not ks or not thresholds or not strategies:
        raise InputError("empty sweep grid; give at least one k_max, one threshold and one strategy")
    for k in ks:
        check_k_max(k, *k_range)
    for th in thresholds:
        check_threshold(th)
    for s in strategies:
        check_strategy(s)


# ---- the sweep -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One point of the sweep (``drafter``/``adaptive`` None: the manifest's default)."""

    k_max: int
    threshold: float
    strategy: str = "full"
    drafter: str | None = None
    adaptive: bool | None = None

    def label(self, with_strategy: bool) -> str:
        """``"k=4 th=0.2"`` (+ ``" full"`` when several strategies are swept, the drafter
        and ``" adaptive"`` when they are given)."""
        return (
            f"k={self.k_max} th={self.threshold:g}"
            + (f" {self.strategy}" if with_strategy else "")
            + (f" {self.drafter}" if self.drafter else "")
            + (" adaptive" if self.adaptive else "")
        )


def grid_settings(ks, thresholds, strategies, drafters=(None,), adaptives=(None,)) -> list[Setting]:
    """Every point of the grid, in sweep order (strategy, drafter, adaptive, k, threshold)."""
    return [Setting(k, th, s, d, a) for s in strategies for d in drafters for a in adaptives for k in ks for th in thresholds]


def _config(base, s: Setting, temperature: float):
    """A GenerationConfig for a setting."""
    return replace(base, k_max=s.k_max, threshold=s.threshold, confidence_temperature=temperature, strategy=s.strategy, drafter=s.drafter, adaptive=s.adaptive)


def _prediction(views, s: Setting, costs, cfg=None) -> dict | None:
    """The cost model's replay of a setting; None where it does not model the loop (no
    trace, or candidates that are not the draft model's at a fixed k)."""
    from .replay import replay

    if views is None or (cfg is not None and (cfg.drafter != "model" or cfg.adaptive)):
        return None
    r = replay(views, s.k_max, s.threshold, costs)
    return dict(
        tokens_per_second=r.tokens_per_second,
        speedup=r.speedup,
        acceptance_rate=r.acceptance_rate,
        mean_accepted=r.mean_accepted,
        passes=r.passes,
        accepted_hist=r.accepted_hist,
        approximated=r.approximated,
    )


def _best_fixed(rows: list[dict], key: str) -> dict | None:
    """The best threshold-0 row (the 'full' strategy, the model drafter and fixed k when
    they were swept) by ``key``."""
    cand = [r for r in rows if r["threshold"] == 0.0 and r.get(key) is not None]
    for plain in (lambda r: r["strategy"] == "full", lambda r: r.get("drafter", "model") == "model", lambda r: not r.get("adaptive")):
        cand = [r for r in cand if plain(r)] or cand
    return max(cand, key=lambda r: r[key]) if cand else None


def tune(
    engine,
    prompts: list[dict],
    ks: Sequence[int],
    thresholds: Sequence[float],
    strategies: Sequence[str] = ("full",),
    max_new_tokens: int = 128,
    repeats: int = 1,
    confirm_repeats: int = 1,
    calibrate: bool = False,
    trace_path: str | Path | None = None,
    cost_reps: int = 50,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda s: None,
    batch_sizes: int = 0,
    drafters: Sequence[str | None] = (None,),
    adaptives: Sequence[bool | None] = (None,),
) -> dict:
    """Sweep settings on validation prompts with the models (module docstring, steps 1-5).

    Args:
        engine: a loaded :class:`~specrt.runtime.engine.Engine`.
        prompts: ``[{"prompt": str, ...}]`` (:func:`specrt.runtime.lab.bench.load_prompts`).
        ks, thresholds, strategies: the grid (checked by :func:`check_grid`); drafters,
            adaptives: its drafter and adaptive-k axes (None: the manifest's default).
        max_new_tokens: tokens per generation. repeats: passes over the prompts in the
            sweep; confirm_repeats: in the confirmation (0 = skip it).
        calibrate: fit the draft confidence temperature first and sweep with it
            (else the manifest's temperature, default 1).
        trace_path: where to write the wide trace (None: a temporary file, removed).
        cost_reps: repetitions of the cost measurement. progress: ``progress(phase, done,
            total)``; log: one-line messages.
        batch_sizes: > 0: also measure a batched target step at batch sizes
            1..batch_sizes (:func:`batch_step_costs`; builder-graph targets only), recorded
            as ``batch_step_costs`` for ``specrt serve --max-batch``'s load-aware rule.

    Returns:
        JSON-ready dict: ``rows`` (per setting: measured tokens/s, speedup over target-only,
        acceptance, mean accepted length, accepted_hist, ``predicted`` by the cost model),
        ``best``, ``best_fixed``, ``confirm``, ``costs``, ``calibration``, settings.

    Raises:
        InputError: a bad grid, no prompts, or what generation raises."""
    from .bench import BenchConfig, prompt_tokens

    manifest = engine.manifest
    if not prompts:
        raise InputError("empty prompt set; tune needs at least one validation prompt")
    ks, thresholds, strategies = sorted({int(k) for k in ks}), sorted({float(t) for t in thresholds}), list(dict.fromkeys(strategies))
    check_grid(ks, thresholds, strategies, (manifest.k_min, manifest.k_max))
    ids = [prompt_tokens(engine, p) for p in prompts]
    greedy = GenerationConfig(max_new_tokens=max_new_tokens)
    result: dict = dict(
        engines=str(engine.folder),
        prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        grid=dict(k_max=ks, threshold=thresholds, strategy=strategies, drafter=list(drafters), adaptive=list(adaptives)),
        backend=engine.backend,
    )
    # 1. calibration
    temperature = _temperature(engine, ids, greedy, calibrate, result, progress, log)
    # 2. costs
    n_prompt = float(np.mean([len(x) for x in ids]))
    past = int(min(max(1, round(n_prompt + max_new_tokens / 2)), manifest.max_ctx - manifest.k_max - 1))
    costs = measure_costs(engine, range(1, manifest.k_max + 2), past, cost_reps, progress=progress)
    result["costs"] = {**costs.to_json(), "backend": engine.backend}  # adaptive k reuses them on this backend only
    if batch_sizes > 0:
        result["batch_step_costs"] = batch_step_costs(engine, batch_sizes, past, min(cost_reps, 15))
    # 3. wide trace -> predictions
    wide = replace(greedy, k_max=manifest.k_max, threshold=0.0, confidence_temperature=temperature)
    views = _wide_views(engine, ids, wide, costs, trace_path, result, progress)
    # 4. sweep
    settings = grid_settings(ks, thresholds, strategies, drafters, adaptives)
    configs = [BenchConfig("target-only", replace(greedy, speculative=False))]
    configs += [BenchConfig(s.label(len(strategies) > 1), engine.resolve(_config(greedy, s, temperature))) for s in settings]
    _sweep(engine, prompts, settings, configs, views, costs, repeats, result, progress)
    # 5. confirmation
    result["confirm"] = _confirm(engine, prompts, configs, result["best"], result["best_fixed"], confirm_repeats, progress)
    return result


def _temperature(engine, ids, greedy: GenerationConfig, calibrate: bool, result: dict, progress, log) -> float:
    """The draft confidence temperature the sweep uses: fitted on ``ids`` with ``calibrate``
    (recorded in ``result["calibration"]``), else the engine's; recorded in ``result``."""
    temperature = engine.resolve(greedy).confidence_temperature
    if calibrate:
        rep = _calibrate(engine, ids, greedy, progress)
        temperature = rep.temperature
        result["calibration"] = rep.as_dict()
        log(rep.summary())
    result["confidence_temperature"] = temperature
    return temperature


def batch_step_costs(engine, max_batch: int, past: int, reps: int = 15) -> dict | None:
    """Median seconds of one batched q = 1 target step per batch size 1..max_batch at past
    length ``past`` (:func:`specrt.runtime.costs.measure_step_costs`, on a temporary batched
    model over the target's weights, :func:`specrt.runtime.backends.batched_model`), as
    ``{"n": seconds, "backend": the engine's backend}``; None when the target has no batched
    model (neither on specrt's kernels nor a builder graph on onnxruntime CPU).

    Raises:
        InputError: max_batch < 1 (param ``max_batch``).
    """
    from ..backends import batched_model
    from ..costs import measure_step_costs

    b = batched_model(engine.target, max_batch)
    if b is None:
        return None
    try:
        costs = measure_step_costs(b, length=min(past, engine.manifest.max_ctx - 1), reps=reps, vocab=engine.manifest.vocab_size).as_dict()
    finally:
        b.close()
    return {**costs, "backend": engine.backend}


def _calibrate(engine, ids: list[list[int]], greedy, progress):
    """Step 1: fit the draft confidence temperature on the target's greedy outputs."""
    from .calibration import calibrate as fit
    from .calibration import teacher_forced

    outs = []
    for i, x in enumerate(ids):
        outs.append(engine.generate(x, replace(greedy, threshold=0.0, confidence_temperature=1.0)).tokens)
        if progress:
            progress("calibrate", i + 1, len(ids))
    return fit(teacher_forced(engine, ids, outs))


def _wide_views(engine, ids, wide, costs, trace_path, result: dict, progress):
    """Step 3: record the wide trace (kept at ``trace_path`` if given) and return its position views."""
    from .replay import position_views
    from .trace import TraceWriter, load_trace

    manifest = engine.manifest
    tmp = trace_path is None
    tpath = Path(trace_path) if trace_path else Path(os.environ.get("TMPDIR", "/tmp")) / f"specrt-tune-{os.getpid()}.jsonl"
    with TraceWriter(tpath, engine, costs, note=f"specrt tune wide trace: k_max {manifest.k_max}, threshold 0, T {wide.confidence_temperature:g}") as tw:
        for i, x in enumerate(ids):
            engine.generate(x, wide, trace=tw)
            if progress:
                progress("trace", i + 1, len(ids))
    views = position_views(load_trace(tpath))
    if tmp:
        tpath.unlink(missing_ok=True)
    else:
        result["trace"] = str(tpath)
    return views


def _sweep(engine, prompts, settings, configs, views, costs, repeats: int, result: dict, progress) -> None:
    """Step 4: every setting and target-only, interleaved; rows, best and best fixed into ``result``."""
    from .bench import run_bench

    sweep = run_bench(engine, prompts, configs, repeats=repeats, progress=(lambda d, t: progress("sweep", d, t)) if progress else None)
    by_label = {r["label"]: r for r in sweep["rows"]}
    rows = []
    for s, c in zip(settings, configs[1:]):
        r = by_label[c.label]  # c.config: the resolved settings (drafter and adaptive filled in)
        rows.append(
            dict(
                label=r["label"],
                k_max=s.k_max,
                threshold=s.threshold,
                strategy=s.strategy,
                drafter=c.config.drafter,
                adaptive=bool(c.config.adaptive),
                tokens_per_second=r["tokens_per_second"],
                speedup=r["speedup"],
                acceptance_rate=r["acceptance_rate"],
                mean_accepted=r["mean_accepted"],
                accepted_hist=r["accepted_hist"],
                equal_to_target=r["equal_to_target"],
                predicted=_prediction(views, s, costs, c.config),
            )
        )
    result["target_only"] = dict(
        tokens_per_second=by_label["target-only"]["tokens_per_second"],
        predicted_tokens_per_second=sum(len(v.out) for v in views) / replay_baseline_seconds(views, costs),
    )
    result["rows"] = rows
    best = max(rows, key=lambda r: r["tokens_per_second"])
    fixed = _best_fixed(rows, "tokens_per_second")
    result["best"], result["best_fixed"] = best, fixed
    result["sweep_ratio_best_over_fixed"] = best["tokens_per_second"] / fixed["tokens_per_second"] if fixed else None


def _confirm(engine, prompts, configs, best: dict, fixed: dict | None, repeats: int, progress) -> dict | None:
    """Step 5: fresh interleaved runs of the chosen setting, the best fixed one and target-only."""
    from .bench import BenchConfig, run_bench

    if repeats <= 0 or fixed is None:
        return None
    if fixed["label"] == best["label"]:
        return dict(skipped="the chosen setting is the best fixed-k threshold-0 setting", ratio=1.0)
    by = {c.label: c for c in configs}
    cc = [configs[0], BenchConfig("tuned " + best["label"], by[best["label"]].config), BenchConfig("fixed " + fixed["label"], by[fixed["label"]].config)]
    conf = run_bench(engine, prompts, cc, repeats=repeats, progress=(lambda d, t: progress("confirm", d, t)) if progress else None)
    t_tuned, t_fixed = conf["rows"][1]["tokens_per_second"], conf["rows"][2]["tokens_per_second"]
    return dict(
        repeats=repeats,
        target_only=conf["rows"][0]["tokens_per_second"],
        tuned=t_tuned,
        fixed=t_fixed,
        ratio=t_tuned / t_fixed,
        tuned_speedup=conf["rows"][1]["speedup"],
        fixed_speedup=conf["rows"][2]["speedup"],
    )


def replay_baseline_seconds(views, costs) -> float:
    """Cost-model seconds of target-only decoding over the views (prefill + (N - 1) q = 1 passes)."""
    return sum(v.prefill_s + max(len(v.out) - 1, 0) * costs.target(1) for v in views)


def tune_from_trace(trace_path: str | Path, ks: Sequence[int] | None, thresholds: Sequence[float], costs=None) -> dict:
    """Predict every (k_max, threshold) setting from a trace, without models (nothing measured).

    Args:
        trace_path: a trace recorded greedy with a wide policy (e.g. ``specrt tune --trace``).
        ks: k_max values (None: 1..the trace's largest k_max).
        thresholds: thresholds in [0, 1].
        costs: :class:`~specrt.runtime.costs.Costs` to use (None: the trace header's
            measured costs, else estimated from the trace's own round timings).

    Returns:
        JSON-ready dict like :func:`tune`'s, with ``measured: False``; ``rows`` carry only
        ``predicted`` figures, ``best``/``best_fixed`` are by predicted tokens/s.

    Raises:
        InputError: missing or malformed trace, a policy the trace cannot predict
            (:func:`~specrt.runtime.lab.replay.check_replayable`), a bad grid.
    """
    from .replay import check_replayable, position_views
    from .trace import costs_from_rounds, load_trace

    tr = load_trace(trace_path)
    man = tr.header["manifest"]
    gs = [g for g in tr.gens if g.greedy_speculative]
    k_rec = max(int(g.settings["k_max"]) for g in gs) if gs else int(man["k_max"])
    ks = sorted(set(int(k) for k in (ks or range(1, k_rec + 1))))
    thresholds = sorted(set(float(t) for t in thresholds))
    check_grid(ks, thresholds, ["full"], (int(man.get("k_min", 1)), int(man["k_max"])))
    for k in ks:
        for th in thresholds:
            check_replayable(tr, k, th)
    source = "given"
    if costs is None:
        costs = tr.costs
        source = "trace header (measured)"
        if costs is None:
            costs = costs_from_rounds(tr)
            source = "estimated from the trace's round timings"
    views = position_views(tr)
    strategies = {g.settings.get("strategy", "full") for g in gs}
    rows = []
    for k in ks:
        for th in thresholds:
            s = Setting(k, th, "/".join(sorted(strategies)))
            p = _prediction(views, s, costs)
            rows.append(
                dict(
                    label=s.label(False),
                    k_max=k,
                    threshold=th,
                    strategy=s.strategy,
                    tokens_per_second=None,
                    speedup=None,
                    acceptance_rate=p["acceptance_rate"],
                    mean_accepted=p["mean_accepted"],
                    accepted_hist=p["accepted_hist"],
                    predicted=p,
                    predicted_tokens_per_second=p["tokens_per_second"],
                )
            )
    for r in rows:
        r["predicted_speedup"] = r["predicted"]["speedup"]
    best = max(rows, key=lambda r: r["predicted_tokens_per_second"])
    fixed = _best_fixed(rows, "predicted_tokens_per_second")
    return dict(
        measured=False,
        trace=str(trace_path),
        engines=tr.header.get("engine"),
        pair_sha256=man.get("pair_sha256"),
        prompts=len(views),
        confidence_temperature=float(gs[0].settings.get("confidence_temperature", 1.0)) if gs else 1.0,
        costs=costs.to_json(),
        costs_source=source,
        grid=dict(k_max=ks, threshold=thresholds, strategy=sorted(strategies)),
        target_only=dict(tokens_per_second=None, predicted_tokens_per_second=sum(len(v.out) for v in views) / replay_baseline_seconds(views, costs)),
        rows=rows,
        best=best,
        best_fixed=fixed,
        predicted_ratio_best_over_fixed=best["predicted_tokens_per_second"] / fixed["predicted_tokens_per_second"] if fixed else None,
    )


# ---- output -----------------------------------------------------------------------------------------
def _f(x, fmt):
    return format(x, fmt) if isinstance(x, (int, float)) and x is not None and math.isfinite(x) else "-"


def format_table(result: dict) -> str:
    """Fixed-width table of a :func:`tune` / :func:`tune_from_trace` result; ``*`` marks the choice."""
    measured = result.get("measured", True)
    head = f"  {'setting':<24}{'tok/s':>9}{'speedup':>9}{'accept':>8}{'acc/pass':>9}{'pred tok/s':>12}{'pred x':>8}{'pred acc':>9}"
    lines = [head, "-" * len(head)]
    machine = Machine.from_json((result.get("costs") or {}).get("machine"))  # where the costs (and the sweep) were measured
    if machine:
        lines.insert(0, f"machine: {machine.describe()}")
    t0 = result["target_only"]
    lines.append(
        f"  {'target-only':<24}{_f(t0.get('tokens_per_second'), '9.1f'):>9}{'1.00x':>9}{'-':>8}{'-':>9}"
        f"{_f(t0.get('predicted_tokens_per_second'), '12.1f'):>12}{'1.00x':>8}{'-':>9}"
    )
    for r in result["rows"]:
        p = r.get("predicted") or {}
        mark = "*" if r["label"] == result["best"]["label"] else " "
        sp = _f(r.get("speedup"), ".2f") + ("x" if r.get("speedup") is not None else "")
        psp = _f(p.get("speedup"), ".2f") + ("x" if p.get("speedup") is not None else "")
        lines.append(
            f"{mark} {r['label']:<24}{_f(r.get('tokens_per_second'), '9.1f'):>9}{sp:>9}{_f(r.get('acceptance_rate'), '.3f'):>8}"
            f"{_f(r.get('mean_accepted'), '.2f'):>9}{_f(p.get('tokens_per_second'), '.1f'):>12}{psp:>8}{_f(p.get('acceptance_rate'), '.3f'):>9}"
        )
    b, f = result["best"], result.get("best_fixed")
    if measured:
        lines.append(
            f"chosen: {b['label']} (T {result['confidence_temperature']:.4g}), {b['tokens_per_second']:.1f} tok/s, {b['speedup']:.2f}x over target-only (sweep)"
        )
        if f is not None:
            lines.append(
                f"best fixed-k threshold-0 setting: {f['label']}, {f['tokens_per_second']:.1f} tok/s; sweep ratio tuned/fixed {result['sweep_ratio_best_over_fixed']:.3f}"
            )
        c = result.get("confirm")
        if c and "skipped" not in c:
            lines.append(
                f"confirmation ({c['repeats']} repeat(s), fresh interleaved runs): tuned {c['tuned']:.1f} tok/s ({c['tuned_speedup']:.2f}x), "
                f"fixed {c['fixed']:.1f} tok/s ({c['fixed_speedup']:.2f}x), target-only {c['target_only']:.1f}: ratio tuned/fixed {c['ratio']:.3f}"
            )
        elif c:
            lines.append(f"confirmation skipped: {c['skipped']}")
        lines.append(
            f"prompts {result['prompts']} x {result['repeats']} repeats, {result['max_new_tokens']} new tokens; "
            "pred = cost model (replay of the wide trace with the measured per-call costs; it times every strategy's "
            "verification as one full-width target pass)"
        )
        eq = [r["label"] for r in result["rows"] if r.get("equal_to_target") is not None and r["equal_to_target"] != result["prompts"]]
        if eq:
            lines.append(f"WARNING: outputs differ from target-only in {', '.join(eq)}")
    else:
        lines.append(f"chosen by prediction only: {b['label']}, predicted {b['predicted_tokens_per_second']:.1f} tok/s ({b['predicted_speedup']:.2f}x)")
        if f is not None:
            lines.append(f"best fixed-k threshold-0 setting (predicted): {f['label']}, ratio {result['predicted_ratio_best_over_fixed']:.3f}")
        lines.append(f"from trace {result['trace']}: nothing was measured; tokens/s are the cost model's predictions (costs: {result['costs_source']})")
    return "\n".join(lines)


def plot_results(result: dict, out_dir: str | Path) -> list[str]:
    """PNG plots: speedup against threshold per k_max (measured solid, predicted dashed;
    one panel per strategy) and the accepted-length histogram at the chosen setting.

    Returns:
        the written paths.

    Raises:
        ImportError: matplotlib is not installed (``pip install -e '.[tune]' in the specrt checkout``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    measured = result.get("measured", True)
    rows = result["rows"]
    strategies = sorted({r["strategy"] for r in rows})
    fig, axes = plt.subplots(1, len(strategies), figsize=(6.4 * len(strategies), 4.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, strat in zip(axes[0], strategies):
        for i, k in enumerate(sorted({r["k_max"] for r in rows})):
            rs = sorted([r for r in rows if r["k_max"] == k and r["strategy"] == strat], key=lambda r: r["threshold"])
            th = [r["threshold"] for r in rs]
            col = colors[i % len(colors)]
            if measured:
                ax.plot(th, [r["speedup"] for r in rs], "o-", color=col, label=f"k_max {k}")
            pred = [(r.get("predicted") or {}).get("speedup") for r in rs]
            if all(p is not None for p in pred):
                ax.plot(th, pred, "--", color=col, alpha=0.7, label=None if measured else f"k_max {k} (predicted)")
        if measured:
            ax.plot([], [], "k--", alpha=0.7, label="cost model")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel(f"draft confidence threshold (T = {result['confidence_temperature']:.3g})")
        ax.set_ylabel("speedup over target-only")
        ax.set_title(f"strategy {strat}: " + ("measured (solid), cost model (dashed)" if measured else "cost model only (from a trace)"))
        ax.legend(fontsize=8)
    fig.tight_layout()
    p1 = out_dir / "speedup_vs_threshold.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    b = result["best"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    hist = np.array(b["accepted_hist"], float)
    ax.bar(np.arange(len(hist)), hist / max(hist.sum(), 1), color="tab:blue", label="measured" if measured else "replayed")
    p = (b.get("predicted") or {}).get("accepted_hist")
    if p and measured:
        ph = np.array(p, float)
        ax.step(np.arange(len(ph) + 1) - 0.5, np.append(ph / max(ph.sum(), 1), 0), where="post", color="tab:red", label="replay of the trace")
    ax.set_xlabel("accepted candidates per verification pass")
    ax.set_ylabel("share of passes")
    ax.set_title(f"accepted lengths at the chosen setting {b['label']}")
    ax.legend()
    fig.tight_layout()
    p2 = out_dir / "accepted_hist_best.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [str(p1), str(p2)]


def chosen_defaults(result: dict) -> dict:
    """The manifest ``defaults`` keys a result chooses: k_max, threshold, strategy (when
    the runtime has strategies), drafter and adaptive (when the sweep was given those axes)
    and draft_confidence_temperature (when calibrated, or the trace's when chosen from a
    trace: the thresholds were read at that temperature)."""
    b = result["best"]
    d = dict(k_max=int(b["k_max"]), threshold=float(b["threshold"]))
    if b.get("strategy") in STRATEGIES:
        d["strategy"] = b["strategy"]
    for key in ("drafter", "adaptive"):  # chosen when the sweep was given that axis
        if ((result.get("grid") or {}).get(key) or [None]) != [None]:
            d[key] = b[key]
    if result.get("calibration"):
        d["draft_confidence_temperature"] = float(result["calibration"]["temperature"])
    elif result.get("measured") is False:  # from a trace: its thresholds are in its temperature
        d["draft_confidence_temperature"] = float(result["confidence_temperature"])
    return d

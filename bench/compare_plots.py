"""The plots of ``specrt.bench.compare`` (PNG files beside compare.json): tokens/s per
system, the k x threshold sweep, the accepted lengths, measured speedups against the
analytic bound. Needs matplotlib (``make bench-envs``); every function takes the result
dict that compare.json holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _save(fig, plt, paths: dict, name: str, out: Path) -> None:
    """Lay out ``fig``, save it as ``out/name.png`` (110 dpi), record its path in ``paths``, close it."""
    fig.tight_layout()
    paths[name] = str(out / f"{name}.png")
    fig.savefig(paths[name], dpi=110)
    plt.close(fig)


def plot_tokens_per_second(plt, result: dict, out: Path, paths: dict) -> None:
    """Horizontal bars of each row's tok/s with its per-run quartiles and its ratio to specrt
    target-only; a row without figures shows its status and error."""
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    labels = [r["label"] for r in rows][::-1]
    for y, r in enumerate(rows[::-1]):
        tps = r.get("tokens_per_second")
        if tps:
            q = r["tokens_per_second_per_run"]
            color = "tab:blue" if r["system"] == "specrt" else "tab:gray"
            ax.barh(y, tps, color=color)
            ax.errorbar(tps, y, xerr=[[max(0, tps - q["q25"])], [max(0, q["q75"] - tps)]], color="black", capsize=3, fmt="none")
            ratio = r.get("ratio_to_specrt_target_only")
            ax.text(max(tps, q["q75"] or tps), y, f"  {tps:.0f}" + (f" ({ratio:.2f}x)" if ratio else ""), va="center", fontsize=8)
        else:
            ax.text(0, y, f"  {r.get('status', 'failed')}: {(r.get('error') or '')[:70]}", va="center", fontsize=7, color="tab:red")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("tokens/s (total new tokens / total time; bars: per-run quartiles)")
    ax.set_title(
        f"{result['settings']['prompts']} prompts x {result['settings']['repeats']} repeats, "
        f"{result['settings']['max_new_tokens']} new tokens, greedy, {result['settings']['threads']} threads"
    )
    ax.margins(x=0.25)
    _save(fig, plt, paths, "tokens_per_second", out)


def plot_sweep(plt, result: dict, out: Path, paths: dict) -> None:
    """Acceptance rate and speedup against the draft confidence threshold, one line per
    k_max of the sweep (nothing without a sweep)."""
    sweep = result.get("sweep", {}).get("rows")
    if not sweep:
        return
    spec = [r for r in sweep if r["speculative"]]
    ks = sorted({r["k_max"] for r in spec})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for k in ks:
        rs = sorted([r for r in spec if r["k_max"] == k], key=lambda r: r["threshold"])
        th = [r["threshold"] for r in rs]
        a1.plot(th, [r["acceptance_rate"] if r["acceptance_rate"] is not None else np.nan for r in rs], "o-", label=f"k_max={k}")
        a2.plot(th, [r["speedup"] for r in rs], "o-", label=f"k_max={k}")
    a1.set_xlabel("draft confidence threshold")
    a1.set_ylabel("acceptance rate (accepted / proposed)")
    a1.set_ylim(-0.02, 1.02)
    a2.axhline(1.0, color="gray", lw=0.8, ls="--")
    a2.set_xlabel("draft confidence threshold")
    a2.set_ylabel("speedup over specrt target-only")
    ths_all = [r["threshold"] for r in spec]
    for a in (a1, a2):
        a.set_xlim(min(ths_all) - 0.05, max(ths_all) + 0.05)
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle(f"specrt sweep: {result['sweep']['prompts']} prompts, {result['sweep']['max_new_tokens']} new tokens")
    _save(fig, plt, paths, "threshold_sweep", out)


def plot_accepted_lengths(plt, result: dict, out: Path, paths: dict) -> None:
    """Share of verification passes by candidates accepted, per speculative row with counters."""
    hists = [(r["label"], r["accepted_hist"]) for r in result["rows"] if r.get("accepted_hist") and r.get("proposed")]
    if not hists:
        return
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(hists)
    for j, (lab, h) in enumerate(hists):
        h = np.asarray(h, float)
        ax.bar(np.arange(len(h)) + j * width - 0.4 + width / 2, h / h.sum(), width=width, label=lab)
    ax.set_xlabel("candidates accepted per verification pass")
    ax.set_ylabel("share of passes")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    _save(fig, plt, paths, "accepted_lengths", out)


def plot_analytic_bound(plt, result: dict, out: Path, paths: dict) -> None:
    """The analytic bound, the counters-times-costs bound and the measured speedup against k
    (the sweep's threshold-0 rows), with the main speculative rows as stars."""
    bound = result.get("analytic", {})
    pts = [b for b in bound.get("sweep", []) if b.get("bound_formula")]
    main = [b for b in bound.get("rows", []) if b.get("bound_formula")]
    if not (pts or main):
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    if pts:
        pts = sorted(pts, key=lambda b: b["k"])
        ks = [b["k"] for b in pts]
        ax.plot(ks, [b["bound_formula"] for b in pts], "o-", label="analytic bound (1-a^(k+1))/((1-a)(kc+1))")
        ax.plot(ks, [b.get("bound_counts") or np.nan for b in pts], "s--", label="bound from this run's counters x call costs")
        ax.plot(ks, [b.get("measured_speedup") or np.nan for b in pts], "^-", label="measured speedup (sweep, threshold 0)")
    for b in main:
        ax.plot([b["k"]], [b["measured_speedup"]], "k*", ms=10)
        ax.plot([b["k"]], [b["bound_formula"]], "r*", ms=10)
        ax.annotate(
            f"{b['label']}\nmeasured {b['measured_speedup']:.2f} / bound {b['bound_formula']:.2f}",
            (b["k"], b["measured_speedup"]),
            fontsize=7,
            xytext=(5, -18),
            textcoords="offset points",
        )
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("speedup over target-only")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, plt, paths, "analytic_bound", out)


def make_plots(result: dict, out: Path) -> dict:
    """Every plot of ``result`` into the folder ``out``; {plot name: PNG path} of those drawn.

    Raises:
        ImportError: no matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict = {}
    for step in (plot_tokens_per_second, plot_sweep, plot_accepted_lengths, plot_analytic_bound):
        step(plt, result, out, paths)
    return paths

"""The block-type matrix (issue 52): the target in each GGUF block type, made with llama.cpp's
own ``llama-quantize`` from one source file, built for specrt's kernels (``specrt export
--target --draft``, no torch) and run through ``make bench-real``'s harness (:mod:`bench.real`)
against llama-server on the same file, one interleaved run per type.

Each type's file is requantized from ``--target`` (``--allow-requantize``: no float checkpoint
ships in the registry), so every type holds the source's weights re-rounded: the speeds are the
type's, the acceptance is near the source's. Rows per type: specrt target-only (exact and
fastest width) and speculative at the folder's defaults; llama-server target-only, its
draft-model mode (``--spec-type draft-simple``), n-gram mode and both. Give the llama-server
settings with ``--llama-draft-args``/``--llama-ngram-args``, or let the first type search them
on tuning prompts that are not measured (``--search-prompts``, bench.real's search): every
later type runs the winners.

    python -m specrt.bench.block_types --target T.gguf --draft D.gguf --types Q2_K,Q8_0 \\
        --files ~/.cache/specrt/block_types --out docs/bench/block_types/RUN
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from specrt.runtime.machine import machine_record

from .common import command, logger, say_machine, source_commit, write_json
from .kernel_step import llama_version

log = logger()
SOURCE = "source"  # the --types entry that names --target itself, unquantized
ROWS = {  # matrix column: bench_real.json row label prefix
    "specrt_target_only": "specrt target-only (fastest width)",
    "specrt_target_only_exact": "specrt target-only (exact width)",
    "specrt_speculative": "specrt speculative (",
    "llama_target_only": "llama-server target-only",
    "llama_draft": "llama-server draft (",
    "llama_ngram": "llama-server n-gram (",
    "llama_ngram_draft": "llama-server n-gram + draft",
}


def quantized_file(source: Path, kind: str, files: Path, quantize: Path) -> tuple[Path, float | None]:
    """``(path, seconds)``: ``source`` requantized to ``kind`` by ``llama-quantize`` into
    ``files`` (reused when present: seconds None); ``kind`` SOURCE gives ``source`` itself.

    Raises:
        SystemExit: llama-quantize is missing or failed (its last line)."""
    if kind == SOURCE:
        return source, None
    out = files / f"{source.stem}-{kind}.gguf"
    if out.exists():
        return out, None
    if not quantize.exists():
        raise SystemExit(f"no llama-quantize at {quantize}: build it with `cmake --build .venv-llamacpp/src/build --target llama-quantize`")
    t0 = time.perf_counter()
    env = dict(os.environ, LD_LIBRARY_PATH=str(quantize.parent))
    p = subprocess.run([str(quantize), "--allow-requantize", str(source), str(out) + ".part", kind, "2"], capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"llama-quantize {kind} failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    os.replace(str(out) + ".part", out)
    return out, time.perf_counter() - t0


def tensor_types(path: Path) -> dict:
    """``{block type: share of the file's tensor bytes}`` (rounded to 3 places), from the
    GGUF's tensor table (:class:`gguf.GGUFReader`)."""
    from gguf import GGUFReader

    sizes: Counter = Counter()
    for t in GGUFReader(str(path)).tensors:
        sizes[t.tensor_type.name] += int(t.n_bytes)
    total = sum(sizes.values())
    return {k: round(v / total, 3) for k, v in sizes.most_common()}


def build_folder(target: Path, draft: Path, out: Path) -> tuple[float | None, str | None]:
    """``(seconds, error)``: ``specrt export --target --draft --out`` (kernels only), reused
    when ``out`` has a manifest (seconds None); ``error`` is the export's one-line refusal."""
    if (out / "manifest.json").exists():
        return None, None
    t0 = time.perf_counter()
    cmd = [str(Path(sys.executable).parent / "specrt"), "export", "--target", str(target), "--draft", str(draft), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return None, ((p.stderr or p.stdout).strip().splitlines() or ["failed"])[-1]
    return time.perf_counter() - t0, None


def winner(searched: list[dict] | None, draft: Path) -> str:
    """The best searched llama-server setting as one argument string (the draft's path as
    ``DRAFT``); "" when nothing was searched."""
    if not searched:
        return ""
    return shlex.join("DRAFT" if Path(str(x)).name == draft.name else str(x) for x in searched[0]["args"])


def pick(rows: list[dict], prefix: str) -> dict | None:
    """The first row whose label starts with ``prefix``."""
    return next((r for r in rows if r["label"].startswith(prefix)), None)


def matrix_row(kind: str, bench: dict) -> dict:
    """One type's line of the matrix from its ``bench_real.json``: tok/s per column, outputs
    equal to their own system's target-only, acceptance, and the ratios the issue's goals name
    (specrt target-only and speculative over llama-server target-only and its fastest row)."""
    rows = bench["rows"]
    out: dict = {"type": kind}
    for col, prefix in ROWS.items():
        r = pick(rows, prefix)
        out[col] = None if r is None else r.get("tokens_per_second")
        if r is not None and r.get("equal_to_own_target_only") is not None:
            out[col + "_equal"] = r["equal_to_own_target_only"]
        if r is not None and r.get("acceptance_rate") is not None:
            out[col + "_acceptance"] = r["acceptance_rate"]
    llama = [out[c] for c in ("llama_target_only", "llama_draft", "llama_ngram", "llama_ngram_draft") if out.get(c)]
    base = out.get("llama_target_only")
    for col in ("specrt_target_only", "specrt_speculative"):
        if out.get(col) and base:
            out[col + "_over_llama_target_only"] = round(out[col] / base, 3)
        if out.get(col) and llama:
            out[col + "_over_llama_fastest"] = round(out[col] / max(llama), 3)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module's docstring); argparse exits on a bad one."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the source GGUF of the target (requantized into each type)")
    ap.add_argument("--draft", required=True, help="the draft GGUF (the same file for every type)")
    ap.add_argument("--types", required=True, help="comma-separated llama-quantize types (Q2_K, Q5_K_M, IQ4_XS, F16, ...); 'source' is --target itself")
    ap.add_argument("--files", required=True, help="folder for the quantized files and their engine folders (reused)")
    ap.add_argument("--quantize", default=".venv-llamacpp/src/build/bin/llama-quantize")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=2, help="held-out prompts per form (completion, chat)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-draft-args", default="", help="llama-server's draft-model settings for every type (DRAFT: the draft GGUF)")
    ap.add_argument("--llama-ngram-args", default="", help="llama-server's n-gram settings for every type")
    ap.add_argument(
        "--search-prompts", type=int, default=1, help="tuning prompts per form for the first type's llama-server search (unless both settings are given)"
    )
    return ap.parse_args(argv)


def run_type(a: argparse.Namespace, kind: str, files: Path, out: Path, search: int = 0) -> dict:
    """One type: its file, its folder, bench.real's rows on it; the matrix line, with the
    file's size and block types and the build's seconds (or the refusal in ``error``);
    ``search`` tuning prompts per form for llama-server's settings (0: ``a``'s fixed ones)."""
    from . import real

    source, draft = Path(a.target).resolve(), Path(a.draft).resolve()
    path, q_s = quantized_file(source, kind, files, Path(a.quantize).resolve())
    line = dict(type=kind, file=path.name, bytes=path.stat().st_size, tensor_types=tensor_types(path), quantize_seconds=q_s)
    link = files / draft.name  # bench.real finds both files by name in one folder (SPECRT_GGUF_CACHE)
    if not link.exists():
        link.symlink_to(draft)
    if path.parent != files and not (files / path.name).exists():
        (files / path.name).symlink_to(path)
    eng = files / "engines" / kind
    line["build_seconds"], line["error"] = build_folder(path, draft, eng)
    if line["error"]:
        log(f"{kind}: {line['error']}")
        return line
    argv = ["--engines", str(eng), "--skip", "ortgenai,openvino,hf", "--specrt-extra", "", "--search-prompts", str(search)]
    argv += ["--n", str(a.n), "--max-new-tokens", str(a.max_new_tokens), "--repeats", str(a.repeats), "--threads", str(a.threads)]
    argv += ["--llama-draft-args", a.llama_draft_args, "--llama-ngram-args", a.llama_ngram_args, "--out", str(out / kind)]
    os.environ["SPECRT_GGUF_CACHE"] = str(files)
    real.main(argv)
    bench = json.loads((out / kind / "bench_real.json").read_text())
    return {**line, **matrix_row(kind, bench)}


def format_table(lines: list[dict]) -> str:
    """The matrix as markdown: tok/s per column and the goal ratios."""
    head = "| type | MB | specrt target-only | specrt spec | llama target-only | llama draft | llama n-gram | llama both | spec == own | target-only / llama | spec / llama | spec / llama fastest |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    for x in lines:
        if x.get("error"):
            out.append(f"| {x['type']} | {x['bytes'] / 1e6:.0f} | refused: {x['error']} |" + " |" * 9)
            continue
        eq = x.get("specrt_speculative_equal")
        out.append(
            f"| {x['type']} | {x['bytes'] / 1e6:.0f} | {f(x.get('specrt_target_only'))} | {f(x.get('specrt_speculative'))} | {f(x.get('llama_target_only'))}"
            f" | {f(x.get('llama_draft'))} | {f(x.get('llama_ngram'))} | {f(x.get('llama_ngram_draft'))} | {eq if eq is not None else '-'}"
            f" | {f(x.get('specrt_target_only_over_llama_target_only'), '.2f')} | {f(x.get('specrt_speculative_over_llama_target_only'), '.2f')}"
            f" | {f(x.get('specrt_speculative_over_llama_fastest'), '.2f')} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    """Every ``--types`` entry in turn (file, folder, bench rows); block_types.json and
    table.md in ``--out`` after each type, so a long run keeps what it measured. Returns 0.

    Raises:
        SystemExit: bad arguments, or llama-quantize missing or failing."""
    a = parse_args(argv)
    say_machine()
    files, out = Path(a.files).expanduser().resolve(), Path(a.out).resolve()
    files.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    server = Path(".venv-llamacpp/bin/llama-server").resolve()
    version = llama_version(str(server)) if server.exists() else None
    settings = dict(
        command=command(), specrt_commit=source_commit(), llama_cpp=version, machine=machine_record(), source=Path(a.target).name, draft=Path(a.draft).name
    )
    settings.update(
        n=a.n, max_new_tokens=a.max_new_tokens, repeats=a.repeats, threads=a.threads, llama_draft_args=a.llama_draft_args, llama_ngram_args=a.llama_ngram_args
    )
    lines = []
    search = a.search_prompts if not (a.llama_draft_args and a.llama_ngram_args) else 0
    for kind in (t.strip() for t in a.types.split(",") if t.strip()):
        log(f"type {kind}")
        lines.append(run_type(a, kind, files, out, search))
        if search and not lines[-1].get("error"):  # the winners, fixed for every later type
            won = json.loads((out / kind / "bench_real.json").read_text()).get("llama_server_search", {})
            a.llama_draft_args = a.llama_draft_args or winner(won.get("draft"), Path(a.draft).resolve())
            a.llama_ngram_args = a.llama_ngram_args or winner(won.get("ngram"), Path(a.draft).resolve())
            settings.update(llama_draft_args=a.llama_draft_args, llama_ngram_args=a.llama_ngram_args, searched_on=kind)
            search = 0
        write_json(out / "block_types.json", dict(settings=settings, types=lines), default=str)
        (out / "table.md").write_text(format_table(lines) + "\n")
    print(format_table(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""specrt's kernels against llama.cpp on random GGUF decoders of each architecture the kernels
run (issue 52 item 3: "the kernels' logits agree with llama.cpp's").

Each file is written by ``tests/kernel_ref.py`` (random blocks of llama.cpp's Q4_K_M mix: Q4_K
attention and FFN, Q6_K values, down projections and head, Q8_0 embeddings; a 512-token
byte-level vocabulary so llama.cpp loads it), and scored on the same random token sequences:

- by the kernels (``KernelModel.run`` from position 0, the CPU's fastest ISA path);
- by llama.cpp (``bench/workers/llamacpp_logits.py`` in a Python that has llama-cpp-python, one
  ``llama_decode`` a sequence).

Per architecture: top-1 agreement of the next-token argmax, and the median and maximum
absolute difference of the true next token's log-probability. Written as JSON.

With ``--gguf FILE`` (a real checkpoint, e.g. ``specrt fetch gemma-3-270m-q4_k_m``) the same
scores on that file instead: the sequences are ``--prompts``' texts (HumanEval prompts by
default) tokenized by llama.cpp's own tokenizer of the file, cut to ``--len`` ids.

Usage: python scripts/arch_vs_llamacpp.py --llama-python PY [--gguf FILE] [--out FILE]
(PY: a Python with llama-cpp-python, e.g. ``.venv-llamacpp/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")


def _cpu() -> str:
    """The CPU's model name and family/model numbers (lscpu)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    f = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{f.get('Model name', '?').strip()} family {f.get('CPU family', '?').strip()} model {f.get('Model', '?').strip()}"


def _kernels(gguf: Path, folder: Path, seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(argmax, log-probability of the true next token) at every position but the last of
    each sequence, by specrt's kernels (a context of the longest sequence)."""
    from specrt.export.kernel_pack import write_panels
    from specrt.runtime import kernels as K
    from specrt.runtime.backends.kern import KernelModel
    from specrt.runtime.kernels.weights import KernelWeights

    rec = write_panels(gguf, folder, "target", log=lambda *_: None)
    if rec is None:
        raise SystemExit(f"the kernels do not run {gguf.name}")
    K.start_team(2)
    ctx = max(256, max(len(x) for x in seqs))
    m = KernelModel(KernelWeights(folder / "target.panels", rec, ctx, ctx), K.cpu_isa())
    arg, lp = [], []
    for s in seqs:
        rows = m.run(s[:-1], 0).astype(np.float64)
        mx = rows.max(-1, keepdims=True)
        lse = mx[:, 0] + np.log(np.exp(rows - mx).sum(-1))
        arg.append(rows.argmax(-1))
        lp.append(rows[np.arange(len(rows)), s[1:]] - lse)
    return np.concatenate(arg), np.concatenate(lp)


def _score(g: Path, d: Path, seqs: list[list[int]], llama_python: str) -> dict:
    """Both engines' scores of ``seqs`` on GGUF ``g`` (work files in ``d``): top-1 agreement and
    the true next token's log-probability differences. Raises SystemExit when llama.cpp fails."""
    ka, kl = _kernels(g, d, seqs)
    (d / "in.json").write_text(json.dumps({"gguf": str(g), "threads": 2, "seqs": seqs, "first": [0] * len(seqs)}))
    r = subprocess.run(
        [llama_python, str(REPO / "bench" / "workers" / "llamacpp_logits.py"), str(d / "in.json"), str(d / "out.npz")], capture_output=True, text=True
    )
    if r.returncode:
        raise SystemExit(f"llama.cpp failed on {g.name}: {r.stderr[-800:]}")
    ll = np.load(d / "out.npz")
    dl = np.abs(kl - ll["logprob"])
    return {
        "positions": int(ka.size),
        "top1_agreement": round(float((ka == ll["argmax"]).mean()), 4),
        # where llama.cpp's own top-1 leads its second by > 0.1: not a near tie either engine could break
        "top1_agreement_margin_gt_0.1": round(float((ka == ll["argmax"])[wide].mean()), 4) if (wide := ll["margin"] > 0.1).any() else None,
        "logprob_abs_diff_median": float(np.median(dl)),
        "logprob_abs_diff_max": float(dl.max()),
        "llamacpp_margin_median": float(np.median(ll["margin"])),
    }


def _tokenized(llama_python: str, gguf: Path, prompts: Path, n: int, length: int) -> list[list[int]]:
    """The first ``n`` texts of the JSONL ``prompts`` (field ``prompt``) as ids by llama.cpp's
    tokenizer of ``gguf`` (its BOS first, as it would serve them), each cut to ``length``."""
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines() if line.strip()][:n]
    code = (
        "import json, sys, llama_cpp as L\n"
        "m = L.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)\n"
        "print(json.dumps([m.tokenize(t.encode(), add_bos=True, special=False) for t in json.loads(sys.stdin.read())]))"
    )
    r = subprocess.run([llama_python, "-c", code, str(gguf)], input=json.dumps(texts), capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"llama.cpp cannot tokenize with {gguf.name}: {r.stderr[-800:]}")
    return [ids[:length] for ids in json.loads(r.stdout.strip().splitlines()[-1])]


def main() -> None:
    """Score every architecture (or the ``--gguf`` file) with both engines and write the
    comparison (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout only)")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=96)
    ap.add_argument("--gguf", type=Path, default=None, help="a real GGUF file to score instead of the random ones")
    ap.add_argument("--prompts", type=Path, default=REPO / "data" / "humaneval_dev.jsonl", help="with --gguf: JSONL of texts")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from kernel_ref import byte_vocab, write_gguf

    from specrt.export.fetch import sha256_file

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        if a.gguf is not None:
            seqs = _tokenized(a.llama_python, a.gguf, a.prompts, a.seqs, a.len)
            rows[a.gguf.name] = _score(a.gguf, Path(tmp), seqs, a.llama_python)
            print(a.gguf.name, json.dumps(rows[a.gguf.name]), flush=True)
        else:
            rng = np.random.default_rng(11)
            seqs = [[int(t) for t in rng.integers(0, 512, a.len)] for _ in range(a.seqs)]
        for arch in ARCHS if a.gguf is None else ():
            d = Path(tmp) / arch
            d.mkdir()
            # gemma ties its head to the token rows it scales by sqrt(n_embd): small rows, or
            # every model repeats its input (a trivial agreement)
            g = write_gguf(d / "m.gguf", arch, seed=5, vocab=byte_vocab(512), embd_scale=1 / 16 if arch.startswith("gemma") else 1.0)
            rows[arch] = _score(g, d, seqs, a.llama_python)
            print(arch, json.dumps(rows[arch]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    ver = subprocess.run([a.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True).stdout.strip()
    if a.gguf is None:
        what, seq_doc = (
            "specrt kernels vs llama.cpp on random Q4_K_M-mix GGUF decoders (scripts/arch_vs_llamacpp.py)",
            f"{a.seqs} random sequences of {a.len} ids (vocab 512), every position scored",
        )
        files = "tests/kernel_ref.write_gguf(arch, seed=5, byte_vocab(512)); gemma: token rows 1/16, gemma2 caps 1.5 / 20, sliding window 16"
    else:
        what = f"specrt kernels vs llama.cpp on the real file {a.gguf.name} (scripts/arch_vs_llamacpp.py --gguf)"
        seq_doc = f"the first {a.seqs} texts of {a.prompts.name}, llama.cpp's tokenization (BOS first), cut to {a.len} ids, every position scored"
        files = f"{a.gguf.name}, SHA-256 {sha256_file(a.gguf)}"
    out = {
        "what": what,
        "cpu": _cpu(),
        "python": platform.python_version(),
        "specrt_commit": commit,
        "llama_cpp_python": ver,
        "sequences": seq_doc,
        "files": files,
        "archs": rows,
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

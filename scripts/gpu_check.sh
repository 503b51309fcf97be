#!/usr/bin/env bash
# GPU check (docs/guide/gpu.md): on a machine with an NVIDIA GPU, TensorRT's Python package,
# cuda-python and onnxruntime-gpu installed next to specrt[export,dev], build TensorRT
# plans, run the GPU tests, compare the backends' greedy outputs, run a short bench, and
# write ONE JSON of results. Budget: under 8 minutes (every step has a timeout).
#
#   bash scripts/gpu_check.sh [OUT_JSON]        (default: $OUT/gpu_check.json or gpu_check.json)
#   env: ENGINES=engines/default  PRECISION=fp16  PY=(.venv/bin/python if present, else python)
#        OPT_LEVEL=(TensorRT default)
#
# The engine folder is copied to a temporary folder first; engines/ is never modified.
# Nothing is installed (the machine may have no network). Exit status 0 even when a step
# fails: the JSON says what passed; the last line printed is the JSON path.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi; fi
PRECISION=${PRECISION:-fp16}
ENGINES=${ENGINES:-engines/default}
OUT_JSON=${1:-${OUT:+$OUT/gpu_check.json}}
OUT_JSON=${OUT_JSON:-gpu_check.json}
WORK=$(mktemp -d /tmp/specrt_gpu_check.XXXXXX)
STEPS=$WORK/steps.jsonl
: > "$STEPS"
T0=$(date +%s)

# step NAME TIMEOUT_S CMD... : run with a timeout, record rc, seconds and the log tail
step() {
  local name=$1 limit=$2; shift 2
  local t=$(date +%s) rc
  echo "== $name (limit ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  tail -c 3000 "$WORK/$name.log" >&2
  "$PY" - "$name" "$rc" "$(( $(date +%s) - t ))" "$WORK/$name.log" >> "$STEPS" <<'EOF'
import json, sys
name, rc, secs, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tail = open(log, errors="replace").read()[-4000:]
print(json.dumps({"step": name, "rc": rc, "timed_out": rc in (124, 137), "seconds": secs, "log_tail": tail}))
EOF
  return $rc
}

step environment 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; $PY - <<'EOF'
import importlib, json
out = {}
for m in ('tensorrt', 'onnxruntime', 'cuda.bindings', 'numpy', 'torch'):
    try:
        mod = importlib.import_module(m)
        out[m] = getattr(mod, '__version__', 'present')
    except Exception as e:
        out[m] = f'missing: {e}'
import onnxruntime as ort
out['onnxruntime_providers'] = ort.get_available_providers()
from specrt.runtime.backends import backend_status
out['backend_status'] = backend_status()
print(json.dumps(out))
EOF"

# engine folder: TensorRT plans are built from standard graphs (fp32/fp16/bf16 exports);
# the default engines are int4 builder graphs, which the plan builder refuses. So: the
# folder when its target is a standard graph, else the embedded pair exported in fp32 from
# models/ (a fresh clone has it), else a tiny random pair (both need torch)
standard=$("$PY" -c "import json,sys; m=json.load(open(sys.argv[1])); print(int(m['target'].get('graph', 'standard') == 'standard'))" "$ENGINES/manifest.json" 2>/dev/null || echo 0)
if [ "$standard" = 1 ]; then
  step copy_engines 60 cp -r "$ENGINES" "$WORK/engine"
elif [ -f models/target/model.safetensors ]; then
  step export_default_fp32 300 "$PY" -m specrt.cli export --draft models/draft --target models/target --out "$WORK/engine" \
    --k-max 8 --max-ctx 1024 --precision fp32 --no-quality
else
  step export_tiny_pair 150 "$PY" - "$WORK" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from helpers import make_tokenizer, save_llama
from specrt.export.pipeline import export_pair
root = Path(sys.argv[1]); tok = make_tokenizer()
save_llama(root / "t", tok, seed=1, hidden=64, layers=2)
save_llama(root / "d", tok, seed=2, hidden=32, layers=1, heads=2, kv_heads=1, inter=64)
export_pair(root / "d", root / "t", root / "engine", k_max=8, max_ctx=512, log=print)
EOF
fi

step build_plans 240 "$PY" -m specrt.cli plans --engines "$WORK/engine" --precision "$PRECISION" ${OPT_LEVEL:+--opt-level "$OPT_LEVEL"}

step pytest_gpu 150 "$PY" -m pytest -q -m gpu tests/test_trt.py -p no:cacheprovider

# greedy outputs of every usable backend against ort-cpu (fp16 plans may differ in a few
# tokens from fp32 onnxruntime; the JSON records the first differing position)
step backend_equality 90 "$PY" - "$WORK/engine" "$WORK/equality.json" <<'EOF'
import json, sys, time
from specrt.runtime.backends import backend_status
from specrt import Engine, GenerationConfig
folder, out = sys.argv[1], sys.argv[2]
prompts = ["def add(a, b):", "for i in range(10):\n", "class Stack:\n    def __init__(self):\n"]
res = {}
status = backend_status(Engine(folder, backend="ort-cpu").manifest)
ref = None
for b in ("ort-cpu", "ort-cuda", "tensorrt"):
    if status[b]:
        res[b] = {"skipped": status[b]}
        continue
    try:
        e = Engine(folder, backend=b)
        rows = []
        for p in prompts:
            for k in (1, 4, 8):
                t = time.perf_counter()
                r = e.generate(p, GenerationConfig(max_new_tokens=48, k_max=k))
                rows.append({"prompt": p, "k_max": k, "tokens": r.tokens, "seconds": time.perf_counter() - t})
        if ref is None:
            ref = rows
        for r, x in zip(rows, ref):
            r["equal_to_ort_cpu"] = r["tokens"] == x["tokens"]
            r["first_difference"] = next((i for i, (a, c) in enumerate(zip(r["tokens"], x["tokens"])) if a != c), None)
        res[b] = {"all_equal_to_ort_cpu": all(r["equal_to_ort_cpu"] for r in rows), "rows": rows}
    except Exception as ex:
        res[b] = {"error": f"{type(ex).__name__}: {ex}"}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps({b: {k: v for k, v in r.items() if k != "rows"} for b, r in res.items()}))
EOF

for b in ort-cuda tensorrt; do
  step "bench_$b" 60 "$PY" -m specrt.cli bench --engines "$WORK/engine" --prompts data/humaneval_dev.jsonl \
    --limit 5 --max-new-tokens 64 --k-max 4 --backend "$b" --out "$WORK/bench_$b.json"
done

"$PY" - "$STEPS" "$WORK" "$OUT_JSON" "$T0" "$PRECISION" <<'EOF'
import json, os, sys, time
steps_file, work, out, t0, precision = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
steps = [json.loads(l) for l in open(steps_file) if l.strip()]
def load(p):
    try:
        return json.load(open(p))
    except Exception as e:
        return {"missing": str(e)}
res = {
    "script": "scripts/gpu_check.sh",
    "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "total_seconds": int(time.time()) - t0,
    "precision": precision,
    "steps": steps,
    "all_steps_passed": all(s["rc"] == 0 for s in steps),
    "equality": load(os.path.join(work, "equality.json")),
    "bench": {b: load(os.path.join(work, f"bench_{b}.json")) for b in ("ort-cuda", "tensorrt")},
}
try:
    res["manifest_tensorrt"] = json.load(open(os.path.join(work, "engine", "manifest.json"))).get("extra", {}).get("tensorrt")
except Exception as e:
    res["manifest_tensorrt"] = {"missing": str(e)}
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
json.dump(res, open(out, "w"), indent=1)
print(out)
EOF

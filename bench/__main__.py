"""``python -m specrt.bench``: the list of benches, one line each (``python -m specrt.bench.NAME --help`` for one)."""

from __future__ import annotations

# module under specrt.bench -> what it measures (its docstring says how)
BENCHES = {
    "real": "the real pair (Qwen2.5-Coder 0.5B -> 1.5B GGUF) against llama-server, onnxruntime-genai, transformers (make bench-real)",
    "compare": "the default pair against transformers, optimum, onnxruntime-genai, OpenVINO, llama.cpp, with sweep and analytic bound (make bench-compare)",
    "agents": "coding-agent conversations: per-turn TTFT with the prefix cache on/off against llama-server's prompt cache (make bench-agents)",
    "structured": "JSON-schema outputs and tool calls, constrained and free, against llama-server --jinja",
    "load": "a bounded loopback load run against specrt serve: requests/s, latency, TTFT, acceptance (make load-test)",
    "load_ttft": "engine load + first token of specrt generate for several engine folders, interleaved",
    "load_summary": "medians and ratios over repeated load runs (files r<k>_<config>.json)",
    "load_vs_llama_server": "serving throughput at several concurrencies: specrt serve --max-batch N against llama-server -np N",
    "compare_load_texts": "greedy response texts of load runs (--save-texts) compared with a reference run",
    "soak_prefix": "prefix-cache soak: random multi-turn chats on several workers; nothing lost, RSS bounded",
    "ceiling": "the most speculation and batching can give on this CPU, from measured per-call costs",
    "reduced_heads": "the kernels' reduced LM heads (argmax verification, a draft step's top-1) against full heads",
    "serve_start": "cold and warm start of specrt serve --target T.gguf [--draft D.gguf] to the first token, build time and RSS",
}


def main() -> int:
    """Print every bench as ``NAME  description``. Returns 0."""
    print("specrt benches: python -m specrt.bench.NAME --help")
    width = max(len(n) for n in BENCHES)
    for name, what in BENCHES.items():
        print(f"  {name:<{width}}  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

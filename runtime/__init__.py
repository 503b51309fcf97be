"""specrt runtime: serve-time speculative decoding on exported engines.

Needs only numpy, onnxruntime, tokenizers and click; never torch, transformers or optimum.
"""

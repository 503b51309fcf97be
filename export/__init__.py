"""specrt export stage: Hugging Face checkpoint folders -> ONNX (IO-bound KV) + manifest.

Needs the ``[export]`` extra (torch, transformers, onnx, onnxscript). The runtime
(:mod:`specrt.runtime`) never imports this package.
"""

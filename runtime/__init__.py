"""specrt runtime: serve-time speculative decoding on exported engines.

Needs only numpy, onnxruntime, tokenizers and click; never torch, transformers or optimum.

The token path lives here (engine, config, decode, speculative, sampling, stats, manifest,
tokenizer, textstream, flops); ``backends/`` holds the model runners behind one protocol,
``serve/`` the HTTP server and Ray Serve, ``lab/`` benchmarking, tuning, traces, replay and
calibration.
"""

from .config import GenerationConfig
from .engine import Engine, GenerationResult, Stream

__all__ = ["Engine", "GenerationConfig", "GenerationResult", "Stream"]

"""A PyTorch checkpoint behind the runtime's :class:`~specrt.runtime.backends.base.Model`
protocol: the reference of the export's quality record for models too large to export to
an fp32 ONNX graph first.

The quality record (:mod:`specrt.export.quality`) scores the exported target against the
fp32 model. For small checkpoints it exports the fp32 standard graph and runs it with
onnxruntime (ten times faster than PyTorch per window); for a real model that export needs
more memory than the rest of the export together (the fp32 graph of a 1.5B model is 6 GB
of initializers, built in memory beside the 6 GB PyTorch model). :class:`TorchModel` runs
the same forward directly in PyTorch with its own KV cache (transformers' ``DynamicCache``),
rolled back by cropping, so the reference costs the float32 model once.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specrt.runtime.errors import InputError

__all__ = ["TorchModel"]


class TorchModel:
    """A Hugging Face causal LM (float32, eval mode) as a runtime ``Model``.

    Args:
        folder: the checkpoint folder (loaded with ``dtype=float32``, never from a hub).
        max_ctx: KV rows allowed (``start + q <= max_ctx``).
        max_q: widest call.

    Attributes:
        max_q, max_ctx, vocab: as the protocol (``vocab`` = the config's vocab_size).
    """

    def __init__(self, folder: str | Path, max_ctx: int, max_q: int):
        from transformers import DynamicCache

        from .onnx_export import load_hf

        self.model = load_hf(folder)
        self.max_ctx, self.max_q = max_ctx, max_q
        self.vocab = int(self.model.config.vocab_size)
        self._new_cache = DynamicCache
        self._cache = DynamicCache()
        # transformers renamed forward's past_key_values to cache within 5.x
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def run(self, tokens: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Logits float32 ``[q, vocab]`` of ``tokens`` at positions ``start ..`` (KV rows
        beyond ``start`` are dropped first: rollback by length, as the runtime's models).

        Raises:
            InputError: ``q`` outside ``1..max_q``, ``start`` beyond the cache, or
                ``start + q > max_ctx``.
        """
        q = len(tokens)
        have = self._cache.get_seq_length()
        if not 1 <= q <= self.max_q or start + q > self.max_ctx or start > have:
            raise InputError(f"torch reference call of {q} tokens at {start} (cache {have}, max_q {self.max_q}, max_ctx {self.max_ctx})")
        if start == 0:
            self._cache = self._new_cache()
        elif start < have:
            self._cache.crop(start - have)  # a negative count removes that many rows (every transformers 5 release)
        ids = torch.as_tensor(np.asarray(tokens, np.int64))[None]
        pos = torch.arange(start, start + q)[None]
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self._cache_kw: self._cache})
        return out.logits[0].float().numpy()

    def fork(self) -> "TorchModel":
        raise NotImplementedError("the PyTorch reference runs one sequence")

    def close(self) -> None:
        """Free the model and its cache."""
        self.model = None
        self._cache = None

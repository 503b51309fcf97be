"""Writing a Hugging Face checkpoint one tensor at a time: safetensors shards of bounded size
and their ``model.safetensors.index.json`` (the layout ``from_pretrained`` reads).

The GGUF import and the prequantized checkpoint both stream tensors through
:class:`ShardWriter`, so neither ever holds a whole model in memory: at most one shard
(:data:`SHARD_BYTES`) plus the tensor being converted.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

__all__ = ["SHARD_BYTES", "ShardWriter"]

SHARD_BYTES = 1 << 30  # largest shard written (bounds the memory a conversion holds)


class ShardWriter:
    """Collects named tensors and writes them as ``model-0000k-of-0000n.safetensors`` shards.

    Args:
        folder: where the shards and the index go (must exist).
        shard_bytes: a shard is written once the tensors collected reach this many bytes.

    Use :meth:`add` per tensor, then :meth:`close` once (writes the last shard, renames the
    shards to their final ``-of-`` names and writes the index).
    """

    def __init__(self, folder: str | Path, shard_bytes: int = SHARD_BYTES):
        self.folder = Path(folder)
        self.shard_bytes = shard_bytes
        self._shard: dict = {}
        self._bytes = 0
        self._files: list[str] = []
        self._index: dict[str, str] = {}

    def add(self, name: str, tensor) -> None:
        """Add one ``torch.Tensor`` (contiguous; written as is, in its dtype).

        Raises:
            ValueError: ``name`` was added before.
        """
        if name in self._index or name in self._shard:
            raise ValueError(f"tensor {name} written twice")
        self._shard[name] = tensor
        self._bytes += tensor.numel() * tensor.element_size()
        if self._bytes >= self.shard_bytes:
            self._flush()

    @property
    def names(self) -> set[str]:
        """Every tensor name added so far."""
        return set(self._index) | set(self._shard)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._shard:
            return
        name = f"model-{len(self._files) + 1:05d}.safetensors"
        save_file(self._shard, str(self.folder / name), metadata={"format": "pt"})
        self._files.append(name)
        self._index.update({k: name for k in self._shard})
        self._shard, self._bytes = {}, 0
        gc.collect()

    def close(self) -> int:
        """Write the last shard and the index; returns the number of shards."""
        self._flush()
        total = len(self._files)
        final = {}
        for k, name in enumerate(self._files, 1):
            final[name] = f"model-{k:05d}-of-{total:05d}.safetensors"
            (self.folder / name).rename(self.folder / final[name])
        size = sum((self.folder / f).stat().st_size for f in final.values())
        weight_map = {k: final[v] for k, v in sorted(self._index.items())}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2))
        return total

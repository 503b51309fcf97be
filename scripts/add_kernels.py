"""Add the target's kernel panels to an engine folder exported before them.

    python scripts/add_kernels.py ENGINE_FOLDER TARGET.gguf

Writes ``target.panels`` from the GGUF file the target was exported from, and ``draft.panels``
from the draft's GGUF beside it (requantized to Q4_0, its head cut to the 65,536 most frequent ids; each tensor checked
against ``gguf.dequantize``), times the exact target step on the kernels and on the ONNX graph
here, and records both in the manifest (:func:`specrt.export.kernel_pack.add_to_engine`).
A fresh ``specrt export`` of a GGUF target (int4/int8) writes the same.
"""

from __future__ import annotations

import sys

from specrt.export.kernel_pack import add_to_engine


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    return 0 if add_to_engine(argv[0], argv[1]) is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

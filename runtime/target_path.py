"""Which backend runs an engine folder when none is named: the target on specrt's kernels
where they run and are faster, else the onnxruntime graph.

A folder exported int4/int8 (from a GGUF target's own blocks, or a checkpoint quantized by
specrt) holds the target's panels for the kernels (``extra.kernels.target``,
:mod:`specrt.export.kernel_pack`). :func:`choose_backend` names
``kernels`` for it when the library loads here, the CPU runs an AVX2 or AVX-512 VNNI path, and
no measurement on this kind of machine found the ONNX graph's exact step faster; otherwise
``ort-cpu``, with one line on the ``specrt`` logger (once per reason and process) saying why
a folder with panels does not use them.
"""

from __future__ import annotations

import logging

from .backends import KERNELS_KEY, kernels_unavailable
from .machine import differs
from .manifest import Manifest

__all__ = ["kernels_choice", "choose_backend"]

_SAID: set[str] = set()


def kernels_choice(manifest: Manifest) -> tuple[bool, str | None]:
    """Whether a folder's target runs on the kernels when no backend is named, and the note
    to give when it does not although the folder has panels.

    Rule: the folder has panels for the target, the kernels can run here
    (:func:`~specrt.runtime.backends.kernels_unavailable`), their quality record (panels
    specrt quantized from a checkpoint: ``extra.quality.kernels``) does not fail, and no
    record of this kind of machine (``extra.kernels.target.measured``: ``{"machine", "isa", "kernels_ms", "ort_ms"}``
    of the exact 1-row step, written by the export) has the ONNX graph faster.

    Returns:
        ``(use, note)``; note is None when the folder has no panels or the kernels are used.
    """
    rec = (manifest.extra.get(KERNELS_KEY) or {}).get("target")
    if not rec:
        return False, None
    why = kernels_unavailable(manifest)
    if why is not None:
        return False, f"target on the onnxruntime graph, not specrt's kernels: {why}"
    q = (manifest.extra.get("quality") or {}).get("kernels")
    if isinstance(q, dict) and q.get("holds") is False:  # panels specrt quantized, scored below the bounds at export
        return False, "target on the onnxruntime graph: the quality record of the kernels' panels (extra.quality.kernels) does not hold"
    for m in rec.get("measured", ()):
        if differs(m.get("machine")) is None and m.get("kernels_ms", 0) >= m.get("ort_ms", float("inf")):
            return False, (
                f"target on the onnxruntime graph: on this kind of machine its exact step measured {m['ort_ms']:.1f} ms "
                f"against the kernels' {m['kernels_ms']:.1f} ms ({m.get('isa')})"
            )
    return True, None


def choose_backend(name: str | None, manifest: Manifest) -> str | None:
    """``name`` when given; else ``kernels`` for a folder with no graph
    (:meth:`~specrt.runtime.manifest.Manifest.kernels_only`: where they cannot run, the load
    says why in one line) or where :func:`kernels_choice` takes them, else None (the
    default backend), logging the note once."""
    if name is not None:
        return name
    if manifest.kernels_only():  # no graph to fall back to: the kernels, or their reason why not
        return "kernels"
    use, note = kernels_choice(manifest)
    if note and note not in _SAID:
        _SAID.add(note)
        logging.getLogger("specrt").warning("specrt: %s", note)
    return "kernels" if use else None

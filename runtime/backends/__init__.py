"""Backends: which :class:`~specrt.runtime.backends.base.Model` class serves an engine folder.

======== ============================================ =========================================
name     model class                                  needs
======== ============================================ =========================================
ort-cpu  :class:`~.ort.OrtModel` (standard graphs),   onnxruntime >= 1.23 (always available)
         :class:`~.ort_gqa.OrtGqaModel` (builder
         graphs), per model from the manifest
kernels  target: :class:`~.kern.KernelModel`          the kernel library (built at install), a
         (specrt's C kernels over the GGUF's blocks); CPU with AVX2 or AVX-512 VNNI, and the
         draft: as ort-cpu                            target's panels in the engine folder
                                                      (exported from a GGUF target)
ort-cuda :class:`~.ort_cuda.OrtCudaModel`             onnxruntime-gpu and an NVIDIA GPU
tensorrt :class:`~.trt.TrtModel`                      tensorrt >= 10.1, cuda-python, a GPU and the
                                                      plans in the manifest's extra
======== ============================================ =========================================

Without a name, the Engine runs an engine folder whose target has kernel panels on
``kernels`` where the library and the CPU can (:func:`specrt.runtime.target_path.choose_backend`;
else ``ort-cpu``, with a one-line note saying why), and any other folder on ``ort-cpu``. A GPU backend is used only
when asked for by name (``--backend``, ``Engine(backend=...)``), and then
refused with the reason when this machine cannot run it. The GPU backends have not been run
on a GPU yet (docs/guide/gpu.md); they are tested against a stand-in (tests/fake_gpu.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import BackendError, EngineError
from ..manifest import GRAPH_BUILDER, Manifest, sha256_file
from .base import HeadSplit, Model, SplitsHead, ThreadConfig

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "Model",
    "HeadSplit",
    "SplitsHead",
    "ThreadConfig",
    "backend_status",
    "resolve_backend",
    "load_models",
    "gpu_present",
    "refuse_builder_graphs",
    "cpu_model",
    "batched_model",
    "kernels_unavailable",
    "kernel_files",
    "kernel_model",
    "KERNELS_KEY",
]

BACKENDS = ("ort-cpu", "kernels", "ort-cuda", "tensorrt")
DEFAULT_BACKEND = "ort-cpu"  # used unless a backend is named (or the Engine chooses the kernels: target_path.choose_backend)
TRT_KEY = "tensorrt"  # key of the TensorRT record in Manifest.extra
KERNELS_KEY = "kernels"  # key of the kernel panels record in Manifest.extra ({"target": ...})


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def gpu_present() -> bool:
    """Whether an NVIDIA GPU is visible: cuda-python's device count when installed, else
    the NVIDIA driver's ``/proc`` entries."""
    from .cuda_mem import gpu_count

    if _module_present("cuda") and gpu_count() > 0:
        return True
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def backend_status(manifest: Manifest | None = None) -> dict[str, str | None]:
    """Per backend: None if usable here (for ``manifest`` when given), else why not.

    Cheap: no model is loaded, nothing is allocated.
    """
    from .ort_cuda import ort_cuda_available

    status: dict[str, str | None] = {"ort-cpu": None, "kernels": kernels_unavailable(manifest)}
    if manifest is not None and manifest.kernels_only():
        why = "the engine folder holds kernel panels only, no ONNX graph (built from GGUF files for the CPU); `specrt export --draft D --target T --out E` writes the graphs"
        return {**status, "ort-cpu": why, "ort-cuda": why, "tensorrt": why}
    gpu = gpu_present()
    status["ort-cuda"] = ort_cuda_available() or (None if gpu else "no NVIDIA GPU is visible on this machine")
    if not _module_present("tensorrt"):
        status["tensorrt"] = "the tensorrt Python package is not installed (NVIDIA's wheels)"
    elif not _module_present("cuda"):
        status["tensorrt"] = "cuda-python is not installed (pip install 'cuda-bindings>=12.6')"
    elif not gpu:
        status["tensorrt"] = "no NVIDIA GPU is visible on this machine"
    elif manifest is not None and TRT_KEY not in manifest.extra:
        status["tensorrt"] = "the engine folder has no TensorRT plans (build them with `python -m specrt.export.trt_build` on this machine)"
    else:
        status["tensorrt"] = None
    return status


def kernels_unavailable(manifest: Manifest | None) -> str | None:
    """Why the kernels cannot run (for ``manifest``'s target when given), or None. A CPU with
    neither AVX2 nor AVX-512 VNNI runs the portable C path only for a folder with no graph
    (:meth:`~specrt.runtime.manifest.Manifest.kernels_only`); else onnxruntime is faster."""
    from ..kernels import cpu_isa, status

    why = status()
    if why is None and cpu_isa() == "portable" and not (manifest is not None and manifest.kernels_only()):
        why = "this CPU has neither AVX2 (with FMA and F16C) nor AVX-512 VNNI: the kernels' portable C path is slower than onnxruntime"
    if why is None and manifest is not None and not (manifest.extra.get(KERNELS_KEY) or {}).get("target"):
        why = "the engine folder has no kernel panels for its target (`specrt export --precision int4|int8` writes them)"
    return why


def resolve_backend(name: str | None, manifest: Manifest | None = None) -> str:
    """The backend to use: ``name``, or :data:`DEFAULT_BACKEND` (ort-cpu) when None (the
    Engine names ``kernels`` itself where a folder's target runs on them:
    :func:`specrt.runtime.target_path.choose_backend`).

    Raises:
        BackendError: unknown name, or a backend this machine/folder cannot run; the
            message gives the reason and the backends that are available here.
    """
    if name is None:
        return DEFAULT_BACKEND
    if name not in BACKENDS:
        raise BackendError(f"backend={name!r}; choose one of {', '.join(BACKENDS)}")
    status = backend_status(manifest)
    if status[name] is not None:
        usable = [b for b in BACKENDS if status[b] is None]
        raise BackendError(f"backend {name!r} is unavailable here: {status[name]}; available: {', '.join(usable)}")
    return name


def trt_record(manifest: Manifest, folder: Path, verify_hashes: bool = True) -> dict:
    """The manifest's TensorRT record, with each plan file checked.

    Returns:
        ``manifest.extra["tensorrt"]`` (see :mod:`specrt.export.trt_build`).

    Raises:
        EngineError: no record, a plan missing, or (``verify_hashes``) altered.
    """
    rec = manifest.extra.get(TRT_KEY)
    if not isinstance(rec, dict) or not all(r in rec.get("models", {}) for r in ("draft", "target")):
        raise EngineError(f"{folder}: the manifest has no TensorRT plans for both models; build them with `python -m specrt.export.trt_build`")
    for role in ("draft", "target"):
        m = rec["models"][role]
        p = Path(folder) / m["plan"]
        if not p.is_file():
            raise EngineError(f"{p} is missing; rebuild the TensorRT plans with `python -m specrt.export.trt_build`")
        if verify_hashes and sha256_file(p) != m.get("plan_sha256"):
            raise EngineError(f"{p} does not match the SHA-256 recorded in the manifest (truncated or altered); rebuild the plans")
    return rec


def cpu_model(folder: Path, entry, max_ctx: int, max_q: int, threads: ThreadConfig, head_sessions=None, role: str = "model"):
    """The onnxruntime CPU model object for one manifest entry: :class:`~.ort_gqa.OrtGqaModel`
    for a builder graph, :class:`~.ort.OrtModel` for a standard one (``head_sessions``: the
    folder's lazy-head sessions, target only; ``role``: ``draft``/``target``, named in messages).

    Raises:
        BackendError: a bf16 graph (onnxruntime's CPU provider has no bf16 kernels for it).
        EngineError: onnxruntime cannot load the file or its I/O differs from the entry.
    """
    from .ort import OrtModel
    from .ort_gqa import OrtGqaModel

    if entry.precision == "bf16":
        raise BackendError(
            f"{Path(folder) / entry.file} computes in bf16, which onnxruntime's CPU provider has no kernels for; "
            "run it with --backend tensorrt, or export --precision fp32|fp16|int8|int4 for the CPU",
            "backend",
        )
    if entry.graph == GRAPH_BUILDER:
        return OrtGqaModel(Path(folder) / entry.file, entry, max_ctx, max_q, threads)
    return OrtModel(Path(folder) / entry.file, entry, max_ctx, max_q, threads, head_sessions=head_sessions, role=role)


def kernel_files(manifest: Manifest) -> dict[str, str]:
    """File name -> SHA-256 of the kernel panels (target, and draft where written: checked at
    load with the graphs when the kernels run), from the manifest's ``files`` map.

    Raises:
        EngineError: a kernels record names no file, or one the manifest's ``files`` does not
            list (it would be loaded unhashed).
    """
    out = {}
    for role, r in (manifest.extra.get(KERNELS_KEY) or {}).items():
        if not isinstance(r, dict):
            continue
        name = r.get("file")
        if not isinstance(name, str) or name not in manifest.files:
            raise EngineError(
                f"the manifest's kernels record for the {role} names {name!r}, which its files map does not list (no SHA-256 to check it against); re-export the engine",
                "files",
            )
        out[name] = manifest.files[name].sha256
    return out


def kernel_target(folder: Path, manifest: Manifest, threads: ThreadConfig, max_q: int, verified: dict | None = None):
    """The target on specrt's kernels (:class:`~.kern.KernelModel`) from the folder's panels,
    on the kernels' thread team (``threads.intra_op`` threads). The path is the CPU's best,
    or ``SPECRT_KERNELS_ISA`` (``avx512vnni``, ``avx2``, ``portable``) when set.

    Raises:
        BackendError: the kernels cannot run here, or the ISA named is not one this CPU runs.
        EngineError: the panels do not fit the manifest (vocabulary width, size).
    """
    from ..kernels import isa_id, start_team

    why = kernels_unavailable(manifest)
    if why is not None:
        raise BackendError(f"backend 'kernels' is unavailable here: {why}", "backend")
    rec = manifest.extra[KERNELS_KEY]["target"]
    isa = kernels_isa()
    try:
        isa_id(isa)
    except ValueError as e:
        raise BackendError(f"SPECRT_KERNELS_ISA: {e}", "backend") from None
    if int(rec["dims"]["n_vocab"]) != manifest.target.vocab_size:
        raise EngineError(
            f"{folder / rec['file']}: {rec['dims']['n_vocab']} logits a row, the manifest's target has {manifest.target.vocab_size}; re-export the engine"
        )
    try:
        start_team(threads.intra_op)
    except RuntimeError as e:
        raise BackendError(f"backend 'kernels': {e}", "threads") from None
    return kernel_model(folder, manifest, "target", max_q, isa, verified)


def kernels_isa() -> str:
    """The kernels' ISA path here: ``SPECRT_KERNELS_ISA`` when set, else the CPU's best
    (:func:`specrt.runtime.kernels.cpu_isa`)."""
    import os

    from ..kernels import cpu_isa

    return os.environ.get("SPECRT_KERNELS_ISA") or cpu_isa()


def kernel_model(folder: Path, manifest: Manifest, role: str, max_q: int, isa: str | None = None, verified: dict | None = None):
    """A :class:`~.kern.KernelModel` over the folder's ``role`` panels (``extra.kernels[role]``)
    on the path ``isa`` (default: as :func:`kernel_target` chooses it).

    Args:
        verified: file name -> ``(identity, sha256)`` of the files the load verified
            (:class:`~specrt.runtime.integrity.Verification`): the panels file mapped must be
            the one verified (:class:`~specrt.runtime.kernels.weights.KernelWeights`); None
            when hashes are not checked.

    Raises:
        EngineError: the panels file does not hold what its record says, or is not the file
            that was verified.
    """
    from ..kernels.weights import KernelWeights
    from .kern import KernelModel

    rec = manifest.extra[KERNELS_KEY][role]
    try:
        weights = KernelWeights(Path(folder) / rec["file"], rec, manifest.max_ctx, max_q, (verified or {}).get(rec["file"]))
    except RuntimeError as e:
        raise EngineError(str(e), "files") from None
    return KernelModel(weights, isa or kernels_isa())


def refuse_builder_graphs(backend: str, manifest: Manifest, folder: Path) -> None:
    """The GPU backends run standard graphs only (TensorRT plans are built from standard-op
    graphs; the CUDA backend binds BLHD past/new-row KV).

    Raises:
        BackendError: a model of the folder is a builder graph (one line, param ``backend``).
    """
    for role, e in (("target", manifest.target), ("draft", manifest.draft)):
        if e.graph == GRAPH_BUILDER:
            raise BackendError(
                f"backend {backend!r} runs standard graphs only; the {role} in {folder} is an onnxruntime-genai builder graph "
                f"({e.precision}): use --backend ort-cpu, or export --precision fp32|fp16|bf16 for the GPU",
                "backend",
            )


def load_models(backend: str, folder: Path, manifest: Manifest, threads, target_q: int, draft_q: int, verify_hashes: bool = True, verified: dict | None = None):
    """(target, draft) model objects of ``backend`` for an engine folder.

    Args:
        backend: one of :data:`BACKENDS` (already resolved).
        folder: the engine folder; manifest: its manifest.
        threads: :class:`~specrt.runtime.backends.base.ThreadConfig` (onnxruntime backends).
        target_q, draft_q: widest call per model.
        verify_hashes: check plan files against the manifest (tensorrt).
        verified: file name -> ``(identity, sha256)`` of the files the load verified (the
            kernels check the panels they map are those: :func:`kernel_model`).

    Returns:
        ``(target, draft)``, each a :class:`~specrt.runtime.backends.base.Model`; an
        ort-cpu target also offers the body/head split
        (:class:`~specrt.runtime.backends.base.SplitsHead`), loaded on first use.

    Raises:
        BackendError, EngineError: see the model classes.
    """
    m = manifest
    if backend == "kernels":
        target = kernel_target(folder, m, threads, target_q, verified)
        if (m.extra.get(KERNELS_KEY) or {}).get("draft"):  # the draft's panels too: one thread team for both
            return target, kernel_model(folder, m, "draft", draft_q, verified=verified)
        return target, cpu_model(folder, m.draft, m.max_ctx, draft_q, threads.for_draft(m.draft.params), role="draft")
    if backend == "ort-cpu":
        from .ort import SharedHeadSessions

        heads = SharedHeadSessions(folder, m, threads, verify_hashes)
        return cpu_model(folder, m.target, m.max_ctx, target_q, threads, heads, role="target"), cpu_model(
            folder, m.draft, m.max_ctx, draft_q, threads.for_draft(m.draft.params), role="draft"
        )
    refuse_builder_graphs(backend, m, folder)
    if backend == "ort-cuda":
        from .ort_cuda import OrtCudaModel

        return (
            OrtCudaModel(folder / m.target.file, m.target, m.max_ctx, target_q, threads),
            OrtCudaModel(folder / m.draft.file, m.draft, m.max_ctx, draft_q, threads.for_draft(m.draft.params)),
        )
    if backend == "tensorrt":
        from .cuda_mem import CudaRuntime
        from .profiles import ProfileSet
        from .trt import TrtModel, load_tensorrt

        rec = trt_record(m, folder, verify_hashes)
        trt, cuda = load_tensorrt(), CudaRuntime()
        models = []
        for role, entry, q in (("target", m.target, target_q), ("draft", m.draft, draft_q)):
            r = rec["models"][role]
            models.append(TrtModel(folder / r["plan"], entry, ProfileSet.from_json(r["profiles"]), q, trt=trt, cuda=cuda))
        return tuple(models)
    raise BackendError(f"backend={backend!r}; choose one of {', '.join(BACKENDS)}")


def batched_model(target, max_batch: int):
    """The batched model continuous batching runs over ``target`` (``max_batch`` KV slots):
    a :class:`~.kern_batch.KernelBatch` for a target on specrt's kernels (exact: its rows are
    batch-1 rows), a :class:`~.ort_gqa_batch.BatchedGqaModel` for a builder graph on
    onnxruntime CPU; None for any other target (no batched model for it).

    Raises:
        InputError: max_batch < 1 (param ``max_batch``).
    """
    from .kern import KernelModel
    from .ort_gqa import OrtGqaModel

    if isinstance(target, KernelModel):
        from .kern_batch import KernelBatch

        return KernelBatch(target, max_batch, target.max_q)  # a call may verify every row's candidates
    if isinstance(target, OrtGqaModel):
        from .ort_gqa_batch import BatchedGqaModel

        return BatchedGqaModel(target, max_batch, target.max_q)
    return None

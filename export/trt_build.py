"""Build TensorRT plans (serialized engines) for an engine folder and record them in the
manifest's ``extra`` (the format version is unchanged; the CPU runtime ignores the extra).

Needs TensorRT >= 10.1 (refused otherwise, with the installed version named). NOT RUN WITH
THE REAL TENSORRT YET (docs/guide/gpu.md); the call sequence is tested on CPU
against a recording stand-in (tests/fake_gpu.py).

Per model (draft, target)::

    ONNX  <role>.onnx, or <role>.<precision>[.pad1].onnx written by onnx tooling
          (:mod:`specrt.export.onnx_precision`: fp16/bf16 compute, float32 I/O; the
          optional dummy-past-row workaround)
    plan  <role>.<precision>.plan: one engine with all the model's optimization profiles
          (:mod:`specrt.runtime.backends.profiles`), built from a strongly typed network (the
          precision is the ONNX's, TensorRT adds none)

Manifest record (``extra["tensorrt"]``)::

    {"record_version": 1, "precision": "fp16", "tensorrt_version": "10.x", "past_pad": 0,
     "strongly_typed": true, "workspace_bytes": N, "prefill_q": 256,
     "models": {"target": {"source_onnx_sha256": <sha256 of target.onnx>, "onnx": ...,
                           "onnx_sha256": ..., "plan": ..., "plan_sha256": ...,
                           "profiles": <ProfileSet.to_json()>}, "draft": {...}}}

A plan is specific to the TensorRT version and the GPU model it was built on; build on
the machine that serves. Command line (used by ``make export``)::

    specrt plans --engines ENGINE_DIR [--precision fp16] [--if-available] [--skip-if-built]
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from specrt.runtime.backends.profiles import PAST_MIN, ProfileConfig, ProfileSet, profiles_for
from specrt.runtime.chunks import PREFILL_CHUNK
from specrt.runtime.errors import TrtBuildError  # noqa: F401  (in the SpecRTError tree)
from specrt.runtime.manifest import Manifest, ModelEntry, load_manifest, sha256_file

from .onnx_precision import PRECISIONS, write_variant

RECORD_VERSION = 1


@dataclass(frozen=True)
class TrtBuildConfig:
    """Settings of one build.

    Attributes:
        precision: ``fp32``, ``fp16`` or ``bf16`` (compute precision; I/O stays float32).
        workspace_gb: TensorRT workspace pool limit, GiB (> 0).
        prefill_q: widest prefill chunk the plans accept (>= 2; the runtime feeds prompts
            in chunks of ``min(PREFILL_CHUNK, this)``, :data:`specrt.runtime.chunks.PREFILL_CHUNK`).
        past_pad: dummy past rows (0, or 1 if a TensorRT version refuses past length 0).
        opt_level: builder optimization level 0..5 (None = TensorRT's default, 3).
    """

    precision: str = "fp16"
    workspace_gb: float = 4.0
    prefill_q: int = PREFILL_CHUNK
    past_pad: int = 0
    opt_level: int | None = None

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; must be one of {', '.join(PRECISIONS)}")
        if not self.workspace_gb > 0:
            raise ValueError(f"workspace_gb={self.workspace_gb}; must be > 0")
        if self.past_pad not in (0, 1):
            raise ValueError(f"past_pad={self.past_pad}; must be 0 or 1")
        if self.opt_level is not None and not 0 <= self.opt_level <= 5:
            raise ValueError(f"opt_level={self.opt_level}; must be 0..5")


def tensorrt_unavailable(trt=None, cuda_rt=None) -> str | None:
    """None when plans can be built here (tensorrt >= 10.1 importable and a GPU visible),
    else why not (one line)."""
    from specrt.runtime.backends.trt import tensorrt_version_problem

    if trt is None:
        try:
            trt = importlib.import_module("tensorrt")
        except ImportError as e:
            return f"the tensorrt Python package is not installed ({e})"
    problem = tensorrt_version_problem(trt)
    if problem:
        return problem
    from specrt.runtime.backends.cuda_mem import gpu_count

    if cuda_rt is None:
        try:
            from specrt.runtime.backends.cuda_mem import load_cuda_runtime

            cuda_rt = load_cuda_runtime()
        except Exception as e:  # noqa: BLE001 - BackendError: report, do not crash
            return str(e)
    if gpu_count(cuda_rt) < 1:
        return "no NVIDIA GPU is visible (cudaGetDeviceCount found none)"
    return None


def network_flags(trt) -> int:
    """``create_network`` flags: STRONGLY_TYPED where the enum has it (TensorRT 10.x);
    0 where it is gone (TensorRT versions whose networks are always strongly typed).
    No EXPLICIT_BATCH: TensorRT 10 networks are always explicit-batch; on TensorRT 8 these
    flags would be wrong, which is why the builder refuses TensorRT < 10.1 first."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(flag) if flag is not None else 0


def build_plan(trt, onnx_path: Path, entry: ModelEntry, pset: ProfileSet, cfg: TrtBuildConfig, log: Callable[[str], None] = print) -> bytes:
    """Parse ``onnx_path`` and build one serialized engine with every profile of ``pset``.

    Args:
        trt: the tensorrt module (or a stand-in).
        onnx_path: the (possibly rewritten) ONNX file.
        entry: the model's manifest entry (input names, KV dims).
        pset: its profiles, in the order they get TensorRT profile indices.
        cfg: :class:`TrtBuildConfig`.

    Returns:
        the serialized engine bytes.

    Raises:
        BackendError: TensorRT older than 10.1 (:data:`specrt.runtime.backends.trt.MIN_TENSORRT`).
        TrtBuildError: parse errors (listed) or a failed build.
    """
    from specrt.runtime.backends.trt import check_tensorrt_version

    check_tensorrt_version(trt)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TrtBuildError(f"TensorRT cannot parse {onnx_path}: {errs or 'no error text'}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(cfg.workspace_gb * (1 << 30)))
    if cfg.opt_level is not None:
        config.builder_optimization_level = cfg.opt_level
    for p in pset.profiles:
        prof = builder.create_optimization_profile()
        for name, (mn, opt, mx) in p.shapes(entry.inputs, entry.n_kv_heads, entry.head_dim, pset.pad).items():
            prof.set_shape(name, mn, opt, mx)
        config.add_optimization_profile(prof)
    log(f"  building {onnx_path.name}: {len(pset.profiles)} profiles ({', '.join(p.name for p in pset.profiles)})")
    ser = builder.build_serialized_network(network, config)
    if ser is None:
        raise TrtBuildError(f"TensorRT failed to build a plan from {onnx_path} (see the TensorRT log above)")
    return bytes(memoryview(ser))


def _write_atomic(path: Path, data: bytes) -> None:
    from specrt.runtime.fileio import write_bytes

    write_bytes(path, data)


def build_plans(folder: str | Path, manifest: Manifest, cfg: TrtBuildConfig = TrtBuildConfig(), trt=None, log: Callable[[str], None] = print) -> Manifest:
    """Write both plans (and rewritten ONNX files) into ``folder``; return the manifest with
    the record in ``extra["tensorrt"]`` (not written: the caller writes it last).

    Raises:
        TrtBuildError, PrecisionError, ValueError; BackendError when tensorrt is missing
        (``trt`` None) or older than 10.1 (checked before anything is written).
    """
    from specrt.runtime.backends.trt import check_tensorrt_version, load_tensorrt

    trt = trt if trt is not None else load_tensorrt()
    check_tensorrt_version(trt)
    folder = Path(folder)
    pcfg = ProfileConfig(k_max=manifest.k_max, max_ctx=manifest.max_ctx, prefill_q=cfg.prefill_q, past_min=PAST_MIN, pad=cfg.past_pad)
    models = {}
    for role, entry in (("draft", manifest.draft), ("target", manifest.target)):
        if entry.graph != "standard":
            raise TrtBuildError(
                f"the {role} is an onnxruntime-genai builder graph ({entry.precision}); TensorRT plans are built from standard graphs: export --precision fp32|fp16|bf16"
            )
        if entry.precision not in ("fp32", cfg.precision):
            raise TrtBuildError(f"the {role} graph computes in {entry.precision}; build plans with --precision {entry.precision} (or export fp32)")
        src = folder / entry.file
        stem = Path(entry.file).stem
        suffix = cfg.precision + (f".pad{cfg.past_pad}" if cfg.past_pad else "")
        # a graph exported at this precision is converted already: only the padding is added
        convert = cfg.precision if entry.precision == "fp32" else "fp32"
        onnx_path = write_variant(src, folder / f"{stem}.{suffix}.onnx", convert, cfg.past_pad)
        pset = profiles_for(role, pcfg)
        plan = folder / f"{stem}.{suffix}.plan"
        _write_atomic(plan, build_plan(trt, onnx_path, entry, pset, cfg, log))
        log(f"  wrote {plan}")
        models[role] = {
            "source_onnx_sha256": entry.sha256,
            "onnx": onnx_path.name,
            "onnx_sha256": sha256_file(onnx_path),
            "plan": plan.name,
            "plan_sha256": sha256_file(plan),
            "profiles": pset.to_json(),
        }
    record = {
        "record_version": RECORD_VERSION,
        "precision": cfg.precision,
        "tensorrt_version": str(getattr(trt, "__version__", "unknown")),
        "strongly_typed": True,
        "past_pad": cfg.past_pad,
        "prefill_q": cfg.prefill_q,
        "workspace_bytes": int(cfg.workspace_gb * (1 << 30)),
        "models": models,
    }
    return replace(manifest, extra={**manifest.extra, "tensorrt": record})


def tensorrt_hook(out: Path, manifest: Manifest, precision: str | None, log: Callable[[str], None] = print) -> Manifest:
    """The optional step of :func:`specrt.export.pipeline.export_pair`: with a precision,
    build plans where TensorRT and a GPU are present, else say plainly that it skipped.

    Returns:
        ``manifest`` with the TensorRT record, or unchanged (no precision / skipped).
    """
    if not precision:
        return manifest
    reason = tensorrt_unavailable()
    if reason:
        log(f"TensorRT plans: skipped ({reason}); the ONNX engines are complete without them")
        return manifest
    log(f"building TensorRT plans ({precision}) in {out}")
    return build_plans(out, manifest, TrtBuildConfig(precision=precision), log=log)


def plans_up_to_date(folder: Path, manifest: Manifest, cfg: TrtBuildConfig, trt_version: str) -> bool:
    """Whether ``manifest`` already records plans built with ``cfg`` by this TensorRT
    version, for these ONNX files, and the plan files still match their hashes."""
    rec = manifest.extra.get("tensorrt")
    if not isinstance(rec, dict) or rec.get("record_version") != RECORD_VERSION:
        return False
    if (rec.get("precision"), rec.get("past_pad"), rec.get("prefill_q"), rec.get("tensorrt_version")) != (
        cfg.precision,
        cfg.past_pad,
        cfg.prefill_q,
        trt_version,
    ):
        return False
    for role, entry in (("draft", manifest.draft), ("target", manifest.target)):
        r = rec.get("models", {}).get(role, {})
        if r.get("source_onnx_sha256") != entry.sha256:
            return False
        for key in ("onnx", "plan"):
            p = Path(folder) / str(r.get(key, ""))
            if not p.is_file() or sha256_file(p) != r.get(f"{key}_sha256"):
                return False
    return True


def build_folder(folder: str | Path, cfg: TrtBuildConfig, if_available: bool = False, skip_if_built: bool = False, log: Callable[[str], None] = print) -> int:
    """``specrt plans``: build plans for an existing engine folder and record them in its
    manifest (written last, atomically); every outcome is one logged line.

    Args:
        folder: the engine folder. cfg: :class:`TrtBuildConfig`.
        if_available: a missing TensorRT or GPU is not an error (status 0).
        skip_if_built: do nothing when the manifest already records matching, intact plans.

    Returns:
        Exit status: 0 built (or skipped), 1 the build failed, 2 TensorRT or a GPU missing
        without ``if_available``.
    """
    reason = tensorrt_unavailable()
    if reason:
        log(f"TensorRT plans: skipped ({reason})")
        return 0 if if_available else 2
    folder = Path(folder)
    try:
        manifest = load_manifest(folder)
        if skip_if_built:
            from specrt.runtime.backends.trt import load_tensorrt

            if plans_up_to_date(folder, manifest, cfg, str(getattr(load_tensorrt(), "__version__", "unknown"))):
                log(f"TensorRT plans: up to date in {folder}")
                return 0
        manifest = build_plans(folder, manifest, cfg, log=log)
        manifest.write(folder)  # atomic, last: until then the old manifest (no plans) stays valid
    except Exception as e:  # noqa: BLE001 - one line, no stack trace, for make
        log(f"TensorRT plans: failed: {type(e).__name__}: {e}")
        return 1
    log(f"TensorRT plans: wrote {', '.join(r['plan'] for r in manifest.extra['tensorrt']['models'].values())} in {folder}")
    return 0

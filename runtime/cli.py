"""``specrt`` command line (click): export | generate | bench | serve.

Errors the project raises (:class:`~specrt.runtime.errors.SpecRTError`) are printed as one
line with a non-zero exit, never as a stack trace.
"""
from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import click

from .errors import SpecRTError

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
    f = click.option("--threads", type=click.IntRange(1, 256), default=None, help="onnxruntime intra-op threads per session (default: 2)")(f)
    f = click.option("--spinning/--no-spinning", default=False, show_default=True, help="let onnxruntime pool threads spin while idle")(f)
    return f


def _backend_option(f):
    return click.option(
        "--backend",
        type=click.Choice(["ort-cpu", "ort-cuda", "tensorrt"]),
        default=None,
        help="model backend (default: the first usable of tensorrt, ort-cuda, ort-cpu; GPU backends unverified, see docs/GPU.md)",
    )(f)


def _sampling_options(f):
    """--temperature/--top-k/--top-p/--seed; values are checked by Engine.resolve (InputError)."""
    f = click.option("--seed", type=int, default=None, help="sampling seed (same seed, same tokens; default: fresh entropy)")(f)
    f = click.option("--top-p", type=float, default=1.0, show_default=True, help="nucleus mass in (0, 1] (1 = off)")(f)
    f = click.option("--top-k", type=int, default=0, show_default=True, help="keep the k most probable tokens (0 = off)")(f)
    f = click.option(
        "--temperature", type=float, default=0.0, show_default=True, help="0 = greedy; > 0 = exact speculative sampling (temperature, then top-k, then top-p)"
    )(f)
    return f


STRATEGY_CHOICE = click.Choice(["full", "chunked", "lazy-head"])


def _strategy_options(f, multiple: bool = False):
    """--strategy (repeatable for bench) and --chunk-bound; values are checked by Engine.resolve."""
    f = click.option(
        "--chunk-bound", type=float, default=None,
        help="chunked/lazy-head: a chunk ends where the product of draft confidences is <= this, in (0, 1] (default: manifest, else 0.5)",
    )(f)
    if multiple:
        return click.option(
            "--strategy", "strategies", type=STRATEGY_CHOICE, multiple=True,
            help="verification strategy to compare (repeatable: one row each; default: manifest, else full)",
        )(f)
    return click.option(
        "--strategy", type=STRATEGY_CHOICE, default=None,
        help="verification: full (one pass), chunked (stop passes at a rejection), lazy-head (stop the vocab projection at a rejection); default: manifest, else full",
    )(f)


def _engine(path: str, threads: int | None, spinning: bool, backend: str | None = None):
    from .generator import Engine
    from .ort_backend import ThreadConfig

    tc = ThreadConfig(intra_op=threads or ThreadConfig().intra_op, spinning=spinning)
    return Engine(path, threads=tc, backend=backend)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specrt")
def cli():
    """specrt: speculative decoding on exported ONNX engines, without PyTorch."""


@cli.command()
@click.option("--draft", "draft", required=True, type=click.Path(exists=True, file_okay=False), help="draft model: local HF checkpoint folder")
@click.option("--target", "target", required=True, type=click.Path(exists=True, file_okay=False), help="target model: local HF checkpoint folder")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="engine folder to write")
@click.option("--k-max", type=click.IntRange(1, 64), default=8, show_default=True, help="largest number of candidates per verification")
@click.option("--max-ctx", type=click.IntRange(2, 1 << 20), default=1024, show_default=True, help="context size (KV rows)")
@click.option(
    "--lazy-head/--no-lazy-head", default=True, show_default=True,
    help="also write the target split at its vocabulary projection (target_body.onnx + target_head.onnx) for --strategy lazy-head",
)
def export(draft, target, out, k_max, max_ctx, lazy_head):
    """Export a draft/target pair to ONNX (IO-bound KV) with parity checks and a manifest."""
    try:
        from specrt.export.pipeline import export_pair
    except ImportError as e:
        raise click.ClickException(f"export needs the [export] extra (torch, transformers, onnx): pip install 'specrt[export]' ({e})") from None
    from specrt.export.arch import UnsupportedModelError
    from specrt.export.onnx_export import ParityError
    from specrt.export.pipeline import PairError

    try:
        export_pair(draft, target, out, k_max=k_max, max_ctx=max_ctx, log=lambda m: click.echo(m, err=True), lazy_head=lazy_head)
    except (PairError, UnsupportedModelError, ParityError, ValueError) as e:
        raise click.ClickException(str(e)) from None


@cli.command()
@click.option("--engines", default=DEFAULT_ENGINES, show_default=True, type=click.Path(), help="engine folder")
@click.option("--prompt", required=True, help="prompt text")
@click.option("--k-max", type=int, default=None, help="most draft candidates per verification (default: manifest)")
@click.option("--threshold", type=float, default=None, help="draft confidence threshold in [0, 1] (default: manifest)")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--no-speculation", is_flag=True, help="run the target alone (baseline)")
@click.option("--stream", is_flag=True, help="print text as it is committed (UTF-8-safe pieces)")
@click.option("--stop", "stops", multiple=True, help="stop string (repeatable, at most 16): the output ends before the first match")
@click.option("--stats/--no-stats", default=True, show_default=True, help="print statistics (JSON) to stderr")
@_strategy_options
@_sampling_options
@_threads_option
@_backend_option
@_clean_errors
def generate(
    engines, prompt, k_max, threshold, max_new_tokens, no_speculation, stream, stops, stats, strategy, chunk_bound,
    temperature, top_k, top_p, seed, threads, spinning, backend,
):
    """Generate a continuation of PROMPT (greedy: the target's own output; sampled: its distribution)."""
    from .generator import GenerationConfig

    t0 = time.perf_counter()
    engine = _engine(engines, threads, spinning, backend)
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens, k_max=k_max, threshold=threshold, speculative=not no_speculation,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=tuple(stops),
        strategy=strategy, chunk_bound=chunk_bound,
    )
    t_loaded = time.perf_counter()
    if stream:
        first = None
        st = engine.stream(prompt, cfg)
        for piece in st:
            if first is None:
                first = time.perf_counter() - t0
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
        res = st.result
    else:
        res = engine.generate(prompt, cfg)
        click.echo(res.text)
    if stats:
        d = res.stats.as_dict()
        d["finish_reason"] = res.finish_reason
        d["stop_reason"] = res.stop_reason
        if stream:
            d["time_to_first_text_s"] = first  # command start to the first printed piece
        d["load_s"] = t_loaded - t0
        d["load_plus_ttft_s"] = d["load_s"] + res.stats.ttft_seconds  # command start to first token
        click.echo(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()}), err=True)


@cli.command()
@click.option("--engines", default=DEFAULT_ENGINES, show_default=True, type=click.Path(), help="engine folder")
@click.option("--prompts", "prompts_file", required=True, type=click.Path(), help="JSONL file, one {\"prompt\": ...} per line")
@click.option("--limit", type=click.IntRange(1), default=None, help="use the first N prompts")
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--k-max", "k_values", type=int, multiple=True, help="k_max values to try (repeatable; default: manifest)")
@click.option("--threshold", "thresholds", type=float, multiple=True, help="thresholds to try (repeatable; default: manifest)")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True, help="passes over the prompts (interleaved)")
@click.option("--out", "out_json", type=click.Path(dir_okay=False), default=None, help="write the results as JSON here")
@functools.partial(_strategy_options, multiple=True)
@_sampling_options
@_threads_option
@_backend_option
@_clean_errors
def bench(
    engines, prompts_file, limit, max_new_tokens, k_values, thresholds, repeats, out_json, strategies, chunk_bound,
    temperature, top_k, top_p, seed, threads, spinning, backend,
):
    """Target-only vs speculative decoding, interleaved on the same prompts; prints a table.

    Sampling options apply to every row, the target-only baseline included. With
    --strategy (repeatable) each k/threshold gets one row per verification strategy."""
    from .bench import BenchConfig, format_table, load_prompts, run_bench
    from .generator import GenerationConfig

    prompts = load_prompts(prompts_file, limit)
    engine = _engine(engines, threads, spinning, backend)
    m = engine.manifest
    ks = k_values or (m.defaults.get("k_max", m.k_max),)
    ths = thresholds or (m.defaults.get("threshold", 0.0),)
    samp = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    configs = [BenchConfig("target-only", GenerationConfig(max_new_tokens=max_new_tokens, speculative=False, **samp))]
    for k in ks:
        for th in ths:
            for st in strategies or (None,):
                cfg = engine.resolve(
                    GenerationConfig(max_new_tokens=max_new_tokens, k_max=k, threshold=th, strategy=st, chunk_bound=chunk_bound, **samp)
                )
                configs.append(BenchConfig(f"spec k={k} th={th:g}" + (f" {st}" if st else ""), cfg))
    with click.progressbar(length=len(prompts) * repeats * len(configs), label="bench", file=sys.stderr) as bar:
        last = [0]

        def progress(done, total):
            bar.update(done - last[0])
            last[0] = done

        result = run_bench(engine, prompts, configs, repeats=repeats, progress=progress)
    result["command"] = " ".join(["specrt"] + sys.argv[1:])
    result["backend"] = engine.backend
    click.echo(format_table(result))
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(result, indent=1))
        click.echo(f"wrote {out_json}", err=True)


@cli.command()
@click.option("--engines", default=DEFAULT_ENGINES, show_default=True, type=click.Path(), help="engine folder")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--workers", type=click.IntRange(1, 256), default=1, show_default=True, help="generator workers, each with its own Engine (workers x --threads <= cores)")
@click.option("--max-queue", type=click.IntRange(1), default=64, show_default=True, help="requests that may wait for a worker (503 beyond)")
@click.option("--model-name", default=None, help="model id clients send (default: the engine folder's name)")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info", show_default=True)
@click.option("--round-delay", type=click.FloatRange(0, 10), default=0.0, hidden=True, help="test hook: a worker sleeps this long after each piece (simulates a slow model)")
@_threads_option
@_backend_option
@_clean_errors
def serve(engines, host, port, workers, max_queue, model_name, log_level, round_delay, threads, spinning, backend):
    """Serve ENGINES over HTTP: OpenAI-compatible /v1/completions (SSE streaming), /metrics (docs/SERVING.md)."""
    from .ort_backend import ThreadConfig
    from .server import serve as run_server

    tc = ThreadConfig(intra_op=threads or ThreadConfig().intra_op, spinning=spinning)
    run_server(engines, host=host, port=port, workers=workers, max_queue=max_queue, threads=tc, backend=backend,
               model_name=model_name, log_level=log_level, round_delay=round_delay)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="specrt")


if __name__ == "__main__":
    main()

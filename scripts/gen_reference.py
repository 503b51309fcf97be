"""Regenerate the generated parts of the reference pages in ``docs/reference/``.

Each page keeps hand-written prose around blocks delimited by marker comments::

    <!-- generated:NAME: scripts/gen_reference.py; do not edit by hand -->
    ...
    <!-- /generated:NAME -->

and this script rewrites what lies between them from the code itself:

* ``cli.md`` (``cli``): every command, argument and option of the ``specrt`` click group
  (names, type, default, required, repeatable, environment variable, help text);
* ``manifest.md`` (``manifest-constants``, ``manifest-schema``): the versions and allowed
  values declared in :mod:`specrt.runtime.manifest`, and the schema of ``manifest.json``
  field by field, from pydantic's JSON schema of the :class:`Manifest`,
  :class:`ModelEntry` and :class:`FileRecord` dataclasses (type, required, default), with
  the meaning of each field from :data:`MEANINGS` below (a field without a meaning stops
  the generator);
* ``http.md`` (``http-requests``): the request fields of ``POST /v1/completions`` and
  ``POST /v1/chat/completions``, from the pydantic request models of
  :mod:`specrt.runtime.serve.protocol`;
* ``metrics.md`` (``metrics``): every series the server registers, read from the
  prometheus_client registries of :class:`ServerMetrics` and :class:`BatchMetrics` (name,
  type, labels, help text), with the unit from :data:`METRIC_UNITS`.

Usage::

    .venv/bin/python scripts/gen_reference.py          # rewrite the pages
    .venv/bin/python scripts/gen_reference.py --check  # exit 1 (and a diff) when a page is stale

``tests/test_reference_docs.py`` runs the check, so a new CLI option, manifest field,
request field or metric without regenerated docs fails the tests.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "reference"

START = "<!-- generated:{name}: scripts/gen_reference.py; do not edit by hand -->"
END = "<!-- /generated:{name} -->"


# ---- shared helpers -----------------------------------------------------------------------
def cell(text: object) -> str:
    """``text`` made safe for one Markdown table cell (pipes escaped, one line)."""
    s = str(text).replace("\n", " ").replace("|", "\\|")
    return re.sub(r"\s+", " ", s).strip()


def code(value: object) -> str:
    """``value`` as inline code (JSON spelling for Python values, pipes escaped)."""
    s = value if isinstance(value, str) else json.dumps(value)
    return "`" + s.replace("|", "\\|") + "`"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the generated block ``name`` replaced by ``body``.

    Raises:
        ValueError: the page has no (or more than one) start/end marker pair for ``name``.
    """
    start, end = START.format(name=name), END.format(name=name)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"expected one block {start} ... {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body.strip()}\n{end}{tail}"


# ---- cli.md -------------------------------------------------------------------------------
def _unset(value: object) -> bool:
    """Whether a click default means "no default" (None, or click 8.2+'s UNSET sentinel)."""
    return value is None or type(value).__name__ == "Sentinel"


def _range(t) -> str:
    """A click IntRange/FloatRange as ``1..64``, ``>= 1``, ``> 0``."""
    lo, hi = t.min, t.max
    lo_op = ">" if t.min_open else ">="
    hi_op = "<" if t.max_open else "<="
    if lo is not None and hi is not None and not t.min_open and not t.max_open:
        return f"{lo}..{hi}"
    parts = []
    if lo is not None:
        parts.append(f"{lo_op} {lo}")
    if hi is not None:
        parts.append(f"{hi_op} {hi}")
    return ", ".join(parts)


def param_type(p) -> str:
    """The value a click parameter takes, in words (flag, integer in a range, one of ...)."""
    import click

    t = p.type
    if isinstance(p, click.Option) and p.is_flag:
        return "flag" if not p.secondary_opts else "on/off flag"
    if isinstance(t, click.Choice):
        return "one of " + ", ".join(code(c) for c in t.choices)
    if isinstance(t, (click.IntRange, click.FloatRange)):
        kind = "integer" if isinstance(t, click.IntRange) else "number"
        return f"{kind} ({_range(t)})"
    if isinstance(t, click.Path):
        what = "file path" if not t.dir_okay else "folder path" if not t.file_okay else "path"
        return what + (" (must exist)" if t.exists else "")
    return {"integer": "integer", "float": "number", "text": "text", "boolean": "boolean"}.get(t.name, t.name)


def param_default(p) -> str:
    """A click parameter's default for the table (``-`` when it has none)."""
    import click

    d = p.default
    if isinstance(p, click.Option) and p.is_flag and not p.secondary_opts:
        return "on" if d is True else "off"
    if isinstance(p, click.Option) and p.secondary_opts:
        return "-" if _unset(d) else code(p.opts[0] if d else p.secondary_opts[0])
    if _unset(d) or (p.multiple and d in ((), [])):
        return "-"
    if callable(d):
        return "(computed)"
    return code(d if not isinstance(d, (list, tuple)) else list(d))


def command_section(name: str, cmd) -> str:
    """The Markdown reference of one click command: usage, help, then a table of its
    arguments and options (hidden ones marked)."""
    import click

    ctx = click.Context(cmd, info_name=name)
    lines = [f"### `specrt {name}`", "", "```text", f"specrt {name} {' '.join(cmd.collect_usage_pieces(ctx))}", "```", ""]
    doc = inspect.cleandoc(cmd.help or "")
    for para in re.split(r"\n\s*\n", doc) if doc else ["*(no help text)*"]:
        lines += [re.sub(r"\s*\n\s*", " ", para.strip()), ""]
    lines += ["| option | value | default | required | help |", "|---|---|---|---|---|"]
    for p in cmd.params:
        if isinstance(p, click.Argument):
            names = f"`{p.human_readable_name}` (argument)"
            help_text = "(argument: see the command's help)"
        else:
            names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
            help_text = p.help or "*(no help text)*"
            if p.hidden:
                help_text = "*(hidden from --help)* " + help_text
            if p.envvar:
                help_text += f" (environment: `${p.envvar}`)"
        value = param_type(p) + (", repeatable" if p.multiple else "")
        req = "yes" if p.required else ""
        lines.append(f"| {names} | {cell(value)} | {cell(param_default(p))} | {req} | {cell(help_text)} |")
    lines += ["| `-h`, `--help` | flag | off |  | print the command's help and exit |", ""]
    return "\n".join(lines)


def cli_reference() -> str:
    """The generated part of ``cli.md``: the group's own options, then every command in
    the order ``specrt --help`` lists them (alphabetical)."""
    import click

    from specrt.cli import cli

    ctx = click.Context(cli, info_name="specrt")
    names = cli.list_commands(ctx)
    out = [
        "Commands: " + ", ".join(f"[`{n}`](#specrt-{n})" for n in names) + ".",
        "",
        "### `specrt`",
        "",
        "```text",
        "specrt [OPTIONS] COMMAND [ARGS]...",
        "```",
        "",
        (cli.help or "").strip(),
        "",
        "| option | value | default | required | help |",
        "|---|---|---|---|---|",
    ]
    for p in cli.params:
        out.append(f"| {', '.join(f'`{o}`' for o in p.opts)} | flag | off |  | {cell(p.help or '')} |")
    out += ["| `-h`, `--help` | flag | off |  | print the help and exit |", ""]
    for n in names:
        out.append(command_section(n, cli.commands[n]))
    return "\n".join(out)


# ---- manifest.md --------------------------------------------------------------------------
# The meaning of every schema field (units and allowed values included). Types, required
# and defaults come from the code; a field missing here (or named here but gone from the
# code) stops the generator, so a new field cannot ship undocumented.
MEANINGS: dict[str, dict[str, str]] = {
    "Manifest": {
        "format_version": "Schema version of this file. Allowed: {readable} (this exporter writes {written}); any other value is refused at load "
        "with the command to re-run. Changes when a field changes meaning or becomes required (see *Versions*).",
        "name": "Engine name: the name of the `specrt export --out` folder at export. Informational, shown in traces and messages (the server's model id is `--model-name`, "
        "else the folder's name).",
        "draft": "The draft model (a `ModelEntry` object, below).",
        "target": "The target model (a `ModelEntry` object, below).",
        "tokenizer_file": "File name of the shared tokenizer (`tokenizer.json`), inside the engine folder.",
        "tokenizer_sha256": "SHA-256 of `tokenizer_file` (64 lowercase hex digits); equals `files[tokenizer_file].sha256` in format 2.",
        "vocab_size": "Real vocabulary size of the tokenizer (tokens). Ids `>= vocab_size` are padding rows of the logits, never proposed. "
        "1..each model's `vocab_size`.",
        "eos_token_id": "End-of-sequence token id, in 0..`vocab_size`-1.",
        "bos_token_id": "Beginning-of-sequence token id (0..`vocab_size`-1), or null when the tokenizer has none.",
        "add_bos": "Whether prompts get BOS prepended (the same rule for draft, target and baseline).",
        "max_ctx": "Context size in positions: positions 0..`max_ctx`-1 exist and the KV buffers hold `max_ctx` rows (`specrt export --max-ctx`). >= 2.",
        "k_min": "Smallest `k_max` a request may ask for. 1 <= `k_min` <= `k_max`.",
        "k_max": "Largest number of draft candidates per verification pass the graphs were exported for (`specrt export --k-max`). "
        "`k_min` <= `k_max` <= min({k_limit}, `max_ctx` - 1).",
        "kv_layout": "Layout of a standard graph's KV rows: `{kv_layout}` = [batch=1, position, kv_head, head_dim]. Only `{kv_layout}` is allowed.",
        "kv_dtype": "Element type of the KV buffers. Only `float32` is allowed.",
        "defaults": "Decoding defaults used when a request or command does not set them (written by `specrt export --defaults` and "
        "`specrt tune`). Keys: {default_keys}; each value is range-checked when a generation config is resolved.",
        "tools": "Versions of the tools used at export, by name (python, torch, transformers, onnx, onnxruntime, onnxruntime_genai). Informational.",
        "extra": "Forward-compatible records by key (see *`extra` keys*); unknown keys are kept and ignored.",
        "pad_token_id": "The target's pad token id (below the target's logits width), or null. Recorded only: batch-1 decoding never pads.",
        "chat_template_file": "File name of the target's chat template copied at export (`chat_template.jinja`), or null when the checkpoint had none.",
        "chat_template_sha256": "SHA-256 of `chat_template_file` (checked at load like the other files); null without a template.",
        "precision": "The export's `--precision`, one of {precisions} (per model: `ModelEntry.precision`).",
        "eos_token_ids": "Every token id that ends a generation (the checkpoint's generation_config / GGUF end-of-generation ids), each in "
        "0..`vocab_size`-1. Empty in older engines: `eos_token_id` alone. Generation stops at any of these and at `eos_token_id`.",
        "files": "Format 2: every file of the engine, by file name relative to the folder, with its SHA-256 and size (`FileRecord`, below). "
        "Must list both graphs, their external-data files, the tokenizer, the chat template and the lazy-head graphs when recorded; "
        "an engine load checks each file's size (one `stat`), then its SHA-256 (cached by file identity). Empty in format 1.",
    },
    "ModelEntry": {
        "file": "ONNX graph file name inside the engine folder.",
        "sha256": "SHA-256 of `file` (64 lowercase hex digits).",
        "family": "Architecture family of the checkpoint (`llama`, `qwen2`, `gpt2`, ...). Informational.",
        "n_layers": "Decoder layers (= number of past key/value input pairs). >= 1.",
        "n_heads": "Query heads. >= 1.",
        "n_kv_heads": "Key/value heads of one KV row. >= 1.",
        "head_dim": "Per-head width (elements); one KV row holds `n_kv_heads` x `head_dim` float32. >= 1.",
        "hidden": "Model width (elements). >= 1.",
        "vocab_size": "Logits width (tokens); may exceed the tokenizer's `vocab_size` by padding rows. >= the top-level `vocab_size`.",
        "params": "Parameter count. >= 0.",
        "parity": "Largest |exported - PyTorch| logit differences (and the logits correlation) measured at export, by check name. Informational.",
        "inputs": "ONNX input names: exactly the interface of `n_layers` layers of the entry's `graph` form, in any order "
        "(standard: `input_ids`, `position_ids`, `past_key_i`, `past_value_i`; builder: `input_ids`, `attention_mask`, "
        "`past_key_values.i.key`/`.value`).",
        "outputs": "ONNX output names, likewise (standard: `logits`, `new_key_i`, `new_value_i`; builder: `logits`, `present.i.key`/`.value`).",
        "source": "The checkpoint folder (or .gguf file) it was exported from. Informational.",
        "vocab_hash": "SHA-256 of the token -> id map of the checkpoint's tokenizer; the draft's and the target's must be equal "
        "(empty in older manifests: not checked).",
        "matmul_params": "Weights of the decoder layers' matrix multiplications (embeddings, norms, biases, LM head excluded), for the FLOPs "
        "figures; 0 in older manifests. >= 0.",
        "graph": "Graph form, one of {graph_forms}: `standard` = specrt's IO-bound graph (new KV rows out, BLHD KV); `builder` = "
        "onnxruntime-genai's model builder graph (GroupQueryAttention, past and present share one BNSH buffer).",
        "precision": "One of {precisions}: compute precision of a standard graph, weight precision of a builder graph.",
        "quant": "How the weights were quantized (builder graphs: builder version, block size, accuracy level, options); empty otherwise.",
        "data_file": "External-data weight file beside `file` (e.g. `target.onnx.data`); empty when the weights are inline.",
        "data_sha256": "SHA-256 of `data_file` (empty without one).",
        "exact_min_q": "Smallest target call width (tokens) from which logits rows are bit-identical whatever the width and row offset, "
        "measured at export; null when none is (or it was not measured). The decode loop never calls the target narrower. "
        "null or 1..`k_max`+1.",
        "exactness": "The measurements behind `exact_min_q` (widths, offsets, max differences). Informational.",
        "note": "What the export chose for this model and why (e.g. a model kept as a standard graph in an int4 export). Informational.",
    },
    "FileRecord": {
        "sha256": "SHA-256 of the file's bytes (64 lowercase hex digits).",
        "bytes": "Size of the file in bytes (>= 0); a file of another size is refused before it is read.",
        "external": "For an ONNX graph, the files its initializers read their data from (ONNX external data), each itself a key of `files`; empty otherwise.",
    },
}


def _manifest_values() -> dict[str, str]:
    """The constants :data:`MEANINGS` quotes, read from :mod:`specrt.runtime.manifest`."""
    from specrt.runtime import manifest as m
    from specrt.runtime.config import DEFAULT_KEYS

    return {
        "readable": ", ".join(code(v) for v in m.READABLE_VERSIONS),
        "written": code(m.FORMAT_VERSION),
        "k_limit": str(m.K_LIMIT),
        "kv_layout": m.KV_LAYOUT,
        "default_keys": ", ".join(code(k) for k in DEFAULT_KEYS),
        "precisions": ", ".join(code(p) for p in m.PRECISIONS),
        "graph_forms": ", ".join(code(g) for g in m.GRAPH_FORMS),
    }


def json_type(prop: dict) -> str:
    """A JSON-schema property as a short type: ``integer``, ``string or null``,
    ``array of string``, ``object of number``, a ``$ref``'s name."""
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " or ".join(json_type(p) for p in prop["anyOf"])
    t = prop.get("type", "any")
    if t == "array":
        return f"array of {json_type(prop['items'])}" if "items" in prop else "array"
    if t == "object":
        extra = prop.get("additionalProperties")
        return f"object of {json_type(extra)}" if isinstance(extra, dict) else "object"
    return t


def schema_table(schema: dict, meanings: dict[str, str], values: dict[str, str], where: str) -> list[str]:
    """Table rows of one object schema: field, JSON type, required, default, meaning.

    Raises:
        ValueError: a field without a meaning in :data:`MEANINGS`, or a meaning for a field
            the schema does not have.
    """
    props = schema["properties"]
    missing = sorted(set(props) - set(meanings))
    stale = sorted(set(meanings) - set(props))
    if missing or stale:
        raise ValueError(f"{where}: fields without a meaning in scripts/gen_reference.py MEANINGS: {missing}; meanings of fields gone: {stale}")
    required = set(schema.get("required", ()))
    rows = ["| field | JSON type | required | default | meaning |", "|---|---|---|---|---|"]
    for name, prop in props.items():
        if name in required:
            default = "-"
        elif "default" in prop:
            default = code(json.dumps(prop["default"]))
        else:
            default = "`{}`" if prop.get("type") == "object" else "-"
        rows.append(
            f"| `{name}` | {cell(json_type(prop))} | {'yes' if name in required else 'no'} | {cell(default)} | {cell(meanings[name].format(**values))} |"
        )
    return rows


def manifest_schema() -> str:
    """The generated schema block of ``manifest.md``: one table per object (top level,
    model entry, file record), from pydantic's JSON schema of the dataclasses."""
    from pydantic import TypeAdapter

    from specrt.runtime.manifest import Manifest

    schema = TypeAdapter(Manifest).json_schema()
    values = _manifest_values()
    out = []
    titles = {
        "Manifest": "Top level (`Manifest`)",
        "ModelEntry": "`draft` and `target` (`ModelEntry`)",
        "FileRecord": "values of `files` (`FileRecord`)",
    }
    for name, title in titles.items():
        obj = schema if name == "Manifest" else schema["$defs"][name]
        out += [f"### {title}", ""]
        out += schema_table(obj, MEANINGS[name], values, name)
        out.append("")
    return "\n".join(out)


def manifest_constants() -> str:
    """The generated constants block of ``manifest.md`` (versions, allowed values)."""
    from specrt.runtime import manifest as m
    from specrt.runtime.config import DEFAULT_KEYS

    rows = [
        ("format version written (`FORMAT_VERSION`)", code(m.FORMAT_VERSION)),
        ("format versions read (`READABLE_VERSIONS`)", ", ".join(code(v) for v in m.READABLE_VERSIONS)),
        ("graph forms (`GRAPH_FORMS`)", ", ".join(code(v) for v in m.GRAPH_FORMS)),
        ("precisions (`PRECISIONS`)", ", ".join(code(v) for v in m.PRECISIONS)),
        ("KV layout of standard graphs (`KV_LAYOUT`)", code(m.KV_LAYOUT)),
        ("largest `k_max` (`K_LIMIT`)", code(m.K_LIMIT)),
        ("keys of `defaults` (`runtime.config.DEFAULT_KEYS`)", ", ".join(code(k) for k in DEFAULT_KEYS)),
        ("key of the lazy-head record in `extra` (`LAZY_HEAD_KEY`)", code(m.LAZY_HEAD_KEY)),
    ]
    return "\n".join(["| constant | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


# ---- http.md ------------------------------------------------------------------------------
def _constraints(prop: dict) -> str:
    """Range and size constraints of a JSON-schema property (first non-null ``anyOf``
    branch): ``0..2``, ``> 0, <= 1``, ``>= 1 items``."""
    branches = prop.get("anyOf", [prop])
    parts = []
    for b in branches:
        lo, hi = b.get("minimum"), b.get("maximum")
        if lo is not None and hi is not None:
            parts.append(f"{lo}..{hi}")
        else:
            if lo is not None:
                parts.append(f">= {lo}")
            if b.get("exclusiveMinimum") is not None:
                parts.append(f"> {b['exclusiveMinimum']}")
            if hi is not None:
                parts.append(f"<= {hi}")
        if b.get("exclusiveMinimum") is not None and hi is not None and lo is None:
            parts = [f"> {b['exclusiveMinimum']}, <= {hi}"]
        if "minItems" in b:
            parts.append(f">= {b['minItems']} items")
        if "enum" in b:
            typed = [x for x in branches if x.get("type") != "null"]
            parts.append(("string form: " if len(typed) > 1 else "") + "one of " + ", ".join(code(v) for v in b["enum"]))
    return ", ".join(dict.fromkeys(parts))


def request_table(model) -> list[str]:
    """Table rows of a request body model: field, JSON type, required, range, description."""
    schema = model.model_json_schema()
    required = set(schema.get("required", ()))
    rows = ["| field | JSON type | required | range | description |", "|---|---|---|---|---|"]
    for name, prop in schema["properties"].items():
        desc = prop.get("description", "")
        rows.append(f"| `{name}` | {cell(json_type(prop))} | {'yes' if name in required else 'no'} | {cell(_constraints(prop))} | {cell(desc)} |")
    return rows


def http_requests() -> str:
    """The generated block of ``http.md``: the fields of both request bodies (and of their
    nested objects), from :mod:`specrt.runtime.serve.protocol`'s pydantic models."""
    from specrt.runtime.serve.protocol import _common_fields, chat_request_model, completion_request_model

    common = set(_common_fields().model_fields)
    out = []
    for title, model in (("`POST /v1/completions`", completion_request_model()), ("`POST /v1/chat/completions`", chat_request_model())):
        own = [f for f in model.model_fields if f not in common]
        out += [f"#### {title}", "", "Fields of this route only: " + ", ".join(f"`{f}`" for f in own) + ".", ""]
        out += request_table(model)
        out.append("")
    chat = chat_request_model().model_json_schema()
    notes = {
        "Message": "other keys (`tool_calls`, `tool_call_id`, ...) are passed to the chat template",
        "TextPart": "an element of a list `content`; only the `text` of each part is rendered, other keys are accepted",
        "StreamOptions": "other keys are refused (400)",
    }
    for name, note in notes.items():
        sub = chat["$defs"][name]
        out += [f"#### `{name}` object", "", f"{note[0].upper()}{note[1:]}.", ""]
        out += request_table(_Schema(sub))
        out.append("")
    return "\n".join(out)


class _Schema:
    """A JSON schema posing as a pydantic model for :func:`request_table`."""

    def __init__(self, schema: dict):
        self.schema = schema

    def model_json_schema(self) -> dict:
        """The wrapped schema."""
        return self.schema


# ---- metrics.md ---------------------------------------------------------------------------
# unit of each metric; a registered metric missing here stops the generator
METRIC_UNITS: dict[str, str] = {
    "specrt_requests": "requests",
    "specrt_request_success": "generations",
    "specrt_prompt_tokens": "tokens",
    "specrt_generation_tokens": "tokens",
    "specrt_draft_tokens_proposed": "tokens",
    "specrt_draft_tokens_accepted": "tokens",
    "specrt_verify_passes": "target calls",
    "specrt_prefix_cache_hits": "generations",
    "specrt_prefix_cache_cached_tokens": "tokens",
    "specrt_prefix_cache_evictions": "records",
    "specrt_prefix_cache_evicted_tokens": "tokens",
    "specrt_prefix_cache_tokens": "tokens",
    "specrt_host_cache_hits": "generations",
    "specrt_host_cache_restored_tokens": "tokens",
    "specrt_host_cache_evicted_tokens": "tokens",
    "specrt_host_cache_tokens": "tokens",
    "specrt_host_cache_bytes": "bytes",
    "specrt_draft_tokens_proposed_by_position": "verification passes",
    "specrt_draft_tokens_accepted_by_position": "tokens",
    "specrt_acceptance_rate": "ratio (0..1)",
    "specrt_mean_accepted_length": "tokens per target pass",
    "specrt_e2e_request_latency_seconds": "seconds",
    "specrt_time_to_first_token_seconds": "seconds",
    "specrt_time_per_output_token_seconds": "seconds per token",
    "specrt_request_queue_time_seconds": "seconds",
    "specrt_workers": "workers (slots with --max-batch)",
    "specrt_workers_busy": "workers (active rows with --max-batch)",
    "specrt_queue_depth": "generations",
    "specrt_queue_capacity": "generations",
    "specrt_batch_size": "rows",
    "specrt_batch_queue_depth": "requests",
    "specrt_tokens_per_forward_pass": "tokens per target call",
    "specrt_batch_iterations": "iterations",
    "specrt_batch_step_seconds": "seconds",
}


def metric_families() -> list[tuple[str, object]]:
    """``(source class, metric family)`` for every specrt metric the server registers: a
    :class:`ServerMetrics` and a :class:`BatchMetrics` made in one registry, as
    ``specrt serve --max-batch`` makes them (prometheus_client's own ``process_*`` and
    ``python_info`` left out)."""
    from specrt.runtime.serve.metrics import BatchMetrics, ServerMetrics

    server = ServerMetrics("MODEL", 2, lambda: (1, 0, 0, 1))
    before = {f.name for f in server.registry.collect()}
    BatchMetrics("MODEL", 2, lambda: [0.0, 0.0, 0.0], registry=server.registry)
    out = []
    for fam in server.registry.collect():
        if fam.name.startswith("specrt_"):
            out.append(("ServerMetrics" if fam.name in before else "BatchMetrics", fam))
    return out


def series_names(fam) -> list[str]:
    """The sample names a family exposes (``_total`` for counters; ``_bucket``, ``_sum``,
    ``_count`` for histograms)."""
    if fam.type == "counter":
        return [f"{fam.name}_total"]
    if fam.type == "histogram":
        return [f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"]
    return [fam.name]


def metrics_reference() -> str:
    """The generated block of ``metrics.md``: one row per registered specrt metric.

    Raises:
        ValueError: a registered metric without a unit in :data:`METRIC_UNITS`, or a unit
            for a metric no longer registered.
    """
    fams = metric_families()
    names = {f.name for _, f in fams}
    missing, stale = sorted(names - set(METRIC_UNITS)), sorted(set(METRIC_UNITS) - names)
    if missing or stale:
        raise ValueError(f"metrics without a unit in scripts/gen_reference.py METRIC_UNITS: {missing}; units of metrics gone: {stale}")
    rows = ["| metric (exposed series) | type | labels | unit | meaning (help text) | registered by |", "|---|---|---|---|---|---|"]
    for source, fam in fams:
        labels = []
        for s in fam.samples:
            for k in s.labels:
                if k != "le" and k not in labels:
                    labels.append(k)
        series = "<br>".join(f"`{n}`" for n in series_names(fam))
        rows.append(
            f"| {series} | {fam.type} | {', '.join(f'`{x}`' for x in labels)} | {cell(METRIC_UNITS[fam.name])} | {cell(fam.documentation)} | `{source}` |"
        )
    return "\n".join(rows)


# ---- pages ---------------------------------------------------------------------------------
BLOCKS: dict[str, dict[str, Callable[[], str]]] = {
    "cli.md": {"cli": cli_reference},
    "manifest.md": {"manifest-constants": manifest_constants, "manifest-schema": manifest_schema},
    "http.md": {"http-requests": http_requests},
    "metrics.md": {"metrics": metrics_reference},
}


def generate(folder: Path = DOCS) -> dict[Path, str]:
    """Every page of ``folder`` with its generated blocks rewritten from the code now
    (the pages themselves are not touched)."""
    out = {}
    for page, blocks in BLOCKS.items():
        path = folder / page
        text = path.read_text()
        for name, fn in blocks.items():
            text = replace_block(text, name, fn())
        out[path] = text
    return out


def stale(folder: Path = DOCS) -> dict[Path, str]:
    """Pages whose committed text differs from what :func:`generate` makes, with a
    unified diff each (empty dict: all up to date)."""
    out = {}
    for path, text in generate(folder).items():
        now = path.read_text()
        if now != text:
            diff = difflib.unified_diff(now.splitlines(), text.splitlines(), f"{path} (committed)", f"{path} (generated)", lineterm="", n=1)
            out[path] = "\n".join(diff)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: rewrite the pages, or with ``--check`` report stale ones (exit 1)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 with a diff when a page is out of date")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for diff in bad.values():
            print(diff)
        if bad:
            print(f"{len(bad)} page(s) out of date: run .venv/bin/python scripts/gen_reference.py", file=sys.stderr)
        return 1 if bad else 0
    for path, text in generate().items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The reference pages in docs/reference/ stay true to the code (issue 32.2).

The generated blocks of cli.md, manifest.md, http.md and metrics.md must equal what
scripts/gen_reference.py makes from the code now; every metric metrics.py registers is
named in metrics.md; the manifest example loads. The mutation tests below show each check
fails when the code gains an undocumented option, manifest field or metric. No engines,
no server: only the click group, the pydantic schemas and prometheus_client registries.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "reference"
METRICS_PY = REPO / "runtime" / "serve" / "metrics.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "scripts" / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


def test_pages_equal_the_generator():
    """Each page's generated blocks are what the generator makes from the code now."""
    bad = gen.stale()
    assert not bad, "reference pages out of date; run .venv/bin/python scripts/gen_reference.py\n" + "\n".join(bad.values())


def _source_metric_names() -> set[str]:
    """Metric names written as string literals in metrics.py (constructor and helper calls)."""
    return set(re.findall(r'"(specrt_[a-z0-9_]+)"', METRICS_PY.read_text()))


def _registered_series() -> set[str]:
    """Every exposed specrt series name of a ServerMetrics + BatchMetrics registry."""
    return {name for _, fam in gen.metric_families() for name in gen.series_names(fam)}


def missing_metrics(page: str) -> list[str]:
    """Registered series and metrics.py names that ``page`` does not name (as `code`)."""
    names = _registered_series() | _source_metric_names()
    return sorted(n for n in names if not re.search(rf"`{re.escape(n)}(_total|_bucket)?(`|\{{)", page))


def test_every_registered_metric_is_named():
    source = _source_metric_names()
    registered = {fam.name for _, fam in gen.metric_families()}
    assert {n.removesuffix("_total") for n in source} <= registered | {"specrt_requests", "specrt_prompt_tokens"}, (
        "a specrt_* name in metrics.py that the registries do not hold"
    )
    assert len(registered) >= 28
    assert missing_metrics((DOCS / "metrics.md").read_text()) == []


def test_manifest_meanings_cover_the_schema():
    """Every field of the three dataclasses has a meaning in the generator, and no more."""
    from specrt.runtime.manifest import FileRecord, Manifest, ModelEntry

    for cls in (Manifest, ModelEntry, FileRecord):
        assert set(gen.MEANINGS[cls.__name__]) == set(cls.__dataclass_fields__), cls.__name__


def test_manifest_example_loads():
    """The example in manifest.md passes the runtime's validation (structure and rules)."""
    from specrt.runtime.manifest import FORMAT_VERSION, validate_manifest

    page = (DOCS / "manifest.md").read_text()
    example = page.split("## Example", 1)[1]
    raw = json.loads(re.search(r"```json\n(.*?)\n```", example, re.S).group(1))
    m = validate_manifest(raw, "engines/default")
    assert m.format_version == FORMAT_VERSION and m.files


def test_cli_page_names_every_option():
    """Belt and braces beside the equality test: each option string appears in cli.md."""
    from specrt.cli import cli

    page = (DOCS / "cli.md").read_text()
    for name, cmd in cli.commands.items():
        assert f"### `specrt {name}`" in page
        for p in cmd.params:
            for opt in [*p.opts, *p.secondary_opts]:
                if opt.startswith("-"):
                    assert f"`{opt}`" in page, (name, opt)


# ---- mutations: each check fails when the code changes without the docs -------------------
# (compared with the generator's output before the mutation, so they hold whether or not the
# committed pages are up to date)
def _diff(before: dict, after: dict) -> dict[str, str]:
    """Page name -> the lines the mutation added to the generated page."""
    out = {}
    for path, text in after.items():
        old = set(before[path].splitlines())
        added = [line for line in text.splitlines() if line not in old]
        if added or text != before[path]:
            out[path.name] = "\n".join(added)
    return out


def test_mutation_new_cli_option_fails(monkeypatch):
    import click

    from specrt.cli import cli

    before = gen.generate()
    serve = cli.commands["serve"]
    monkeypatch.setattr(serve, "params", [*serve.params, click.Option(["--fake-knob"], type=int, default=3, help="a new option")])
    assert _diff(before, gen.generate()) == {"cli.md": "| `--fake-knob` | integer | `3` |  | a new option |"}


def test_mutation_changed_default_fails(monkeypatch):
    from specrt.cli import cli

    before = gen.generate()
    opt = next(p for p in cli.commands["export"].params if p.name == "k_max")
    monkeypatch.setattr(opt, "default", 9)
    changed = _diff(before, gen.generate())
    assert list(changed) == ["cli.md"] and "| `--k-max` | integer (1..64) | `9` |" in changed["cli.md"]


def test_mutation_new_manifest_field_fails(monkeypatch):
    import specrt.runtime.manifest as manifest

    @dataclass(frozen=True)
    class Grown(manifest.Manifest):
        new_field: int = 0

    monkeypatch.setattr(manifest, "Manifest", Grown)
    with pytest.raises(ValueError, match=r"fields without a meaning .*\['new_field'\]"):
        gen.manifest_schema()


def test_mutation_new_request_field_fails(monkeypatch):
    from pydantic import create_model

    import specrt.runtime.serve.protocol as protocol

    before = gen.generate()
    grown = create_model("CompletionRequest", __base__=protocol.completion_request_model(), logit_scale=(float | None, None))
    monkeypatch.setitem(protocol._models, "completion", grown)
    changed = _diff(before, gen.generate())
    assert list(changed) == ["http.md"] and "| `logit_scale` | number or null | no |" in changed["http.md"]


def test_mutation_new_metric_fails(monkeypatch):
    import prometheus_client as pc

    from specrt.runtime.serve.metrics import ServerMetrics

    init = ServerMetrics.__init__

    def grown(self, *a, **kw):
        init(self, *a, **kw)
        pc.Counter("specrt_fake_events", "A new metric.", ["model_name"], registry=self.registry)

    monkeypatch.setattr(ServerMetrics, "__init__", grown)
    with pytest.raises(ValueError, match="specrt_fake_events"):
        gen.metrics_reference()
    assert missing_metrics((DOCS / "metrics.md").read_text()) == ["specrt_fake_events_total"]


def test_mutation_metric_row_removed_fails():
    page = (DOCS / "metrics.md").read_text()
    cut = "\n".join(line for line in page.splitlines() if "specrt_batch_step_seconds" not in line)
    assert missing_metrics(cut) == ["specrt_batch_step_seconds"]

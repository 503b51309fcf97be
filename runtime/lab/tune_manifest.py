"""What ``specrt tune`` records in an engine's manifest, and its inputs besides the sweep:
the chosen defaults with the tune's summary (per-call costs for adaptive k, batch step
costs, calibration), restoring the defaults a tune replaced, the strategies a folder can
run, and a costs file. The CLI only prints (``specrt_ns/cli.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import InputError, SpecRTError

__all__ = ["load_costs_file", "runnable_strategies", "restore_previous_defaults", "write_tune_defaults"]


def load_costs_file(costs_file: str | None):
    """The per-call :class:`~specrt.runtime.costs.Costs` of a costs file (a tune.json's
    ``"costs"`` or a bare costs object), or None without a file.

    Raises:
        InputError: unreadable JSON or malformed costs.
    """
    if not costs_file:
        return None
    from ..costs import Costs

    try:
        raw = json.loads(Path(costs_file).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read costs file {costs_file}: {e}") from None
    return Costs.from_json(raw.get("costs", raw) if isinstance(raw, dict) else raw, str(costs_file))


def runnable_strategies(engine, prompt: list[int], log=print) -> list[str]:
    """Every verification strategy this engine folder and backend can run (one 2-token
    generation each); each one left out is logged with the reason."""
    from ..config import STRATEGIES, GenerationConfig

    runnable = []
    for st in STRATEGIES:
        try:
            engine.generate(prompt, GenerationConfig(max_new_tokens=2, strategy=st))
            runnable.append(st)
        except SpecRTError as e:
            log(f"strategy {st} left out: {e}")
    return runnable


def restore_previous_defaults(target: str) -> tuple[dict, dict]:
    """Swap ``target``'s defaults with those the last ``specrt tune`` replaced; returns
    ``(restored, replaced)``.

    Raises:
        InputError: the manifest keeps no previous defaults.
    """
    from ..manifest import load_manifest, write_defaults

    manifest = load_manifest(target, verify_hashes=False)
    prev = manifest.extra.get("previous_defaults")
    if not isinstance(prev, dict):
        raise InputError(f"{Path(target) / 'manifest.json'} keeps no previous defaults (extra.previous_defaults); nothing to restore")
    write_defaults(target, prev, {"previous_defaults": dict(manifest.defaults)}, replace=True)
    return prev, dict(manifest.defaults)


def write_tune_defaults(result: dict, defaults: dict, target: str, from_trace: str | None) -> None:
    """Write a tune result's chosen defaults (and its summary in ``extra``) into ``target``'s manifest.

    Raises:
        InputError: a trace recorded on another pair than ``target``.
    """
    from ..manifest import load_manifest, write_defaults
    from .trace import manifest_identity

    if from_trace and manifest_identity(load_manifest(target, verify_hashes=False))["pair_sha256"] != result.get("pair_sha256"):
        raise InputError(f"the trace {from_trace} was recorded on another pair than {target} (pair_sha256 differs); not writing its defaults there")
    extra = {"tune": {k: result.get(k) for k in ("prompts_file", "prompts", "max_new_tokens", "measured", "trace", "command")}}
    extra["tune"]["machine"] = (result.get("costs") or {}).get("machine")  # the costs and the choice hold on this kind of CPU
    extra["tune"].update(
        chosen=defaults,
        tokens_per_second=result["best"].get("tokens_per_second"),
        speedup=result["best"].get("speedup"),
        confirm=result.get("confirm"),
        unix_time=time.time(),
    )
    if result.get("batch_step_costs"):
        extra["tune"]["batch_step_costs"] = result["batch_step_costs"]
    if result.get("costs"):
        extra["tune"]["costs"] = result["costs"]  # the per-call costs adaptive k decides with (Engine.adaptive_costs)
    if result.get("calibration"):
        cal = result["calibration"]
        extra["calibration"] = {
            k: cal[k]
            for k in ("temperature", "n", "prompts", "acceptance", "ece_before", "ece_after", "ece_after_heldout", "nll_before", "nll_after", "n_bins")
        }
    previous = dict(load_manifest(target, verify_hashes=False).defaults)
    extra["previous_defaults"] = previous
    write_defaults(target, defaults, extra)
    result["wrote_manifest"] = str(Path(target) / "manifest.json")
    result["previous_defaults"] = previous

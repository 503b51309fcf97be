"""The code's shape, checked so it cannot drift back: no import circle between the product's
modules and no import up a floor (lazy imports inside functions count: a circle or an
upward arrow dodged by a late import is still one), no module of the serving wing over 600
lines, no function over 80 lines and no class over 350 (docstrings included; the bench harness and its workers too),
scripts/ under 15% of the non-test Python lines (benches live in bench/, ``specrt.bench``,
the top floor: nothing of the product imports it), ``Round`` and
``Plan`` built by keyword, a CLI that reads the server's defaults instead of retyping them,
and a batch scheduler that drives :class:`~specrt.runtime.generation.Generation` instead of
copying the decode loop's prefill, length, commit or result logic (it imports only its
allow-list, defines only its scheduling, and touches a generation through its steps), and
KV residency written once: only ``runtime/slots.py`` keeps a generation's prefix record,
trims records and releases KV or logits rows (the backends implement the release methods).

Pure source analysis (``ast``): no model is loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"specrt": ROOT / "specrt_ns", "specrt.runtime": ROOT / "runtime", "specrt.export": ROOT / "export", "specrt.bench": ROOT / "bench"}
MAX_FUNCTION, MAX_CLASS, MAX_SERVE_FILE = 80, 350, 600
# the folders of Python code that is not tests: the product, the bench harness, the one-off
# measurement scripts (which must stay a small share: a bench belongs in bench/)
CODE_FOLDERS = ("runtime", "export", "specrt_ns", "bench", "scripts")
MAX_SCRIPTS_SHARE = 0.15

# The floors, lowest first. A module imports modules of its own wing or of a lower floor,
# never of a higher floor nor of the other wing of its floor. A wing is a tuple of import
# prefixes; a module belongs to the wing of its longest matching prefix.
FLOORS = (
    (
        ("specrt.runtime.errors", "specrt.runtime.integrity", "specrt.runtime.manifest", "specrt.runtime.fileio"),
    ),  # the error tree and the export/runtime contract
    (("specrt.runtime.kernels",),),  # specrt's C kernels and their panels: numpy and ctypes only
    (("specrt.runtime.backends",),),  # model runners: they read the manifest, nothing of the loop
    (("specrt.runtime",),),  # the token path (engine, decode loop, tokenizer, chat templates, costs)
    (("specrt.runtime.lab",), ("specrt.runtime.serve",)),  # measuring and serving: two wings on the engine, neither over the other
    (("specrt.export",),),  # the export stage (it measures with lab's exactness and quality)
    (("specrt",),),  # the public API and the CLI
    (("specrt.bench",),),  # the benchmark harness: it uses the product as a user would; nothing of the product imports it
)


def _modules() -> dict[str, Path]:
    """Import name -> file of every product module (pyproject's package-dir mapping)."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """Product modules ``name`` imports anywhere in its file (``if TYPE_CHECKING`` blocks left out)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # "from .pkg import module"
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def _import_graph() -> dict[str, set[str]]:
    mods = _modules()
    # a package's __init__ importing its own submodules is not a circle with them
    return {n: {m for m in _imports(n, p, mods) if not (p.name == "__init__.py" and m.startswith(n + "."))} for n, p in mods.items()}


def test_cycle_finder_finds_a_circle():
    # the checker itself: a -> b -> c -> a is one circle, d alone none
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    graph = _import_graph()
    assert "specrt.runtime.serve.jobs" in graph["specrt.runtime.serve.batching"]  # the graph sees relative imports
    assert _cycles(graph) == []


def _place(module: str, floors=FLOORS) -> tuple[int, int]:
    """(floor, wing) of ``module``: those of its longest matching prefix."""
    hits = [(len(p), f, w) for f, wings in enumerate(floors) for w, prefixes in enumerate(wings) for p in prefixes if module == p or module.startswith(p + ".")]
    assert hits, f"{module} stands on no floor (add it to FLOORS)"
    _, f, w = max(hits)
    return f, w


def _upward(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """Every import ``a -> b`` that runs up a floor, or across to the other wing of a floor."""
    out = []
    for a, deps in graph.items():
        fa, wa = _place(a, floors)
        for b in deps:
            fb, wb = _place(b, floors)
            if fb > fa or (fb == fa and wb != wa):
                out.append(f"{a} -> {b}")
    return sorted(out)


def test_floor_finder_sees_an_upward_import():
    # the checker itself: up a floor (errors -> engine, backends -> the loop's chunks), across
    # a floor's wings (lab -> serve), the product into the bench harness (cli -> bench) are
    # arrows back up; down (serve -> core, cli -> export, bench -> cli) and within a wing
    # (serve -> serve, bench -> bench) are not
    graph = {
        "specrt.runtime.errors": {"specrt.runtime.engine"},
        "specrt.runtime.backends.ort": {"specrt.runtime.chunks", "specrt.runtime.manifest"},
        "specrt.runtime.lab.bench": {"specrt.runtime.serve.chat", "specrt.runtime.chat"},
        "specrt.runtime.serve.app": {"specrt.runtime.errors", "specrt.runtime.serve.jobs"},
        "specrt.cli": {"specrt.export.pipeline", "specrt.runtime.lab.bench", "specrt.bench.common"},
        "specrt.export.pipeline": {"specrt.runtime.lab.exactness"},
        "specrt.bench.real": {"specrt.bench.compare", "specrt.runtime.engine", "specrt.cli"},
    }
    assert _upward(graph) == [
        "specrt.cli -> specrt.bench.common",
        "specrt.runtime.backends.ort -> specrt.runtime.chunks",
        "specrt.runtime.errors -> specrt.runtime.engine",
        "specrt.runtime.lab.bench -> specrt.runtime.serve.chat",
    ]


def test_no_import_runs_up_a_floor():
    graph = _import_graph()
    assert "specrt.runtime.chat" in graph["specrt.runtime.lab.bench"]  # the graph sees imports inside functions
    assert _upward(graph) == []


def test_serving_modules_are_short():
    long = {p.name: n for p in (ROOT / "runtime" / "serve").glob("*.py") if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_SERVE_FILE}
    assert long == {}


def _sizes():
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield path.relative_to(ROOT), node, node.end_lineno - node.lineno + 1


def test_functions_and_classes_are_short():
    too_long = [
        f"{path}:{node.lineno} {node.name} ({n} lines)" for path, node, n in _sizes() if n > (MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION)
    ]
    assert too_long == []


def _long_functions(folders) -> list[str]:
    """``"path:line name (n lines)"`` of every function over :data:`MAX_FUNCTION` lines
    (docstring included: ``end_lineno - lineno + 1``) in the ``*.py`` files under ``folders``."""
    out = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_80_lines_in_runtime_export_cli_or_bench():
    # every folder, not only the modules the import map knows: the bench workers included
    assert _long_functions([ROOT / d for d in ("runtime", "export", "specrt_ns", "bench")]) == []


def _python_lines(folder: Path) -> int:
    """Lines of the ``*.py`` files under ``folder``."""
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_scripts_hold_a_small_share_of_the_code():
    # scripts/ keeps one-off measurement records; a bench that is run again belongs in bench/
    lines = {d: _python_lines(ROOT / d) for d in CODE_FOLDERS}
    share = lines["scripts"] / sum(lines.values())
    assert share < MAX_SCRIPTS_SHARE, f"scripts/ holds {share:.1%} of the non-test Python lines {lines}"


def test_round_and_plan_are_built_by_keyword():
    # thirteen positional settings are one swap away from a wrong plan
    positional = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _modules().values()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("Round", "Plan") and node.args
    ]
    assert positional == []


def test_cli_serve_retypes_no_server_default():
    # the serve command's defaults and choices come from specrt.runtime.serve.settings
    tree = ast.parse((ROOT / "specrt_ns" / "cli.py").read_text(encoding="utf-8"))
    serve = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "serve")
    literal = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.List, ast.Tuple)
    typed = [
        f"line {k.value.lineno}: {k.arg}={ast.unparse(k.value)}"
        for d in serve.decorator_list
        if isinstance(d, ast.Call)
        for k in d.keywords
        if k.arg == "default" and isinstance(k.value, literal)
    ]
    typed += [
        f"line {c.lineno}: {ast.unparse(c)}"
        for d in serve.decorator_list
        for c in ast.walk(d)
        if isinstance(c, ast.Call) and c.args and isinstance(c.args[0], (ast.List, ast.Tuple))
    ]
    assert typed == []


BATCHING = ROOT / "runtime" / "serve" / "batching.py"
JOINT = ROOT / "runtime" / "serve" / "joint.py"  # its one-call iterations on an exact batch: held to the same rules
# What the batch scheduler may import from the product, by module: the Generation it steps,
# the batched model and its slots, the step costs, the job contract and its metrics. Nothing
# of the decode loop (decode, speculative, chunks, prefix, stats, textstream, logprobs,
# sampling, constraints): a generation's rules are its own.
SCHEDULER_IMPORTS = {
    "specrt.runtime.backends": {"batched_model"},  # the batched model for the target (kernels or onnxruntime's graph)
    "specrt.runtime.costs": {"EMA", "BatchCosts", "measure_step_costs", "recorded_costs"},
    "specrt.runtime.engine": {"Engine"},
    "specrt.runtime.generation": {"Generation"},
    "specrt.runtime.serve.jobs": {"Job", "ServeError", "ServerBusy", "fail", "finish", "pool_slots", "run_prompt", "send_text"},
    "specrt.runtime.serve.joint": {"ModeChooser", "joint_round"},  # one call an iteration on an exact batch
    "specrt.runtime.serve.metrics": {"BatchMetrics"},
    "specrt.runtime.serve.settings": {"BATCH_POLICIES", "DEFAULT_BATCH_POLICY", "DEFAULT_MAX_QUEUE"},
    "specrt.runtime.slots": {"SlotPolicy", "Slots", "Waiter"},  # KV residency: the slots' own module
}
# The functions, classes and methods it defines: scheduling alone. A new one is a review
# point (the length rule once came back as a ``_length`` helper).
SCHEDULER_DEFINES = {
    *("choose_mode", "check_pool_args", "_claim", "_Row", "done", "BatchPool", "__init__", "load", "workers", "busy", "queued", "steps", "attach_metrics"),
    *("submit", "submit_all", "close", "_loop", "_in_flight", "_iterate", "_admit_waiting", "_mode", "_admit", "_run", "_round"),
    *("_batched_step", "_compact_ready", "_end", "_release", "prefix_tokens", "_fail_row", "_GraphModes"),
    *("ModeChooser", "choose", "best", "observe", "packed", "joint_round"),
}
# A generation (``gen``, ``row.gen``) is touched through its steps (called) and these reads,
# each with the attributes it may be read further by; it is never written, so a copied
# commit, rollback or length rule (which must set seq, kv, done or finish_reason, or read
# n_prompt and the plan) shows.
GENERATION_STEPS = {"reuse", "prefill", "step", "push_row", "draft_step", "verify_step", "result"}  # its record (prefix) is the slot's to keep
GENERATION_READS = {"done": set(), "seq": set(), "kv": {"target"}, "stats": {"target_calls"}, "logprobs": set(), "greedy": set(), "plain_ok": set()}
FINISH_REASONS = {"stop", "length", "constraint"}  # a generation's to decide (Generation.push)


def _is_gen(node) -> bool:
    return (isinstance(node, ast.Name) and node.id == "gen") or (isinstance(node, ast.Attribute) and node.attr == "gen")


def _through_gen(node) -> bool:
    """Whether an attribute/subscript chain passes through a generation (``r.gen.kv.target``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if _is_gen(node.value):
            return True
        node = node.value
    return False


def _docstrings(tree) -> set[int]:
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return {id(n.body[0].value) for n in nodes if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _scheduler_imports(tree, name: str = "specrt.runtime.serve.batching") -> list[str]:
    """Product imports of the scheduler outside :data:`SCHEDULER_IMPORTS`."""
    modules, base, out = _modules(), name.split(".")[:-1], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in modules:  # "from .. import decode": a module
                    out += [] if sub in SCHEDULER_IMPORTS else [f"imports {sub}"]
                elif mod in modules and a.name not in SCHEDULER_IMPORTS.get(mod, ()):
                    out.append(f"imports {mod}.{a.name}")
    return out


def _generation_use(tree) -> list[str]:
    """A generation touched outside its steps and reads, written, or aliased under another name."""
    out, calls = [], set()
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            pass  # a write: reported below
        elif isinstance(node, ast.Attribute) and _is_gen(node.value):
            if node.attr not in GENERATION_STEPS and node.attr not in GENERATION_READS:
                out.append(f"line {line}: reads gen.{node.attr}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and _is_gen(node.value.value):
            if node.attr not in GENERATION_READS.get(node.value.attr, ()):
                out.append(f"line {line}: reads gen.{node.value.attr}.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if _is_gen(node.func.value) and node.func.attr in GENERATION_STEPS:
                calls.add(node.func.attr)
            elif _through_gen(node.func.value):
                out.append(f"line {line}: calls {ast.unparse(node.func)}")
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if (_is_gen(t) and not isinstance(t, ast.Name)) or _through_gen(t):
                out.append(f"line {line}: writes {ast.unparse(t)}")
            elif isinstance(node, ast.Assign) and _is_gen(node.value) and not (isinstance(t, ast.Name) and t.id == "gen"):
                out.append(f"line {line}: names a generation {ast.unparse(t)}")
    out += [f"never calls gen.{m}" for m in sorted(GENERATION_STEPS - calls)]
    return out


def _scheduler_findings(source: str) -> list[str]:
    """Where the batch scheduler's source copies decode logic instead of stepping a
    Generation: imports outside its allow-list, definitions outside its scheduling, a
    generation touched outside its steps and reads, a finish reason named."""
    tree = ast.parse(source)
    out = _scheduler_imports(tree)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    out += [f"defines {n}" for n in sorted(defined - SCHEDULER_DEFINES)]
    out += _generation_use(tree)
    docs = _docstrings(tree)
    out += [
        f"line {n.lineno}: names the finish reason {n.value!r}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value in FINISH_REASONS and id(n) not in docs
    ]
    return out


def _scheduler_source() -> str:
    return BATCHING.read_text(encoding="utf-8") + "\n\n" + JOINT.read_text(encoding="utf-8")


def test_batch_scheduler_copies_no_decode_logic():
    findings = _scheduler_findings(_scheduler_source())
    assert findings == [], "the batch scheduler copies decode logic:\n" + "\n".join(findings)


def test_scheduler_checker_sees_copied_decode_rules():
    # the checker itself, on the scheduler with decode rules copied in: the length rule as it
    # once was (a helper reading the prompt length and the plan, deciding "length"), a KV
    # rollback written by hand, a commit, and the loop's length rule imported
    source = _scheduler_source() + (
        "\n\ndef _length(row):\n"
        '    gen = row.gen\n    return "length" if len(gen.seq) - gen.n_prompt >= gen.plan.budget or len(gen.seq) >= gen.plan.max_ctx else None\n'
        "\n\ndef _rollback(r, m):\n    r.gen.kv.target = len(r.gen.seq) - 1\n    r.gen.seq.extend([m])\n    g = r.gen\n"
        "\n\nfrom ..decode import length_finish\n"
    )
    found = _scheduler_findings(source)
    for expected in (
        "imports specrt.runtime.decode.length_finish",
        "defines _length",
        "defines _rollback",
        "reads gen.n_prompt",
        "reads gen.plan",
        "names the finish reason 'length'",
        "writes r.gen.kv.target",
        "calls r.gen.seq.extend",
        "names a generation g",
    ):
        assert any(expected in f for f in found), (expected, found)


# KV residency (runtime/slots.py): keeping a generation's record (``gen.prefix()``), cutting a
# record to a budget (``trimmed``) and handing KV or logits rows back to the OS (the Model
# protocol's optional ``release_rows``/``release_logits``, ``base.release_scratch``) are written
# in one module; the backends implement the release methods and are left out.
SLOTS = ROOT / "runtime" / "slots.py"
RESIDENCY = {"prefix", "trimmed", "release_rows", "release_logits", "release_scratch"}


def _residency(source: str) -> list[str]:
    """Where ``source`` keeps, trims or releases KV itself: a call of a :data:`RESIDENCY`
    name, or a release method's name as a string (a ``getattr`` of the optional method)."""
    tree = ast.parse(source)
    docs, out = _docstrings(tree), []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) in RESIDENCY:
            out.append(f"line {n.lineno}: calls {ast.unparse(n.func)}")
        elif isinstance(n, ast.Constant) and n.value in ("release_rows", "release_logits") and id(n) not in docs:
            out.append(f"line {n.lineno}: names {n.value!r}")
    return out


def test_kv_keep_trim_and_release_are_written_once():
    backends = ROOT / "runtime" / "backends"
    found = {
        str(path.relative_to(ROOT)): f
        for path in _modules().values()
        if path != SLOTS and backends not in path.parents and (f := _residency(path.read_text(encoding="utf-8")))
    }
    assert found == {}, "KV kept, trimmed or released outside runtime/slots.py"
    assert len(_residency(SLOTS.read_text(encoding="utf-8"))) >= 4  # the owner does all four


def test_residency_checker_sees_the_old_copies():
    # the checker itself, on the two copies the slot module replaced (the worker pool's
    # _fit_cache, the batch slots' keep and release)
    old = (
        "def _fit_cache(self, engine):\n"
        "    for model in (engine.target, engine.draft):\n        release_scratch(model, 9)\n"
        "    engine.cached = engine.cached.trimmed(self.share, 256, 256)\n"
        '    rel = getattr(engine.target, "release_rows", None)\n'
        "\n\ndef keep(self, row):\n    rec = row.gen.prefix()\n    self.batched.release_logits(self.narrow)\n"
    )
    found = _residency(old)
    for expected in (
        "calls release_scratch",
        "calls engine.cached.trimmed",
        "names 'release_rows'",
        "calls row.gen.prefix",
        "calls self.batched.release_logits",
    ):
        assert any(expected in f for f in found), (expected, found)

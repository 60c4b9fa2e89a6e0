"""The package's wings import one way: cli -> serve -> jobs/measure -> engine -> top-level leaves
(the server runs Batch API batches on the jobs wing).

Read from the source with `ast`, lazy imports inside functions included, so a new module that
reaches upward or sideways fails here rather than in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import llamabatch

PACKAGE = Path(llamabatch.__file__).parent

# What each part of the package may import from llamabatch (besides itself).
LEAVES = {"llamabatch.errors", "llamabatch.catalog", "llamabatch.durable"}
ALLOWED = {
    "llamabatch.errors": set(),
    "llamabatch.durable": set(),
    "llamabatch.catalog": {"llamabatch.errors"},
    "llamabatch.chat": LEAVES,
    "llamabatch.engine": LEAVES | {"llamabatch.chat"},
    "llamabatch.openai_format": LEAVES | {"llamabatch.engine", "llamabatch.chat"},
    "llamabatch.embeddings_format": LEAVES | {"llamabatch.engine", "llamabatch.openai_format"},
    "llamabatch.serve": LEAVES | {"llamabatch.engine", "llamabatch.chat", "llamabatch.openai_format", "llamabatch.embeddings_format", "llamabatch.jobs"},
    "llamabatch.jobs": LEAVES | {"llamabatch.engine", "llamabatch.chat", "llamabatch.openai_format", "llamabatch.embeddings_format"},
    "llamabatch.measure": LEAVES | {"llamabatch.engine"},
    "llamabatch.display": LEAVES | {"llamabatch.engine", "llamabatch.measure"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def imports_of(path: Path) -> set[str]:
    """Every llamabatch module this file imports, as absolute names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("llamabatch")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.startswith("llamabatch"):
                # `from . import display` names a module, `from .x import Name` a member of one
                found |= {f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names}
    return found


def wing(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def test_every_wing_imports_only_what_it_may():
    problems = []
    for module, imported in graph().items():
        rules = ALLOWED.get(wing(module))
        if rules is None:
            continue  # cli and the package's front door may import anything
        for target in imported:
            if wing(target) != wing(module) and wing(target) not in rules:
                problems.append(f"{module} imports {target}")
    assert not problems, "\n".join(sorted(problems))


def test_nothing_imports_the_cli():
    """But `python -m llamabatch`, the front door."""
    reaching = [m for m, imported in graph().items()
                if wing(m) not in ("llamabatch.cli", "llamabatch.__main__") and any(wing(t) == "llamabatch.cli" for t in imported)]
    assert not reaching


def test_no_import_cycles():
    edges = graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in edges.get(module, ()):
            if target not in edges:
                continue
            assert state.get(target) != "open", " -> ".join([*path, module, target])
            if target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in edges:
        if module not in state:
            visit(module, [])


def test_the_wings_are_where_the_readme_says():
    for wing_name in ("engine", "serve", "jobs", "measure"):
        init = PACKAGE / wing_name / "__init__.py"
        assert init.is_file()
        assert len(ast.get_docstring(ast.parse(init.read_text())).splitlines()) == 2


def test_every_room_of_the_engine_says_in_two_lines_what_it_holds():
    rooms = [p for p in (PACKAGE / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert {p.name for p in rooms} >= {"sampling", "memory", "speculative", "scheduling", "sizing", "native"}
    for room in rooms:
        docstring = ast.get_docstring(ast.parse((room / "__init__.py").read_text()))
        assert docstring is not None and len(docstring.splitlines()) == 2, room.name


# What only the engine's own thread may touch: the parts BatchEngine is assembled from. Outside
# engine/, code reads the engine through its public methods, the handles it is given (model,
# vocab, ctx, adapters, batch), its config and stats, and what it publishes (snapshot, facts).
ENGINE_INTERNALS = {"scheduler", "memory", "stepper", "picker", "post", "reuse", "intake", "runtime", "prompt_cache",
                    "speculator", "grammars"}
# Engine modules whose contents are the engine's business: no module outside engine/ imports them.
INTERNAL_MODULES = ("llamabatch.engine.scheduling.scheduler", "llamabatch.engine.scheduling.composer",
                    "llamabatch.engine.scheduling.slots", "llamabatch.engine.scheduling.leaders",
                    "llamabatch.engine.memory.streams", "llamabatch.engine.memory.reuse", "llamabatch.engine.stepper",
                    "llamabatch.engine.sampling.picker", "llamabatch.engine.postprocess", "llamabatch.engine.rows",
                    "llamabatch.engine.intake", "llamabatch.engine.runtime")


def reaches_into_an_engine(path: Path) -> list[str]:
    """`engine.scheduler`, `worker.engine.memory`, `engine().prompt_cache`, ...: an engine's internal
    part reached through an expression that names an engine."""
    found = []
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path.name
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
            owner = ast.unparse(node.value)
            if owner == "engine" or owner.endswith((".engine", "engine()")):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_engine_reaches_into_it():
    outside = [p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(PACKAGE / "engine")]
    reaching = [line for path in outside for line in reaches_into_an_engine(path)]
    importing = [f"{module_name(p)} imports {target}" for p in outside for target in imports_of(p) if target.startswith(INTERNAL_MODULES)]
    assert not reaching and not importing, "\n".join(reaching + importing)


def test_the_contract_test_finds_a_reach(tmp_path):
    """The check above would fail on what the server's metrics did before the snapshot."""
    scrape = tmp_path / "scrape.py"
    scrape.write_text("def kv(worker):\n    engine = worker.engine\n    return sum(s.n_past for s in engine.scheduler.running)\n"
                      "def checkpoints(worker):\n    return worker.engine.memory.checkpoints.count\n")
    assert sorted(reaches_into_an_engine(scrape)) == ["scrape.py:3: engine.scheduler", "scrape.py:5: worker.engine.memory"]


# The server's handlers and the answers they build run on the event loop, beside the engine's
# thread: they hold Tickets and Results (immutable), never a Sequence. Only the worker, which
# steps the engine on that thread, holds sequences.
LOOP_SIDE = [PACKAGE / "openai_format.py", *[p for p in (PACKAGE / "serve").rglob("*.py") if p.name != "worker.py"]]


def names_a_sequence(path: Path) -> list[str]:
    """`Sequence` imported from the engine, or a `.sequences` read (a Submission's, as it was)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and "engine" in (node.module or "") and any(a.name == "Sequence" for a in node.names):
            found.append(f"{path.name}:{node.lineno}: imports Sequence")
        elif isinstance(node, ast.Attribute) and node.attr == "sequences" and isinstance(node.ctx, ast.Load):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_on_the_event_loop_holds_a_sequence():
    found = [line for path in LOOP_SIDE for line in names_a_sequence(path)]
    assert not found, "\n".join(found)


def test_the_sequence_check_finds_what_the_handlers_did(tmp_path):
    handler = tmp_path / "handler.py"
    handler.write_text("from ..engine import BatchEngine, Sequence\n"
                       "def whole(reply):\n    return [s.text for s in reply.submission.sequences]\n")
    assert names_a_sequence(handler) == ["handler.py:1: imports Sequence", "handler.py:3: reply.submission.sequences"]

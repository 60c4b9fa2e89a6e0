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
LEAVES = {"llamabatch.errors", "llamabatch.catalog"}
ALLOWED = {
    "llamabatch.errors": set(),
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
    reaching = [m for m, imported in graph().items()
                if wing(m) != "llamabatch.cli" and any(wing(t) == "llamabatch.cli" for t in imported)]
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

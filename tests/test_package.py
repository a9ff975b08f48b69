"""Package-level promises: the layers of docs/architecture.md, checked on every module.

Each top-level package or module of cutpipe is a layer. ``LAYERS`` says which other layers it
may import and where it may import torch, and is the table in docs/architecture.md ("Layers"):
a test keeps the two equal. The imports are read with ``ast`` from every source file, at module
top and inside functions alike, so a layer cannot reach upward by importing late.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import cutpipe

ROOT = Path(cutpipe.__file__).parent
ARCHITECTURE = Path(__file__).parents[1] / "docs" / "architecture.md"

NEVER, LAZY, ANYWHERE = "never", "inside functions", "anywhere"


@dataclass(frozen=True)
class Layer:
    may_import: frozenset[str]  # other layers; a layer may always import itself
    torch: str  # NEVER, LAZY (importing the layer's modules never imports torch) or ANYWHERE


def layer(torch: str, may_import: str = "") -> Layer:
    return Layer(frozenset(may_import.split()), torch)


#: The package's layers, bottom to top ("cutpipe" is the package's own ``__init__``).
LAYERS = {
    "records": layer(NEVER),
    "files": layer(NEVER),
    "arguments": layer(NEVER),
    "spec": layer(NEVER),
    "model_config": layer(NEVER, "spec"),
    "schedule": layer(NEVER, "records files"),
    "sim": layer(NEVER, "schedule records files"),
    "formulas": layer(NEVER, "sim"),
    "viz": layer(NEVER, "schedule sim files"),
    "interop": layer(LAZY, "schedule"),
    "plan": layer(NEVER, "schedule sim spec records files"),
    "runtime": layer(ANYWHERE, "schedule sim records files"),
    "models": layer(ANYWHERE, "spec model_config"),
    "parallel": layer(ANYWHERE, "runtime models sim"),
    "launch": layer(ANYWHERE, "runtime"),
    "doctor": layer(LAZY),
    "profiling": layer(ANYWHERE, "plan models runtime spec"),
    "data": layer(LAZY, "files"),
    "train": layer(
        ANYWHERE,
        "schedule sim plan runtime models parallel profiling data spec model_config files records "
        "arguments",
    ),
    "bench": layer(LAZY, "schedule sim plan runtime models parallel launch train spec"),
    "cli": layer(
        LAZY,
        "schedule sim viz plan runtime models parallel launch doctor profiling bench data train "
        "spec model_config files records arguments",
    ),
    "__main__": layer(LAZY, "cli launch"),
    "cutpipe": layer(NEVER, "schedule sim"),
}


@dataclass(frozen=True)
class Import:
    module: str  # the module importing
    target: str  # the dotted name imported
    lazy: bool  # inside a function (or under ``if TYPE_CHECKING``): not run on import
    line: int

    def __str__(self) -> str:
        where = "inside a function" if self.lazy else "at module top"
        return f"{self.module}:{self.line} imports {self.target} {where}"


def module_name(path: Path) -> str:
    parts = ["cutpipe", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> str:
    """``cutpipe.plan.costs.model`` is in layer ``plan``; ``cutpipe`` itself in ``cutpipe``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "cutpipe"


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path) -> list[Import]:
    """Every import statement of one source file, with whether it runs when the module loads."""
    module = module_name(path)
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(module, a.name, lazy, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(child, module, path.name == "__init__.py")
                found.append(Import(module, target, lazy, child.lineno))
            deferred = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, lazy or deferred or _is_type_checking(child))

    visit(ast.parse(path.read_text()), False)
    return found


def all_imports() -> list[Import]:
    return [found for path in sorted(ROOT.rglob("*.py")) for found in imports_of(path)]


def is_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def test_every_module_is_in_a_layer():
    layers = {layer_of(module_name(path)) for path in ROOT.rglob("*.py")}
    assert layers == set(LAYERS), "add new packages to LAYERS and to docs/architecture.md"


def test_imports_point_only_to_allowed_layers():
    wrong = [
        str(found)
        for found in all_imports()
        if found.target.split(".")[0] == "cutpipe"
        and layer_of(found.target) != layer_of(found.module)
        and layer_of(found.target) not in LAYERS[layer_of(found.module)].may_import
    ]
    assert not wrong, "imports outside the layer table:\n" + "\n".join(wrong)


def test_torch_only_where_the_table_allows():
    wrong = []
    for found in all_imports():
        if not is_torch(found.target):
            continue
        rule = LAYERS[layer_of(found.module)].torch
        if rule == NEVER or (rule == LAZY and not found.lazy):
            wrong.append(f"{found} (torch: {rule})")
    assert not wrong, "\n".join(wrong)


def test_the_table_keeps_torch_out_transitively():
    """A layer that never imports torch may only import such layers, and a layer that imports
    it lazily may import at module top only layers whose modules load without it: so the
    per-statement checks above cover every chain of imports."""
    for name, rule in LAYERS.items():
        for dependency in rule.may_import:
            assert dependency in LAYERS, f"{name} may import unknown layer {dependency}"
            if rule.torch == NEVER:
                assert LAYERS[dependency].torch == NEVER, f"{name} may import {dependency}"
    wrong = [
        f"{found}, which loads torch"
        for found in all_imports()
        if LAYERS[layer_of(found.module)].torch != ANYWHERE
        and not found.lazy
        and found.target.split(".")[0] == "cutpipe"
        and LAYERS[layer_of(found.target)].torch == ANYWHERE
    ]
    assert not wrong, "\n".join(wrong)


def test_cli_and_bench_are_on_top():
    """Nothing but ``python -m cutpipe`` imports the command line; only the command line imports
    the benchmarks."""
    assert [name for name, rule in LAYERS.items() if "cli" in rule.may_import] == ["__main__"]
    assert [name for name, rule in LAYERS.items() if "bench" in rule.may_import] == ["cli"]
    for name in ("models", "runtime"):
        assert "plan" not in LAYERS[name].may_import


def _documented_layers() -> dict[str, Layer]:
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `cutpipe")]
    table = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        name = cells[0].strip("`").removeprefix("cutpipe").removeprefix(".") or "cutpipe"
        may = frozenset(re.findall(r"`([a-z_]+)`", cells[2]))
        table[name] = Layer(may, cells[3])
    return table


def test_the_doc_table_is_this_table():
    assert _documented_layers() == LAYERS


def test_no_torch_on_import():
    """Every module of every layer that keeps torch out of its module top loads without it."""
    modules = sorted(
        module_name(path)
        for path in ROOT.rglob("*.py")
        if LAYERS[layer_of(module_name(path))].torch != ANYWHERE
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, f'importing {name} imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

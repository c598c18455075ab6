"""The shape of the code base (issue 11): commands are leaves, and functions stay short enough to read."""

import ast
from pathlib import Path

import vitlab

SRC = Path(vitlab.__file__).parent
# The `python -m vitlab.<command>` modules: nothing under src/ may import them.
COMMANDS = {
    "vitlab.train",
    "vitlab.eval",
    "vitlab.predict",
    "vitlab.visualize",
    "vitlab.parity",
    "vitlab.export",
    "vitlab.pack",
    "vitlab.benchmark.__main__",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at module level or inside functions ("from vitlab import run"
    counts as vitlab.run)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_no_module_imports_a_command():
    sources = {_module_name(p): p for p in SRC.rglob("*.py")}
    assert COMMANDS <= set(sources)  # the list above is complete
    offenders = {name: sorted(_imports(path) & COMMANDS) for name, path in sources.items() if _imports(path) & COMMANDS}
    assert offenders == {}


def _code_lines(path: Path) -> int:
    """Lines of code: not blank, not a comment, not a docstring."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node) is not None:
            doc = node.body[0]
            docs |= set(range(doc.lineno, doc.end_lineno + 1))
    lines = path.read_text().splitlines()
    return sum(
        1 for i, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#") and i not in docs
    )


def test_every_command_is_a_leaf_of_at_most_80_lines_of_code():
    sizes = {name: _code_lines(SRC / (name.removeprefix("vitlab.").replace(".", "/") + ".py")) for name in COMMANDS}
    assert max(sizes.values()) <= 80, sizes


def test_no_function_over_60_lines():
    long = [
        f"{path.relative_to(SRC)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in SRC.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []


def test_reading_a_config_needs_neither_torch_nor_lightning():
    """`python -m vitlab.train --help` and config errors answer without importing them (start-up)."""
    import subprocess
    import sys

    code = (
        "import sys, vitlab.train, vitlab.eval, vitlab.predict\n"
        "print(sorted(m for m in ('torch', 'lightning', 'timm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

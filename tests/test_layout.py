"""The shape of the code base (issue 11): commands are leaves, and functions stay short enough to read."""

import ast
from pathlib import Path

import vitlab

SRC = Path(vitlab.__file__).parent
# A command is a module of vitlab/commands/; `python -m vitlab.<command>` reaches it through a forwarding module.
COMMANDS = {f"vitlab.commands.{p.stem}" for p in (SRC / "commands").glob("*.py") if p.stem != "__init__"}
FORWARDS = {p for p in SRC.rglob("*.py") if "from vitlab.commands." in p.read_text() and p.parent.name != "commands"}

# The floors of the code base, lowest first: a module imports only from its own floor or below.
FLOORS = [
    # what everything may use: errors, checked settings, atomic files, signals, per-rank state, log routing
    {
        "vitlab.errors",
        "vitlab.settings",
        "vitlab.atomic",
        "vitlab.signals",
        "vitlab.rank_state",
        "vitlab.logs",
        "vitlab.downloads",
    },
    # the components, none of them Lightning's or Hydra's: model, data, weight conversion, optimisers, figures
    {
        "vitlab.model",
        "vitlab.data",
        "vitlab.convert",
        "vitlab.optim",
        "vitlab.distill",
        "vitlab.probes",
        "vitlab.features",
        "vitlab.figures",
        "vitlab.benchmark.config",
        "vitlab.benchmark.measure",
    },
    # the assembly layer: the LightningModule, callbacks, config -> fit (run), the benchmarks built on it
    {
        "vitlab.lit_module",
        "vitlab.mae",
        "vitlab.callbacks",
        "vitlab.plugins",
        "vitlab.run",
        "vitlab.hardware",
        "vitlab.representation",
        "vitlab.resume",
        "vitlab.pretrained",
        "vitlab.feature_eval",
        "vitlab.benchmark",
    },
    # the command line: Hydra's app, the config tree, the run directory, the sweep summary, the Slurm launcher
    {"vitlab.app", "vitlab.configs", "vitlab.launch", "vitlab.sweep", "vitlab.slurm"},
    # the commands and the modules that forward `python -m vitlab.<command>` to them
    {
        "vitlab.commands",
        "vitlab.__main__",
        "vitlab.train",
        "vitlab.eval",
        "vitlab.predict",
        "vitlab.visualize",
        "vitlab.parity",
        "vitlab.export",
        "vitlab.pack",
        "vitlab.benchmark.__main__",
    },
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every vitlab module `path` imports, at module level or inside functions ("from vitlab import run"
    counts as vitlab.run, "from vitlab.data import transforms" as vitlab.data.transforms only)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = {f"{node.module}.{a.name}" for a in node.names} & set(SOURCES)
            found |= modules or {node.module}
    return {m for m in found if m in SOURCES and m != "vitlab"}


def _floor(module: str) -> int:
    """The floor of the longest prefix of `module` listed in FLOORS."""
    best = max(
        (
            (i, prefix)
            for i, floor in enumerate(FLOORS)
            for prefix in floor
            if module == prefix or module.startswith(prefix + ".")
        ),
        key=lambda t: len(t[1]),
        default=None,
    )
    assert best is not None, f"{module} is on no floor of FLOORS: add it where it belongs"
    return best[0]


def test_every_module_is_on_a_floor_and_imports_nothing_above_it():
    upward = sorted(
        f"{name} (floor {_floor(name)}) imports {imp} (floor {_floor(imp)})"
        for name, path in SOURCES.items()
        if name != "vitlab"
        for imp in _imports(path)
        if _floor(imp) > _floor(name)
    )
    assert upward == []


def test_no_import_cycles_between_modules():
    """A package importing its own modules (data/__init__.py re-exporting its datasets) is not a cycle."""
    graph = {name: {m for m in _imports(path) if not name.startswith(m + ".")} for name, path in SOURCES.items()}
    cycles, done = [], set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycles.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, stack + [node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    assert cycles == []


def test_commands_are_found_by_their_folder_and_every_python_m_name_forwards_to_one():
    assert {"vitlab.commands.train", "vitlab.commands.eval", "vitlab.commands.benchmark"} <= COMMANDS
    for path in FORWARDS:  # vitlab/train.py, vitlab/benchmark/__main__.py, vitlab/__main__.py
        assert _code_lines(path) <= 15, f"{path} does more than forward to a command"
    forwarded = {_module_name(p).removesuffix(".__main__").rpartition(".")[2] for p in FORWARDS}
    assert {c.rpartition(".")[2] for c in COMMANDS} <= forwarded  # every command keeps `python -m vitlab.<name>`


def test_no_module_imports_a_command():
    offenders = {
        name: sorted(_imports(path) & COMMANDS)
        for name, path in SOURCES.items()
        if _imports(path) & COMMANDS and path not in FORWARDS
    }
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
    sizes = {name: _code_lines(SOURCES[name]) for name in COMMANDS}
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


def test_no_file_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}

"""The shape of the code base (issues 11 and 31): the tree is the floors, commands are leaves at the top of the
package, and functions stay short enough to read."""

import ast
import pkgutil
from pathlib import Path

import vitlab

SRC = Path(vitlab.__file__).parent

# The floors of the code base, lowest first, read from the package prefixes: a module imports only from its own floor
# or below. The commands are what is left at the top: vitlab's own modules (vitlab/train.py is the train command) and
# the benchmark package's __main__.
FLOORS = [
    {"vitlab.utils"},  # what everything may use: errors, value checks, atomic files, downloads, logs, signals
    {"vitlab.model", "vitlab.data", "vitlab.convert"},  # the components, none of them Lightning's or Hydra's
    {"vitlab.training"},  # the LightningModule, objectives, optim, callbacks, checkpoint IO, the fit build
    {"vitlab.evaluation", "vitlab.benchmark"},  # frozen-feature evaluation, the benchmarks: built on training
    {"vitlab.cli"},  # the command line: entry decorator, run directory, config tree, sweep summary, Slurm launcher
]
PACKAGES = {m.name for m in pkgutil.iter_modules(vitlab.__path__) if m.ispkg}
COMMANDS = {f"vitlab.{m.name}" for m in pkgutil.iter_modules(vitlab.__path__) if not m.ispkg and m.name != "__main__"}
COMMANDS |= {f"vitlab.{p}.__main__" for p in PACKAGES if (SRC / p / "__main__.py").is_file()}
FLOORS.append(COMMANDS | {"vitlab.__main__"})


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every vitlab module `path` imports, at module level or inside functions ("from vitlab import run"
    counts as vitlab.training.run.build, "from vitlab.data import transforms" as vitlab.data.transforms only)."""
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


# vitlab.training's rooms (issue 52), lowest first; a room imports from its own or lower ones. callbacks/ and
# objectives/ share a floor and import neither each other. What is not in a sub-package (module.py, optim.py,
# checkpoint_io.py, pretrained.py) is the third floor.
TRAINING_FLOORS = [{"devices"}, {"callbacks", "objectives"}, {""}, {"run"}]


def _training_room(module: str) -> str:
    rest = module.removeprefix("vitlab.training").lstrip(".").split(".")
    return rest[0] if len(rest) > 1 or (SRC / "training" / rest[0]).is_dir() else ""


def test_training_is_rooms_by_role_and_every_arrow_points_down():
    """devices/ < callbacks/, objectives/ < the module and its recipe < run/ (each sub-package's __init__ says what
    lives there and what it may import)."""
    floor = {room: i for i, rooms in enumerate(TRAINING_FLOORS) for room in rooms}
    assert {p.name for p in (SRC / "training").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(floor) - {""}

    def wrong_way(name: str, imp: str) -> bool:
        a, b = _training_room(name), _training_room(imp)
        return floor[b] > floor[a] or (floor[b] == floor[a] == 1 and a != b)  # up, or across callbacks/objectives

    wrong = sorted(
        f"{name} imports {imp}"
        for name, path in SOURCES.items()
        if name.startswith("vitlab.training.") and _training_room(name) in floor
        for imp in _imports(path)
        if imp.startswith("vitlab.training.") and wrong_way(name, imp)
    )
    assert wrong == []
    for room in set(floor) - {""}:
        doc = ast.get_docstring(ast.parse((SRC / "training" / room / "__init__.py").read_text())) or ""
        assert len(doc) > 200 and "import" in doc, f"training/{room}/__init__.py says what lives there and may import"


def test_the_command_line_imports_no_command():
    """cli/ serves every command and knows none: a command's config and its checks live with it (issue 41: schemas.py
    imported the benchmark's config, the one arrow from cli/ to a command)."""
    found = sorted(
        f"{name} imports {imp}"
        for name, path in SOURCES.items()
        if name.startswith("vitlab.cli")
        for imp in _imports(path)
        if imp in COMMANDS or imp.startswith("vitlab.benchmark")
    )
    assert found == []


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


def test_the_top_of_the_package_is_the_commands_and_the_role_packages():
    """`python -m vitlab.<command>` runs the command's own module: no forwarders, no folder of commands."""
    assert {m.rpartition(".")[2] for m in COMMANDS} >= {"train", "eval", "predict", "visualize", "parity", "export"}
    assert PACKAGES == {"cli", "convert", "data", "evaluation", "model", "training", "utils", "benchmark"}
    for name in COMMANDS:
        assert "@entry_point(" in SOURCES[name].read_text(), f"{name} is at the top and is no command"


def test_no_two_modules_share_a_name_without_the_package_saying_why():
    """Names say what a file holds: a name appears twice only where the packages make the difference plain."""
    from collections import Counter

    stems = Counter(p.stem for p in SRC.rglob("*.py") if p.stem not in ("__init__", "__main__"))
    # model/config.py and benchmark/config.py; model/mae.py (MAE's network) and training/objectives/mae.py (its
    # objective); convert/hf.py (Hugging Face's weights) and data/hf.py (Hugging Face's datasets); model/naflex.py
    # (NaFlex's embedding, masks and pools) and data/naflex.py (its loading)
    assert {s for s, n in stems.items() if n > 1} <= {"config", "mae", "hf", "naflex"}


def test_no_module_imports_a_command():
    offenders = {
        name: sorted(_imports(path) & COMMANDS)
        for name, path in SOURCES.items()
        if _imports(path) & COMMANDS and name not in ("vitlab.__main__",)
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


# Third-party code kept verbatim (its header and license kept, excluded from ruff in pyproject.toml): its style is its
# authors'. iterative-stratification's file is vendored, not installed: the package installs a top-level `tests`.
VENDORED = {SRC / "data" / "ml_stratifiers.py"}


def test_no_function_over_60_lines():
    long = [
        f"{path.relative_to(SRC)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(set(SRC.rglob("*.py")) - VENDORED)
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


def test_the_train_command_shows_its_steps_and_calls_fit_and_test_itself():
    """python -m vitlab.train -> entry_point's main (Hydra composes, the run directory is claimed) -> its guard ->
    train(cfg) -> trainer.fit: the command's own function builds each part and calls fit and test (issue 31)."""
    tree = ast.parse((SRC / "train.py").read_text())
    (train,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
    called = {
        f"{ast.unparse(c.func.value)}.{c.func.attr}"
        for c in ast.walk(train)
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
    }
    steps = ["fit_datamodule", "build_module", "build_callbacks", "build_trainer"]
    assert {f"build.{s}" for s in steps} | {"loggers.build_loggers", "trainer.fit", "trainer.test"} <= called


def test_the_module_never_branches_on_which_objective_it_trains():
    """ViTModule calls its objective for the loss, metrics and extra networks: no objective's name or class appears in
    it beyond the table that maps `objective.name` to the class."""
    text = (SRC / "training" / "module.py").read_text()
    body = text[text.index("class ViTModule") :]
    assert not [w for w in ("Classification", "Distillation", "MAE", '"mae"', '"classify"', '"distill"') if w in body]


# The model's two doors that read a ViTConfig: the ViT itself (vit.py, with its timm-API mixin) and MAE's decoder
# (mae.py, built around the encoder's config and its own MAEConfig). Every other layer takes what it uses.
CONFIG_READERS = {("model/vit.py", "ViT"), ("model/mae.py", "MAEDecoder")}
# Files of the model that read a config by their job: the config and its checks, the cost model, weight init (the
# whole model's schemes), timm's model API, MAE's functions around the encoder, and the package's door (__init__).
CONFIG_FILES = {
    "__init__.py",
    "config.py",
    "config_checks.py",
    "rope_config.py",
    "naflex_config.py",
    "cost.py",
    "init.py",
    "timm_api.py",
    "vit.py",
    "mae.py",
}


def _takes_a_config(fn: ast.FunctionDef) -> bool:
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
    return any(
        p.arg == "cfg" or (p.annotation is not None and "ViTConfig" in ast.unparse(p.annotation)) for p in params
    )


def test_layers_take_what_they_use_not_the_model_config():
    """Issue 73 point 5: a layer of model/ is built from explicit arguments (dim, num_heads, norm_layer, ...), as
    timm's and dinov2's are, so each can be built and tested alone; ViTConfig is read by vit.py (and MAE's decoder).
    No class's constructor outside those takes a `cfg` or a ViTConfig, and outside the files that read a config by
    their job no function does."""
    slips = []
    for path in sorted((SRC / "model").glob("*.py")):
        rel = str(path.relative_to(SRC))
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            inits = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
            if (rel, cls.name) not in CONFIG_READERS and any(_takes_a_config(f) for f in inits):
                slips.append(f"{rel}:{cls.name}.__init__")
        if path.name not in CONFIG_FILES:
            tree = ast.parse(path.read_text())
            fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name != "__init__"]
            slips += [f"{rel}:{f.name}" for f in fns if _takes_a_config(f)]
            imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "vitlab.model.config"]
            slips += [f"{rel} imports ViTConfig" for n in imports if any(a.name == "ViTConfig" for a in n.names)]
    assert slips == []


# NaFlex's rooms (issue 73): the model's own (model/), its loading (data/naflex*.py) and its timm conversion. Outside
# them a NaFlex batch, schedule or model answers for itself (NaFlexBatch, the size schedule's methods); nothing asks.
NAFLEX_ROOMS = ("model/", "data/naflex", "convert/timm_naflex")
NAFLEX_WORDS = ("naflex", "seq_lens", "loss_scale")
# The branch the fit's assembly holds until the run's plan takes data.naflex's decision (issue 73, point 1).
NAFLEX_PENDING: set[str] = set()


def _naflex_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """Each `if`/`while`/`assert`/conditional expression/comprehension filter whose test names NaFlex, and each
    isinstance/hasattr, or comparison of a class's name (a type test by name), that names it."""

    def names_naflex(node: ast.AST) -> bool:
        words = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
        words += [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)]
        words += [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        return any(w in word.lower() for word in words for w in NAFLEX_WORDS)

    found = []
    for node in ast.walk(tree):
        tests = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = node.ifs
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "hasattr")
        ):
            tests = [node]
        elif isinstance(node, ast.Compare) and any(
            isinstance(n, ast.Attribute) and n.attr == "__name__" for n in ast.walk(node)
        ):
            tests = [node]  # a type test by the class's name
        found += [(t.lineno, ast.unparse(t)) for t in tests if names_naflex(t)]
    return found


def test_no_naflex_branch_outside_its_rooms():
    """No code outside NaFlex's rooms asks whether a batch, a schedule or a model is NaFlex's (issue 73, point 3)."""
    found = [
        f"{rel}:{line}: {text}"
        for path in sorted(SRC.rglob("*.py"))
        if not (rel := str(path.relative_to(SRC))).startswith(NAFLEX_ROOMS) and rel not in NAFLEX_PENDING
        for line, text in _naflex_branches(ast.parse(path.read_text()))
    ]
    assert found == []


OBJECTIVE_NAMES = {"classify", "distill", "mae", "dino"}  # training.module.OBJECTIVES' keys
# Comparisons with an objective's name that issue 73's other steps take out of these files (the size schedules'
# objective checks and the data module's views): each entry goes when its file no longer has one.
OBJECTIVE_NAMES_DUE: set[str] = set()


def _an_objectives_name(node: ast.expr) -> bool:
    """A string constant naming an objective, or a tuple, list or set holding one."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_an_objectives_name(e) for e in node.elts)
    return isinstance(node, ast.Constant) and node.value in OBJECTIVE_NAMES


def test_no_branch_on_an_objectives_name_outside_its_room():
    """What a command needs of an objective (the views it trains on, whether it reads labels, the metric that picks
    its checkpoint) is its class's, read through training.module.OBJECTIVES: outside training/objectives/ and that
    table nothing named objective or name is compared with an objective's name (`objective == "mae"`)."""
    offenders = []
    for name, path in SOURCES.items():
        where = str(path.relative_to(SRC))
        if name.startswith("vitlab.training.objectives") or name == "vitlab.training.module":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            named = [o for o in operands if _an_objectives_name(o)]
            others = [ast.unparse(o) for o in operands if not _an_objectives_name(o)]
            if named and any("objective" in o or "name" in o for o in others):
                offenders.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert [o for o in offenders if o.partition(":")[0] not in OBJECTIVE_NAMES_DUE] == []


# Where a command's config may travel (STYLE rule 13): the commands and cli/ make it into their plan; below them each
# builder takes its part. Every package below cli/ holds to it (benchmark/__main__.py is a command).
PLANNED = ("benchmark", "convert", "data", "evaluation", "model", "training", "utils")


def _config_takers_and_writers(path: Path) -> list[str]:
    """The functions of `path` that take a DictConfig (or an unannotated parameter named *cfg), and its open_dict
    calls (a write into a config)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for a in args:
                annotation = ast.unparse(a.annotation) if a.annotation else ""
                if "DictConfig" in annotation or (a.arg.endswith("cfg") and not annotation):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}({a.arg})")
        elif isinstance(node, ast.Call) and "open_dict" in ast.unparse(node.func):
            found.append(f"{path.relative_to(SRC)}:{node.lineno} open_dict")
    return found


def test_below_the_plan_no_function_takes_a_config_or_writes_into_one():
    paths = [p for name in PLANNED for p in (SRC / name).rglob("*.py") if p != SRC / "benchmark" / "__main__.py"]
    assert paths
    assert [hit for path in paths for hit in _config_takers_and_writers(path)] == []

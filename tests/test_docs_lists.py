"""The lists the docs give, held to what they list: `vitlab.create_model`'s options to ViTConfig's fields and the
names each accepts, its component tables to the files that hold them; the Configs page to the groups, options and
top-level keys of `conf/`; the layout's objectives to `conf/objective/` and `training/objectives/`; an extra named
in an install command to pyproject.toml's. A field, config file or module added without its line here fails."""

import ast
import dataclasses
import importlib.util
import re
import types

import yaml

from tests.helpers.commands import ROOT
from vitlab.model import config, rope_config
from vitlab.model.config import ViTConfig

DOCS = ROOT / "docs"
CONF = ROOT / "conf"
CREATE_MODEL = (DOCS / "models" / "create-model.md").read_text()
CONFIGS = (DOCS / "training" / "configs.md").read_text()
LAYOUT = (DOCS / "reference" / "layout.md").read_text()

# a ViTConfig field -> the names config.py lets it take
CHOICES = {
    "act_layer": config.ACT_LAYERS,
    "norm_layer": config.NORM_LAYERS,
    "mlp_layer": config.MLP_LAYERS,
    "attn_layer": config.ATTN_LAYERS,
    "block_fn": config.BLOCK_FNS,
    "pos_embed": config.POS_EMBEDS,
    "pos_embed_resample": config.POS_EMBED_RESAMPLE,
    "weight_init": config.WEIGHT_INITS,
    "global_pool": config.GLOBAL_POOLS,
    "rope": rope_config.ROPES,
    "rope_grid_indexing": rope_config.ROPE_GRID_INDEXING,
    "rope_normalize_coords": rope_config.ROPE_NORMALIZE_COORDS,
}


def code(name: str) -> str:
    return f"`{name}`" if name else "`''`"


def option_bullets() -> list[str]:
    """create-model.md's "Options": a bullet each topic, its wrapped lines joined."""
    section = CREATE_MODEL.split("## Options", 1)[1]
    return [" ".join(b.split()) for b in re.split(r"\n- ", section)[1:]]


def test_create_model_lists_every_vitconfig_field_and_each_name_it_takes():
    bullets = option_bullets()
    fields = [f.name for f in dataclasses.fields(ViTConfig) if f.init]
    missing = [name for name in fields if not any(code(name) in b for b in bullets)]
    assert not missing, f"create-model.md's options lack {missing}"
    for name, allowed in CHOICES.items():
        (bullet,) = [b for b in bullets if code(name) in b]
        after = bullet.split(code(name), 1)[1]
        assert not [v for v in allowed if code(v) not in after], f"{name}: create-model.md lacks some of {allowed}"


def component_tables(path) -> set[str]:
    """The module-level tables of a model/ file: UPPER_CASE names bound to a dict."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id.isupper() and isinstance(node.value, ast.Dict):
            found.add(target.id)
    return found


def test_create_model_puts_each_component_table_in_its_file():
    """Every table of model/ that builds components (config.py's VARIANTS is sizes) is named beside its file, as
    "`model/layers.py` (`ACTIVATIONS`, ...)", and no file is said to hold a table it does not."""
    model = ROOT / "src" / "vitlab" / "model"
    held = {
        p.name: tables for p in sorted(model.glob("*.py")) if p.name != "config.py" and (tables := component_tables(p))
    }
    said = {
        file: set(re.findall(r"`(\w+)`", names))
        for file, names in re.findall(r"`model/(\w+\.py)` \(([^)]*)\)", " ".join(CREATE_MODEL.split()))
    }
    assert said == held


def configs_rows() -> dict[str, str]:
    """configs.md's table: group -> what its row says (a row each: a merge can leave two)."""
    rows = re.findall(r"^\| `([\w/]+)` \| (.*) \|$", CONFIGS, re.M)
    assert len({group for group, _ in rows}) == len(rows), [group for group, _ in rows]
    return dict(rows)


def test_the_configs_page_lists_every_group_and_option():
    rows = configs_rows()
    zoo = (DOCS / "models" / "zoo.md").read_text()  # the model row points to the zoo
    missing = []
    for folder in sorted({p.parent for p in CONF.rglob("*.yaml") if p.parent != CONF}):
        group = folder.relative_to(CONF).as_posix()
        top = group.split("/")[0]
        if top not in rows:
            missing.append(f"group {top}")
            continue
        for option in sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("_")):
            said = f"{group}={option}" if "/" in group else option
            if f"`{said}`" not in (zoo if top == "model" else rows[top]):
                missing.append(f"{group}={option}")
    assert not missing, f"docs/training/configs.md lacks {missing}"


def test_the_configs_page_names_every_top_level_key_of_train_yaml():
    keys = set(yaml.safe_load((CONF / "train.yaml").read_text())) - {"defaults", "model"}  # model: the wiring
    said = " ".join(CONFIGS.split("Top-level keys:", 1)[1].split("\n\n", 1)[0].split())
    assert not [k for k in sorted(keys) if f"`{k}`" not in said], said


def test_the_layout_names_every_objective():
    line = next(line for line in LAYOUT.splitlines() if "conf/objective/:" in line)
    named = set(re.findall(r"\w+", line.split("conf/objective/:", 1)[1]))
    assert {p.stem for p in (CONF / "objective").glob("*.yaml")} <= named, line
    modules = {p.name for p in (ROOT / "src" / "vitlab" / "training" / "objectives").glob("*.py")} - {"__init__.py"}
    assert not [m for m in sorted(modules) if m not in LAYOUT], "docs/reference/layout.md: objectives/"


def test_every_extra_an_install_command_names_exists():
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, re.M))  # (tomllib is Python 3.11's; we support 3.10)
    assert "dev" in extras, extras
    pages = [ROOT / "README.md", *DOCS.rglob("*.md"), *CONF.rglob("*.yaml"), *ROOT.glob("experiments/*/README.md")]
    named = {
        (page.relative_to(ROOT).as_posix(), extra)
        for page in pages
        for group in re.findall(r"pip install [^\n]*?(?:vitlab|\.)\[([\w,-]+)\]", page.read_text())
        for extra in group.split(",")
    }
    assert not [(page, extra) for page, extra in sorted(named) if extra not in extras], extras


def headings(text: str):
    """The Markdown headings of a page, fenced code left out (a `# comment` there is not one)."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            yield line


def test_no_heading_is_a_bare_issue_number():
    """A reader of the site has no issue tracker: titles say what a section holds, not which issue asked for it."""
    pages = [*DOCS.rglob("*.md"), *ROOT.glob("experiments/*/README.md")]
    bare = [
        f"{p.relative_to(ROOT)}: {h}"
        for p in pages
        for h in headings(p.read_text())
        if re.search(r"(?i)\bissues? \d", h)
    ]
    assert not bare, "\n".join(bare)


def test_the_gpu_script_is_not_among_the_studies():
    """docs/hooks.py fills the nav's "Studies" with every experiments/*/README.md that mkdocs.yml does not place."""
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    nav = hooks.on_config(types.SimpleNamespace(nav=yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])).nav

    def section(entries, title):
        for entry in entries:
            for name, inner in entry.items() if isinstance(entry, dict) else ():
                if name == title:
                    return inner
                if isinstance(inner, list) and (found := section(inner, title)) is not None:
                    return found

    studies = section(nav, "Studies")
    assert "experiments/gpu/README.md" not in studies and len(studies) >= 10, studies
    assert "experiments/gpu/README.md" in hooks._nav_pages(nav)  # placed elsewhere, not dropped


def test_getting_started_names_the_python_and_torch_it_installs():
    page = (DOCS / "getting-started.md").read_text()
    python = re.search(r'requires-python = ">=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    torch = re.search(r"TORCH\s+\?= torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert f"Python {python} or newer" in page and f"torch {torch}" in page, (python, torch)

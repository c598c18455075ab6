"""MkDocs hooks (mkdocs.yml: hooks): the pages generated at build time, so that they cannot drift from what they
describe.

- `reference/config.md`, from `conf/`: every command's config file, then every group, its options (each file's
  leading comment, its example commands as code) and each option's file as it is, the group's `_base` (the
  defaults its options extend) first.
- `experiments/<study>/...`, read where they are: each study's README.md (its table) and the files it links (plots,
  `timm_zoo.md`), one nav entry per study under "Benchmarks and experiments", "Studies" (but for a README that
  mkdocs.yml's nav places itself: experiments/gpu/, the script a lent GPU runs, is not a study).
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
EXPERIMENTS = ROOT / "experiments"
NAV_SECTION = "Studies"  # under "Benchmarks and experiments"
PULLED = {".md", ".png", ".svg", ".jpg"}  # what an experiment's page shows or links


def studies() -> list[Path]:
    return sorted(p.parent for p in EXPERIMENTS.glob("*/README.md"))


def _nav_pages(entries) -> set[str]:
    """Every page mkdocs.yml's nav names."""
    pages = set()
    for entry in entries:
        for inner in entry.values() if isinstance(entry, dict) else [entry]:
            pages |= _nav_pages(inner) if isinstance(inner, list) else {inner}
    return pages


def on_config(config):
    placed = _nav_pages(config.nav or [])  # a study page mkdocs.yml puts elsewhere (the GPU script) stays there

    def fill(entries):
        for entry in entries:
            for title, inner in entry.items() if isinstance(entry, dict) else ():
                if title == NAV_SECTION:
                    inner += [page for s in studies() if (page := f"experiments/{s.name}/README.md") not in placed]
                elif isinstance(inner, list):
                    fill(inner)

    fill(config.nav or [])
    return config


def on_files(files: Files, config) -> Files:
    for study in studies():
        for path in sorted(study.rglob("*")):
            if path.is_file() and path.suffix in PULLED:
                uri = path.relative_to(ROOT).as_posix()
                # a study's own page is in the nav; what it links (timm_zoo.md) is reached from it
                # (a README.md deeper in the study, as experiments/gpu/reference/'s, is linked from it, not listed)
                own = path == study / "README.md"
                level = InclusionLevel.UNDEFINED if own else InclusionLevel.NOT_IN_NAV
                files.append(File.generated(config, uri, abs_src_path=str(path), inclusion=level))
    files.append(File.generated(config, "reference/config.md", content=config_reference()))
    return files


# --- the config reference ---------------------------------------------------------------------------------------


ESCAPED = {"<": "&lt;", ">": "&gt;", "[": "&#91;", "]": "&#93;", "|": "&#124;", "*": "&#42;", "_": "&#95;"}


def _escape(text: str) -> str:
    """As HTML entities where Markdown would read markup (`<name>`, `[...]`, `|` in a table, `_` and `*`)."""
    return "".join(ESCAPED.get(c, c) for c in text)


def _example(line: str) -> str:
    """An indented example line of a leading comment (`#   python -m ...   # what it does`): the command as code, what
    follows it after two spaces or more as words."""
    command, note = (re.split(r"\s{2,}", line.strip(), maxsplit=1) + [""])[:2]
    note = note.removeprefix("#").strip()
    if note.startswith("(") and note.endswith(")"):
        note = note[1:-1]
    return f"<code>{_escape(command)}</code>" + (f" ({_escape(note)})" if note else "")


def _description(text: str) -> str:
    """A file's leading comment (Hydra's `# @package` left out), to its first blank comment line: what the option
    is, in a table cell. Its indented example lines (the commands a sentence ending in ':' introduces) are kept, as
    code, so that no note ends on a dangling ':'; a `\\`-continued example is one command."""
    parts: list[str] = []
    examples: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#") or (line.strip() == "#" and parts):
            break
        words = line[1:].strip()
        if line.startswith("# @package") or not words:
            continue
        if line.startswith("#   ") and examples and examples[-1].endswith("\\"):
            examples[-1] = examples[-1][:-1].rstrip() + " " + words  # the continued line
        elif line.startswith("#   "):
            examples.append(words)
        else:
            if examples:
                parts.append("; ".join(map(_example, examples)) + ".")
                examples = []
            parts.append(_escape(words))
    if examples:
        parts.append("; ".join(map(_example, examples)))
    return " ".join(parts)


def _train_defaults() -> dict[str, str]:
    """The option each group of `python -m vitlab.train` starts from (conf/train.yaml's defaults list)."""
    chosen = {}
    for line in (CONF / "train.yaml").read_text().split("defaults:", 1)[1].splitlines()[1:]:
        m = re.match(r"\s+- (?:optional )?([\w/]+): *([\w.]+)", line)
        if not line.startswith(" "):
            break
        if m:
            chosen[m.group(1)] = m.group(2)
    return chosen


def _yaml_block(path: Path) -> list[str]:
    title = f'```yaml title="conf/{path.relative_to(CONF).as_posix()}"'
    return [title, *path.read_text().rstrip().splitlines(), "```", ""]


def config_reference() -> str:
    out = [
        "# The config tree (`conf/`)",
        "",
        "Generated from `conf/` when the site is built: every command's config, every group, its options and",
        "their defaults, as the files hold them. A group is chosen with `group=option` (`model=vit_b16`), a key set",
        "with `group.key=value` (`model.depth=6`); see [Configs](../training/configs.md) for how they combine.",
        "",
        "## Commands",
        "",
        "Each `python -m vitlab.<command>` reads `conf/<command>.yaml`: its groups (`defaults`) and its own keys.",
        "",
    ]
    for path in sorted(CONF.glob("*.yaml")):
        out += [f"### `vitlab.{path.stem}` {{#command-{path.stem}}}", ""]
        out += _yaml_block(path)
    chosen = _train_defaults()
    groups = sorted({p.parent for p in CONF.rglob("*.yaml") if p.parent != CONF and p.parent.name != "local"})
    out += ["## Groups", ""]
    for group in groups:
        name = group.relative_to(CONF).as_posix()
        files = sorted(group.glob("*.yaml"), key=lambda p: (not p.stem.startswith("_"), p.stem))
        default = chosen.get(name)
        out += [f"### `{name}` {{#{name.replace('/', '-')}}}", ""]
        out += [f"`vitlab.train` starts from `{name}={default}`." if default else "No option unless one is chosen.", ""]
        out += ["| option | what it is |", "|---|---|"]
        for f in files:
            label = f"`{f.stem}` (what the options extend)" if f.stem.startswith("_") else f"`{name}={f.stem}`"
            out.append(f"| {label} | {_description(f.read_text())} |")
        out.append("")
        for f in files:
            out += [f'??? note "`{name}/{f.stem}.yaml`"', ""]
            out += ["    " + line if line else "" for line in _yaml_block(f)]
    out += [
        "### `local`",
        "",
        "Your git-ignored `conf/local/default.yaml` (cluster paths, a Slurm partition), read when present; see",
        "[Scaling out](../scaling-out.md#slurm).",
        "",
    ]
    return "\n".join(out)

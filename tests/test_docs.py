"""The documentation site (mkdocs.yml, docs/): it builds with --strict (a broken link or anchor, a missing page, a
reference mkdocstrings cannot resolve fails), its generated pages cover what they must, and every command it shows
parses against the config tree as typed (tests/helpers.py: documented_commands, the one list of them)."""

import os
import re
import subprocess
import sys

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType

from tests.helpers import DOC_PAGES, ROOT, documented_commands, run_cli

COMMANDS = documented_commands()
CONF = ROOT / "conf"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-5000:]
    return out


def test_the_site_builds_with_strict(site):
    assert (site / "index.html").is_file() and (site / "search" / "search_index.json").is_file()


def test_the_config_reference_has_every_group_and_option(site):
    page = (site / "reference" / "config" / "index.html").read_text()
    for path in CONF.rglob("*.yaml"):
        if path.parent.name != "local":
            assert f"conf/{path.relative_to(CONF).as_posix()}" in page, path


def test_every_study_is_a_page_with_its_plots(site):
    for readme in ROOT.glob("experiments/*/README.md"):
        study = readme.parent
        assert (site / "experiments" / study.name / "index.html").is_file(), study.name
        for png in study.rglob("*.png"):
            assert (site / png.relative_to(ROOT)).is_file(), png


@pytest.mark.parametrize(
    "page, names",
    [
        ("model", ["create_model", "ViT", "ViTConfig"]),
        ("objectives", ["Objective", "Classification", "Distillation", "MAE", "DINO"]),
        (
            "data",
            [
                "DigitsDataModule",
                "CIFAR10DataModule",
                "CIFAR100DataModule",
                "ImageFolderDataModule",
                "StreamingDataModule",
                "FakeDataModule",
            ],
        ),
        ("evaluation", ["tasks", "probe", "knn_accuracy", "linear_grid", "fewshot_accuracy"]),
    ],
)
def test_the_api_reference_covers(site, page, names):
    """Each object has its own heading (mkdocstrings' anchor: its full path), so it shows with its docstring."""
    html = (site / "reference" / "api" / page / "index.html").read_text()
    for name in names:
        assert re.search(rf'id="(vitlab\.[\w.]*\.)?{re.escape(name)}"', html), name


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    assert DOC_PAGES[0] == ROOT / "README.md" and any(where.startswith("README.md:") for where, _, _ in COMMANDS)


def one_job(args: list[str]) -> list[str]:
    """A sweep's command as its first job: without -m/--multirun, each swept key at its first value (Hydra takes
    --cfg or -m, not both)."""
    if not {"-m", "--multirun"} & set(args):
        return args
    args = [a for a in args if a not in ("-m", "--multirun")]
    parsed = OverridesParser.create().parse_overrides(args)
    job = []
    for text, override in zip(args, parsed, strict=True):
        if override.is_sweep_override():
            key = text.split("=", 1)[0]
            if override.value_type == ValueType.INTERVAL_SWEEP:
                first = str(override.value().start)
            else:
                first = next(iter(override.sweep_string_iterator()))
            text = f"{key}={first}"
        job.append(text)
    return job


def jobs() -> dict[tuple[str, tuple[str, ...]], list[str]]:
    """Each distinct command line to check (the README's also in docs/, placeholders alike), and where it is shown."""
    seen: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for where, command, args in COMMANDS:
        seen.setdefault((command, tuple(one_job(args))), []).append(where)
    return seen


JOBS = jobs()


@pytest.mark.parametrize("command, args", list(JOBS), ids=[wheres[0] for wheres in JOBS.values()])
def test_every_documented_command_parses_against_the_config_tree(command, args):
    """`python -m vitlab.<command> <args> --cfg job` composes without running: every group option and key exists
    (a placeholder such as <ckpt> stands for a value)."""
    r = run_cli(command, *args, "--cfg", "job")
    shown = ", ".join(JOBS[command, args])
    assert r.returncode == 0, f"{shown}: python -m vitlab.{command} {' '.join(args)}\n{r.stderr[-2000:]}"

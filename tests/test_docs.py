"""The documentation site (mkdocs.yml, docs/): it builds with --strict (a broken link or anchor, a missing page, a
reference mkdocstrings cannot resolve fails), its generated pages cover what they must, and every command it shows
parses against the config tree as typed (tests/helpers/docs.py: documented_commands, the one list of them), composed
as `--cfg job` composes it. Where a Chromium is installed, the built site is read in it as a reader reads it: no code
block cut off at 1280 px, the search box's first result the page a query means (tests/test_docs_lists.py holds the
lists the pages give to what they list)."""

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType

from tests.helpers.commands import ROOT
from tests.helpers.docs import DOC_PAGES, documented_commands
from vitlab.cli.config_tree import config_dir, register_resolvers

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
        ("evaluation", ["tasks", "run_probe", "knn_accuracy", "linear_grid", "fewshot_accuracy"]),
    ],
)
def test_the_api_reference_covers(site, page, names):
    """Each object has its own heading (mkdocstrings' anchor: its full path), so it shows with its docstring."""
    html = (site / "reference" / "api" / page / "index.html").read_text()
    for name in names:
        assert re.search(rf'id="(vitlab\.[\w.]*\.)?{re.escape(name)}"', html), name


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html)).strip()


def test_every_entry_of_the_api_reference_says_what_it_is(site):
    """Each object on the Python API pages (a class, function, field, table) has a description under its heading:
    a config dataclass's fields theirs from the comment beside or above them (docs/griffe_comments.py), a method or
    property its docstring."""
    bare = []
    for page in sorted((site / "reference" / "api").glob("*/index.html")):
        for entry in page.read_text().split('<div class="doc doc-object')[1:]:  # up to the next (a member) or the end
            heading = re.search(r'<h\d id="([^"]+)"', entry)
            contents = entry.partition('class="doc doc-contents')[2].partition(">")[2]
            if heading and not _text(contents):
                bare.append(f"{page.parent.name}: {heading.group(1)}")
    assert not bare, "no description: " + ", ".join(bare)


def test_every_option_of_the_config_reference_has_a_note_that_ends(site):
    """A group's table gives each option its file's leading comment, examples included: none is empty, none ends on
    the ':' that introduced the commands it left out."""
    page = (site / "reference" / "config" / "index.html").read_text()
    rows = re.findall(r"<tr>\s*<td>(.*?)</td>\s*<td>(.*?)</td>\s*</tr>", page, re.S)
    assert len(rows) > 70, len(rows)  # every option of every group (79 on 2026-11-28)
    unfinished = [f"{_text(option)}: {_text(note)[-60:]!r}" for option, note in rows if _text(note)[-1:] in ("", ":")]
    assert not unfinished, "\n".join(unfinished)


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


def jobs(mine: bool = False) -> dict[tuple[str, tuple[str, ...]], list[str]]:
    """Each distinct command line to check (the README's also in docs/, placeholders alike), and where it is shown;
    `mine`: those with a user's --config-dir (docs/training/your-configs.md), the others without."""
    seen: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for where, command, args in COMMANDS:
        if ("--config-dir" in args) == mine:
            seen.setdefault((command, tuple(one_job(args))), []).append(where)
    return seen


JOBS, JOBS_MINE = jobs(), jobs(mine=True)
# A file the docs show for my_configs/, whole as a user copies it: its path in a comment on its first line (or on the
# second, under an experiment's `# @package _global_`, which Hydra reads on the first line only: issue 74, point 10).
MY_FILE = re.compile(r"```yaml\n((?:# @package _global_\n)?# (my_configs/[\w/.-]+\.yaml)[^\n]*\n.*?)```", re.DOTALL)


@pytest.fixture(scope="module")
def compose_as_typed():
    """Hydra's compose over conf/, as `python -m vitlab.<command> ... --cfg job` composes before it prints: the
    same config tree and resolvers, in this process (a tenth of a second a command, not the half second of a
    command started for each)."""
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        yield lambda command, args: compose(command, overrides=list(args), return_hydra_config=True)
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("command, args", list(JOBS), ids=[wheres[0] for wheres in JOBS.values()])
def test_every_documented_command_parses_against_the_config_tree(compose_as_typed, command, args):
    """Every group option and key of the command exists (a placeholder such as <ckpt> stands for a value)."""
    try:
        compose_as_typed(command, args)
    except Exception as e:
        shown = ", ".join(JOBS[command, args])
        pytest.fail(f"{shown}: python -m vitlab.{command} {' '.join(args)}: {type(e).__name__}: {e}")


@pytest.mark.parametrize("command, args", list(JOBS_MINE), ids=[wheres[0] for wheres in JOBS_MINE.values()])
def test_every_documented_command_with_a_users_tree_parses(tmp_path, command, args):
    """The commands with `--config-dir my_configs`, composed over the files the docs show for that folder (each
    ```yaml block that begins `# my_configs/<file>`), as the command composes them."""
    from vitlab.cli.config_tree import read_user_config_dir, without_config_dir

    shown = [m.groups() for page in DOC_PAGES for m in MY_FILE.finditer(page.read_text())]
    assert shown, "no page shows the files of my_configs/"
    for text, name in shown:  # (verbatim: the block's first line too)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    register_resolvers()
    read_user_config_dir(["--config-dir", str(tmp_path / args[args.index("--config-dir") + 1])])
    backup = get_gh_backup()  # (compose_as_typed's Hydra, kept for the tests after this one)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            compose(command, overrides=without_config_dir(list(args)), return_hydra_config=True)
    finally:
        read_user_config_dir([])
        restore_gh_from_backup(backup)


def test_a_documented_command_prints_its_config_with_cfg_job():
    """The same check through the command line itself, once: what the docs promise a reader can do."""
    (command, args), _ = next(iter(JOBS.items()))
    argv = [sys.executable, "-m", f"vitlab.{command}", *args, "--cfg", "job"]  # started bare: no torch to import
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "model:" in r.stdout, r.stderr[-2000:]


# --- the site read in a browser ---------------------------------------------------------------------------------

# Every code block on every page, the collapsed ones (the config reference's files) opened: its width and the width
# it is shown in, and the text material's copy button takes (innerText while it marks the block data-md-copying).
CODE_BLOCKS_JS = """() => {
  document.querySelectorAll('details').forEach(d => d.open = true);
  return [...document.querySelectorAll('.md-typeset pre > code')].map(code => {
    const shown = [code.scrollWidth, code.clientWidth];
    code.setAttribute('data-md-copying', '');
    const copied = code.innerText;
    code.removeAttribute('data-md-copying');
    return {shown, copied, text: code.textContent};
  });
}"""


@pytest.fixture(scope="module")
def chromium():
    """Debian's Chromium (`apt-get install chromium`) driven by Playwright (the dev extra); Playwright's own browser
    builds are never downloaded. Skipped, with the reason, where either is missing."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[dev]')")
    exe = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
    if exe is None:
        pytest.skip("no Chromium to render the site in (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe)
        yield browser
        browser.close()


def test_no_code_block_is_cut_off_at_1280_px(site, chromium):
    """At 1280 px (a laptop), every code block shows all its columns: long lines wrap (stylesheets/extra.css)
    instead of hiding past the block's right edge behind a scroll bar; and the copy button still copies each line
    once, as written."""
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    page.route("**/*.js", lambda route: route.abort())  # widths are the stylesheets' (material's scripts: 40% longer)
    cut, copied_wrong, blocks = [], [], 0
    for html in sorted(site.rglob("*.html")):
        if html.name == "404.html":
            continue
        page.goto(html.as_uri())
        for i, block in enumerate(page.evaluate(CODE_BLOCKS_JS)):
            blocks += 1
            where = f"{html.relative_to(site).parent.as_posix()} block {i}: {block['text'][:60]!r}"
            scroll, shown = block["shown"]
            if scroll > shown:
                cut.append(f"{where} ({scroll} px in {shown})")
            if block["copied"].rstrip() != block["text"].rstrip():
                copied_wrong.append(where)
    page.close()
    assert blocks > 300, blocks  # the pages were read (388 blocks on 2026-11-28)
    assert not cut, "\n".join(cut)
    assert not copied_wrong, "\n".join(copied_wrong)


# What a reader types into the search box -> the page that must come first (issue 64: "make train" did not find
# Getting started in 12 results, "resume training" Reliability in 6; "install" ranked the GPU script's page first).
SEARCHES = {
    "make train": "getting-started/",
    "install": "getting-started/",
    "own photos": "getting-started/",
    "resume training": "reliability/",
    "slurm": "scaling-out/",
}
RESULT_PAGES_JS = """() => [...document.querySelectorAll('.md-search-result__list > .md-search-result__item > a')]
  .map(a => new URL(a.href).pathname)"""


@pytest.fixture(scope="module")
def served(site):
    """The site over HTTP on a free local port, as `make docs` serves it (the search worker fetches its index)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


def test_the_search_box_finds_the_page_a_reader_means(served, chromium):
    """Material's search, run in the browser as a reader runs it (`?q=` fills the box): each query's first page."""
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    wrong = {}
    for query, expected in SEARCHES.items():
        page.goto(f"{served}?q={urllib.parse.quote(query)}")
        page.wait_for_function("() => /matching/i.test(document.querySelector('.md-search-result__meta').textContent)")
        found = page.evaluate(RESULT_PAGES_JS)
        if not found or found[0] != f"/{expected}":
            wrong[query] = found[:5]
    page.close()
    assert not wrong, f"expected first: {SEARCHES}; found: {wrong}"

"""The commands the documentation shows, the one list of them for the tests that parse or run them."""

import re
import shlex
from pathlib import Path

from tests.helpers.commands import ROOT

# The pages of the documentation site (mkdocs.yml): the README, docs/, and each study's README.md that docs/hooks.py
# pulls in. Their fenced code blocks are the one list of commands: tests/test_docs.py parses every one against the
# config tree, and the tests that run a documented command as typed take it from here (`documented`).
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(ROOT.glob("experiments/*/README.md"))]


# <ckpt>, <run>, <its best .ckpt>: a value the reader fills in; $s, ${m#vit_}: the shell's, in a study's loop
PLACEHOLDER = re.compile(r"<[^<>\n]+>|\$\{[^}\s]*\}|\$\w+")


def _code_lines(text: str):
    """(line number, line) of every line inside a fenced code block, `\\` continuations joined."""
    fence, held, start = None, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence else stripped
            continue
        if fence is None or fence.startswith(("```python", "```yaml")):
            continue
        start = start or n
        if stripped.endswith("\\"):
            held += stripped[:-1] + " "
            continue
        yield start, held + stripped
        held, start = "", 0


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """Every `python -m vitlab.<command> args` (or `torchrun ... -m vitlab.<command>`) in a code block of the
    documentation: (where, as `page:line`; the command; its arguments, shell-split, placeholders as `x`)."""
    found = []
    for page in DOC_PAGES:
        for n, line in _code_lines(page.read_text()):
            line = line.removeprefix("$ ")
            try:
                words = shlex.split(PLACEHOLDER.sub("x", line), comments=True)
            except ValueError:  # not a shell line (a log line quoting one)
                continue
            for i, word in enumerate(words[:-1]):
                by = Path(words[i - 1]).name in ("python", "python3") if i else False
                if (by or words[0] == "torchrun") and word == "-m" and re.fullmatch(r"vitlab\.\w+", words[i + 1]):
                    where = f"{page.relative_to(ROOT)}:{n}"
                    found.append((where, words[i + 1].removeprefix("vitlab."), words[i + 2 :]))
                    break
    return found


def documented(command: str, *args: str) -> tuple[str, ...]:
    """`args`, checked to begin a command the documentation shows for `python -m vitlab.<command>`: a test that runs
    a documented command as typed names it through this, so that the page and the test cannot part."""
    for _, name, words in documented_commands():
        if name == command and tuple(words[: len(args)]) == args:
            return args
    raise AssertionError(
        f"no page shows `python -m vitlab.{command} {' '.join(args)}` (tests/helpers/docs.py DOC_PAGES)"
    )

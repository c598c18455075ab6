"""`python -m vitlab <command> [overrides]`: the commands are vitlab's top-level modules (vitlab/train.py, ...) and
the benchmark package (vitlab/benchmark/__main__.py), the same as `python -m vitlab.<command>`."""

import pkgutil
import runpy
import sys
from pathlib import Path

import vitlab

COMMANDS = sorted(
    m.name
    for m in pkgutil.iter_modules(vitlab.__path__)
    if (not m.ispkg and not m.name.startswith("_"))
    or (m.ispkg and (Path(vitlab.__path__[0]) / m.name / "__main__.py").is_file())
)

USAGE = f"python -m vitlab <command> [overrides], a command one of {COMMANDS}; python -m vitlab.<command> --help"
if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):  # (asked for: not an error)
    print(f"usage: {USAGE}")
    raise SystemExit(0)
if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    given = f"{sys.argv[1]!r} is not a vitlab command" if len(sys.argv) > 1 else "no command given"
    print(f"error: {given}; one of {COMMANDS}: python -m vitlab <command> [overrides]", file=sys.stderr)
    raise SystemExit(2)
command = sys.argv.pop(1)
sys.argv[0] = f"vitlab.{command}"
runpy.run_module(f"vitlab.{command}", run_name="__main__", alter_sys=True)

"""`vitlab <command> [overrides]` (the console script a pip install makes) and `python -m vitlab <command>
[overrides]`: the commands are vitlab's top-level modules (vitlab/train.py, ...) and the benchmark package
(vitlab/benchmark/__main__.py), each run as `python -m vitlab.<command>` runs it."""

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
USAGE = f"vitlab <command> [--config-dir <dir>] [overrides]; the commands: {', '.join(COMMANDS)}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(f"usage: {USAGE}\n`vitlab <command> --help`: the command's config groups and keys")
        return
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        given = f"{sys.argv[1]!r} is not a vitlab command" if len(sys.argv) > 1 else "no command given"
        print(f"error: {given}; one of {COMMANDS}: {USAGE.partition(';')[0]}", file=sys.stderr)
        raise SystemExit(2)
    command = sys.argv.pop(1)
    sys.argv[0] = f"vitlab.{command}"
    runpy.run_module(f"vitlab.{command}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

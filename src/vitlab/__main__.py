"""`python -m vitlab <command> [overrides]`: the commands are the modules of vitlab/commands/."""

import pkgutil
import runpy
import sys

import vitlab.commands

COMMANDS = sorted(m.name for m in pkgutil.iter_modules(vitlab.commands.__path__))

if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    given = f"{sys.argv[1]!r} is not a vitlab command" if len(sys.argv) > 1 else "no command given"
    print(f"error: {given}; one of {COMMANDS}: python -m vitlab <command> [overrides]", file=sys.stderr)
    raise SystemExit(2)
command = sys.argv.pop(1)
sys.argv[0] = f"vitlab.commands.{command}"
runpy.run_module(f"vitlab.commands.{command}", run_name="__main__", alter_sys=True)

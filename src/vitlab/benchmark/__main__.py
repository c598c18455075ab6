"""`python -m vitlab.benchmark`, as it is typed: the command is vitlab/commands/benchmark.py."""

from vitlab.commands.benchmark import main

if __name__ == "__main__":
    main()

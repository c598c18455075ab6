"""`python -m vitlab.export`, as it is typed: the command is vitlab/commands/export.py."""

from vitlab.commands.export import main

if __name__ == "__main__":
    main()

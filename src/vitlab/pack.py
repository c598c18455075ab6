"""`python -m vitlab.pack`, as it is typed: the command is vitlab/commands/pack.py."""

from vitlab.commands.pack import main

if __name__ == "__main__":
    main()

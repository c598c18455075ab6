"""`python -m vitlab.parity`, as it is typed: the command is vitlab/commands/parity.py."""

from vitlab.commands.parity import main

if __name__ == "__main__":
    main()

"""`python -m vitlab.visualize`, as it is typed: the command is vitlab/commands/visualize.py."""

from vitlab.commands.visualize import main

if __name__ == "__main__":
    main()

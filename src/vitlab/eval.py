"""`python -m vitlab.eval`, as it is typed: the command is vitlab/commands/eval.py."""

from vitlab.commands.eval import main

if __name__ == "__main__":
    main()

"""`python -m vitlab.train`, as it is typed: the command is vitlab/commands/train.py."""

from vitlab.commands.train import main

if __name__ == "__main__":
    main()

"""`python -m vitlab.predict`, as it is typed: the command is vitlab/commands/predict.py."""

from vitlab.commands.predict import main

if __name__ == "__main__":
    main()

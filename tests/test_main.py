"""`vitlab <command>` (the console script, vitlab.__main__:main) and `python -m vitlab <command>`: the command's own
module run as `python -m vitlab.<command>` runs it; anything else is one line naming the commands."""

import sys

import pytest

from vitlab import __main__ as vitlab_main


def test_the_commands_are_the_modules_at_the_top():
    assert vitlab_main.COMMANDS == [
        "average", "benchmark", "eval", "export", "pack", "parity", "predict", "train", "visualize"
    ]  # fmt: skip


def test_help_lists_the_commands(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["vitlab", "--help"])
    vitlab_main.main()
    assert capsys.readouterr().out.splitlines()[0] == (
        "usage: vitlab <command> [--config-dir <dir>] [overrides]; the commands: average, benchmark, eval, export, "
        "pack, parity, predict, train, visualize"
    )


@pytest.mark.parametrize("argv, said", [([], "no command given"), (["trian"], "'trian' is not a vitlab command")])
def test_no_command_or_another_word_is_one_line(monkeypatch, capsys, argv, said):
    monkeypatch.setattr(sys, "argv", ["vitlab", *argv])
    with pytest.raises(SystemExit) as stop:
        vitlab_main.main()
    assert stop.value.code == 2 and capsys.readouterr().err.splitlines() == [
        f"error: {said}; one of {vitlab_main.COMMANDS}: vitlab <command> [--config-dir <dir>] [overrides]"
    ]


def test_a_command_runs_as_its_module(monkeypatch, capsys):
    """`vitlab parity --cfg job` is `python -m vitlab.parity --cfg job`: the command's config, composed by Hydra."""
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.setattr(sys, "argv", ["vitlab", "parity", "model=vit_s16", "--cfg", "job"])
    try:
        vitlab_main.main()
    finally:
        GlobalHydra.instance().clear()  # (Hydra's main leaves its own for the next test otherwise)
    assert "timm_name: vit_small_patch16_224" in capsys.readouterr().out

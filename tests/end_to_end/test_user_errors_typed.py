"""Issue 64's wrong answers a new user met (points 7-19), each through the command as typed: one line and nothing left
behind, or the right result."""

import pytest

from tests.helpers import assert_refused, earlier_run, run_cli

TRAIN_KEYS = (
    "its top-level keys: ['ckpt_path', 'compile', 'freeze_backbone', 'memory_budget_gb', 'memory_check', 'model', "
    "'optimized_metric', 'print_config', 'progress_bar', 'seed', 'tags', 'task_name', 'test', 'train'], its groups: "
)
UNREAD = "vitlab.train has no key {!r} and would ignore it (a + adds a key no command reads); "
TWICE = (
    "is given twice and only the last would count; give it once (a brace pattern left unquoted, "
    "data.urls=/data/train-{0..9}.tar, is one argument a shard in the shell: quote it for the shell and for Hydra, "
    """'data.urls="/data/train-{0..9}.tar"')"""
)


@pytest.mark.parametrize(
    "command, args, said",
    [
        # point 7: a + key at the top level that no command reads (the +foo=bar run trained its 300 epochs)
        ("train", ["+foo=bar"], f"+foo=bar: {UNREAD.format('foo')}{TRAIN_KEYS}"),
        ("train", ["+max_epochs=1"], f"+max_epochs=1: {UNREAD.format('max_epochs')}did you mean trainer.max_epochs=1?"),
        ("train", ["+epochs=1"], f"+epochs=1: {UNREAD.format('epochs')}did you mean trainer.min_epochs=1 or "),
        ("train", ["++foo=1"], f"++foo=1: {UNREAD.format('foo')}"),
        ("eval", ["+foo=1"], "+foo=1: vitlab.eval has no key 'foo' and would ignore it"),
        ("train", ["+optim.foo=1"], "unknown optim key(s) ['foo']; allowed:"),  # (refused before)
        # point 8: a key given twice, as an unquoted brace pattern becomes in the shell
        (
            "train",
            ["data=wds", "data.urls=a.tar", "data.urls=b.tar"],
            f"data.urls=a.tar and data.urls=b.tar: data.urls {TWICE}",
        ),
        (
            "train",
            ["model=vit_s16", "seed=1", "model=vit_b16"],
            "model=vit_s16 and model=vit_b16: model is given twice",
        ),
        # point 14: the quoting hint for , and ( ) in a value, as for a character outside ASCII
        (
            "train",
            ["data.data_dir=/x/cats,dogs (2024)"],
            "data.data_dir=/x/cats,dogs (2024): Hydra's override grammar reads , ( ) in a value as its own; quote the "
            """value for Hydra as well as for the shell: 'data.data_dir="/x/cats,dogs (2024)"'""",
        ),
        (
            "predict",
            ["ckpt_path=a.ckpt", "images=[weird name (1).jpg]"],
            "images=[weird name (1).jpg]: Hydra's override grammar reads ( ) [ ] in a value as its own; quote the value "
            """for Hydra as well as for the shell: 'images=["weird name (1).jpg"]'""",
        ),
    ],
)
def test_an_override_no_command_reads_or_given_twice_or_unquoted_is_one_line(tmp_path, command, args, said):
    before = earlier_run(tmp_path)
    assert_refused(run_cli(command, *args, cwd=tmp_path), f"error: {said}", before, tmp_path / "outputs")


def test_the_quoting_hint_parses_to_what_was_typed():
    """Point 14: the quoted value the line gives is the path the user meant, once Hydra reads it."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from vitlab.cli.overrides import quoting_hint

    for typed, meant in [("/x/cats,dogs (2024)", "/x/cats,dogs (2024)"), ("[weird name (1).jpg]", ["weird name (1).jpg"]),
                         ("/it's (a)", "/it's (a)")]:  # fmt: skip
        hint = quoting_hint([f"images={typed}"])
        (override,) = OverridesParser.create().parse_overrides(shlex.split(hint.rpartition("shell: ")[2]))
        assert override.value() == meant

import logging

from vitlab.utils.logs import QUIET_LOGS, quiet


def test_torch_notes_nobody_can_act_on_are_dropped_and_the_rest_of_their_loggers_kept(caplog):
    quiet()
    for name, text in QUIET_LOGS.items():
        logger = logging.getLogger(name)
        logger.propagate = True  # (torch's own loggers may not propagate: caplog listens at the root)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=name):
            logger.warning("\nDetected that %s here.\n", text)
            logger.warning("something else")
        assert [r.getMessage() for r in caplog.records] == ["something else"]

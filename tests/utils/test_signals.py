"""utils/signals.py without processes: how often the ranks exchange their stop flags (the end-to-end stops, in one
process and in two, are tests/end_to_end/test_signal_resume.py)."""

import signal
from types import SimpleNamespace

from vitlab.utils import signals


def test_several_processes_agree_every_few_steps_never_every_step(monkeypatch):
    """With several processes the flags are exchanged every AGREE_EVERY optimizer steps, launched at one exchange and
    read at the next: a signal received after step 13 is sent at step 16 and stops every rank after step 24. Alone,
    a process stops after the step its signal came in."""
    launched = []

    def all_reduce(flag, op, group, async_op):
        launched.append((step, int(flag[0])))
        return SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(signals.dist, "all_reduce", all_reduce)
    connector = signals.StopSignals(SimpleNamespace())
    connector._group = object()  # several processes
    stopped = []
    for step in range(1, 41):
        if step == 14:
            connector.received = signal.SIGTERM
        if connector.agree(step) is not None:
            stopped.append(step)
    assert signals.AGREE_EVERY == 8
    assert launched == [(8, 0), (16, signal.SIGTERM), (24, signal.SIGTERM)]  # then none: every rank has stopped
    assert stopped[0] == 24
    alone = signals.StopSignals(SimpleNamespace())
    assert alone.agree(5) is None
    alone.received = signal.SIGINT
    assert alone.agree(6) == signal.SIGINT

"""utils/signals.py without processes: how often the ranks exchange their stop flags (the end-to-end stops, in one
process and in two, are tests/end_to_end/test_signal_resume.py)."""

import signal
import threading
from types import SimpleNamespace

import pytest

from vitlab.utils import signals


def test_several_processes_agree_every_few_steps_never_every_step(monkeypatch):
    """With several processes the flags are exchanged every AGREE_EVERY optimizer steps, launched at one exchange and
    read at the next: a signal received after step 13 is sent at step 16 and stops every rank after step 24. Alone,
    a process stops after the step its signal came in."""
    launched = []
    monkeypatch.setattr(signals, "STOPPING", threading.Event())  # (agree sets it: this process's state)

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
    assert stopped[0] == 24 and signals.STOPPING.is_set()
    alone = signals.StopSignals(SimpleNamespace())
    assert alone.agree(5) is None
    alone.received = signal.SIGINT
    assert alone.agree(6) == signal.SIGINT


@pytest.mark.parametrize("agreed", [False, True])
def test_a_child_ended_by_a_stop_is_reported_only_where_training_did_not_stop_on_it(monkeypatch, agreed):
    """Lightning's child-process observer finds rank 1 ended by SIGTERM (exit 143). During start-up (no agreement:
    rank 0 may be stuck in the rendezvous) the other processes are killed and the report is this process's last
    line; where the ranks agreed to stop (STOPPING), rank 1 ended after the checkpoint they saved together and rank 0
    is writing its own last line: nothing is killed or reported (the race this closes printed the report's failure,
    HydraConfig already unset, after rank 0's line)."""
    from lightning.fabric.strategies.launchers import subprocess_script

    observer = subprocess_script._ChildProcessObserver
    monkeypatch.setattr(observer, "_terminate_all", observer._terminate_all)  # undone after the test
    monkeypatch.delattr(observer, "_lightnings_terminate_all", raising=False)
    monkeypatch.setattr(signals, "STOPPING", threading.Event())
    if agreed:
        signals.STOPPING.set()
    killed, reported = [], []
    child = SimpleNamespace(returncode=128 + signal.SIGTERM, send_signal=killed.append)

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(signals.os, "_exit", exit_)
    signals.when_children_stop(lambda signum: reported.append(signum) or "train stopped by SIGTERM")
    me = SimpleNamespace(_child_processes=[child])
    if agreed:
        assert observer._terminate_all(me) is None
        assert killed == [] and reported == []
    else:
        with pytest.raises(SystemExit) as e:
            observer._terminate_all(me)
        assert e.value.code == 128 + signal.SIGTERM
        assert killed == [signal.SIGKILL] and reported == [signal.SIGTERM]

"""Each process's part of a checkpoint (vitlab.training.devices.rank_state): what it holds, that it loads with
weights_only, and which part each process takes back. The command-line runs that resume exactly:
end_to_end/test_signal_resume.py."""

import copy
import io
import logging
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torchmetrics import MaxMetric, MeanMetric

from tests.helpers.configs import tiny
from vitlab.training.devices import rank_state
from vitlab.training.objectives.classification import Classification


def _trainer(rank=0, world=1, datamodule=None, epoch=0, batches=0, epoch_over=False):
    """A Trainer mid-epoch `epoch` after `batches` batches, or (`epoch_over`) as its end's checkpoint sees it: epoch
    `epoch - 1` processed (its batches still counted), not yet completed."""
    progress = SimpleNamespace(current=SimpleNamespace(completed=batches), total=SimpleNamespace(completed=batches))
    epochs = SimpleNamespace(processed=epoch, completed=epoch - 1 if epoch_over else epoch)
    loop = SimpleNamespace(epoch_progress=SimpleNamespace(current=epochs),
                           epoch_loop=SimpleNamespace(batch_progress=progress))  # fmt: skip
    return SimpleNamespace(global_rank=rank, world_size=world, is_global_zero=rank == 0, datamodule=datamodule,
                           fit_loop=loop)  # fmt: skip


class _Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(2, 2)
        self.register_buffer("count", torch.zeros(()))  # stands in for a metric's state


def _checkpoint(loader_state=None):
    return {"loops": {"fit_loop": {"state_dict": {"combined_loader": loader_state}}}}


def test_every_generator_round_trips_through_a_weights_only_checkpoint():
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    module, checkpoint = _Module(), _checkpoint([{"_num_yielded": 4}])
    rank_state.save(_trainer(), module, checkpoint)
    expected = (torch.rand(3), random.random(), np.random.rand())
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)  # no arrays, nothing to execute
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    mine = rank_state.take(_trainer(), loaded)
    rank_state.restore(module, mine)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.random.rand() == expected[2]
    assert loaded["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"_num_yielded": 4}]


def test_running_metrics_go_back_to_the_device_their_module_is_on():
    """They are saved on the CPU; torchmetrics keeps whatever tensor it is given, so a run resumed on a GPU
    crashed at its first update ("Encountered different devices in metric calculation") until each state was
    put where the module's own one is. `meta` stands in for the GPU here."""
    module, checkpoint = _Module(), _checkpoint()
    module.metric = MeanMetric()  # a child beside the network, as the LightningModule's metrics are
    module.metric.persistent(True)
    module.metric.update(torch.tensor(5.0))
    rank_state.save(_trainer(), module, checkpoint)
    assert checkpoint[rank_state.KEY][0]["metrics"]["metric.mean_value"].device.type == "cpu"
    module.metric.to("meta")
    rank_state.restore(module, rank_state.take(_trainer(), checkpoint))
    assert {getattr(module.metric, k).device.type for k in ("mean_value", "weight")} == {"meta"}


def test_each_process_takes_its_own_part():
    parts = [{"rng": {}, "loader": [{"rank": r}], "datamodule": {"augment_rng": r}, "metrics": {}} for r in range(2)]
    loaded = []
    dm = SimpleNamespace(load_state_dict=loaded.append)  # Lightning has loaded rank 0's state into it already
    checkpoint = {**_checkpoint([{"rank": 0}]), rank_state.KEY: parts, "SimpleNamespace": {"augment_rng": 0}}
    rank_state.take(_trainer(rank=1, world=2, datamodule=dm), checkpoint)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"rank": 1}]
    assert checkpoint["SimpleNamespace"] == {"augment_rng": 1} and loaded == [{"augment_rng": 1}]


def test_another_number_of_processes_resumes_with_a_warning_and_without_the_loader_position(caplog):
    parts = [{"rng": {}, "loader": [{"rank": r}], "datamodule": None, "metrics": {}} for r in range(2)]
    checkpoint = {**_checkpoint([{"rank": 0}]), rank_state.KEY: parts}
    rank_state.take(_trainer(rank=0, world=1), checkpoint)
    assert "written by 2 processes and resumes with 1" in caplog.text
    assert "combined_loader" not in checkpoint["loops"]["fit_loop"]["state_dict"]


def test_only_other_ranks_reseed():
    class Data:
        def seed_process(self, seed):
            self.seed = seed

    torch.manual_seed(5)
    before = torch.get_rng_state()
    data = Data()
    rank_state.seed_process(_trainer(rank=0, world=2, datamodule=data))
    assert torch.equal(torch.get_rng_state(), before) and not hasattr(data, "seed")  # rank 0 as one process
    rank_state.seed_process(_trainer(rank=1, world=2, datamodule=data))
    assert data.seed == 6 and torch.initial_seed() == 6  # seed + rank


def _written_by(world, drew=(), global_order=True, epoch=1, batches=3):
    """A checkpoint as `world` processes of a global order write it, each with a MeanMetric's running state (rank r
    has seen r + 1 images of value 2) and a MaxMetric's (synced: 7 on all)."""
    parts = []
    for r in range(world):
        module, checkpoint = _Module(), _checkpoint([{"rank": r}])
        module.metric, module.best = MeanMetric(), MaxMetric()
        for m in (module.metric, module.best):
            m.persistent(True)
        module.metric.update(torch.full((r + 1,), 2.0))
        module.best.update(torch.tensor(7.0))
        dm = SimpleNamespace(batch_size=8, global_order=global_order, state_dict=dict)
        rank_state.save(_trainer(r, world, dm, epoch, batches), module, checkpoint, drew=r in drew)
        parts += checkpoint[rank_state.KEY]
    return {**checkpoint, rank_state.KEY: parts}


def _module():
    module = _Module()
    module.metric, module.best = MeanMetric(), MaxMetric()
    return module


@pytest.mark.parametrize("old, new", [(4, 2), (4, 3), (2, 1), (2, 3)])
def test_on_another_count_a_global_order_resumes_at_its_position_with_every_image_s_metrics(old, new, caplog):
    caplog.set_level(logging.INFO)
    checkpoint = _written_by(old)
    assert checkpoint[rank_state.POSITION] == {"epoch": 1, "batches": 3, "samples": 24, "processes": old,
                                               "global_order": True, "mix_groups": None}  # fmt: skip
    seen = []
    for rank in range(new):
        loaded = copy.deepcopy(checkpoint)
        dm = SimpleNamespace(load_state_dict=lambda state: None, resume_at=None)
        module = _module()
        mine = rank_state.take(_trainer(rank, new, dm), loaded, module)
        assert dm.resume_at == (1, 3) and "combined_loader" not in loaded["loops"]["fit_loop"]["state_dict"]
        if mine["metrics"] is not None:
            rank_state.restore(module, mine)
        seen.append((float(module.metric.weight), float(module.metric.mean_value), float(module.best.max_value)))
    # every image the old processes had seen, once, among the new ones; the synced maximum kept
    assert sum(w for w, _, _ in seen) == sum(range(1, old + 1)) and sum(v for _, v, _ in seen) == 2 * sum(
        w for w, _, _ in seen
    )
    assert max(b for _, _, b in seen) == 7.0
    assert f"written by {old} processes, resumed on {new}: exact" in caplog.text


def test_on_another_count_a_run_that_drew_per_process_says_what_is_not_exact(caplog):
    caplog.set_level(logging.INFO)
    dm = SimpleNamespace(load_state_dict=lambda state: None, resume_at=None)
    rank_state.take(_trainer(0, 1, dm), _written_by(2, drew=[1]), _module())
    assert "written by 2 processes, resumed on 1: the data order and each image's augmentation" in caplog.text
    assert "not exact" in caplog.text and dm.resume_at == (1, 3)


def test_a_sampler_that_deals_per_process_resumes_on_another_count_with_today_s_warning(caplog):
    dm = SimpleNamespace(load_state_dict=lambda state: None, resume_at=None)
    rank_state.take(_trainer(0, 1, dm), _written_by(2, global_order=False), _module())
    assert "written by 2 processes and resumes with 1: the data order and random draws" in caplog.text
    assert dm.resume_at is None


def test_a_checkpoint_at_an_epoch_s_end_resumes_on_another_count_at_the_next_epoch_s_start():
    """The end of epoch 2's checkpoint (13 of 13 batches done; Lightning has processed the epoch, not completed it):
    the position is epoch 3, batch 0, not epoch 3 past 13 batches (an epoch that would train nothing)."""
    checkpoint = _checkpoint()
    dm = SimpleNamespace(batch_size=8, global_order=True, state_dict=dict)
    rank_state.save(_trainer(0, 2, dm, epoch=3, batches=13, epoch_over=True), _Module(), checkpoint)
    assert checkpoint[rank_state.POSITION]["epoch"] == 3 and checkpoint[rank_state.POSITION]["batches"] == 0


def test_mixups_groups_are_saved_with_the_position_and_come_back_with_it(caplog):
    """MixUp pairs within the shares of the processes the run started on (objective.mix_groups): the position keeps
    them, a resume on any count takes them back, and one whose count does not divide them says it is not exact."""
    caplog.set_level(logging.INFO)
    checkpoint = _written_by(4)
    checkpoint[rank_state.POSITION]["mix_groups"] = 4
    for new, said in (
        (2, "resumed on 2: exact"),
        (3, "not exact: MixUp/CutMix pair images within the shares of the 4"),
    ):
        module = _module()
        module.objective = Classification({"mixup": {"mixup_alpha": 0.8}}, tiny())
        dm = SimpleNamespace(load_state_dict=lambda state: None, resume_at=None)
        rank_state.take(_trainer(0, new, dm), copy.deepcopy(checkpoint), module)
        assert module.objective.mix_groups == 4 and said in caplog.text

"""Each process's part of a checkpoint (vitlab.training.devices.rank_state): what it holds, that it loads with
weights_only, and which part each process takes back. The command-line runs that resume exactly:
end_to_end/test_signal_resume.py."""

import io
import random
from types import SimpleNamespace

import numpy as np
import torch
from torchmetrics import MeanMetric

from vitlab.training.devices import rank_state


def _trainer(rank=0, world=1, datamodule=None):
    return SimpleNamespace(global_rank=rank, world_size=world, is_global_zero=rank == 0, datamodule=datamodule)


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

"""data/lookahead.py: the training loader's workers run on into the next epoch (no epoch-start refill): the next
epoch's first batches are prepared before it is asked for, the order is the sampler's epoch by epoch, a resume
mid-epoch gives the batches that were left, an epoch cut short restarts cleanly."""

import time

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from vitlab.data.lookahead import LookaheadLoader
from vitlab.data.seeded import GlobalOrder

N, BATCH = 22, 4  # 5 whole batches an epoch (drop_last)


class Keys(Dataset):
    """Each (seed, index) key as a tensor, every fetch written down in `log` (by whichever worker made it)."""

    def __init__(self, log):
        self.log = log

    def __len__(self):
        return N

    def __getitem__(self, key):
        with open(self.log, "a") as f:
            f.write(f"{key[0]} {key[1]}\n")
        return torch.tensor([key[0] % 1000, key[1]])


def _loader(tmp_path, epoch=0):
    sampler = GlobalOrder(Keys(tmp_path / "fetched"), 1, 0, seed=5, batch_size=1, keyed=True)
    sampler.set_epoch(epoch)  # (as data/base.py does before Lightning's first iter())
    return LookaheadLoader(sampler.dataset, sampler=sampler, batch_size=BATCH, num_workers=2, persistent_workers=True,
                           prefetch_factor=1)  # fmt: skip


def _expected(epoch):
    sampler = GlobalOrder(Keys(None), 1, 0, seed=5, batch_size=1, keyed=True)
    sampler.set_epoch(epoch)
    keys = [[s % 1000, i] for s, i in sampler][: N // BATCH * BATCH]
    return [keys[k : k + BATCH] for k in range(0, len(keys), BATCH)]


def _epoch(loader, epoch, n=None):
    loader.sampler.set_epoch(epoch)  # (Lightning, at every epoch's start)
    it = iter(loader)  # as Lightning takes them: len() batches (or n), and no next() past them
    return [next(it).tolist() for _ in range(n or len(loader) - loader._at[1])]


def test_the_next_epoch_is_prepared_before_it_starts_in_the_same_order(tmp_path):
    loader = _loader(tmp_path)
    assert len(loader) == N // BATCH and _epoch(loader, 0) == _expected(0)
    first = {(s, i) for s, i in _expected(1)[0]}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the workers go on into epoch 1 with no iter() asked of the loader
        fetched = {tuple(int(v) for v in line.split()) for line in (tmp_path / "fetched").read_text().splitlines()}
        if first <= {(s % 1000, i) for s, i in fetched}:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("epoch 1's first batch was not prepared at the end of epoch 0")
    assert _epoch(loader, 1) == _expected(1) and _epoch(loader, 2) == _expected(2)
    lines = (tmp_path / "fetched").read_text().splitlines()
    fetched = [(int(s) % 1000, int(i)) for s, i in (line.split() for line in lines)]
    assert all(fetched.count(tuple(key)) == 1 for batch in _expected(1) for key in batch)  # not read again at iter()


def test_a_resume_mid_epoch_and_an_epoch_cut_short_give_the_sampler_s_batches(tmp_path):
    loader = _loader(tmp_path)
    _epoch(loader, 0)
    assert _epoch(loader, 1, n=2) == _expected(1)[:2]
    state = loader.state_dict()
    assert state == {"lookahead": {"epoch": 1, "batches": 2}}
    resumed = _loader(tmp_path, epoch=1)
    resumed.load_state_dict(state)
    assert _epoch(resumed, 1) == _expected(1)[2:] and _epoch(resumed, 2) == _expected(2)
    # trainer.limit_train_batches: epoch 1 stopped after 2 batches, and epoch 2 is whole, from its start
    assert _epoch(loader, 2) == _expected(2)


def test_a_checkpoint_of_torchdata_s_loader_from_before_resumes_after_its_batches(tmp_path):
    sampler = GlobalOrder(Keys(tmp_path / "fetched"), 1, 0, seed=5, batch_size=1, keyed=True)
    sampler.set_epoch(1)
    before = StatefulDataLoader(sampler.dataset, sampler=sampler, batch_size=BATCH, num_workers=2, drop_last=True)
    it = iter(before)
    taken = [next(it).tolist() for _ in range(3)]
    resumed = _loader(tmp_path, epoch=1)
    resumed.load_state_dict(before.state_dict())
    assert taken + _epoch(resumed, 1) == _expected(1)

"""Tiny model configs and the argument lists several files' runs share."""

from vitlab.model import ViTConfig

# A short deterministic CPU run to interrupt and resume: 3 epochs x 9 steps (batch 128 of 1,257 digits), with
# stochastic depth and EMA on, so the random draws and the averaged weights are part of what must resume exactly.
RESUMABLE = [
    "trainer.max_epochs=3",
    "data.batch_size=128",
    "trainer.deterministic=true",
    "progress_bar=none",
    "model.drop_path_rate=0.1",
    "callbacks=ema",
    "callbacks.ema.update_starting_at_step=0",
    "trainer.log_every_n_steps=5",  # 27 steps in all: log the LR (compared after resuming) within them
    # the CPU's resume, also where a GPU is visible (tests/end_to_end/test_gpu.py resumes on one)
    "trainer.accelerator=cpu",
]


# A run on the `folder`/`shards` fixtures' images (conftest.py: 3 classes x 24 images of 12 px in train, val and
# test): 9 steps of 8 an epoch, loader workers, RandAugment and random erasing.
SHARDS_RUN = [
    "data.batch_size=8",
    "data.num_workers=2",
    "model.img_size=8",
    "trainer.max_epochs=3",
    "trainer.deterministic=true",
    "progress_bar=none",
    "model.drop_path_rate=0.1",
    "data.train_transform.auto_augment=randaugment",
    "data.train_transform.random_erasing=0.5",
    "trainer.log_every_n_steps=5",
]


def tiny(**overrides) -> ViTConfig:
    """A ViT small enough for CPU tests: 32 px, patch 8 (16 patches), dim 32, depth 2, 4 heads."""
    base = dict(img_size=32, patch_size=8, in_chans=3, num_classes=7, embed_dim=32, depth=2, num_heads=4)
    return ViTConfig(**{**base, **overrides})


def extra_callback(name: str, target: str, **params) -> list[str]:
    """Overrides that add callbacks.<name>: the class `target` of tests/helpers/callbacks.py (or a dotted path),
    built with `params`."""
    return [
        f"+callbacks.{name}._target_={target if '.' in target else f'tests.helpers.callbacks.{target}'}",
        *(f"+callbacks.{name}.{k}={v}" for k, v in params.items()),
    ]

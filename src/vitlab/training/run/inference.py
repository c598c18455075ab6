"""A trained checkpoint made ready for inference (vitlab.eval, predict, export, visualize, average's soups): its file
read once (convert.weights.read_checkpoint: a file, or a directory of shards gathered in memory) and the ViTModule
rebuilt from what was read, as Lightning's `load_from_checkpoint` rebuilds one (its stored hyper-parameters, then
`on_load_checkpoint`, then the state dict, strictly), without reading the file a second time; and the DataModule of
the data config stored in it, which prepares an image as the checkpoint's test images were."""

from __future__ import annotations

import inspect

import lightning as L

from vitlab.convert.weights import read_checkpoint
from vitlab.training.adapters import WEIGHT_SETS
from vitlab.training.checkpoint_io import upgrade_hparams
from vitlab.training.module import ViTModule
from vitlab.training.run import build
from vitlab.utils.errors import UserError


def load_for_inference(ckpt_path: str, map_location: str = "cpu", ckpt: dict | None = None) -> ViTModule:
    """A trained ViTModule from a checkpoint file (or a directory of shards), rebuilt from the config stored in it
    (no Hydra) and the one read of the file (`ckpt`: that read, where the command made it already)."""
    ckpt = ckpt if ckpt is not None else read_checkpoint(ckpt_path)  # a missing, corrupt or unsafe file: one line
    # on_load_checkpoint completes the sets of weights in place (a peft= checkpoint's base, fresh metric states): it
    # gets copies of them, so that a read the caller keeps stays the file's (a soup scores every ingredient from its
    # read: the best one's had grown the base, and no longer matched the others)
    ckpt = ckpt | {key: dict(ckpt[key]) for key in WEIGHT_SETS if key in ckpt}
    hparams = ckpt["hyper_parameters"]
    upgraded = upgrade_hparams(hparams)  # written before objectives were objects: the same module
    takes = inspect.signature(ViTModule.__init__).parameters
    module = ViTModule(**{k: v for k, v in hparams.items() if k in takes} | upgraded)
    module.on_load_checkpoint(ckpt)
    module.load_state_dict(ckpt["state_dict"], strict=module.strict_loading)
    return module.to(map_location)


def inference_datamodule(module: ViTModule, ckpt_path: str) -> L.LightningDataModule:
    """The DataModule of the checkpoint's stored data config (in `module`'s hyper-parameters, read with it): its
    predict_tensor() prepares an image exactly as the test images were."""
    data = module.hparams.get("data")
    if not data:
        raise UserError(f"checkpoint {ckpt_path!r} stores no data config to preprocess images with")
    return build.build_datamodule(dict(data))

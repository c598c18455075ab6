"""python -m vitlab.eval ckpt_path=<file.ckpt> [data=<name>]: test a checkpoint, write metrics.json.

The model comes from the checkpoint's stored config; the data from `data=...` or, by default, the
data config the checkpoint was trained with, so the test split and transforms are the same.
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from vitlab.cli import entry_point
from vitlab.lit_module import load_checkpoint
from vitlab.train import make_trainer, progress_bar


def evaluate(cfg: DictConfig) -> dict[str, float]:
    module = load_checkpoint(cfg.ckpt_path)
    mc = module.model.cfg
    with open_dict(cfg):
        cfg.model.img_size = list(mc.img_size) if isinstance(mc.img_size, tuple) else mc.img_size
        cfg.model.in_chans, cfg.model.num_classes = mc.in_chans, mc.num_classes
    data_cfg = cfg.get("data") or OmegaConf.create(module.hparams.get("data") or {})
    if "_target_" not in data_cfg:
        raise ValueError(f"checkpoint {cfg.ckpt_path!r} stores no data config; choose one with data=<name>")
    datamodule = instantiate(data_cfg)
    if (datamodule.num_classes, datamodule.channels) != (mc.num_classes, mc.in_chans):
        raise ValueError(
            f"checkpoint expects {mc.num_classes} classes and {mc.in_chans} channels, but the data has "
            f"{datamodule.num_classes} classes and {datamodule.channels} channels"
        )
    bars, show_bar = progress_bar(cfg.progress_bar)
    trainer = make_trainer(
        cfg.trainer, logger=False, callbacks=bars, enable_progress_bar=show_bar, enable_checkpointing=False
    )
    (metrics,) = trainer.test(module, datamodule=datamodule)
    metrics = {k: float(v) for k, v in metrics.items()} | {"ckpt_path": str(cfg.ckpt_path)}
    (Path(cfg.paths.output_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


@entry_point("eval")
def main(cfg: DictConfig) -> dict[str, float]:
    return evaluate(cfg)


if __name__ == "__main__":
    main()

"""python -m vitlab.pack data=<name> data.data_dir=<where> out=<folder>: every split of a dataset as LitData
shards (data/shards.py), which `data=streaming data.data_dir=<folder or s3://...>` trains on; with format=wds as
WebDataset tars (data/wds.py), which `data=wds data.urls=...` trains on. The image files' bytes
are kept as they are, the labels and class names come along; a file that cannot be decoded is named in one line
and nothing is left behind; an existing `out` is replaced only with overwrite=true."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from vitlab.cli.entry import entry_point
from vitlab.utils.errors import Interrupted, is_ctrl_c


@entry_point("pack")
def main(cfg: DictConfig) -> dict:
    from vitlab.data.shards import pack
    from vitlab.training.run import build

    datamodule = build.build_datamodule(OmegaConf.to_container(cfg.data, resolve=True))
    datamodule.setup("fit")
    out = Path(cfg.out).absolute()
    kept = f"the earlier {out} is as it was" if out.exists() else f"nothing was written to {out}"
    try:
        info = pack(datamodule, out, overwrite=cfg.overwrite, workers=cfg.workers, chunk_bytes=cfg.chunk_bytes,
                    format=cfg.format, shard_size=cfg.shard_size)  # fmt: skip
    except BaseException as e:
        if not is_ctrl_c(e):
            raise
        raise Interrupted(f"pack stopped by Ctrl-C (SIGINT): the partial shards were removed; {kept}") from None
    sizes = ", ".join(f"{name} {n:,}" for name, n in info["splits"].items())
    print(f"packed {sizes} images of {len(info['class_names'])} classes into {out}", flush=True)
    if cfg.format == "wds":  # (Hydra reads a brace pattern only quoted)
        urls = " ".join(
            f"'data.{'urls' if split == 'train' else split + '_urls'}=\"{out}/{pattern}\"'"
            for split, pattern in info["urls"].items()
        )
        print(f"train on them: python -m vitlab.train data=wds {urls}", flush=True)
    else:
        print(f"train on them: python -m vitlab.train data=streaming data.data_dir={out}", flush=True)
    return info


if __name__ == "__main__":
    main()

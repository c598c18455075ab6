"""The image folder make_jpegs.py wrote, in the other readers' formats, for the loader benchmark (issue 55):

    python experiments/throughput/make_records.py /tmp/jpegs /tmp/jpegs-records

writes <out>/saved (a Hugging Face DatasetDict, Dataset.save_to_disk: each file's bytes in an Image feature, its
class folder a ClassLabel) and <out>/{train,val}.csv (path,label lists of the same files), in ImageFolder's order.
WebDataset tars of the same files: python -m vitlab.pack format=wds data=imagefolder data.data_dir=<folder> out=...
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def main() -> None:
    import datasets

    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    classes = sorted(p.name for p in (args.folder / "train").iterdir() if p.is_dir())
    features = datasets.Features(image=datasets.Image(), label=datasets.ClassLabel(names=classes))
    splits = {}
    args.out.mkdir(parents=True)
    for split in ("train", "val"):
        files = sorted((args.folder / split).glob("*/*"))
        splits["validation" if split == "val" else split] = datasets.Dataset.from_dict(
            {"image": [{"bytes": f.read_bytes(), "path": f.name} for f in files],
             "label": [classes.index(f.parent.name) for f in files]},
            features=features,
        )  # fmt: skip
        rows = [f"{os.path.relpath(f, args.out)},{f.parent.name}" for f in files]
        (args.out / f"{split}.csv").write_text("\n".join(["path,label", *rows]) + "\n")
    datasets.DatasetDict(splits).save_to_disk(str(args.out / "saved"))


if __name__ == "__main__":
    main()

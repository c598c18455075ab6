"""What the record formats say about themselves, read before torch and Lightning are imported: an image list's rows
(`data=list`), the description `vitlab.pack format=wds` writes beside its shards (`data=wds`), a Hugging Face
dataset's splits and columns (`data=hf`, through `datasets`, which imports no torch), and a label column as class
indices. `${data_classes:}` (cli/config_tree.py) counts a config's classes from them (data/formats.py), so a bad
value (a missing list or shard, a column that is not there) is refused within a second; the data modules read the
same files through the same functions when they set up.

Imports only the standard library and vitlab.utils (braceexpand and datasets where they are used).
"""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitlab.utils.downloads import unless_hub_reachable_read_the_cache
from vitlab.utils.errors import MissingFileError, OfflineError, UserError


def label_indices(values: Sequence[Any], where: str, names: list[str] | None = None) -> tuple[list[int], list[str]]:
    """A label column as class indices and the class names: integers as they are (named by their numbers unless
    `names` are known), class names as their place among the sorted names (an image folder's order)."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if any(v < 0 for v in values):
            raise UserError(f"{where} holds the label {min(values)}: labels are class indices >= 0 or class names")
        return list(values), names or [str(i) for i in range(max(values, default=-1) + 1)]
    if all(isinstance(v, str) and v for v in values):
        found = names or sorted(set(values))
        index = {name: i for i, name in enumerate(found)}
        if unknown := sorted(set(values) - set(index)):
            raise UserError(f"{where} holds labels not among the classes {found[:5]}...: {unknown[:5]}")
        return [index[v] for v in values], found
    odd = next(v for v in values if not isinstance(v, (int, str)) or isinstance(v, bool) or v == "")
    raise UserError(f"{where} holds the label {odd!r} ({type(odd).__name__}): labels must be integers or class names")


# ---- data=list: a CSV or JSON Lines list of images ----


@functools.lru_cache(maxsize=16)
def read_rows(file: str) -> list[dict]:
    """The rows of a CSV or JSONL list, each {column: value}."""
    path = Path(file).expanduser()
    if not path.is_file():
        raise MissingFileError(f"image list {file!r} does not exist")
    if path.suffix.lower() not in (".csv", ".jsonl", ".tsv"):
        raise UserError(f"image list {file!r} is neither a .csv (or .tsv) nor a .jsonl file")
    with open(path, newline="", encoding="utf-8-sig") as f:  # (-sig: a CSV that Excel saved begins with a BOM)
        if path.suffix.lower() == ".jsonl":
            rows = [_json_row(line, path, n) for n, line in enumerate(f, start=1) if line.strip()]
        else:
            rows = list(csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
    if not rows:
        raise UserError(f"image list {file!r} holds no images")
    return rows


def read_list(file: str, image_key: str = "path", label_key: str | None = "label") -> tuple[list[str], list[Any]]:
    """The (paths, labels) of a CSV or JSONL list; a path is made absolute against the list's folder. `label_key`
    None: the labels are the rows (data.label_format=columns, data/multilabels.py)."""
    rows, path = read_rows(file), Path(file).expanduser()
    for key, what in ((image_key, "image"), (label_key, "label")):
        if key is None:
            continue
        if key not in rows[0]:
            raise UserError(
                f"image list {file!r} has no column {key!r}; its columns: {', '.join(rows[0])} (name the {what} "
                f"column with data.{what}_key)"
            )
    root = path.parent
    paths = [str(root / row[image_key]) for row in rows]
    if label_key is None:
        return paths, list(rows)
    labels = [row[label_key] for row in rows]
    if path.suffix.lower() != ".jsonl" and all(str(v).lstrip("-").isdigit() for v in labels):
        labels = [int(v) for v in labels]  # (a CSV's numbers are text)
    return paths, labels


def _json_row(line: str, path: Path, n: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"line {n} of image list {str(path)!r} is not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise UserError(f"line {n} of image list {str(path)!r} is not a JSON object")
    return row


def list_classes(train_file: str, image_key: str = "path", label_key: str = "label", multilabel: bool = False,
                 label_format: str = "names") -> int:  # fmt: skip
    """`${data_classes:}` for data=list: the classes of the training list's labels (several a row: multilabel)."""
    return len(list_labels(str(train_file), image_key, label_key, multilabel, label_format)[2])


def list_labels(file: str, image_key: str, label_key: str, multilabel: bool, label_format: str,
                names: list[str] | None = None) -> tuple[list[str], list[Any], list[str]]:  # fmt: skip
    """(paths, labels, class names) of a list: a label a row as its class index, or (multilabel) each row's list of
    class indices (data/multilabels.py)."""
    from vitlab.data import multilabels

    multilabels.check_label_format(label_format)
    if label_format == "columns" and not multilabel:
        raise UserError("data.label_format=columns (a 0/1 column per class) is several labels an image: set "
                        "objective.multilabel=true, or give a label column (data.label_format=names)")  # fmt: skip
    where = f"the labels of {file}"
    if label_format == "columns":
        paths, rows = read_list(file, image_key, None)
        return paths, *multilabels.column_labels(rows, image_key, where, names)
    paths, labels = read_list(file, image_key, label_key)
    if multilabel:
        return paths, *multilabels.multilabel_indices(labels, where, names)
    return paths, *label_indices(labels, where, names)


# ---- data=wds: the pack's description beside the shards ----
INFO = "vitlab-wds.json"  # written by python -m vitlab.pack format=wds beside the shards


def expand(urls: str | list[str] | None, key: str) -> list[str]:
    """A brace pattern, or a list of them, as the shards' URLs; local ones must exist."""
    import braceexpand

    patterns = [urls] if isinstance(urls, str) else list(urls or [])
    found = [url for pattern in patterns for url in braceexpand.braceexpand(str(pattern))]
    if not found:
        raise UserError(f"data.{key} {urls!r} names no shards: give a brace pattern such as /data/train-{{0..9}}.tar")
    missing = [url for url in found if is_local(url) and not Path(url).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingFileError(f"data.{key}: shard {missing[0]!r} does not exist{more}")
    return found


def is_local(url: str) -> bool:
    return not url.startswith("pipe:") and "://" not in url


@functools.lru_cache(maxsize=8)
def read_info(first_url: str) -> dict | None:
    """The pack's description beside a local shard, where there is one."""
    where = Path(first_url).parent / INFO
    return json.loads(where.read_text()) if is_local(first_url) and where.is_file() else None


def wds_classes(urls: Any) -> int:
    """`${data_classes:}` for data=wds: the class count `vitlab.pack format=wds` wrote beside the shards."""
    info = read_info(expand(urls, "urls")[0])
    if info is None:
        raise UserError(f"no {INFO} beside the shards of data.urls: give data.num_classes (and data.num_train)")
    return len(info["class_names"])


# ---- data=hf: a Hugging Face dataset's splits and columns ----
IMAGE_KEYS, LABEL_KEYS = ("image", "img"), ("label", "labels", "fine_label")
SIZES: dict[str, dict[str, int]] = {}  # a saved dataset's split sizes, by its path, when it is streamed
STREAM_SHARDS = 64  # shards a saved dataset is cut into when streamed, to deal out to processes and workers


@functools.lru_cache(maxsize=8)
def load(name: str, config: str | None = None, streaming: bool = False, cache_dir: str | None = None) -> dict:
    """The dataset's splits {name: Dataset or IterableDataset}; a saved dataset streamed keeps its splits' sizes in
    SIZES."""
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith(("/", ".", "~")) or name.count("/") > 1):
        raise MissingFileError(f"data.name {name!r} does not exist (a folder save_to_disk wrote, or of parquet files)")
    import datasets  # (~1 s: after the refusal that needs none)

    if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
        saved = datasets.load_from_disk(str(path))
        splits = dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}
        if streaming:
            SIZES[str(path)] = {k: len(v) for k, v in splits.items()}
            splits = {
                k: v.to_iterable_dataset(num_shards=min(STREAM_SHARDS, max(1, len(v)))) for k, v in splits.items()
            }
        return splits
    if not path.exists():
        unless_hub_reachable_read_the_cache()  # (no network: the cache alone, at once)
    try:
        return dict(datasets.load_dataset(str(path) if path.exists() else name, config, streaming=streaming,
                                          cache_dir=cache_dir))  # fmt: skip
    except Exception as e:  # the Hub's errors offline are many kinds (ConnectionError, LocalEntryNotFoundError, ...)
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        if path.exists():
            raise UserError(f"data.name {name!r} cannot be read as a dataset ({said})") from e
        raise OfflineError(
            f"data.name {name!r} cannot be loaded from the Hugging Face Hub ({said}); offline, point data.name at a "
            "local copy: a folder Dataset.save_to_disk wrote, or a folder of its parquet files"
        ) from e


def find_column(features: dict, given: str | None, kinds: tuple, names: tuple, what: str, where: str) -> str:
    """The image or label column: `given`, else the one of `kinds` (features) or `names` where there is one."""
    columns = list(features)
    if given is not None:
        if given not in features:
            raise UserError(f"data.{what}_key {given!r} is not a column of {where}; its columns: {', '.join(columns)}")
        return given
    for found in ([c for c in columns if isinstance(features[c], kinds)], [c for c in names if c in features]):
        if len(found) == 1:
            return found[0]
    raise UserError(
        f"{where} has no single {what} column ({', '.join(columns)}): name it with data.{what}_key=<column>"
    )


def columns(split: Any, image_key: str | None, label_key: str | None, where: str) -> tuple[str, str]:
    import datasets

    features = split.features
    if features is None:
        raise UserError(f"{where} does not say its columns' features; name them with data.image_key and data.label_key")
    image = find_column(features, image_key, (datasets.Image,), IMAGE_KEYS, "image", where)
    label = find_column(features, label_key, (datasets.ClassLabel,), LABEL_KEYS, "label", where)
    kind = features[image]
    if isinstance(kind, datasets.ClassLabel) or (isinstance(kind, datasets.Value) and "string" not in kind.dtype
                                                 and "binary" not in kind.dtype):  # fmt: skip
        held = "class labels" if isinstance(kind, datasets.ClassLabel) else f"{kind.dtype} values"
        raise UserError(
            f"data.image_key {image!r} is a column of {where} that holds {held}, not images; its columns: "
            f"{', '.join(features)}"
        )
    return image, label


def class_names(split: Any, label_key: str) -> list[str] | None:
    import datasets

    feature = split.features[label_key]
    return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None


def hf_classes(name: str, config: str | None = None, label_key: str | None = None, streaming: bool = False,
               cache_dir: str | None = None, train_split: str = "train", multilabel: bool = False,
               label_format: str = "names", image_key: str | None = None) -> int:  # fmt: skip
    """`${data_classes:}` for data=hf: the classes of the train split's label column (several a row: multilabel)."""
    splits = load(str(name), config, bool(streaming), cache_dir)
    train = pick(splits, train_split, name)
    if multilabel and streaming:
        return len(hf_streamed_multilabels(train, image_key, label_key, label_format, f"{name} [{train_split}]")[2])
    if multilabel:
        return len(hf_multilabels(train, image_key, label_key, label_format, f"{name} [{train_split}]")[2])
    label = columns(train, None, label_key, f"{name} [{train_split}]")[1]
    names = class_names(train, label)
    if names is None:
        if streaming:
            raise UserError(f"the label column {label!r} of {name} is not a ClassLabel: give data.num_classes")
        names = label_indices(train[label], f"the label column {label!r} of {name} [{train_split}]")[1]
    return len(names)


def pick(splits: dict, split: str, name: str) -> Any:
    if split not in splits:
        raise UserError(f"{name} has no split {split!r}; its splits: {', '.join(splits)}")
    return splits[split]


def hf_multilabels(
    split: Any,
    image_key: str | None,
    label_key: str | None,
    label_format: str,
    where: str,
    names: list[str] | None = None,
) -> tuple[str, list[list[int]], list[str]]:
    """(image column, each row's class indices, class names) of a Hugging Face split with several labels a row
    (data/multilabels.py): a list column (its Sequence(ClassLabel)'s names, or the names found), or
    `label_format=columns` (a 0/1 column a class, every column but the image's)."""
    import datasets

    from vitlab.data import multilabels

    multilabels.check_label_format(label_format)
    if label_format == "columns":
        image = find_column(split.features, image_key, (datasets.Image,), IMAGE_KEYS, "image", where)
        return image, *multilabels.column_labels(split.remove_columns(image).to_list(), image, where, names)
    listed = [c for c, f in split.features.items() if isinstance(getattr(f, "feature", None), datasets.ClassLabel)]
    if label_key is None and len(listed) == 1:  # the one column of class-label lists (Sequence(ClassLabel))
        label_key = listed[0]
    image, label = columns(split, image_key, label_key, where)
    inner = getattr(split.features[label], "feature", None)
    if names is None and isinstance(inner, datasets.ClassLabel):
        names = list(inner.names)
    return image, *multilabels.multilabel_indices(split[label], f"the label column {label!r} of {where}", names)


def hf_streamed_multilabels(
    split: Any, image_key: str | None, label_key: str | None, label_format: str, where: str
) -> tuple[str, list[str], list[str]]:
    """(image column, label columns, class names) of a streamed Hugging Face split with several labels a row, the
    classes read from its features (its rows are read only as training goes): a list column of ClassLabel
    (Sequence(ClassLabel)), or `label_format=columns` (a 0/1 column a class, every column but the image's)."""
    import datasets

    from vitlab.data import multilabels

    multilabels.check_label_format(label_format)
    if split.features is None:
        raise UserError(f"{where} does not say its columns before it is read: set data.streaming=false")
    if label_format == "columns":
        image = find_column(split.features, image_key, (datasets.Image,), IMAGE_KEYS, "image", where)
        names = [c for c in split.features if c != image]
        return image, names, names
    listed = [c for c, f in split.features.items() if isinstance(getattr(f, "feature", None), datasets.ClassLabel)]
    if label_key is None and len(listed) == 1:  # the one column of class-label lists
        label_key = listed[0]
    image, label = columns(split, image_key, label_key, where) if label_key or listed else (None, None)
    inner = getattr(split.features[label], "feature", None) if label else None
    if not isinstance(inner, datasets.ClassLabel):
        why = f"the label column {label!r} of {where} names none" if label else f"no column of {where} names them"
        raise UserError(
            f"objective.multilabel=true streams its classes from the dataset's features, and {why} (a list of "
            "ClassLabel would): use 0/1 columns a class (data.label_format=columns), or set data.streaming=false"
        )
    return image, [label], list(inner.names)

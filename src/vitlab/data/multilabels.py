"""Several labels an image (`objective.multilabel=true`; `data.multilabel` follows it in conf/data/list.yaml and
hf.yaml): the labels of a list's rows (data=list) or a dataset's column (data=hf) as index lists and class names,
before torch. `data.label_format` says how a row holds them:

- `names` (the default): the label column holds class names (or indices) separated by `;` (`cat;dog`, `0;3`), or,
  in JSON Lines and Hugging Face datasets, a list of them (`["cat", "dog"]`); the classes are the names sorted.
- `columns`: one 0/1 column per class, every column but the image's (`data.image_key`): the class names are the
  column names, in the file's order; an image whose columns are all 0 has no label (a negative of every class).

Imports only the standard library and vitlab.utils.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vitlab.utils.errors import UserError

LABEL_FORMATS = ("names", "columns")
SEPARATOR = ";"


def check_label_format(label_format: str) -> None:
    if label_format not in LABEL_FORMATS:
        raise UserError(f"data.label_format {label_format!r} is not one of {list(LABEL_FORMATS)}")


def _cell(value: Any, where: str, row: int) -> list[Any]:
    """One row's labels as a list of names or integers."""
    if isinstance(value, (list, tuple)):
        parts = list(value)
    elif isinstance(value, bool) or value is None:
        parts = []
    elif isinstance(value, int):
        parts = [value]
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(SEPARATOR) if p.strip()]
    else:
        raise UserError(f"{where}, row {row}, holds the label {value!r} ({type(value).__name__}): give class names or "
                        f"indices separated by {SEPARATOR!r}, or a list of them")  # fmt: skip
    if not parts:
        raise UserError(
            f"{where}, row {row}, has no label, and objective.multilabel=true needs one or more (class names "
            f"separated by {SEPARATOR!r}); images that are negatives of every class: data.label_format=columns"
        )
    return [int(p) if isinstance(p, str) and p.isdigit() else p for p in parts]


def multilabel_indices(
    values: Sequence[Any], where: str, names: list[str] | None = None
) -> tuple[list[list[int]], list[str]]:
    """A label column of several labels a row as each row's class indices (sorted, once each) and the class names:
    integers as they are (named by their numbers unless `names` are known), names as their place among the sorted
    names (an image folder's order)."""
    cells = [_cell(v, where, n) for n, v in enumerate(values, start=1)]
    flat = {p for cell in cells for p in cell}
    if all(isinstance(p, int) and not isinstance(p, bool) for p in flat):
        if any(p < 0 for p in flat):
            raise UserError(f"{where} holds the label {min(flat)}: labels are class indices >= 0 or class names")
        found = names or [str(i) for i in range(max(flat) + 1)]
        if max(flat) >= len(found):
            raise UserError(f"{where} holds the label {max(flat)}, not a class index of the {len(found)} classes")
        return [sorted(set(cell)) for cell in cells], found
    if all(isinstance(p, str) for p in flat):
        found = names or sorted(flat)
        index = {name: i for i, name in enumerate(found)}
        if unknown := sorted(flat - set(index)):
            raise UserError(f"{where} holds labels not among the classes {found[:5]}...: {unknown[:5]}")
        return [sorted({index[p] for p in cell}) for cell in cells], found
    raise UserError(f"{where} mixes class names and indices ({sorted(map(str, flat))[:5]}): give one kind")


def column_labels(
    rows: Sequence[dict], image_key: str, where: str, names: list[str] | None = None
) -> tuple[list[list[int]], list[str]]:
    """data.label_format=columns: each row's classes from its 0/1 columns (every column but `image_key`)."""
    columns = [c for c in rows[0] if c != image_key]
    if names is not None and columns != names:
        raise UserError(f"{where} has the class columns {columns[:5]}..., not the training list's {names[:5]}...")
    if not columns:
        raise UserError(f"{where} has no class column beside {image_key!r} (data.label_format=columns)")
    labels = []
    for n, row in enumerate(rows, start=1):
        values = [str(row[c]).strip() for c in columns]
        if odd := [(c, v) for c, v in zip(columns, values, strict=True) if v not in ("0", "1", "True", "False")]:
            raise UserError(f"{where}, row {n}, column {odd[0][0]!r} holds {odd[0][1]!r}: a class column holds 0 or 1")
        labels.append([i for i, v in enumerate(values) if v in ("1", "True")])
    return labels, columns


def class_counts(labels: Sequence[Any], names: Sequence[str]) -> dict[str, int]:
    """The images of each class (an index, or a list of indices an image), by name: the run's metrics.json."""
    counts = [0] * len(names)
    for label in labels:
        for i in label if isinstance(label, (list, tuple)) else [label]:
            counts[int(i)] += 1
    return dict(zip(names, counts, strict=True))

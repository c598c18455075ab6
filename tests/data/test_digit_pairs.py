"""data=digit_pairs (issue 77, point 4): data=segmentation's canvases of two digits, each labelled by the digits its
mask shows, as multi-hot rows a multi-label run reads."""

import pytest
import torch

from vitlab.data import DigitPairsDataModule
from vitlab.data.canvas import make_split
from vitlab.data.digit_pairs import digit_labels
from vitlab.utils.errors import UserError


def test_each_canvas_is_labelled_by_the_digits_on_it():
    dm = DigitPairsDataModule(img_size=16, canvas_size=16, canvases=[40, 8, 8], on_device=False)
    dm.setup("fit")
    _, masks = make_split("train", 40, 16, 3, 0)
    labels = dm.train_set.base.labels
    assert labels.shape == (40, 10) and dm.multilabel and dm.class_names == [str(d) for d in range(10)]
    for mask, row in zip(masks, labels, strict=True):
        shown = {int(v) - 1 for v in mask.unique() if v > 0}
        assert set(torch.nonzero(row).flatten().tolist()) == shown and 1 <= len(shown) <= 2
    assert (labels.sum(1) == 2).float().mean() > 0.5  # most canvases show two digits
    image, label = dm.train_set[0]
    assert image.shape == (3, 16, 16) and torch.equal(label, labels[0])
    assert dm.class_counts == {str(d): int(labels[:, d].sum()) for d in range(10)}
    assert digit_labels(torch.tensor([[[0, 3], [3, 10]]])).tolist() == [[0, 0, 1, 0, 0, 0, 0, 0, 0, 1]]


def test_bad_canvases_are_one_line():
    with pytest.raises(UserError, match=r"^data.canvases \[4, 4\] must be \[train, val, test\] counts >= 1$"):
        DigitPairsDataModule(img_size=16, canvases=[4, 4])
    with pytest.raises(UserError, match=r"^data=digit_pairs has several labels an image: train it with objective.mul"):
        DigitPairsDataModule(img_size=16, multilabel=False)

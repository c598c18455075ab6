"""LightningDataModules, selected in configs with `data=<name>` (conf/data/)."""

from vitlab.data.cifar import CIFAR10DataModule, CIFAR100DataModule
from vitlab.data.digits import DigitsDataModule
from vitlab.data.fake import FakeDataModule
from vitlab.data.hf import HFDataModule
from vitlab.data.imagefolder import ImageFolderDataModule
from vitlab.data.lists import ListDataModule
from vitlab.data.segmentation import SegmentationDataModule
from vitlab.data.streaming import StreamingDataModule
from vitlab.data.wds import WDSDataModule

__all__ = [
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "DigitsDataModule",
    "FakeDataModule",
    "HFDataModule",
    "ImageFolderDataModule",
    "ListDataModule",
    "SegmentationDataModule",
    "StreamingDataModule",
    "WDSDataModule",
]

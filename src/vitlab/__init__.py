"""vitlab: a from-scratch Vision Transformer research framework, checked against timm."""

__version__ = "0.1.0"

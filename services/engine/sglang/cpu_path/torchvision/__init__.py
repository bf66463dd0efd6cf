"""Import-only torchvision for SGLang on CPU (see ../README.md). It has no dist-info, so
transformers still reports torchvision as absent and never uses it."""

import enum

from _stub import install

__version__ = "0.28.0"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


install("torchvision", RuntimeError, {"InterpolationMode": InterpolationMode})

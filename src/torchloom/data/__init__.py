"""Data for torchloom runs: `DataModule` and preprocessing for text, images and audio."""

from torchloom.data.module import DataModule

__all__ = ["DataModule"]

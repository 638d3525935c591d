"""Image transforms: resize and normalise (plain settings or a transformers image processor), and augment.

`ImageTransform` turns decoded images into ``pixel_values`` (float32 ``(channels, height, width)``), either with a
transformers image processor (`load_image_processor`) or with plain ``size`` / ``mean`` / ``std`` settings;
`preprocess_images` applies it to a table with a batched ``Dataset.map`` (before the cache). `random_crop`,
`random_horizontal_flip` and `ImageAugmentation` augment training batches with torch ops (after the cache, so
every epoch sees new draws). Part of `torchloom.data.image`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from torchloom._settings import invalid
from torchloom.data.image_decoding import MODES, load_image
from torchloom.data.tables import require_column
from torchloom.errors import ConfigError

if TYPE_CHECKING:
    import PIL.Image

__all__ = [
    "ImageAugmentation",
    "ImageTransform",
    "load_image_processor",
    "preprocess_images",
    "random_crop",
    "random_horizontal_flip",
]

#: Resampling filters for plain resizing, by name.
RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3, "lanczos": 1, "box": 4, "hamming": 5}


# -------------------------------------------------------------------------------------------- transforms


def load_image_processor(spec: str | os.PathLike[str] | Mapping[str, Any] | Any, backend: str | None = "pil") -> Any:
    """Build a transformers image processor.

    Args:
        spec: a local directory holding ``preprocessor_config.json``; a Hub id already in the local cache; a
            mapping with that file's contents (``{"image_processor_type": "ViTImageProcessor", "size": {"height":
            32, "width": 32}, "image_mean": [0.5], "image_std": [0.5]}``); or a processor object (returned as is).
        backend (`str`, *optional*, defaults to ``"pil"``): transformers' processing backend; ``"pil"`` works
            everywhere (``"torchvision"`` needs torchvision), ``None`` lets transformers choose.

    Returns:
        the processor (a `transformers.image_processing_utils.BaseImageProcessor` or similar).

    Raises:
        ConfigError: the directory holds no processor config, the mapping names no known processor type, or
            loading fails (names the reason).
    """
    from transformers import AutoImageProcessor

    if not isinstance(spec, str | os.PathLike | Mapping):
        if not callable(spec):
            raise ConfigError(
                f"image_processor: got a {type(spec).__name__}; expected a directory, a dict or a processor"
            )
        return spec
    kwargs: dict[str, Any] = {"backend": backend} if backend else {}
    try:
        if isinstance(spec, Mapping):
            if "image_processor_type" not in spec:
                raise ConfigError(
                    f"image_processor {dict(spec)!r} has no 'image_processor_type'; expected a "
                    "preprocessor_config.json-style dict such as {'image_processor_type': 'ViTImageProcessor', ...}"
                )
            with tempfile.TemporaryDirectory(prefix="torchloom-processor-") as scratch:
                with open(os.path.join(scratch, "preprocessor_config.json"), "w", encoding="utf-8") as f:
                    json.dump(dict(spec), f)
                return AutoImageProcessor.from_pretrained(scratch, **kwargs)
        path = Path(spec).expanduser()
        text = os.fspath(spec)
        if path.is_dir() and not (path / "preprocessor_config.json").is_file():
            raise ConfigError(f"image_processor directory '{path}' has no preprocessor_config.json")
        if (path.is_absolute() or text.startswith((".", "~"))) and not path.exists():
            raise ConfigError(f"image_processor path '{path}' does not exist")
        return AutoImageProcessor.from_pretrained(str(path) if path.is_dir() else text, **kwargs)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"image_processor {os.fspath(spec) if not isinstance(spec, Mapping) else dict(spec)!r} "
            f"cannot be loaded ({reason})"
        ) from None


class ImageTransform:
    """Decoded images -> ``pixel_values``: float32 ``(batch, channels, height, width)``.

    Either a transformers image processor does the work (``processor``), or the plain settings do: resize to
    ``size`` (Pillow, ``resample``), scale to ``[0, 1]``, then ``(x - mean) / std`` per channel.

    Args:
        mode (`str`, defaults to ``"RGB"``): ``"RGB"`` (3 channels) or ``"L"`` (1); images are converted to it
            before anything else (`load_image`).
        size (`int` or `[height, width]`, *optional*): resize every image to this; ``None`` keeps their size
            (they must then all have the same one).
        mean (`float` or `list[float]`, *optional*): one value, or one per channel; ``None``: no
            normalisation (values stay in ``[0, 1]``).
        std (`float` or `list[float]`, *optional*): one value, or one per channel, with ``mean``.
        resample (`str`, defaults to ``"bilinear"``): ``nearest``, ``bilinear``, ``bicubic``, ``lanczos``,
            ``box`` or ``hamming``.
        processor (*optional*): a transformers image processor (see `load_image_processor`); then ``size``,
            ``mean``, ``std`` and ``resample`` must stay unset (set the processor's own).

    Raises:
        ConfigError: a bad setting.
    """

    def __init__(
        self,
        mode: str = "RGB",
        size: int | Sequence[int] | None = None,
        mean: float | Sequence[float] | None = None,
        std: float | Sequence[float] | None = None,
        resample: str = "bilinear",
        processor: Any = None,
    ) -> None:
        if mode not in MODES:
            raise invalid("mode", mode, f"one of {', '.join(MODES)}", owner="ImageTransform")
        self.mode, self.channels, self.processor = mode, MODES[mode], processor
        if processor is not None:
            given = [k for k, v in (("size", size), ("mean", mean), ("std", std)) if v is not None]
            if given or resample != "bilinear":
                raise ConfigError(
                    f"ImageTransform: {', '.join(given) or 'resample'} set together with an image processor; set the "
                    "processor's own size / image_mean / image_std / resample instead"
                )
        self.size = _size(size)
        self.mean = _per_channel("mean", mean, self.channels)
        self.std = _per_channel("std", std, self.channels)
        if (self.mean is None) != (self.std is None):
            raise ConfigError("ImageTransform: set both mean and std, or neither")
        if self.std is not None and any(s <= 0 for s in self.std):
            raise ConfigError(f"ImageTransform: std={list(self.std)}; expected positive values")
        if resample not in RESAMPLE:
            raise invalid("resample", resample, f"one of {', '.join(RESAMPLE)}", owner="ImageTransform")
        self.resample = resample

    def settings(self) -> dict[str, Any]:
        """Everything that shapes the output, JSON-like (for a `cache_key`)."""
        settings: dict[str, Any] = {"mode": self.mode, "exif_transpose": True, "alpha": "over white"}
        if self.processor is not None:
            to_json = getattr(self.processor, "to_json_string", None)
            config = json.loads(to_json()) if to_json else repr(self.processor)
            return {**settings, "processor": {"class": type(self.processor).__qualname__, "config": config}}
        return {**settings, "size": self.size, "mean": self.mean, "std": self.std, "resample": self.resample}

    def __call__(self, images: Sequence[PIL.Image.Image], names: Sequence[str] | None = None) -> np.ndarray:
        """Transform images already in ``mode`` (`load_image`); ``names`` name them in error messages."""
        from PIL.Image import Resampling  # Pillow is there: it decoded these images (`load_image`)

        names = names or [f"image {i}" for i in range(len(images))]
        if self.processor is not None:
            arrays = [np.asarray(image).reshape(image.height, image.width, -1) for image in images]
            try:
                out = self.processor(images=arrays, return_tensors="np", input_data_format="channels_last")
            except (ValueError, TypeError, RuntimeError) as exc:
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConfigError(
                    f"image processor {type(self.processor).__name__} failed on {names[0]} ... ({reason}); check that "
                    f"image_mean / image_std have one value per channel ({self.channels} in mode {self.mode!r})"
                ) from None
            return np.asarray(out["pixel_values"], dtype=np.float32)
        rows: list[np.ndarray] = []
        for image, where in zip(images, names):
            if self.size is not None and (image.height, image.width) != self.size:
                image = image.resize((self.size[1], self.size[0]), Resampling(RESAMPLE[self.resample]))
            pixels = np.asarray(image, dtype=np.float32).reshape(image.height, image.width, -1).transpose(2, 0, 1)
            if rows and pixels.shape != rows[0].shape:
                raise ConfigError(
                    f"{where} is {pixels.shape[2]}x{pixels.shape[1]} but {names[0]} is {rows[0].shape[2]}x"
                    f"{rows[0].shape[1]}; set size so that every image is resized to the same size"
                )
            rows.append(pixels)
        batch = np.stack(rows) / np.float32(255)
        if self.mean is not None and self.std is not None:
            mean = np.asarray(self.mean, np.float32)[:, None, None]
            batch = (batch - mean) / np.asarray(self.std, np.float32)[:, None, None]
        return batch.astype(np.float32, copy=False)


def _size(size: Any) -> tuple[int, int] | None:
    if size is None:
        return None
    values = [size, size] if isinstance(size, int) else list(size) if isinstance(size, Sequence) else None
    if (
        values is None
        or len(values) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)
    ):
        raise invalid("size", size, "a positive integer or [height, width]", owner="ImageTransform")
    return values[0], values[1]


def _per_channel(setting: str, value: Any, channels: int) -> list[float] | None:
    if value is None:
        return None
    values = [value] if isinstance(value, int | float) else list(value) if isinstance(value, Sequence) else None
    if values is None or not values or any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        raise invalid(setting, value, "a number or one number per channel", owner="ImageTransform")
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise ConfigError(
            f"ImageTransform: {setting}={value!r} has {len(values)} values; mode has {channels} channel(s)"
        )
    return [float(v) for v in values]


def preprocess_images(
    dataset: datasets.Dataset,
    transform: ImageTransform,
    image_column: str = "image",
    keep_columns: Sequence[str] = ("labels",),
    batch_size: int = 256,
    name: str = "data",
    row_names: Callable[[int], str] | None = None,
) -> datasets.Dataset:
    """Decode every image and transform it, with a batched `datasets.Dataset.map`.

    Args:
        dataset (`datasets.Dataset`): the table (see `image_table`).
        transform (`ImageTransform`): the conversion, resizing and normalisation.
        image_column (`str`, defaults to ``"image"``): a ``datasets.Image`` column (file paths or bytes), a binary
            column of encoded images, or pixel arrays.
        keep_columns (`Sequence[str]`, defaults to ``("labels",)``): columns kept next to ``pixel_values``; every
            other column is dropped. Missing ones are ignored.
        batch_size (`int`, defaults to 256): images per map call.
        name (`str`, defaults to ``"data"``): what to call the table in error messages.
        row_names (*optional*): what to call row ``i`` in the error about its image, in place of ``name``: e.g.
            ``"<name> path 'rows.jsonl': line 3"`` for a table read from a file (`read_image_file_table`).

    Returns:
        `datasets.Dataset`: ``pixel_values`` (``Array3D`` float32, ``(channels, height, width)``, the same for
        every row) plus ``keep_columns``, in memory.

    Raises:
        ConfigError: the column is missing or of the wrong type, the table is empty, or an image cannot be read,
            is truncated, cannot be converted, or comes out of another size than the first (each names the file
            or row).
    """
    require_column(dataset, image_column, "image_column", name)
    kind = _image_kind(dataset.features[image_column], image_column, name)
    if len(dataset) == 0:
        raise ConfigError(f"{name} has no rows; an empty split")
    if kind is None and isinstance(dataset.features[image_column], datasets.Image):
        dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
    source = dataset.with_format("numpy") if kind is not None else dataset

    def label(value: Any, row: int) -> str:
        path = value.get("path") if isinstance(value, Mapping) else None
        return f"image file '{path}'" if path else f"row {row} of column {image_column!r}"

    def encode_rows(values: Sequence[Any], indices: Sequence[int]) -> np.ndarray:
        labels = [label(v, i) for v, i in zip(values, indices)]
        images = []
        for value, where, row in zip(values, labels, indices):
            if kind is not None:
                value = np.asarray(value).astype(kind)  # the numpy formatter widens integers to int64
            path_only = isinstance(value, Mapping) and value.get("bytes") is None
            named = row_names(row) if row_names is not None else name
            images.append(load_image(value, transform.mode, named if path_only else f"{named}: {where}"))
        try:
            return transform(images, labels)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None

    first = encode_rows([source[0][image_column]], [0])[0]
    shape = tuple(int(s) for s in first.shape)

    def encode(values: Sequence[Any], indices: list[int]) -> dict[str, Any]:
        pixels = encode_rows(values, indices)
        if pixels.shape[1:] != shape:
            raise ConfigError(
                f"{name}: rows {indices[0]}..{indices[-1]} came out of shape {pixels.shape[1:]} but row 0 as {shape}; "
                "set size (or the processor's size) so that every image has the same size"
            )
        return {"pixel_values": pixels}

    keep = [c for c in keep_columns if c in dataset.column_names and c != image_column]
    features = datasets.Features(
        {**{c: dataset.features[c] for c in keep}, "pixel_values": datasets.Array3D(shape=shape, dtype="float32")}
    )
    return source.map(
        encode,
        input_columns=[image_column],
        with_indices=True,
        batched=True,
        batch_size=batch_size,
        remove_columns=[c for c in dataset.column_names if c not in keep],
        features=features,
        keep_in_memory=True,
        load_from_cache_file=False,
        new_fingerprint=datasets.fingerprint.generate_random_fingerprint(),
        desc=f"Preprocessing images of {name}",
    ).with_format(None)


def _image_kind(feature: Any, column: str, name: str) -> str | None:
    """``None`` for encoded images (a ``datasets.Image`` or binary column), else the dtype of pixel arrays."""
    if isinstance(feature, datasets.Image) or (
        isinstance(feature, datasets.Value) and feature.dtype in ("binary", "large_binary")
    ):
        return None
    if isinstance(feature, datasets.Array2D | datasets.Array3D):
        return str(feature.dtype)
    inner, depth = feature, 0
    while hasattr(inner, "feature") and not isinstance(inner, datasets.Value):
        inner, depth = inner.feature, depth + 1
    if depth >= 2 and isinstance(inner, datasets.Value) and inner.dtype in ("uint8", "uint16", "int64", "int32"):
        return "uint16" if inner.dtype == "uint16" else "uint8"
    hint = ""
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        hint = " (file paths? cast them with dataset.cast_column(column, datasets.Image()))"
    raise ConfigError(
        f"{name}: image_column {column!r} has type {feature}{hint}; expected a datasets.Image column or pixel arrays"
    )


# ------------------------------------------------------------------------------------------ augmentation


def random_crop(pixel_values: torch.Tensor, padding: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pad each image by ``padding`` pixels on every side (repeating its edge pixels) and crop it back to its size
    at a random offset: shifts of up to ``padding`` pixels in each direction.

    Args:
        pixel_values (`torch.Tensor`): ``(batch, channels, height, width)``.
        padding (`int`): the largest shift; 0 returns the input.
        generator (`torch.Generator`, *optional*): the random source; ``None`` uses torch's global one (which
            the engine seeds, and which each dataloader worker has seeded on its own).

    Returns:
        `torch.Tensor`: the same shape and dtype; every image shifted independently.
    """
    if padding == 0:
        return pixel_values
    batch, _, height, width = pixel_values.shape
    padded = F.pad(pixel_values, (padding, padding, padding, padding), mode="replicate")
    dy = torch.randint(0, 2 * padding + 1, (batch,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (batch,), generator=generator)
    rows = (dy[:, None] + torch.arange(height))[:, :, None]  # (batch, height, 1)
    cols = (dx[:, None] + torch.arange(width))[:, None, :]  # (batch, 1, width)
    picked = padded.permute(0, 2, 3, 1)[torch.arange(batch)[:, None, None], rows, cols]  # (batch, h, w, channels)
    return picked.permute(0, 3, 1, 2).contiguous()


def random_horizontal_flip(
    pixel_values: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Mirror each image left-right with probability ``p`` (independently); ``(batch, channels, height, width)``."""
    if p <= 0:
        return pixel_values
    flip = torch.rand(pixel_values.shape[0], generator=generator) < p
    return torch.where(flip[:, None, None, None], pixel_values.flip(-1), pixel_values)


class ImageAugmentation:
    """A dataloader ``collate_fn`` for training: stack the rows, then `random_crop` and `random_horizontal_flip`.

    Augmentation runs after the cache, on every batch, so each epoch sees new draws; validation and prediction
    batches are never augmented.

    Args:
        crop_padding (`int`, defaults to 0): the largest shift of `random_crop`; 0 turns it off.
        horizontal_flip (`float`, defaults to 0.0): the probability of mirroring an image; 0 turns it off.
        generator (`torch.Generator`, *optional*): the random source; ``None``: torch's global one.
    """

    def __init__(self, crop_padding: int = 0, horizontal_flip: float = 0.0, generator: torch.Generator | None = None):
        if isinstance(crop_padding, bool) or not isinstance(crop_padding, int) or crop_padding < 0:
            raise invalid("crop_padding", crop_padding, "an integer >= 0", owner="ImageAugmentation")
        if (
            isinstance(horizontal_flip, bool)
            or not isinstance(horizontal_flip, int | float)
            or not 0 <= horizontal_flip <= 1
        ):
            raise invalid("horizontal_flip", horizontal_flip, "a probability in [0, 1]", owner="ImageAugmentation")
        self.crop_padding, self.horizontal_flip, self.generator = crop_padding, float(horizontal_flip), generator

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = default_collate(list(rows))
        pixels = random_crop(batch["pixel_values"], self.crop_padding, self.generator)
        batch["pixel_values"] = random_horizontal_flip(pixels, self.horizontal_flip, self.generator)
        return batch

"""Image preprocessing: decode with Pillow, resize and normalise, augment training batches, cache the result.

The pieces are plain functions and small classes over `datasets.Dataset`, and `ImageClassificationData` strings
them together as a `DataModule`:

- `load_image` decodes one image (a file, encoded bytes, a ``datasets`` Image value, an array or a
  `PIL.Image.Image`) and converts it to ``"RGB"`` or ``"L"``; every failure is a `ConfigError` naming the file
  or the row.
- `read_image_folder` lists an image folder with one sub-folder per class; `image_table` turns any source (an
  image folder, a ``save_to_disk`` directory, a `datasets.Dataset` with an ``Image`` or array column, or arrays)
  into a table.
- `ImageTransform` resizes and normalises, either with a transformers image processor (`load_image_processor`:
  from a local directory, a Hub id in the local cache, or a ``preprocessor_config.json``-style dict) or with
  plain settings (``size``, ``mean``, ``std``); `preprocess_images` applies it with a batched ``Dataset.map``
  and stores ``pixel_values`` as float32 ``(channels, height, width)``.
- `random_crop`, `random_horizontal_flip` and `ImageAugmentation` augment training batches on the fly, with
  torch ops (after the cache, so every epoch sees new draws).

.. code-block:: python

    data = ImageClassificationData(
        train="images/train", validation="images/test",          # one sub-folder per class
        mode="RGB", size=[64, 64], mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5],
        random_crop_padding=4, horizontal_flip=0.5, batch_size=64,
    )
    torchloom.Engine(max_epochs=1).fit(task, datamodule=data)

The processed splits are saved under a key that hashes the raw data and every setting that shapes them (see
`torchloom.data.cache`), so a second run loads them instead of decoding again. Pillow is the one extra
dependency: ``pip install 'torchloom[vision]'``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import datasets
import numpy as np
import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader, default_collate

from torchloom.data.cache import DatasetCache, cache_key, fingerprint
from torchloom.data.module import DataModule
from torchloom.data.text import encode_labels, resolve_label_names
from torchloom.errors import ConfigError

try:
    import PIL
    import PIL.Image
    import PIL.ImageOps
except ImportError as _exc:  # pragma: no cover - Pillow is in the vision extra
    raise ImportError("torchloom.data.image needs Pillow: pip install 'torchloom[vision]'") from _exc

__all__ = [
    "ImageAugmentation",
    "ImageClassificationData",
    "ImageTransform",
    "image_data_fingerprint",
    "image_table",
    "load_image",
    "load_image_processor",
    "preprocess_images",
    "random_crop",
    "random_horizontal_flip",
    "read_image_folder",
]

logger = logging.getLogger(__name__)

#: Target modes and their channel counts.
MODES = {"RGB": 3, "L": 1}
#: Resampling filters for plain resizing, by name.
RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3, "lanczos": 1, "box": 4, "hamming": 5}
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_ALPHA = ("RGBA", "LA", "PA", "RGBa", "La")

#: What an image source may be (see `image_table`); typed loosely for config files.
ImageSource: TypeAlias = Any


# ------------------------------------------------------------------------------------------------ decoding


def load_image(source: Any, mode: str = "RGB", name: str = "") -> PIL.Image.Image:
    """Decode one image and convert it to ``mode``.

    EXIF orientation is applied (a photo taken sideways comes out upright), the first frame of an animation is
    used, and transparent pixels are laid over white before the alpha channel is dropped. 16-bit grey images
    (``I;16``) are scaled to 8 bits (``round(v * 255 / 65535)``); 32-bit ones (``I``, ``F``) have no fixed
    value range and are refused rather than clipped.

    Args:
        source: a path (`str` or `os.PathLike`) to an image file; encoded bytes; a ``datasets.Image`` value
            (``{"bytes": ..., "path": ...}``: the bytes if present, else the file); a `numpy.ndarray` of ``uint8``
            (or ``uint16``) pixels shaped ``(height, width)`` or ``(height, width, channels)`` with 1, 3 or 4
            channels; or a `PIL.Image.Image`.
        mode (`str`, defaults to ``"RGB"``): ``"RGB"`` or ``"L"`` (8-bit grey).
        name (`str`, *optional*): what to call it in error messages, e.g. ``"train data: row 7 of column
            'image'"``; for a file, the messages name ``"<name>: image file '<path>'"``.

    Returns:
        `PIL.Image.Image` in ``mode``, fully decoded.

    Raises:
        ConfigError: the file does not exist or cannot be read, is not an image Pillow can read, is truncated
            or corrupt, or is in a mode that cannot be converted to ``mode`` (each names the file or row).
    """
    if mode not in MODES:
        raise ConfigError(f"{name or 'load_image'}: mode={mode!r}; expected one of {', '.join(MODES)}")
    if isinstance(source, Mapping):
        raw, path = source.get("bytes"), source.get("path")
        if raw is None and not path:
            raise ConfigError(f"{name or 'image'}: an image value with neither bytes nor a path")
        if raw is not None:
            source = raw
            name = name or (f"image '{path}'" if path else "")
        else:
            source = path
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        where = f"{name}: image file '{path}'" if name else f"image file '{path}'"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"{where} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"{where} cannot be read: {exc.strerror or exc}") from None
        return _convert(_decode(io.BytesIO(data), where), mode, where)
    where = name or "image"
    if isinstance(source, PIL.Image.Image):
        image = source
    elif isinstance(source, np.ndarray):
        image = _from_array(source, where)
    elif isinstance(source, bytes | bytearray | memoryview):
        image = _decode(io.BytesIO(source), where)
    else:
        raise ConfigError(
            f"{where}: got a {type(source).__name__}; expected a path, encoded bytes, a datasets Image value, "
            "a numpy array of pixels or a PIL image"
        )
    return _convert(image, mode, where)


def _decode(stream: io.BytesIO, where: str) -> PIL.Image.Image:
    try:
        image = PIL.Image.open(stream)
        image.load()  # decodes now: a truncated file fails here, not later inside a batch
        return PIL.ImageOps.exif_transpose(image) or image
    except PIL.UnidentifiedImageError:
        raise ConfigError(f"{where} is not an image that Pillow can read (unknown or damaged header)") from None
    except PIL.Image.DecompressionBombError as exc:
        raise ConfigError(f"{where} is too large to decode safely ({exc})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        reason = str(exc).strip() or type(exc).__name__
        raise ConfigError(f"{where} is truncated or corrupt ({reason})") from None


def _from_array(array: np.ndarray, where: str) -> PIL.Image.Image:
    shape_ok = array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (1, 3, 4))
    if not shape_ok or array.dtype not in (np.uint8, np.uint16) or min(array.shape[:2], default=0) < 1:
        raise ConfigError(
            f"{where} is an array of dtype {array.dtype} and shape {tuple(array.shape)}; expected uint8 (or uint16) "
            "pixels shaped (height, width) or (height, width, channels) with 1, 3 or 4 channels"
        )
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.dtype == np.uint16:
        if array.ndim == 3:
            raise ConfigError(f"{where} is a uint16 colour array; expected uint8 for colour images")
        return PIL.Image.fromarray(np.ascontiguousarray(array, dtype="<u2"))  # mode I;16, scaled by _convert
    return PIL.Image.fromarray(np.ascontiguousarray(array))


def _convert(image: PIL.Image.Image, mode: str, where: str) -> PIL.Image.Image:
    source = image.mode
    if source == mode:
        return image
    if source in _SIXTEEN_BIT:
        wide = np.asarray(image).astype(np.uint32)
        image = PIL.Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8))  # round(v * 255 / 65535)
        return image if mode == "L" else image.convert(mode)
    if source in ("I", "F"):
        kind = "integer" if source == "I" else "floating-point"
        raise ConfigError(
            f"{where} is an image in mode {source!r} (32-bit {kind} pixels, no fixed value range), which cannot be "
            f"converted to {mode!r} without guessing a scale; save it with 8 or 16 bits per channel"
        )
    try:
        if source in _ALPHA or (source == "P" and "transparency" in image.info):
            rgba = image.convert("RGBA")
            image = PIL.Image.alpha_composite(PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return image.convert(mode)
    except ValueError as exc:
        raise ConfigError(
            f"{where} is an image in mode {source!r}, which cannot be converted to {mode!r} ({exc})"
        ) from None


# --------------------------------------------------------------------------------------------- sources


def _image_extensions() -> set[str]:
    PIL.Image.init()
    return {ext for ext, fmt in PIL.Image.registered_extensions().items() if fmt in PIL.Image.OPEN}


def read_image_folder(
    root: str | os.PathLike[str],
    image_column: str = "image",
    label_column: str = "label",
    label_names: Sequence[str] | None = None,
    name: str = "data",
    allow_empty_classes: bool = False,
) -> datasets.Dataset:
    """List an image folder with one sub-folder per class: ``root/<class>/<image>`` (nested folders allowed).

    Files whose suffix is not one Pillow reads (``.png``, ``.jpg``, ``.webp``, ``.tif`` ...) and hidden files
    are skipped; nothing is decoded here (`preprocess_images` does that, and names any file it cannot read).

    Args:
        root (`str` or `os.PathLike`): the folder.
        image_column (`str`, defaults to ``"image"``), label_column (`str`, defaults to ``"label"``): the
            columns to create.
        label_names (`Sequence[str]`, *optional*): the classes in id order; every sub-folder must be one of them
            (a validation folder may lack some). Defaults to the sorted sub-folder names.
        name (`str`, defaults to ``"data"``): what to call it in error messages.
        allow_empty_classes (`bool`, defaults to False): keep a class sub-folder without image files as a class
            with no samples here (its name still takes its place, and id, among the classes). By default such a
            folder is an error: it would shift the ids of the classes after it.

    Returns:
        `datasets.Dataset`: ``image_column`` (a ``datasets.Image(decode=False)`` column of paths) and
        ``label_column`` (a `datasets.ClassLabel`), sorted by class, then path.

    Raises:
        ConfigError: ``root`` is not a directory, has no class sub-folders, a sub-folder is not in
            ``label_names``, a class sub-folder holds no image file (unless ``allow_empty_classes``; names the
            folder), or there is no image at all (an empty split).
    """
    path = Path(root).expanduser()
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise ConfigError(f"{name}: image folder '{path}' {what}")
    classes = sorted(d.name for d in path.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ConfigError(
            f"{name}: image folder '{path}' has no class sub-folders; expected {path}/<class name>/<image file>"
        )
    names = list(label_names) if label_names is not None else classes
    unknown = [c for c in classes if c not in names]
    if unknown:
        raise ConfigError(
            f"{name}: image folder '{path}' has class sub-folders {unknown[:5]} that are not in label_names {names}"
        )
    extensions = _image_extensions()
    paths, labels = [], []
    for label in classes:
        folder = path / label
        for file in sorted(folder.rglob("*")):
            hidden = any(part.startswith(".") for part in file.relative_to(folder).parts)
            if not hidden and file.suffix.lower() in extensions and file.is_file():
                paths.append({"bytes": None, "path": str(file)})
                labels.append(names.index(label))
    if not paths:
        raise ConfigError(
            f"{name}: image folder '{path}' has no image files in its class sub-folders ({', '.join(classes[:5])}); "
            "an empty split"
        )
    present = set(labels)
    empty = [label for label in classes if names.index(label) not in present]
    if empty and not allow_empty_classes:
        raise ConfigError(
            f"{name}: class folder '{path / empty[0]}' has no image files"
            + (f" (nor do {', '.join(repr(e) for e in empty[1:6])})" if len(empty) > 1 else "")
            + "; expected at least one image in each class sub-folder: add images, remove the folder, or set "
            "allow_empty_classes=True to keep it as a class with no samples"
        )
    features = datasets.Features(
        {image_column: datasets.Image(decode=False), label_column: datasets.ClassLabel(names=names)}
    )
    return datasets.Dataset.from_dict({image_column: paths, label_column: labels}, features=features)


def image_table(
    source: ImageSource,
    image_column: str = "image",
    label_column: str = "label",
    label_names: Sequence[str] | None = None,
    name: str = "data",
    allow_empty_classes: bool = False,
) -> datasets.Dataset:
    """Return ``source`` as a `datasets.Dataset` with an image column and a label column.

    Args:
        source: one of

            - a directory written by ``save_to_disk`` (one `datasets.Dataset`), loaded memory-mapped;
            - any other directory: an image folder, one sub-folder per class (`read_image_folder`);
            - a `datasets.Dataset` whose ``image_column`` is a ``datasets.Image`` column or holds pixel arrays
              (``Array2D`` / ``Array3D`` / nested lists of integers), returned as is;
            - ``(images, labels)``: a ``uint8`` array shaped ``(n, height, width)`` or ``(n, height, width,
              channels)`` (or a sequence of such images) and ``n`` labels;
            - a mapping ``{image_column: images, label_column: labels}`` of the same.
        image_column (`str`): the image column's name (created for a folder or arrays).
        label_column (`str`): the label column's name (created for a folder or arrays).
        label_names (`Sequence[str]`, *optional*): for an image folder, the classes in id order.
        name (`str`, defaults to ``"data"``): what to call it in error messages.
        allow_empty_classes (`bool`, defaults to False): for an image folder, keep a class sub-folder without
            images as a class with no samples instead of refusing it (`read_image_folder`).

    Raises:
        ConfigError: a path that does not exist, a directory holding a DatasetDict, an image folder that
            `read_image_folder` refuses, arrays of unequal length or an unsupported kind of source.
    """
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"{name} path '{path}' does not exist")
        if not path.is_dir():
            raise ConfigError(
                f"{name} path '{path}' is a file; expected an image folder (one sub-folder per class) or a "
                "save_to_disk directory"
            )
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            if not isinstance(loaded, datasets.Dataset):
                raise ConfigError(
                    f"{name} path '{path}' holds a DatasetDict (splits {', '.join(loaded)}); give one split's directory"
                )
            return loaded
        return read_image_folder(path, image_column, label_column, label_names, name, allow_empty_classes)
    if isinstance(source, Mapping):
        missing = [c for c in (image_column, label_column) if c not in source]
        if missing:
            raise ConfigError(f"{name}: the mapping has no {missing[0]!r} entry; its keys are {', '.join(source)}")
        images, labels = source[image_column], source[label_column]
    elif isinstance(source, tuple | list) and len(source) == 2:
        images, labels = source
    else:
        raise ConfigError(
            f"{name}: got a {type(source).__name__}; expected an image folder, a save_to_disk directory, a "
            "datasets.Dataset, (images, labels) arrays or a mapping of them"
        )
    return _array_table(images, labels, image_column, label_column, name)


def _array_table(images: Any, labels: Any, image_column: str, label_column: str, name: str) -> datasets.Dataset:
    labels = labels.tolist() if isinstance(labels, np.ndarray) else list(labels)
    if len(images) != len(labels):
        raise ConfigError(f"{name}: {len(images)} images but {len(labels)} labels; expected one label per image")
    if isinstance(images, np.ndarray) and images.ndim in (3, 4) and images.dtype in (np.uint8, np.uint16):
        shape = tuple(int(s) for s in images.shape[1:])
        kind = datasets.Array2D if len(shape) == 2 else datasets.Array3D
        feature: Any = kind(shape=shape, dtype=str(images.dtype))
        table = datasets.Dataset.from_dict({image_column: images}, features=datasets.Features({image_column: feature}))
    else:  # a list of images (sizes may differ): nested lists, checked here row by row
        pixels = [np.asarray(image) for image in images]
        for i, image in enumerate(pixels):
            _from_array(image, f"{name}: image {i}")
        feature = _nested_feature(pixels[0].ndim, str(pixels[0].dtype)) if pixels else _nested_feature(2, "uint8")
        table = datasets.Dataset.from_dict(
            {image_column: [p.tolist() for p in pixels]}, features=datasets.Features({image_column: feature})
        )
    return table.add_column(label_column, labels)  # the label type is inferred; encode_labels checks it


def _nested_feature(ndim: int, dtype: str) -> Any:
    feature: Any = datasets.Value(dtype)
    for _ in range(ndim):
        feature = datasets.List(feature)
    return feature


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


def _require_column(dataset: datasets.Dataset, column: str, setting: str, name: str) -> None:
    if column not in dataset.column_names:
        raise ConfigError(
            f"{name}: {setting} {column!r} is not a column; the columns are {', '.join(dataset.column_names)}"
        )


def image_data_fingerprint(dataset: datasets.Dataset, image_column: str) -> str:
    """`fingerprint` of a table, plus the bytes of every image file that a ``datasets.Image`` column only names.

    A ``datasets.Image`` column may hold a path without the image's bytes; hashing the table alone would then miss
    an edited file, so those files' contents are hashed too.
    """
    digest = hashlib.sha256(fingerprint(dataset).encode())
    if isinstance(dataset.features.get(image_column), datasets.Image):
        values = dataset.cast_column(image_column, datasets.Image(decode=False))[image_column]
        for value in values:
            if value and value.get("bytes") is None and value.get("path"):
                digest.update(fingerprint(value["path"]).encode())
    return digest.hexdigest()


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
            raise ConfigError(f"ImageTransform: mode={mode!r}; expected one of {', '.join(MODES)}")
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
            raise ConfigError(f"ImageTransform: resample={resample!r}; expected one of {', '.join(RESAMPLE)}")
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
                image = image.resize((self.size[1], self.size[0]), PIL.Image.Resampling(RESAMPLE[self.resample]))
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
        raise ConfigError(f"ImageTransform: size={size!r}; expected a positive integer or [height, width]")
    return values[0], values[1]


def _per_channel(setting: str, value: Any, channels: int) -> list[float] | None:
    if value is None:
        return None
    values = [value] if isinstance(value, int | float) else list(value) if isinstance(value, Sequence) else None
    if values is None or not values or any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        raise ConfigError(f"ImageTransform: {setting}={value!r}; expected a number or one number per channel")
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

    Returns:
        `datasets.Dataset`: ``pixel_values`` (``Array3D`` float32, ``(channels, height, width)``, the same for
        every row) plus ``keep_columns``, in memory.

    Raises:
        ConfigError: the column is missing or of the wrong type, the table is empty, or an image cannot be read,
            is truncated, cannot be converted, or comes out of another size than the first (each names the file
            or row).
    """
    _require_column(dataset, image_column, "image_column", name)
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
        for value, where in zip(values, labels):
            if kind is not None:
                value = np.asarray(value).astype(kind)  # the numpy formatter widens integers to int64
            path_only = isinstance(value, Mapping) and value.get("bytes") is None
            images.append(load_image(value, transform.mode, name if path_only else f"{name}: {where}"))
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
            raise ConfigError(f"ImageAugmentation: crop_padding={crop_padding!r}; expected an integer >= 0")
        if (
            isinstance(horizontal_flip, bool)
            or not isinstance(horizontal_flip, int | float)
            or not 0 <= horizontal_flip <= 1
        ):
            raise ConfigError(
                f"ImageAugmentation: horizontal_flip={horizontal_flip!r}; expected a probability in [0, 1]"
            )
        self.crop_padding, self.horizontal_flip, self.generator = crop_padding, float(horizontal_flip), generator

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = default_collate(list(rows))
        pixels = random_crop(batch["pixel_values"], self.crop_padding, self.generator)
        batch["pixel_values"] = random_horizontal_flip(pixels, self.horizontal_flip, self.generator)
        return batch


# ------------------------------------------------------------------------------------------- DataModule


class ImageClassificationData(DataModule):
    """Preprocessed image classification data from an image folder, a ``datasets`` table or arrays.

    ``prepare_data`` reads each split (`image_table`), encodes the labels as a `datasets.ClassLabel` column
    ``labels`` (`torchloom.data.encode_labels`), decodes and transforms every image (`preprocess_images`) and
    saves both splits with ``save_to_disk`` in the processed-dataset cache, under a key that hashes the raw data
    and every setting below that shapes the result; a second run with the same inputs loads them instead (the
    ``cache_hit`` attribute says which happened). ``setup`` loads the splits (memory-mapped) and takes the
    ``max_*_samples`` subsets. Training batches are augmented on the fly (`ImageAugmentation`); validation
    batches are not.

    Args:
        train: the training images (see `image_table`): an image folder (one sub-folder per class), a
            ``save_to_disk`` directory, a `datasets.Dataset`, ``(images, labels)`` arrays or a mapping of them.
        validation (*optional*): the validation images, same kinds.
        image_column (`str`, defaults to ``"image"``): a ``datasets.Image`` column, encoded bytes or pixel arrays.
        label_column (`str`, defaults to ``"label"``): the class of each row: a `datasets.ClassLabel`, strings or
            non-negative integers.
        label_names (`list[str]`, *optional*): the class names in id order; defaults to the sorted class
            sub-folders, the `ClassLabel` names, the sorted distinct strings, or ``"0"`` .. ``"<max>"``.
        allow_empty_classes (`bool`, defaults to False): keep a class sub-folder without image files as a class
            with no samples in that split; by default it is an error naming the folder and the split.
        mode (`str`, defaults to ``"RGB"``): ``"RGB"`` or ``"L"`` (grey, one channel).
        image_processor (*optional*): a transformers image processor that resizes and normalises: a local
            directory with ``preprocessor_config.json``, a Hub id in the local cache, or that file's contents as a
            dict (`load_image_processor`). Leave ``size`` / ``mean`` / ``std`` unset then.
        processor_backend (`str`, *optional*, defaults to ``"pil"``): the processor's backend (``None``: let
            transformers choose; ``"torchvision"`` needs torchvision).
        size (`int` or `[height, width]`, *optional*): plain resizing (without a processor); ``None`` keeps the
            images' own size, which must then be the same for all.
        mean (`float` or `list[float]`, *optional*): plain normalisation per channel, on values scaled to
            ``[0, 1]``; ``None``: no normalisation.
        std (`float` or `list[float]`, *optional*): the standard deviations of that normalisation, with ``mean``.
        resample (`str`, defaults to ``"bilinear"``): the filter of plain resizing.
        random_crop_padding (`int`, defaults to 0): training only: shift each image by up to this many pixels
            (`random_crop`).
        horizontal_flip (`float`, defaults to 0.0): training only: mirror each image with this probability.
        batch_size (`int`, defaults to 32): training batch size, per process.
        eval_batch_size (`int`, *optional*): validation batch size, per process; defaults to ``batch_size``.
        max_train_samples (`int`, *optional*): use a random subset of this many training images (drawn with
            ``seed``); the cache still holds the whole split, so changing it costs nothing.
        max_val_samples (`int`, *optional*): the same for validation.
        shuffle (`bool`, defaults to True): reshuffle the training images every epoch (under `torchloom.Engine`
            the order of epoch ``e`` comes from the engine's ``seed + e``).
        seed (`int`, defaults to 0): seeds the subsets (and the shuffling outside an engine).
        num_workers (`int`, defaults to 0): dataloader worker processes.
        cache_dir (`str` or `os.PathLike`, *optional*): the processed-dataset cache; defaults to
            ``$TORCHLOOM_CACHE/processed`` or ``~/.cache/torchloom/processed``.

    Attributes:
        cache_hit (`bool` or ``None``): after ``prepare_data``: whether the splits were loaded from the cache.
        cache_path (`pathlib.Path` or ``None``): the cache entry in use.
        label_names (`list[str]`): after ``setup``: the class names, in id order.
        train_dataset, val_dataset (`datasets.Dataset` or ``None``): after ``setup``: the processed splits, in
            torch format: ``pixel_values`` float32 ``(channels, height, width)``, ``labels`` int64.

    Raises:
        ConfigError: a bad setting (names it, its value and what is valid); and, from ``prepare_data``, a missing
            path or column, labels of the wrong type, an unreadable, truncated or unconvertible image (naming the
            file or row) or an empty split.
    """

    def __init__(
        self,
        # Typed loosely for config files (a class in this union would make jsonargparse read a path as a config
        # file); a Dataset or arrays are accepted from Python too, see `image_table`.
        train: str | os.PathLike[str] | Any | None = None,
        validation: str | os.PathLike[str] | Any | None = None,
        *,
        image_column: str = "image",
        label_column: str = "label",
        label_names: list[str] | None = None,
        allow_empty_classes: bool = False,
        mode: str = "RGB",
        # dict first: jsonargparse tries the types in order, and a str would swallow a YAML mapping
        image_processor: dict[str, Any] | str | os.PathLike[str] | None = None,
        processor_backend: str | None = "pil",
        size: int | list[int] | None = None,
        mean: float | list[float] | None = None,
        std: float | list[float] | None = None,
        resample: str = "bilinear",
        random_crop_padding: int = 0,
        horizontal_flip: float = 0.0,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        cls = type(self).__name__
        for setting, value in (("image_column", image_column), ("label_column", label_column)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{cls}: {setting}={value!r}; expected a column name")
        if image_column == label_column:
            raise ConfigError(f"{cls}: image_column and label_column are both {image_column!r}; expected two columns")
        if label_names is not None:
            if (
                isinstance(label_names, str)
                or not all(isinstance(n, str) for n in label_names)
                or len(set(label_names)) != len(label_names)
                or len(label_names) < 2
            ):
                raise ConfigError(f"{cls}: label_names={label_names!r}; expected a list of 2 or more distinct strings")
            label_names = list(label_names)
        optional = {
            "eval_batch_size": eval_batch_size,
            "max_train_samples": max_train_samples,
            "max_val_samples": max_val_samples,
        }
        for setting, count in [("batch_size", batch_size), *((k, v) for k, v in optional.items() if v is not None)]:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigError(f"{cls}: {setting}={count!r}; expected a positive integer")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"{cls}: num_workers={num_workers!r}; expected an integer >= 0")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"{cls}: seed={seed!r}; expected an integer")
        if not isinstance(allow_empty_classes, bool):
            raise ConfigError(f"{cls}: allow_empty_classes={allow_empty_classes!r}; expected True or False")
        try:
            # Validated now (a bad size fails at construction); the processor itself is loaded on first use.
            self._plain = ImageTransform(mode, size, mean, std, resample)
            self.augmentation = ImageAugmentation(random_crop_padding, horizontal_flip)
        except ConfigError as exc:
            raise ConfigError(f"{cls}: {str(exc).split(': ', 1)[-1]}") from None
        if image_processor is not None and any(v is not None for v in (size, mean, std)):
            raise ConfigError(
                f"{cls}: image_processor is set together with size/mean/std; set the processor's own size, "
                "image_mean and image_std instead"
            )
        self.train, self.validation = train, validation
        self.image_column, self.label_column, self.label_names_setting = image_column, label_column, label_names
        self.allow_empty_classes = allow_empty_classes
        self.mode = mode
        self.image_processor_spec, self.processor_backend = image_processor, processor_backend
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.max_train_samples, self.max_val_samples = max_train_samples, max_val_samples
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        self.cache = DatasetCache(Path(cache_dir).expanduser() if cache_dir is not None else None)
        self.cache_hit: bool | None = None
        self.cache_path: Path | None = None
        self.label_names: list[str] = []
        self.train_dataset: datasets.Dataset | None = None
        self.val_dataset: datasets.Dataset | None = None
        self._transform: ImageTransform | None = None
        self._tables: dict[str, datasets.Dataset] = {}
        self._key: str | None = None
        self._settings: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------- steps

    @property
    def transform(self) -> ImageTransform:
        """The `ImageTransform` (the image processor is loaded on first use)."""
        if self._transform is None:
            if self.image_processor_spec is None:
                self._transform = self._plain
            else:
                processor = load_image_processor(self.image_processor_spec, self.processor_backend)
                self._transform = ImageTransform(self.mode, processor=processor)
        return self._transform

    def sources(self) -> dict[str, ImageSource]:
        """Return the raw images by split (``"train"``, ``"validation"``). Override to produce them in code.

        Raises:
            ConfigError: no training images.
        """
        if self.train is None:
            raise ConfigError(f"{type(self).__name__}: train=None; expected the training images (a folder or a table)")
        splits: dict[str, ImageSource] = {"train": self.train}
        if self.validation is not None:
            splits["validation"] = self.validation
        return splits

    def table(self, split: str) -> datasets.Dataset:
        """The raw table of ``split`` (`image_table`), read once per instance."""
        if split not in self._tables:
            source = self.sources()[split]
            names = self.label_names_setting
            if split != "train" and names is None and isinstance(source, str | os.PathLike):
                names = self._folder_classes()  # a validation folder may lack a class: keep the training ids
            where = f"{type(self).__name__} {split} data"
            self._tables[split] = image_table(
                source, self.image_column, self.label_column, names, where, self.allow_empty_classes
            )
        return self._tables[split]

    def _folder_classes(self) -> list[str] | None:
        train = self.table("train")
        feature = train.features.get(self.label_column)
        return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None

    def cache_settings(self) -> dict[str, Any]:
        """Return everything that determines the processed splits; its `cache_key` names the cache entry.

        Raw data enters as its fingerprint (for a folder: every file's path and bytes and every sub-folder, an empty
        one included; a table's contents plus any image files it only names; or the arrays); the class names in id
        order that the labels are encoded with (``classes``, `resolve_label_names`: the label mapping); the
        transform as its settings (or the processor's class and full config); library versions are included
        because decoding and resizing can change between them. ``max_*_samples``, batch sizes, shuffling and
        augmentation are left out: they act after the cache; so is ``allow_empty_classes``, which only decides
        whether an empty class folder is an error (the folder itself is in the fingerprint and in ``classes``).

        Raises:
            ConfigError: a source that cannot be read (`image_table`), or labels that cannot be encoded.
        """
        sources = self.sources()
        return {
            "kind": "torchloom.data.image.ImageClassificationData",
            "data": {split: self._fingerprint(split) for split in sources},
            "sources": {split: _source_kind(source) for split, source in sources.items()},
            "image_column": self.image_column,
            "label_column": self.label_column,
            "label_names": self.label_names_setting,
            "classes": self._classes(),
            "transform": self.transform.settings(),
            "versions": {
                "datasets": datasets.__version__,
                "numpy": np.__version__,
                "pillow": PIL.__version__,
                "transformers": transformers.__version__,
            },
        }

    def _classes(self) -> list[str]:
        names = self.label_names_setting
        for split in self.sources():  # as `_build` encodes them: "train" fixes the names, the others follow
            names = resolve_label_names(
                self.table(split), self.label_column, names, f"{type(self).__name__} {split} data"
            )
        return list(names or [])

    def _fingerprint(self, split: str) -> str:
        table, source = self.table(split), self.sources()[split]  # reading the table checks the source first
        if isinstance(source, str | os.PathLike) and _source_kind(source) == "image folder":
            return fingerprint(source)  # file bytes and paths relative to the folder: moving it keeps the key
        return image_data_fingerprint(table, self.image_column)

    def prepare_data(self) -> None:
        """Preprocess the splits and save them to the cache, or find them already there."""
        settings = self.cache_settings()
        self._key = key = cache_key(**settings)
        self._settings = settings
        self.cache_path = self.cache.path(key)
        if key in self.cache:
            self.cache.check(key, settings)  # an entry under this key built from other settings is refused
            self.cache_hit = True
            logger.info("%s: loading the processed splits from %s", type(self).__name__, self.cache_path)
            return
        self.cache_hit = False
        logger.info("%s: preprocessing; the result goes to %s", type(self).__name__, self.cache_path)
        self.cache.save(key, self._build(), settings=settings)

    def _build(self) -> datasets.DatasetDict:
        names = self.label_names_setting
        processed = {}
        for split in self.sources():  # "train" first: it fixes the label names
            where = f"{type(self).__name__} {split} data"
            table = self.table(split)
            _require_column(table, self.image_column, "image_column", where)
            if len(table) == 0:
                raise ConfigError(f"{where} has no rows; an empty split")
            table = encode_labels(table, self.label_column, names, where)
            names = table.features["labels"].names
            processed[split] = preprocess_images(table, self.transform, self.image_column, name=where)
        return datasets.DatasetDict(processed)

    def setup(self, stage: str) -> None:
        """Load the processed splits from the cache and take the ``max_*_samples`` subsets."""
        if self._key is None or self._key not in self.cache:
            self.prepare_data()
        assert self._key is not None
        splits = self.cache.load(self._key, self._settings)
        self.cache_path = self.cache.path(self._key)
        self._tables.clear()  # the raw tables are not needed any more
        self.label_names = list(splits["train"].features["labels"].names)
        self.train_dataset = self._subset(splits["train"], self.max_train_samples)
        self.val_dataset = self._subset(splits["validation"], self.max_val_samples) if "validation" in splits else None

    def _subset(self, dataset: datasets.Dataset, n: int | None) -> datasets.Dataset:
        if n is not None and n < len(dataset):
            dataset = dataset.shuffle(seed=self.seed, keep_in_memory=True).select(range(n), keep_in_memory=True)
        return dataset.with_format("torch", columns=["pixel_values", "labels"])

    @property
    def num_labels(self) -> int:
        """The number of classes (after ``setup``)."""
        return len(self.label_names)

    def train_dataloader(self) -> DataLoader:
        """Batches of ``batch_size``: ``pixel_values`` float32 ``(batch, channels, height, width)``, augmented, and
        ``labels`` int64 ``(batch,)``."""
        if self.train_dataset is None:
            raise RuntimeError(f"{type(self).__name__}.train_dataloader() called before setup()")
        augment = self.augmentation.crop_padding or self.augmentation.horizontal_flip
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            collate_fn=self.augmentation if augment else None,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader | None:
        """Batches of ``eval_batch_size`` in order, not augmented; ``None`` without validation."""
        if self.val_dataset is None:
            return None
        return DataLoader(
            self.val_dataset, batch_size=self.eval_batch_size, shuffle=False, num_workers=self.num_workers
        )

    def predict_dataloader(self) -> DataLoader | None:
        """The validation images, in order (labels included, for comparison); ``None`` without validation."""
        return self.val_dataloader()


def _source_kind(source: Any) -> str:
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        return "save_to_disk" if (path / "state.json").is_file() else "image folder"
    return type(source).__name__

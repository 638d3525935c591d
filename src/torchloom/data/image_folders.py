"""Image sources: an image folder (one sub-folder per class), a ``save_to_disk`` directory, a table or arrays.

`read_image_folder` lists a folder without decoding anything; `image_table` turns any image source into a
`datasets.Dataset` with an image column and a label column; `image_data_fingerprint` hashes a table and the image
files it only names, for a cache key. Part of `torchloom.data.image`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import datasets
import numpy as np

from torchloom.data.cache import fingerprint
from torchloom.data.image_decoding import image_extensions, image_from_array
from torchloom.data.tables import TABLE_READERS, read_table, require_column, table_path
from torchloom.errors import ConfigError

__all__ = ["image_data_fingerprint", "image_table", "read_image_file_table", "read_image_folder"]

#: What an image source may be (see `image_table`); typed loosely for config files.
ImageSource: TypeAlias = Any


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
        image_column (`str`, defaults to ``"image"``): the name of the column of image paths.
        label_column (`str`, defaults to ``"label"``): the name of the label column.
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
    extensions = image_extensions()
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
            - a ``.jsonl`` / ``.json`` / ``.csv`` / ``.tsv`` / ``.parquet`` file whose ``image_column`` holds image
              paths, relative to the file's folder or absolute (`read_image_file_table`);
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
            `read_image_folder` refuses, a table file that `read_image_file_table` refuses, a file of another
            suffix, arrays of unequal length or an unsupported kind of source.
    """
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"{name} path '{path}' does not exist")
        if not path.is_dir():
            if path.suffix.lower() in TABLE_READERS:
                return read_image_file_table(path, image_column, name)
            raise ConfigError(
                f"{name} path '{path}' is a file with the suffix {path.suffix or '(none)'!r}; expected an image "
                f"folder (one sub-folder per class), a save_to_disk directory or a table file of image paths "
                f"({', '.join(TABLE_READERS)})"
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


def read_image_file_table(
    path: str | os.PathLike[str], image_column: str = "image", name: str = "data"
) -> datasets.Dataset:
    """Read a table file whose ``image_column`` holds image paths (`torchloom.data.read_table`: ``.jsonl``,
    ``.json``, ``.csv``, ``.tsv``, ``.parquet``), as `read_image_folder` lists a folder.

    A relative path starts at the file's folder, an absolute one is kept. Each path becomes a
    ``datasets.Image(decode=False)`` value naming the file, as in a folder's table, so the images are decoded as a
    folder's are; every other column (a label column, complete or not, or none) is kept as it is, and the rows keep
    the file's order. Nothing is decoded here.

    Args:
        path (`str` or `os.PathLike`): the file.
        image_column (`str`, defaults to ``"image"``): the column of image paths.
        name (`str`, defaults to ``"data"``): what to call it in error messages.

    Returns:
        `datasets.Dataset`: the file's rows, ``image_column`` a ``datasets.Image(decode=False)`` column of absolute
        paths.

    Raises:
        ConfigError: the file cannot be read (`read_table`), has no ``image_column`` (names the file and lists its
            columns), or a row has no path or names a path that is not a file (names the file, the row: its line in
            a JSON lines file, the path and what is valid).
    """
    path = Path(path).expanduser().absolute()
    table = read_table(path, name)
    require_column(table, image_column, "image_column", f"{name} path '{path}'")
    values = [
        {"bytes": None, "path": str(table_path(value, path, row, image_column, "image_column", name, "an image file"))}
        for row, value in enumerate(table[image_column])
    ]
    features = table.features.copy()
    features[image_column] = datasets.Image(decode=False)
    return datasets.Dataset.from_dict({**table.to_dict(), image_column: values}, features=features)


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
            image_from_array(image, f"{name}: image {i}")
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

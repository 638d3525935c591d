"""Image decoding: one image (a file, encoded bytes, a ``datasets`` Image value, an array or a PIL image) to ``mode``.

`load_image` decodes with Pillow, applies the EXIF orientation, lays transparency over white and converts to
``"RGB"`` or ``"L"``; every failure is a `ConfigError` that names the file or the row. Part of
`torchloom.data.image` (`ImageClassificationData` uses it through `preprocess_images`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from torchloom._settings import invalid
from torchloom.errors import ConfigError

try:
    import PIL
    import PIL.Image
    import PIL.ImageOps
except ImportError as _exc:  # pragma: no cover - Pillow is in the vision extra
    raise ImportError("torchloom.data.image needs Pillow: pip install 'torchloom[vision]'") from _exc

__all__ = ["load_image"]

#: The Pillow that decodes (part of the cache key: decoding can change between versions).
PILLOW_VERSION: str = PIL.__version__
#: Target modes and their channel counts.
MODES = {"RGB": 3, "L": 1}
#: Pillow modes of 16-bit grey pixels, and modes with an alpha channel.
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_ALPHA = ("RGBA", "LA", "PA", "RGBa", "La")


def image_extensions() -> set[str]:
    """The file suffixes (``".png"``, ``".jpg"`` ...) of the formats this Pillow can open."""
    PIL.Image.init()
    return {ext for ext, fmt in PIL.Image.registered_extensions().items() if fmt in PIL.Image.OPEN}


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
        raise invalid("mode", mode, f"one of {', '.join(MODES)}", owner=name or "load_image")
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
        image = image_from_array(source, where)
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


def image_from_array(array: np.ndarray, where: str) -> PIL.Image.Image:
    """Return uint8 (or grey uint16) pixels as a `PIL.Image.Image`; another array: a `ConfigError` naming ``where``."""
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

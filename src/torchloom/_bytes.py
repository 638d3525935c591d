"""Sizes in bytes, for people: one formatter (`format_bytes`) and one reader (`parse_bytes`) for every command and
message of torchloom.

One unit system, binary (IEC: KiB, MiB, GiB, TiB, powers of 1024), everywhere torchloom prints a size: these are
sizes of memory (``estimate-memory``'s rows, which a user compares with a GPU's memory, itself a power of 2, and
with PyTorch's and Accelerate's own figures, which are binary) and of tensors and weights that are loaded into
memory (``inspect``). The unit's name always says which system it is (never the ambiguous ``MB``); ``inspect``
prints the exact byte count beside it. A size that a user writes may use either system (``8GiB``, ``16GB``).
"""

from __future__ import annotations

from torchloom.errors import ConfigError

__all__ = ["format_bytes", "parse_bytes"]

#: The binary units, largest first.
UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(size: int) -> str:
    """A size in bytes for people: three significant digits in binary units (powers of 1024), or bytes under 1 KiB.

    The one formatter of torchloom's output (``inspect``, ``estimate-memory``); plugins that print a size use it
    too, so that every size reads alike.

    Args:
        size (`int`): bytes, >= 0.

    Returns:
        `str`: e.g. ``"1.5 GiB"``, ``"12.3 MiB"``, ``"1.25 KiB"``, ``"512 B"``.

    Example: ``torchloom.utils.format_bytes(181_712_308) == "173 MiB"``.
    """
    for unit, scale in UNITS:
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def parse_bytes(size: int | str, what: str = "budget") -> int:
    """Read a size: an int (bytes), a string of digits, or a number with a unit as
    `accelerate.utils.convert_file_size_to_int` reads it (``KiB``, ``MiB``, ``GiB``: powers of 2; ``kB``, ``MB``,
    ``GB``: powers of 10), e.g. ``"8GiB"``, ``"1.5GB"``.

    Raises:
        ConfigError: not a size, or not > 0.
    """
    from accelerate.utils import convert_file_size_to_int

    valid = "bytes (an integer) or a number with a unit: KiB, MiB, GiB (powers of 2) or kB, MB, GB, e.g. 8GiB"
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise ConfigError(f"{what} {size!r} is not a size; expected {valid}")
    text = size.strip() if isinstance(size, str) else size
    try:
        value = int(text) if isinstance(text, str) and text.isdigit() else convert_file_size_to_int(text)
    except (ValueError, AttributeError):
        raise ConfigError(f"{what} {size!r} is not a size; expected {valid}") from None
    if value <= 0:
        raise ConfigError(f"{what} {size!r} is not a size > 0; expected {valid}")
    return int(value)

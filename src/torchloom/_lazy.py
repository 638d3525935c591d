"""Names imported when first used (PEP 562 module ``__getattr__``, as SciPy and scikit-image load lazily,
scientific-python SPEC 1): the one implementation behind ``torchloom``, ``torchloom.utils`` and
``torchloom.checkpoint``, so that importing a shelf imports neither torch nor Accelerate.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(module: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of module ``module`` for its table ``exports`` (public name -> the
    module that defines it).

    ``__getattr__(name)`` imports the defining module, keeps the value in ``module``'s namespace (later look-ups
    skip it) and returns it; ``__dir__()`` lists the namespace and the table.

    Raises:
        AttributeError: from ``__getattr__``, for a name the table does not hold, as Python words it for a module.
    """

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(exports))

    return __getattr__, __dir__

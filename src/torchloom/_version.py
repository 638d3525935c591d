"""torchloom's version: one place, read by the package (``torchloom.__version__``), by the modules that record it
(checkpoints, model cards) and by the build (``[tool.hatch.version]`` in pyproject.toml)."""

__version__ = "0.1.0"

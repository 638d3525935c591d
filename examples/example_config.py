"""What the examples' ``main()`` share: the run config, read from the YAML next to the script (or one given first)
with ``dotted.key=value`` overrides.

``python examples/fine_foods.py data.init_args.max_train_samples=64 engine.output_dir=runs/x`` reads
``examples/fine_foods.yaml`` and sets those two keys, as ``torchloom fit --config examples/fine_foods.yaml
--data.init_args.max_train_samples=64 --engine.output_dir=runs/x`` would; a leading ``--`` is allowed. A value is
read as YAML (``false``, ``3``, ``[1, 2]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["read_config"]


def read_config(script: str | Path, argv: list[str]) -> dict[str, Any]:
    """The config of ``script``'s ``main(argv)``: ``argv[0]`` when it is a ``.yaml`` / ``.yml`` file, else the YAML
    file of the script's name; then every other argument, ``dotted.key=value`` (or ``--dotted.key=value``), sets
    that key, creating the mappings on the way.

    Raises:
        SystemExit: an argument without ``=`` (the message names the script).
    """
    config_path = Path(script).with_suffix(".yaml")
    if argv and argv[0].endswith((".yaml", ".yml")):
        config_path, argv = Path(argv[0]), argv[1:]
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    for item in argv:
        key, sep, value = item.lstrip("-").partition("=")
        if not sep:
            raise SystemExit(f"{Path(script).name}: override {item!r} is not of the form dotted.key=value")
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return config

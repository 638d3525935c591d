"""``python -m torchloom.cli``: the ``torchloom`` command (`torchloom.cli.main`)."""

from . import main

if __name__ == "__main__":
    raise SystemExit(main())

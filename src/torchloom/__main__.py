"""``python -m torchloom``: the ``torchloom`` command (`torchloom.cli.main`)."""

from torchloom.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

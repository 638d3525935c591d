"""How a checkpoint's files are written fast (issue 27, item 5): Accelerate's ``torch.save`` files without the zip
archive's CRC-32 of each record (the manifest's SHA-256 covers every file), the process-wide setting restored after
the save, synchronous or asynchronous; and the files hashed and synced in threads, with the sizes and hashes a
sequential read gives."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash

import torchloom
from torchloom.checkpoint.manifest import hash_and_sync, verify_files
from torchloom.checkpoint.store import list_checkpoints, without_zip_crc32
from torchloom.testing import TinyTask


class AdamTask(TinyTask):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)


needs_option = pytest.mark.skipif(
    not hasattr(torch.serialization, "set_crc32_options"), reason="torch < 2.6 has no set_crc32_options"
)


@needs_option
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_optimizer_file_has_no_zip_crc_loads_and_the_setting_is_restored(tmp_path, async_save) -> None:
    assert torch.serialization.get_crc32_options() is True
    engine = torchloom.Engine(
        output_dir=str(tmp_path), max_epochs=1, plugins={"checkpoint": {"async_save": async_save}}
    )
    engine.fit(AdamTask())
    assert torch.serialization.get_crc32_options() is True  # the user's torch.save is as it was
    checkpoint = Path(list_checkpoints(tmp_path)[-1])
    optimizer = checkpoint / "accelerate" / "optimizer.bin"
    with zipfile.ZipFile(optimizer) as archive:
        records = [info for info in archive.infolist() if info.file_size > 0]
        assert any("/data/" in info.filename for info in records)  # AdamW's moments
        assert all(info.CRC == 0 for info in records)  # no CRC computed
    state = torch.load(optimizer, weights_only=True)
    assert set(state) == {"state", "param_groups"} and state["state"]
    verify_files(str(checkpoint), json.loads((checkpoint / "manifest.json").read_text()))


@needs_option
def test_the_setting_is_restored_after_an_error_and_keeps_a_false_one(tmp_path) -> None:
    with pytest.raises(RuntimeError), without_zip_crc32():
        assert torch.serialization.get_crc32_options() is False
        raise RuntimeError
    assert torch.serialization.get_crc32_options() is True
    torch.serialization.set_crc32_options(False)
    try:
        with without_zip_crc32():
            pass
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)
    torch.save({"x": torch.ones(3)}, tmp_path / "plain.pt")  # outside: CRCs as torch writes them by default
    with zipfile.ZipFile(tmp_path / "plain.pt") as archive:
        assert any(info.CRC != 0 for info in archive.infolist() if "/data/" in info.filename)


def test_files_hashed_in_threads_have_the_sequential_sizes_and_hashes(tmp_path) -> None:
    sizes = [0, 1, 3 << 20, (1 << 20) + 7, 5]
    paths = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"f{i}"
        path.write_bytes(bytes((j * 31 + i) % 251 for j in range(size)))
        paths.append(path)
    entries = hash_and_sync(paths)
    assert set(entries) == set(paths)
    for path in paths:
        data = path.read_bytes()
        assert entries[path] == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}, path.name
    assert hash_and_sync([paths[2]]) == {paths[2]: entries[paths[2]]} and hash_and_sync([]) == {}

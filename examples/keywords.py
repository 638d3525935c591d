"""Spot 10 spoken keywords with a small CNN on log-mel spectrograms, on CPU, offline; test on voices never heard.

No speech corpus installs from the package registries, so the data step makes one: the words yes, no, up, down,
left, right, on, off, stop, go, spoken by the Debian text-to-speech engines ``espeak-ng`` (5 English accents x 8
voice variants x 2 speeds x 2 pitches) and ``flite`` (5 voices x 3 tempos), 175 clips per word, each cut by
``sox`` to one second at 16 kHz and stored as FLAC. The test set is every clip of two held-out voices (espeak-ng's
``f4`` variant in all accents, flite's ``slt``): 230 clips; the other 1520 are for training.

Run it (from the repository root; ``apt-get install -y espeak-ng flite sox`` first, as root)::

    torchloom fit --config examples/keywords.yaml                     # the CLI
    python examples/keywords.py                                       # the same config, through Python
    python examples/keywords.py engine.max_epochs=1 engine.output_dir=runs/kw_small

What happens:

1. ``KeywordsData.prepare_data`` (main process first): `generate_keywords` runs espeak-ng / flite and sox for
   the 1750 clips into ``~/.cache/torchloom/keywords/clips/{train,test}/`` (each with a ``metadata.csv``:
   ``file_name,label,engine,voice``) unless they are there already; then `torchloom.data.AudioClassificationData`
   decodes them (soundfile), resamples to 16 kHz (soxr; a no-op here), pads / cuts to 1 s and computes 40-band
   log-mel spectrograms (``(40, 101)`` per clip), and caches both splits with ``save_to_disk``. A second run
   reads both caches: no synthesis, no decoding.
2. ``KeywordClassifier``: `KeywordCNN` (3 conv blocks, 75k parameters) on the spectrograms, normalised per clip
   (peak at 0 dB, floor at -80 dB); ``augment: true`` shifts and masks each training batch (SpecAugment).
   AdamW with a one-cycle schedule. Validation logs ``val/accuracy``, ``val/loss`` and ``val/chance_rate``
   (1 / number of words: 0.10).
3. ``<output_dir>/latest/model`` holds the weights (``model.safetensors``; reload them with
   ``torchloom.TaskModule.load_model(KeywordCNN(), path)``).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torchloom
from torchloom.data import AudioClassificationData, default_cache_dir

__all__ = ["KeywordCNN", "KeywordClassifier", "KeywordsData", "generate_keywords", "main"]

WORDS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go"]
ESPEAK_ACCENTS = ["en-us", "en-gb", "en-gb-scotland", "en-029", "en-gb-x-rp"]
ESPEAK_VARIANTS = ["m1", "m3", "m7", "f1", "f2", "f4", "croak", "klatt"]
ESPEAK_SPEEDS = [130, 175]  # words per minute
ESPEAK_PITCHES = [35, 65]  # 0-99
FLITE_VOICES = ["kal", "kal16", "awb", "rms", "slt"]
FLITE_TEMPOS = [0.85, 1.0, 1.2]  # sox tempo factors
#: The voices of the test set: never heard in training.
TEST_VOICES = ("espeak-ng:f4", "flite:slt")
TOOLS = ("espeak-ng", "flite", "sox")
#: Bump when the clips would come out differently: an old folder is then regenerated under a new name.
CLIPS_VERSION = 1
#: sox: 16 kHz mono 16-bit, silence trimmed at both ends, then padded / cut to exactly one second.
SOX_EFFECTS = ["silence", "1", "0.01", "0.5%", "reverse", "silence", "1", "0.01", "0.5%", "reverse"]
SOX_EFFECTS += ["pad", "0", "1", "trim", "0", "1"]


# ------------------------------------------------------------------------------------------- the data step


def clip_plan() -> list[dict[str, Any]]:
    """Every clip to make: ``split``, ``word``, ``engine``, ``voice`` and the synthesis settings (1750 rows)."""
    voices: list[dict[str, Any]] = []
    for accent in ESPEAK_ACCENTS:
        for variant in ESPEAK_VARIANTS:
            for speed in ESPEAK_SPEEDS:
                for pitch in ESPEAK_PITCHES:
                    voices.append(
                        {"engine": "espeak-ng", "voice": variant, "accent": accent, "speed": speed, "pitch": pitch}
                    )
    for voice in FLITE_VOICES:
        for tempo in FLITE_TEMPOS:
            voices.append({"engine": "flite", "voice": voice, "tempo": tempo})
    plan = []
    for word in WORDS:
        for v in voices:
            split = "test" if f"{v['engine']}:{v['voice']}" in TEST_VOICES else "train"
            parts = [v["engine"], v.get("accent", ""), v["voice"], str(v.get("speed", "")), str(v.get("pitch", ""))]
            stem = "_".join(p for p in parts if p) + (f"_t{v['tempo']}" if "tempo" in v else "")
            plan.append({**v, "split": split, "word": word, "file_name": f"{word}/{stem}.flac"})
    return plan


def _synthesise(clip: dict[str, Any], root: Path, scratch: Path) -> None:
    raw = scratch / (clip["file_name"].replace("/", "_") + ".wav")
    if clip["engine"] == "espeak-ng":
        voice = f"{clip['accent']}+{clip['voice']}"
        speak = ["espeak-ng", "-v", voice, "-s", str(clip["speed"]), "-p", str(clip["pitch"]), "-w", str(raw)]
        tempo: list[str] = []
    else:
        speak = ["flite", "-voice", clip["voice"], "-o", str(raw), "-t"]
        tempo = ["tempo", str(clip["tempo"])] if clip["tempo"] != 1.0 else []
    _run([*speak, clip["word"]])
    out = root / clip["split"] / clip["file_name"]
    # -R: repeatable (sox seeds its dither with a constant), so the same tools give the same bytes every time.
    _run(["sox", "-R", "-V1", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(out), *tempo, *SOX_EFFECTS])
    raw.unlink()


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        raise torchloom.ConfigError(
            f"KeywordsData: '{' '.join(command)}' exited with {result.returncode} ({(lines or ['no output'])[-1]})"
        )


def generate_keywords(data_dir: str | os.PathLike[str], workers: int | None = None) -> Path:
    """Return the clip folder ``<data_dir>/clips-v1``, making the 1750 clips first if it is not there.

    The folder holds ``train/`` (1520 clips) and ``test/`` (230 clips, the held-out voices), each an audio
    folder: ``<word>/<voice settings>.flac`` files and a ``metadata.csv`` with ``file_name,label,engine,voice``.
    It is built in a temporary directory and renamed into place when complete, so an interrupted run leaves
    nothing that looks finished; a later call finds it and returns at once.

    Args:
        data_dir (`str` or `os.PathLike`): where the folder goes.
        workers (`int`, *optional*): synthesis processes run at once; defaults to the number of CPUs.

    Raises:
        torchloom.ConfigError: espeak-ng, flite or sox is not installed (says how to install them), or one of them
            fails (names the command).
    """
    root = Path(data_dir).expanduser()
    clips = root / f"clips-v{CLIPS_VERSION}"
    if (clips / "train" / "metadata.csv").is_file() and (clips / "test" / "metadata.csv").is_file():
        return clips
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise torchloom.ConfigError(
            f"KeywordsData: the clips are made with espeak-ng, flite and sox, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH; install them with "
            "'apt-get install -y espeak-ng flite sox' (Debian/Ubuntu, as root), or put a clip folder made "
            f"elsewhere at '{clips}'"
        )
    plan = clip_plan()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".clips-", dir=root))
    try:
        for clip in plan:
            (work / clip["split"] / clip["word"]).mkdir(parents=True, exist_ok=True)
        scratch = work / "scratch"
        scratch.mkdir()
        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
            list(pool.map(lambda clip: _synthesise(clip, work, scratch), plan))  # list(): re-raises the first error
        scratch.rmdir()
        for split in ("train", "test"):
            with open(work / split / "metadata.csv", "w", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                writer.writerow(["file_name", "label", "engine", "voice"])
                for clip in plan:
                    if clip["split"] == split:
                        writer.writerow([clip["file_name"], clip["word"], clip["engine"], clip["voice"]])
        versions = {tool: _version(tool) for tool in TOOLS}
        counts = {split: sum(c["split"] == split for c in plan) for split in ("train", "test")}
        info = {"words": WORDS, "test_voices": list(TEST_VOICES), "clips": counts, "tools": versions}
        (work / "generated.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
        try:
            os.rename(work, clips)
        except OSError:
            if not (clips / "test" / "metadata.csv").is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return clips


def _version(tool: str) -> str:
    result = subprocess.run([tool, "--version"], capture_output=True, text=True)
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return next((line for line in lines if "version" in line.lower() or "v1" in line), lines[0] if lines else "?")


class KeywordsData(AudioClassificationData):
    """The keyword clips as 40-band log-mel spectrograms; validation is the held-out voices.

    Args:
        max_train_samples (`int`, *optional*): a random subset of the 1520 training clips (seeded).
        max_val_samples (`int`, *optional*): a random subset of the 230 held-out clips (seeded).
        n_mels (`int`, defaults to 40): mel bands.
        batch_size (`int`, defaults to 32): training batch size.
        eval_batch_size (`int`, defaults to 128): validation batch size.
        cache_dir (`str`, *optional*): the clips and the processed cache (under ``processed/``); defaults to
            ``$TORCHLOOM_CACHE/keywords`` or ``~/.cache/torchloom/keywords``.
        seed (`int`, defaults to 0): seeds the subsets and the shuffling.
        num_workers (`int`, defaults to 0): dataloader worker processes.

    Raises:
        torchloom.ConfigError: a bad setting (see `AudioClassificationData`); from ``prepare_data``, missing
            synthesis tools (with the install line).
    """

    def __init__(
        self,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        n_mels: int = 40,
        batch_size: int = 32,
        eval_batch_size: int = 128,
        cache_dir: str | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        self.data_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir() / "keywords"
        self.clips = self.data_dir / f"clips-v{CLIPS_VERSION}"
        super().__init__(
            train=self.clips / "train",
            validation=self.clips / "test",
            label_names=WORDS,
            sample_rate=16000,
            max_duration=1.0,
            features="log_mel",
            feature_args={"n_mels": n_mels},
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            max_train_samples=max_train_samples,
            max_val_samples=max_val_samples,
            seed=seed,
            num_workers=num_workers,
            cache_dir=self.data_dir / "processed",
        )

    def prepare_data(self) -> None:
        """Make the clips (once), then decode and featurise them (once)."""
        generate_keywords(self.data_dir)
        super().prepare_data()


# -------------------------------------------------------------------------------------------------- the task


class KeywordCNN(nn.Module):
    """Three conv blocks over a log-mel spectrogram, global average pooling, a linear head.

    Input ``input_features`` of shape ``(batch, n_mels, frames)`` in dB. Each clip is normalised on its own:
    its loudest bin is moved to 0 dB, everything below -80 dB is clipped, and the result is scaled to [-2, 0], so
    a louder or quieter voice gives the same input.

    Args:
        num_labels (`int`, defaults to 10): classes.
        channels (`list[int]`, defaults to ``[32, 64, 96]``): channels of the three 3x3 conv blocks (conv, batch
            norm, ReLU, 2x2 max-pool; no pooling after the last).
        dropout (`float`, defaults to 0.2): before the head.
    """

    def __init__(self, num_labels: int = 10, channels: list[int] | None = None, dropout: float = 0.2) -> None:
        super().__init__()
        channels = list(channels or [32, 64, 96])
        blocks: list[nn.Module] = []
        previous = 1
        for i, width in enumerate(channels):
            blocks += [nn.Conv2d(previous, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
            if i < len(channels) - 1:
                blocks.append(nn.MaxPool2d(2))
            previous = width
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(previous, num_labels))

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        x = input_features - input_features.amax(dim=(1, 2), keepdim=True)  # the clip's peak at 0 dB
        x = x.clamp(min=-80.0) / 40.0
        x = self.features(x.unsqueeze(1))
        return self.head(x.mean(dim=(2, 3)))


def spec_augment(features: torch.Tensor, max_shift: int = 10, freq_mask: int = 6, time_mask: int = 12) -> torch.Tensor:
    """Shift each spectrogram in time by up to ``max_shift`` frames (filling with its quietest value) and blank
    one band of up to ``freq_mask`` mel bins and one span of up to ``time_mask`` frames (SpecAugment), on the
    batch's own device; the draws use torch's global generator (seeded by the engine)."""
    batch, n_mels, frames = features.shape
    device = features.device
    floor = features.amin(dim=(1, 2), keepdim=True)
    shifts = torch.randint(-max_shift, max_shift + 1, (batch, 1, 1), device=device)
    time = torch.arange(frames, device=device).view(1, 1, frames)
    source = time - shifts
    shifted = features.gather(2, source.clamp(0, frames - 1).expand(batch, n_mels, frames))
    shifted = torch.where((source >= 0) & (source < frames), shifted, floor)
    f0 = torch.randint(0, n_mels, (batch, 1, 1), device=device)
    fw = torch.randint(0, freq_mask + 1, (batch, 1, 1), device=device)
    t0 = torch.randint(0, frames, (batch, 1, 1), device=device)
    tw = torch.randint(0, time_mask + 1, (batch, 1, 1), device=device)
    mel = torch.arange(n_mels, device=device).view(1, n_mels, 1)
    masked = ((mel >= f0) & (mel < f0 + fw)) | ((time >= t0) & (time < t0 + tw))
    return torch.where(masked, floor, shifted)


class KeywordClassifier(torchloom.TaskModule):
    """Keyword classification with `KeywordCNN`, trained from scratch.

    Args:
        label_names (`list[str]`, *optional*): the words in id order; defaults to `WORDS`.
        channels (`list[int]`, *optional*): `KeywordCNN` channels.
        dropout (`float`, defaults to 0.2): `KeywordCNN` dropout.
        lr (`float`, defaults to 3e-3): AdamW's peak learning rate (one-cycle schedule over the fit).
        weight_decay (`float`, defaults to 0.01): AdamW weight decay.
        augment (`bool`, defaults to False): `spec_augment` each training batch (on these clips it lowered the
            held-out accuracy: see examples/README.md).

    Logged: ``train/loss`` (by the engine); after each validation pass ``val/accuracy``, ``val/loss`` and
    ``val/chance_rate`` (1 / the number of words), exact over the validation set (values gathered over processes
    with ``gather_for_metrics`` and weighted by sample count).

    Raises:
        torchloom.ConfigError: a bad setting.
    """

    def __init__(
        self,
        label_names: list[str] | None = None,
        channels: list[int] | None = None,
        dropout: float = 0.2,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        augment: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise torchloom.ConfigError(f"KeywordClassifier: {name}={value!r}; expected a number >= 0")
        if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
            raise torchloom.ConfigError(f"KeywordClassifier: dropout={dropout!r}; expected 0 <= x < 1")
        self.label_names = list(label_names or WORDS)
        self.channels, self.dropout = channels, float(dropout)
        self.lr, self.weight_decay, self.augment = float(lr), float(weight_decay), augment

    def configure_model(self) -> nn.Module:
        return KeywordCNN(len(self.label_names), self.channels, self.dropout)

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, Any]:
        if self.num_training_steps is None:
            raise torchloom.ConfigError(
                "KeywordClassifier: the number of training steps is unknown; set the engine's max_steps"
            )
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.lr, total_steps=max(self.num_training_steps, 1), pct_start=0.2
        )
        return optimizer, scheduler

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        features = spec_augment(batch["input_features"]) if self.augment else batch["input_features"]
        loss = F.cross_entropy(self.model(features), batch["labels"])
        return {"loss": loss, "num_items": batch["labels"].shape[0]}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self.model(batch["input_features"])
        losses = F.cross_entropy(logits, batch["labels"], reduction="none")
        # gather_for_metrics drops the copies Accelerate pads the last batch with: every count is over the real set.
        preds, labels, losses = self.accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"], losses))
        n = labels.shape[0]
        exact = torch.float64 if labels.device.type != "mps" else torch.float32
        self.log("val/accuracy", (preds == labels).sum().to(exact) / n, weight=n)
        self.log("val/loss", losses.mean(), weight=n)
        self.log("val/chance_rate", 1.0 / len(self.label_names), weight=n)
        return {"preds": logits.softmax(-1), "target": batch["labels"]}

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Per clip: ``label`` (the word's id, int64) and ``p`` (its probability, float32)."""
        probabilities = self.model(batch["input_features"]).softmax(-1)
        p, label = probabilities.max(-1)
        return {"label": label, "p": p}


# ---------------------------------------------------------------------------------------------- the runner


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run ``examples/keywords.yaml`` through Python, with ``dotted.key=value`` overrides; print the result.

    ``python examples/keywords.py engine.max_epochs=2`` is the same run as ``torchloom fit --config
    examples/keywords.yaml --engine.max_epochs=2``. Returns the final logged metrics.
    """
    import importlib
    import time

    from example_config import read_config  # examples/example_config.py, next to this file

    config = read_config(__file__, sys.argv[1:] if argv is None else argv)

    def build(section: dict[str, Any]) -> Any:
        module, _, name = section["class_path"].rpartition(".")
        cls = globals()[name] if module in ("keywords", __name__) else getattr(importlib.import_module(module), name)
        return cls(**(section.get("init_args") or {}))

    start = time.perf_counter()
    task, data = build(config["task"]), build(config["data"])
    engine = torchloom.Engine(plugins=config.get("plugins") or None, **config.get("engine", {}))
    engine.run_config = config
    metrics = engine.fit(task, datamodule=data)
    elapsed = time.perf_counter() - start
    print(
        f"keywords: {len(data.train_dataset or [])} training / {len(data.val_dataset or [])} held-out clips, "
        f"{engine.progress.global_step} optimizer steps, {elapsed:.1f} s"
    )
    print(f"  val/accuracy    = {metrics['val/accuracy']:.4f}")
    print(f"  val/chance_rate = {metrics['val/chance_rate']:.4f}  (1 / {len(task.label_names)} words)")
    print(f"  val/loss        = {metrics['val/loss']:.4f}")
    return metrics


if __name__ == "__main__":
    main()

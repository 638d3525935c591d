"""Causal-LM batches: padding or best-fit-decreasing packing, ``position_ids`` that restart per sequence, the
loss-token count ``num_items``, and the check that a model's attention keeps packed sequences apart.

A sequence here is a pair of equal-length token lists, ``input_ids`` and ``labels`` (``-100`` where no loss is
taken; the first label of every sequence is ``-100``, since no token predicts it). Transformers' causal-LM loss
shifts the labels by one (position ``t`` predicts ``labels[t + 1]``), so a batch's loss tokens are
``labels[:, 1:] != -100``; with every sequence's first label ``-100``, no loss token is ever predicted across a
packed boundary, and the count is the same packed or not.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from torchloom.errors import ConfigError

__all__ = ["CausalLMCollator", "check_packed_attention", "count_loss_tokens", "left_padded_prompts", "pack_best_fit"]

IGNORE_INDEX = -100


def count_loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The number of tokens transformers' causal-LM loss averages over: ``(labels[..., 1:] != -100).sum()``
    (the loss shifts the labels by one), a 0-dim int64 tensor on ``labels``' device."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def pack_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group sequence indices into bins of at most ``capacity`` tokens, best-fit decreasing.

    Sequences are taken longest first (ties by index); each goes into the open bin with the least room that still
    fits it, or into a new bin. Within a bin, indices keep the order they were placed in.

    Args:
        lengths (`Sequence[int]`): each sequence's length, ``1 <= length <= capacity``.
        capacity (`int`): a bin's size (``max_length``).

    Returns:
        `list[list[int]]`: the bins, in the order they were opened.

    Raises:
        ValueError: a length outside ``1..capacity``.
    """
    for i, n in enumerate(lengths):
        if not 1 <= n <= capacity:
            raise ValueError(f"sequence {i} has length {n}; expected 1..{capacity}")
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect.bisect_left(rooms, (n, -1))
        if at < len(rooms):
            room, b = rooms.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(rooms, (room - n, b))
    return bins


class CausalLMCollator:
    """Pad a list of rows (``input_ids``, ``labels``, and ``position_ids`` for packed rows) into a batch.

    Unpacked rows: ``input_ids`` padded with ``pad_token_id``, ``labels`` with -100, and an ``attention_mask``.
    Packed rows: no ``attention_mask`` (transformers then finds the sequences from the ``position_ids`` resets, see
    `check_packed_attention`), ``position_ids`` as stored, the padding numbered from 0 as a sequence of its own.
    Every batch has ``num_items`` (`count_loss_tokens`). Tensors are int64.

    With ``generation`` (rows that have ``prompt_ids`` and ``reference``), the batch also has ``generation``:
    ``{"input_ids", "attention_mask"}`` of the prompts alone, **left**-padded (so that generated tokens follow
    every prompt directly), and ``"reference"``, the list of reference texts.

    Args:
        pad_token_id (`int`): the padding token.
        pad_to_multiple_of (`int`, *optional*): pad the batch length up to a multiple of this.
        generation (`bool`, defaults to False): add the ``generation`` entry.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, generation: bool = False) -> None:
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of
        self.generation = generation

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        width = max(len(row["input_ids"]) for row in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        packed = "position_ids" in rows[0]
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        extra = torch.zeros((len(rows), width), dtype=torch.long)  # attention_mask, or position_ids
        for r, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[r, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            labels[r, :n] = torch.as_tensor(row["labels"], dtype=torch.long)
            if packed:
                extra[r, :n] = torch.as_tensor(row["position_ids"], dtype=torch.long)
                extra[r, n:] = torch.arange(width - n)
            else:
                extra[r, :n] = 1
        batch: dict[str, Any] = {
            "input_ids": ids, "labels": labels, ("position_ids" if packed else "attention_mask"): extra
        }  # fmt: skip
        batch["num_items"] = count_loss_tokens(labels)
        if self.generation:
            batch["generation"] = left_padded_prompts(rows, self.pad_token_id)
        return batch


def left_padded_prompts(rows: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """``{"input_ids", "attention_mask", "reference"}``: the rows' ``prompt_ids`` left-padded with ``pad_token_id``
    (the mask 0 on the padding), and their ``reference`` texts."""
    width = max(len(row["prompt_ids"]) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        n = len(row["prompt_ids"])
        if n:
            ids[r, width - n :] = torch.as_tensor(row["prompt_ids"], dtype=torch.long)
            mask[r, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask, "reference": [str(row["reference"]) for row in rows]}


def check_packed_attention(model: torch.nn.Module) -> None:
    """Refuse a model whose attention would let packed sequences see each other.

    Packed batches carry ``position_ids`` that restart at every sequence and no ``attention_mask``; whether the
    model then keeps the sequences apart depends on its attention implementation, its settings and the
    transformers version: transformers 5 builds the block-diagonal mask from the resets for sdpa and eager only
    when no KV cache is made (``config.use_cache=False``; with the default ``True`` a cache is made even in
    training and the sequences see each other), and flash-attention finds them only in a batch of one row. So
    this checks the model as it will be called: once on two short sequences packed into each row of a batch of
    two (eval mode, no gradients), and once on the second sequence alone; their logits must agree (to 1e-4 in
    32-bit, 2% of the largest logit in 16-bit).

    Args:
        model (`torch.nn.Module`): a causal LM that takes ``input_ids`` and ``position_ids`` and returns
            ``.logits``.

    Raises:
        ConfigError: the packed logits differ (names the model class, its ``attn_implementation`` and
            ``use_cache`` and what to set instead).
    """
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    use_cache = getattr(config, "use_cache", None)
    vocab = int(getattr(config, "vocab_size", 8) or 8)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    ids = torch.tensor([[t % vocab for t in (1, 2, 3, 4, 5, 6, 7)]] * 2, device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=positions).logits[:, 3:]
            alone = model(input_ids=ids[:, 3:], position_ids=positions[:, 3:]).logits
    finally:
        model.train(was_training)
    tolerance = 1e-4 if torch.finfo(alone.dtype).bits >= 32 else 2e-2 * (1 + alone.float().abs().max().item())
    difference = (packed.float() - alone.float()).abs().max().item()
    if not difference <= tolerance:
        advice = "load the model with attn_implementation='sdpa' or 'eager', or set packing=False"
        if use_cache:
            advice = (
                "set model.config.use_cache = False (transformers finds packed sequences only without a KV cache); "
                f"if that is not enough, {advice}"
            )
        raise ConfigError(
            f"packing=True: {type(model).__name__} with attn_implementation={implementation!r} and "
            f"use_cache={use_cache!r} lets packed sequences attend to each other (a packed sequence's logits differ "
            f"from its logits alone by {difference:.3g}); {advice}"
        )

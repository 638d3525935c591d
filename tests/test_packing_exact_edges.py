"""torchloom.data.packing at its edges: `check_packed_attention` on models without a config, without parameters, with
a vocabulary smaller than its probe's tokens; `left_padded_prompts` exactly. Tiny hand-written models, CPU, fast."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchloom.data.packing import CausalLMCollator, check_packed_attention, left_padded_prompts, pack_best_fit
from torchloom.errors import ConfigError


class _Out:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class TokenAndPosition(nn.Module):
    """No config, no parameters: each position's logits are its token (one-hot) plus its position id, so packed
    sequences are kept apart. With ``mix``, each position also adds every earlier token (a running sum over the
    row): packed sequences see each other."""

    def __init__(self, vocab: int = 8, mix: bool = False) -> None:
        super().__init__()
        self.vocab, self.mix = vocab, mix

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> _Out:
        logits = nn.functional.one_hot(input_ids, self.vocab).float() + position_ids.float()[..., None]
        if self.mix:
            logits = logits + nn.functional.one_hot(input_ids, self.vocab).float().cumsum(1)
        return _Out(logits)


class SegmentSum(nn.Module):
    """No config, no parameters: each position's logits are the sum of its sequence's tokens so far (one-hot), a
    sequence starting at the row's start and wherever ``position_ids`` is 0 (as flash-attention's variable-length
    path finds packed sequences): it keeps packed sequences apart only when they restart at 0."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> _Out:
        tokens = nn.functional.one_hot(input_ids, 8).float()
        logits = torch.zeros_like(tokens)
        for t in range(input_ids.shape[1]):
            start = (t == 0) | (position_ids[:, t] == 0)
            before = logits[:, t - 1] if t else torch.zeros_like(tokens[:, 0])
            logits[:, t] = torch.where(start[:, None], tokens[:, t], before + tokens[:, t])
        return _Out(logits)


class Leaky(nn.Module):
    """No config, no parameters: logits ``scale`` on each position's token (one-hot), plus ``leak`` wherever earlier
    tokens of another sequence share the row (the row index is past the position id), in ``dtype``. Packed, the
    second sequence's logits differ from its logits alone by exactly ``leak`` (values exact in ``dtype``)."""

    def __init__(self, scale: float, leak: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale, self.leak, self.dtype = scale, leak, dtype

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> _Out:
        logits = nn.functional.one_hot(input_ids, 8).to(self.dtype) * self.scale
        foreign = torch.arange(input_ids.shape[1]) > position_ids  # earlier tokens of another sequence
        return _Out(logits + (self.leak * foreign[..., None]).to(self.dtype))


class SmallVocabulary(nn.Module):
    """An embedding of ``vocab_size`` tokens (its config says so), looked up per position: an id at or above it is
    an IndexError."""

    def __init__(self, vocab_size: int, **config: object) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, **config)
        self.embedding = nn.Embedding(vocab_size, 4)
        self.position = nn.Embedding(8, 4)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> _Out:
        return _Out(self.embedding(input_ids) + self.position(position_ids))


def test_a_model_without_config_or_parameters_that_keeps_sequences_apart_passes() -> None:
    model = TokenAndPosition()
    model.train()
    check_packed_attention(model)
    assert model.training  # put back in the mode it was in


def test_a_model_without_config_or_parameters_that_mixes_sequences_is_refused_naming_no_settings() -> None:
    model = TokenAndPosition(mix=True)
    model.eval()
    with pytest.raises(ConfigError) as info:
        check_packed_attention(model)
    message = str(info.value)
    assert message.startswith(
        "packing=True: TokenAndPosition with attn_implementation=None and use_cache=None lets packed sequences "
        "attend to each other (a packed sequence's logits differ from its logits alone by "
    )
    assert message.endswith("); load the model with attn_implementation='sdpa' or 'eager', or set packing=False")
    assert not model.training


def test_a_model_that_finds_sequences_where_positions_restart_at_zero_passes() -> None:
    check_packed_attention(SegmentSum())


@pytest.mark.parametrize(("leak", "refused"), [(0.0, False), (5e-5, False), (3e-4, True)])
def test_in_32_bit_packed_logits_may_differ_by_1e_4(leak, refused) -> None:
    model = Leaky(1.0, leak, torch.float32)
    if refused:
        with pytest.raises(ConfigError, match=r"differ from its logits alone by 0\.0003\b"):
            check_packed_attention(model)
    else:
        check_packed_attention(model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_in_16_bit_packed_logits_may_differ_by_2_percent_of_one_plus_the_largest_logit(dtype) -> None:
    # the largest logit alone is 49: the tolerance is 0.02 * (1 + 49) = 1.0, a difference of exactly 1.0 passes
    check_packed_attention(Leaky(49.0, 1.0, dtype))
    with pytest.raises(ConfigError, match=r"differ from its logits alone by 1\.0[0-9]"):
        check_packed_attention(Leaky(49.0, 1.0078125, dtype))  # exact in both dtypes where the logit is 0


def test_a_config_without_vocab_size_probes_with_tokens_below_eight() -> None:
    model = TokenAndPosition(vocab=8)
    model.config = SimpleNamespace(use_cache=False, _attn_implementation="eager")
    check_packed_attention(model)


@pytest.mark.parametrize("vocab_size", [2, 5, 7])
def test_the_probe_tokens_are_taken_modulo_a_small_vocabulary(vocab_size) -> None:
    check_packed_attention(SmallVocabulary(vocab_size, use_cache=False))  # no IndexError: every id < vocab_size


def test_a_config_whose_vocab_size_is_none_or_zero_probes_as_eight() -> None:
    for vocab_size in (None, 0):
        model = TokenAndPosition(vocab=8)
        model.config = SimpleNamespace(vocab_size=vocab_size)
        check_packed_attention(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probe_runs_on_the_models_device() -> None:
    seen: list[torch.device] = []

    class Recording(SmallVocabulary):
        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> _Out:
            seen.extend([input_ids.device, position_ids.device])
            return super().forward(input_ids, position_ids)

    model = Recording(16).to("cuda")
    check_packed_attention(model)
    assert seen and all(device.type == "cuda" for device in seen)


# ------------------------------------------------------------------------------------------ prompts for generation


def test_prompts_are_left_padded_with_the_pad_token_and_masked() -> None:
    rows = [
        {"prompt_ids": [5, 6, 7], "reference": "yes"},
        {"prompt_ids": [8], "reference": "no"},
        {"prompt_ids": [], "reference": 3},
    ]
    batch = left_padded_prompts(rows, pad_token_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [2, 2, 8], [2, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.long
    assert batch["reference"] == ["yes", "no", "3"]
    assert set(batch) == {"input_ids", "attention_mask", "reference"}


def test_the_collator_adds_the_prompts_only_with_generation() -> None:
    rows = [
        {"input_ids": [5, 6, 7, 1], "labels": [-100, -100, -100, 1], "prompt_ids": [5, 6, 7], "reference": "a"},
        {"input_ids": [8, 1], "labels": [-100, 1], "prompt_ids": [8], "reference": "b"},
    ]
    assert "generation" not in CausalLMCollator(pad_token_id=0)(rows)
    batch = CausalLMCollator(pad_token_id=0, generation=True)(rows)
    assert batch["generation"]["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["generation"]["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["generation"]["reference"] == ["a", "b"]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1], [8, 1, 0, 0]]  # the rows themselves right-padded


# ------------------------------------------------------------------------------------------ best-fit decreasing


def test_lengths_of_one_and_of_the_capacity_fit_and_zero_or_above_is_refused() -> None:
    assert pack_best_fit([], 8) == []
    assert pack_best_fit([8, 1, 8], 8) == [[0], [2], [1]]  # a full bin takes nothing more; the 1 opens a third
    assert pack_best_fit([1] * 4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"^sequence 2 has length 0; expected 1\.\.8$"):
        pack_best_fit([3, 4, 0], 8)
    with pytest.raises(ValueError, match=r"^sequence 0 has length 9; expected 1\.\.8$"):
        pack_best_fit([9], 8)


def test_each_sequence_goes_to_the_tightest_bin_ties_to_the_earliest() -> None:
    # 6 -> bin 0 (room 4), 6 -> bin 1 (room 4), 4 -> bin 0 (rooms tie: the earlier bin), 3 -> bin 1 (room 1),
    # 1 -> bin 1 (room 0, the tightest), 1 -> bin 2 (nothing left with room)
    assert pack_best_fit([1, 6, 3, 6, 4, 1], 10) == [[1, 4], [3, 2, 0], [5]]


# ------------------------------------------------------------------------------------------------ the collator


@pytest.mark.parametrize(("multiple", "width"), [(None, 5), (1, 5), (4, 8), (5, 5), (8, 8)])
def test_the_batch_is_padded_to_a_multiple_and_every_tensor_is_int64(multiple, width) -> None:
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, 8, 9]}, {"input_ids": [4], "labels": [-100]}]
    batch = CausalLMCollator(pad_token_id=3, pad_to_multiple_of=multiple)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9] + [3] * (width - 5), [4] + [3] * (width - 1)]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * (width - 5), [1] + [0] * (width - 1)]
    assert batch["labels"].tolist() == [[-100, 6, 7, 8, 9] + [-100] * (width - 5), [-100] * width]
    assert batch["num_items"].item() == 4 and batch["num_items"].dtype == torch.int64
    assert all(batch[k].dtype == torch.int64 for k in ("input_ids", "attention_mask", "labels"))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "num_items"}


def test_packed_rows_keep_their_position_ids_and_number_the_padding_from_zero() -> None:
    rows = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, -100], "position_ids": [0, 1, 0]},
        {"input_ids": [8], "labels": [-100], "position_ids": [0]},
    ]
    batch = CausalLMCollator(pad_token_id=0, pad_to_multiple_of=4)(rows)
    assert batch["position_ids"].tolist() == [[0, 1, 0, 0], [0, 0, 1, 2]]
    assert batch["position_ids"].dtype == torch.int64 and "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]] and batch["num_items"].item() == 1

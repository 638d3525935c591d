"""The ``fsdp`` plugin's settings and its start-up check of the wrap policy against the model (issue 41, item 11):
one clear error each, before anything is sharded. The runs themselves are in tests/test_fsdp.py."""

from __future__ import annotations

import pytest
import torch
import transformers

import torchloom
from torchloom_plugins.fsdp import FullyShardedDataParallel


@pytest.fixture(scope="module")
def llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"version": 3}, "setting 'version' = 3; expected 1 or 2"),
        (
            {"auto_wrap_policy": "layers"},
            "setting 'auto_wrap_policy' = 'layers'; expected one of transformer_based_wrap",
        ),
        ({"state_dict_type": "LOCAL"}, "setting 'state_dict_type' = 'LOCAL'; expected one of SHARDED_STATE_DICT"),
        ({"min_num_params": 0}, "setting 'min_num_params' = 0; expected an integer >= 1"),
        ({"transformer_layer_cls_to_wrap": []}, "setting 'transformer_layer_cls_to_wrap' = []; expected a non-empty"),
        ({"transformer_layer_cls_to_wrap": [""]}, "setting 'transformer_layer_cls_to_wrap' = ['']; expected"),
        ({"version": 1, "reshard_after_forward": False}, "setting 'reshard_after_forward' = False is an FSDP2 setting"),
    ],
)
def test_bad_settings_are_one_config_error_naming_the_setting(settings, message):
    with pytest.raises(torchloom.ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        FullyShardedDataParallel(**settings)


def test_the_largest_valid_settings_are_accepted():
    plugin = FullyShardedDataParallel(
        version=1, auto_wrap_policy="size_based_wrap", min_num_params=1, state_dict_type="FULL_STATE_DICT"
    )
    assert plugin.config.version == 1 and plugin.config.min_num_params == 1


def test_a_model_s_own_blocks_are_wrapped_by_default(llama):
    FullyShardedDataParallel().configure_model(llama)  # LlamaDecoderLayer, from _no_split_modules
    FullyShardedDataParallel(transformer_layer_cls_to_wrap=["LlamaDecoderLayer", "LlamaRMSNorm"]).configure_model(llama)


def test_a_block_class_the_model_does_not_have_is_named(llama):
    plugin = FullyShardedDataParallel(transformer_layer_cls_to_wrap=["LlamaDecoderLayer", "GPT2Block"])
    with pytest.raises(torchloom.ConfigError, match=r"names \['GPT2Block'\], which no module of LlamaForCausalLM is"):
        plugin.configure_model(llama)


def test_a_model_without_blocks_to_wrap_asks_for_them():
    with pytest.raises(torchloom.ConfigError, match="Sequential has no _no_split_modules; set transformer_layer_cls"):
        FullyShardedDataParallel().configure_model(_mlp())
    FullyShardedDataParallel(transformer_layer_cls_to_wrap=["Linear"]).configure_model(_mlp())
    FullyShardedDataParallel(auto_wrap_policy="no_wrap").configure_model(_mlp())


def test_a_size_that_wraps_no_module_is_refused_and_the_exact_size_wraps():
    # the MLP's largest submodule: Linear(4, 8), 40 parameters
    FullyShardedDataParallel(auto_wrap_policy="size_based_wrap", min_num_params=40).configure_model(_mlp())
    plugin = FullyShardedDataParallel(auto_wrap_policy="size_based_wrap", min_num_params=41)
    with pytest.raises(torchloom.ConfigError, match=r"min_num_params 41 wraps no module of Sequential .* has 40 param"):
        plugin.configure_model(_mlp())

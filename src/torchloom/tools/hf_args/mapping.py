"""The tables `torchloom.convert_hf_args` converts with: ``TrainingArguments`` values and what the built-in plugins
take for them, why the fields without an equivalent have none, and the defaults of fields older transformers
versions had."""

from __future__ import annotations

from typing import Any

__all__ = [
    "COMPILE_MODES",
    "IGNORED",
    "LEGACY_DEFAULTS",
    "OPTIMIZERS",
    "PLUGIN_OPTIMIZERS",
    "REASONS",
    "SAVE_STRATEGIES",
    "STRATEGIES",
    "TRACKERS",
    "UNSUPPORTED_SCHEDULES",
]

#: TrainingArguments ``optim`` -> the ``optimizer`` plugin's ``name``, and a remark when the two differ.
OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    "adamw_torch": (
        "adamw",
        "torch.optim.AdamW with the fastest implementation the device has (fused where torch has the kernel, as "
        "adamw_torch_fused) instead of torch's default choice: the same update within rounding",
    ),
    "adamw_torch_fused": ("adamw", None),  # the plugin's default implementation: fused where the device has it
    "adamw_hf": ("adamw", "torch.optim.AdamW, the update of transformers' removed AdamW (correct_bias=True)"),
    "adamw_apex_fused": ("adamw", "torch.optim.AdamW instead of apex's FusedAdam: the same update"),
    "adamw_torch_xla": ("adamw", "torch.optim.AdamW instead of torch_xla's syncfree AdamW"),
    "adamw_torch_npu_fused": ("adamw", "torch.optim.AdamW instead of torch_npu's fused AdamW"),
    "adafactor": ("adafactor", None),
    "adamw_bnb_8bit": ("adamw8bit", None),
    "adamw_8bit": ("adamw8bit", None),
    "paged_adamw_8bit": ("paged_adamw8bit", None),
    "sgd": ("sgd", None),
}
#: The names the ``optimizer`` plugin builds (for the reason given when an ``optim`` has no equivalent).
PLUGIN_OPTIMIZERS = ("adamw", "adafactor", "adamw8bit", "adam8bit", "paged_adamw8bit", "sgd")
#: ``lr_scheduler_type`` values the ``optimizer`` plugin cannot build: their ``step()`` needs a metric or a loss.
UNSUPPORTED_SCHEDULES = ("reduce_lr_on_plateau", "greedy")
#: ``report_to`` names the ``trackers`` plugin writes to (Accelerate's trackers).
TRACKERS = ("tensorboard", "wandb", "mlflow", "aim", "comet_ml", "clearml", "dvclive", "swanlab", "trackio")
#: ``torch_compile_mode`` values the ``compile`` plugin takes.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = (*STRATEGIES, "best")

_ACCELERATE = (
    "is set up by Accelerate, not by the run config: describe it with `accelerate config` (or an Accelerate "
    "config file) and start the run with `accelerate launch --config_file FILE -m torchloom.cli fit ...`"
)
_DDP = (
    "DDP is set up by Accelerate from the launcher's environment; to pass DDP options, write a plugin whose "
    "configure_accelerator returns {'kwargs_handlers': [accelerate.DistributedDataParallelKwargs(...)]}"
)
_DATALOADER = (
    "a DataLoader setting: it belongs to your DataModule's train_dataloader / val_dataloader (torchloom's "
    "built-in data modules take num_workers only)"
)
_COLUMNS = "the columns a batch holds are chosen by your DataModule and read by your task's training_step"
_COLLECTION = (
    "how the Trainer gathers predictions for compute_metrics; torchloom updates metrics batch by batch "
    "(validation_step, or the eval_metrics plugin), so there is nothing to configure"
)
_HUB = (
    "torchloom does not upload: save the model (engine setting save_model: true) and push <run>/model with "
    "huggingface_hub's upload_folder"
)
_LOGGING = (
    "the torchloom command keeps library logging to the main process; set TRANSFORMERS_VERBOSITY or Python's "
    "logging yourself"
)

#: Fields with no equivalent, and why (for those the converter does not handle itself).
REASONS: dict[str, str] = {
    "fsdp": f"FSDP {_ACCELERATE}",
    "fsdp_config": f"FSDP {_ACCELERATE}",
    "deepspeed": f"DeepSpeed {_ACCELERATE} (deepspeed_config_file: this JSON)",
    "parallelism_config": f"the parallelism layout {_ACCELERATE}",
    "local_rank": "set for each process by the launcher (torchrun, accelerate launch); not a setting",
    "ddp_backend": _DDP,
    "ddp_timeout": _DDP,
    "ddp_find_unused_parameters": _DDP,
    "ddp_bucket_cap_mb": _DDP,
    "ddp_broadcast_buffers": _DDP,
    "ddp_static_graph": _DDP,
    "use_cpu": (
        "the device is chosen when the run starts: on a machine with GPUs, ACCELERATE_USE_CPU=1 (or `accelerate "
        "launch --cpu`) trains on the CPU; without GPUs torchloom uses the CPU anyway"
    ),
    "no_cuda": "the device is chosen when the run starts: ACCELERATE_USE_CPU=1 (or `accelerate launch --cpu`)",
    "use_mps_device": "the device is chosen by Accelerate when the run starts",
    "tf32": (
        "set torch.backends.cuda.matmul.allow_tf32 (or torch.set_float32_matmul_precision('high')) in your task's "
        "configure_model"
    ),
    "bf16_full_eval": "no setting casts the model to half precision for evaluation only",
    "fp16_full_eval": "no setting casts the model to half precision for evaluation only",
    "half_precision_backend": "the mixed_precision plugin uses Accelerate's native torch.amp; there is no apex backend",
    "fp16_backend": "the mixed_precision plugin uses Accelerate's native torch.amp; there is no apex backend",
    "fp16_opt_level": "an apex AMP level; the mixed_precision plugin uses native torch.amp",
    "label_smoothing_factor": (
        "part of the loss: compute it in your task's training_step, e.g. torch.nn.functional.cross_entropy(logits, "
        "labels, label_smoothing=...)"
    ),
    "optim_target_modules": "GaLore / APOLLO target modules; the optimizer plugin builds neither",
    "logging_first_step": "training values are logged every log_every_n_steps optimizer steps, not after the first",
    "logging_nan_inf_filter": (
        "torchloom does not filter non-finite losses out of the logs: by default (engine setting nonfinite_loss: "
        "error) a NaN or infinite loss stops the run"
    ),
    "eval_on_start": (
        "no full validation before training: the engine's sanity pass (num_sanity_val_steps) runs a few "
        "validation batches and logs nothing; call Engine.validate first, or run torchloom validate"
    ),
    "eval_delay": "validation runs at every interval from the first one",
    "eval_accumulation_steps": _COLLECTION,
    "eval_do_concat_batches": _COLLECTION,
    "eval_use_gather_object": _COLLECTION,
    "batch_eval_metrics": _COLLECTION,
    "include_for_metrics": _COLLECTION,
    "include_inputs_for_metrics": _COLLECTION,
    "prediction_loss_only": _COLLECTION,
    "save_only_model": (
        "a checkpoint always holds the optimizer, scheduler, random states and data position, so that resuming is "
        "exact; for the weights alone set the engine setting save_model: true (<run>/model at the end)"
    ),
    "save_on_each_node": "checkpoints are written once, by the main process, into the run directory",
    "save_safetensors": "torchloom always saves weights as safetensors",
    "overwrite_output_dir": "every run writes a new <output_dir>/version_N; nothing is overwritten",
    "logging_dir": "trackers write inside the run directory (<output_dir>/version_N)",
    "push_to_hub": _HUB,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "hub_private_repo": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "push_to_hub_model_id": _HUB,
    "push_to_hub_organization": _HUB,
    "run_name": (
        "the trackers plugin names the run with project_name; give a tracker its own run name in init_kwargs, "
        "e.g. {wandb: {name: ...}}"
    ),
    "log_level": _LOGGING,
    "log_level_replica": _LOGGING,
    "log_on_each_node": _LOGGING,
    "ignore_data_skip": "a resumed fit always continues at the checkpoint's position in the data",
    "restore_callback_states_from_checkpoint": (
        "every stateful plugin's state is saved and restored with the checkpoint"
    ),
    "full_determinism": (
        "with the engine's seed a CPU run is bitwise repeatable; for deterministic GPU kernels call "
        "transformers.enable_full_determinism(seed) in your task's configure_model"
    ),
    "data_seed": "the data order is drawn from the engine's seed (seed + epoch)",
    "accelerator_config": (
        "the engine builds the Accelerator; a plugin's configure_accelerator can return Accelerator keyword "
        "arguments such as dataloader_config"
    ),
    "dataloader_drop_last": _DATALOADER,
    "dataloader_pin_memory": _DATALOADER,
    "dataloader_persistent_workers": _DATALOADER,
    "dataloader_prefetch_factor": _DATALOADER,
    "dataloader_multiprocessing_context": _DATALOADER,
    "dataloader_in_order": _DATALOADER,
    "train_sampling_strategy": (
        "the sampler belongs to your DataModule's train_dataloader; for 'group_by_length', torchloom's text data "
        "modules take group_by_length: true"
    ),
    "group_by_length": (
        "a data-module setting: group_by_length: true on torchloom's text data modules (TextClassificationData, "
        "LanguageModelingData, PromptCompletionData, ChatData)"
    ),
    "remove_unused_columns": _COLUMNS,
    "label_names": _COLUMNS,
    "length_column_name": _COLUMNS,
    "auto_find_batch_size": (
        "the auto_batch plugin: give the data module the effective batch per process (per_device_train_batch_size "
        "x gradient_accumulation_steps) as its batch_size, keep grad_accum's steps at 1, and enable auto_batch: it "
        "backs off on out-of-memory errors keeping the effective batch and the schedule"
    ),
    "neftune_noise_alpha": "a change to the model: add the noise to the input embeddings in your task",
    "use_liger_kernel": "patch the model with liger_kernel's apply_liger_kernel_to_* in your task's configure_model",
    "liger_kernel_config": "patch the model with liger_kernel's apply_liger_kernel_to_* in your task's configure_model",
    "use_cache": "a model setting: set model.config.use_cache in your task's configure_model",
    "do_train": "read by example scripts, not by the Trainer: run torchloom fit",
    "do_eval": "read by example scripts, not by the Trainer: run torchloom validate, or give fit validation data",
    "do_predict": "read by example scripts, not by the Trainer: run torchloom predict",
    "resume_from_checkpoint": (
        "not a config setting: `torchloom fit --config ... --resume [PATH]` continues from a torchloom checkpoint; "
        "a Trainer checkpoint (checkpoint-N/) cannot be resumed, load its weights in your task's configure_model"
    ),
    "optim_args": "arguments for optimizers the optimizer plugin does not build",
    "project": "the trackers plugin's project_name; no tracker is enabled (report_to)",
}

#: Fields of older transformers versions, with their default there (a value equal to it is not reported).
LEGACY_DEFAULTS: dict[str, Any] = {
    "evaluation_strategy": "no",
    "warmup_ratio": 0.0,
    "logging_dir": None,
    "overwrite_output_dir": False,
    "save_safetensors": True,
    "half_precision_backend": "auto",
    "fp16_backend": "auto",
    "fp16_opt_level": "O1",
    "no_cuda": False,
    "use_mps_device": False,
    "use_ipex": False,
    "jit_mode_eval": False,
    "group_by_length": False,
    "include_inputs_for_metrics": False,
    "include_tokens_per_second": False,
    "use_legacy_prediction_loop": False,
    "past_index": -1,
    "ray_scope": "last",
    "mp_parameters": "",
    "fsdp_min_num_params": 0,
    "tpu_metrics_debug": False,
    "push_to_hub_token": "<PUSH_TO_HUB_TOKEN>",
    "eval_do_concat_batches": True,
    "dispatch_batches": None,
    "split_batches": None,
}
#: Fields never reported: secrets (``to_json_string`` masks them) and the deprecated mirror of another field.
IGNORED = ("hub_token", "push_to_hub_token", "gradient_checkpointing", "gradient_checkpointing_kwargs")

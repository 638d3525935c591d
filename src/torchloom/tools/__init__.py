"""Clients of the engine: they answer questions about a run without running it.

- `memory_plan`, `memory_source`, `memory_trace`, `optimizer_memory`: training memory before training
  (`torchloom.estimate_memory`, `torchloom.estimate_optimizer_memory`).
- `flops`: the floating-point operations of one training micro-batch (`torchloom.estimate_flops`).
- `sizes`: how big a model and its optimizer state are (`torchloom.utils.count_parameters`,
  `torchloom.utils.optimizer_state_bytes`).
- `hf_args`: a Hugging Face ``TrainingArguments`` JSON as a torchloom run config (`torchloom.convert_hf_args`).
"""

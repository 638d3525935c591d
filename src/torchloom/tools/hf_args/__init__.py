"""A saved Hugging Face ``TrainingArguments`` JSON as a torchloom run config (`torchloom.convert_hf_args`).

- `convert`: the entry point, `convert_hf_args`.
- `fields`: the conversion, field by field (`Converter`).
- `conversion`: what it returns (`HFArgsConversion`): the settings and a remark on each argument.
- `mapping`: ``TrainingArguments`` values and the built-in plugin settings they map to.
"""

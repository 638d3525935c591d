"""Run directories and the files in them: what a run writes, where, and what reads it back.

Its modules, by role:

- `layout`: an ``output_dir``'s run directories ``version_N`` and the names of what they hold.
- `runfiles`: a run's own directory, with ``config.yaml``, ``metrics.jsonl`` and its summary.
- `atomic`, `liveness`: files and directories that appear complete or not at all, and what tells a killed
  writer's leftovers from a live one's.
- `weight_files`: the files of saved weights, read without loading them.
- `adapter_format`: adapters injected in place into a model, in peft's own folder format.
- `export`, `export_checkpoint`: the exported model (its card, the trained weights ``predict`` loads) and the
  conversion of a checkpoint into one.
- `inspect`: what a checkpoint, a run directory or an exported model holds (`torchloom.inspect_path`).
"""

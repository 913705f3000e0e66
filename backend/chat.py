"""Chat prompts: a list of messages turned into the prompt text by the checkpoint's chat template.

    template = ChatTemplate.from_checkpoint(path)       # None: the checkpoint ships no template
    text = template.render([{"role": "user", "content": "Hi"}])

The template is tokenizer_config.json's `chat_template`, rendered by transformers' own renderer (what
apply_chat_template calls: Jinja's immutable sandbox with transformers' loop controls, `{% generation %}` blocks,
`tojson` without HTML escapes, `raise_exception` and `strftime_now`; `messages`, `add_generation_prompt=True`,
`bos_token`, `eos_token`), so that templates written for it render here as there. A template that refuses the
messages (`raise_exception`) or fails on them is a ValueError with its message. Messages are checked first: a
non-empty list of objects with `role` (system, user, assistant) and string `content`; anything else is a ValueError
naming the message. The rendered text carries its own special tokens, so it is tokenized without adding any
(`Tokenizer.encode(text, add_special_tokens=False)`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path) -> "ChatTemplate | None":
        path = Path(checkpoint) / "tokenizer_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # transformers' named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not template:
            return None
        import transformers.utils.chat_template_utils  # noqa: F401 (its import, half a second, at start-up)

        return cls(template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: Any) -> str:
        check_messages(messages)
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            (text,), _ = render_jinja_template([messages], chat_template=self.source, add_generation_prompt=True,
                                               bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None
        return text


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty JSON list of {\"role\", \"content\"} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content' (and optionally 'name')")
        if message.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")


def _token_text(token: Any) -> str:
    """tokenizer_config.json keeps special tokens as strings or as {"content": ...} objects."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token or ""

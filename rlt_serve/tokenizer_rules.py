"""Per-family tokenization rules that a checkpoint's tokenizer files do not state.

Huginn-0125 (MODELS.md §3.7): its tokenizer adds BOS *and* EOS, and the official usage drops the
trailing EOS from a prompt (`encode(text, add_special_tokens=True)[:, :-1]`), so an encoded
prompt here ends without it. Its chat template is the one the official converter pushes to the
hub; it is used when a checkpoint directory ships none. Read from `config.json`'s model_type so
the router and the offline API, which load tokenizers on their own, apply the same rules.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

# BOS before the first message; each message `<|begin_header|>{role}<|end_header|>\n\n{content|trim}<|end_turn|>`
# with the assistant's role shown as Huginn; the generation prompt opens a Huginn turn, and a
# conversation without one ends with <|end_text|>.
HUGINN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{- bos_token -}}{%- endif -%}"
    "{%- set role = 'Huginn' if message['role'] in ['assistant', 'Huginn'] else message['role'] -%}"
    "{{- '<|begin_header|>' + role + '<|end_header|>\\n\\n' -}}"
    "{%- if role == 'Huginn' -%}"
    "{% generation %}{{- message['content'] | trim + '<|end_turn|>' -}}{% endgeneration %}"
    "{%- else -%}"
    "{{- message['content'] | trim + '<|end_turn|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|begin_header|>Huginn<|end_header|>\\n\\n' -}}"
    "{%- else -%}{{- '<|end_text|>' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TokenizerRules:
    drop_trailing_eos: bool = False  # encode(add_special_tokens=True) leaves off a trailing EOS
    chat_template: str | None = None  # used when the checkpoint has no chat template


_RULES = {"huginn_raven": TokenizerRules(drop_trailing_eos=True, chat_template=HUGINN_CHAT_TEMPLATE)}


def tokenizer_rules(model_dir: str) -> TokenizerRules:
    """The rules for the family named by `model_dir/config.json` (none when it is absent or unreadable:
    a tokenizer-only directory keeps its files' own behaviour)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return TokenizerRules()
    return _RULES.get(model_type, TokenizerRules())

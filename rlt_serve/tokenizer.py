"""Tokenizer, chat templates and streaming detokenization.

`Tokenizer` wraps the Rust `tokenizers` library directly (no `transformers` dependency) and reads
the Hugging Face files a checkpoint ships: `tokenizer.json` (the whole pipeline), plus the
settings that live only in `tokenizer_config.json` (special-token names, `add_bos_token`, the chat
template). Chat templates are rendered the way `transformers`' `apply_chat_template` renders
them, because checkpoints' templates are written against that environment: a sandboxed jinja2
environment with `trim_blocks`/`lstrip_blocks`, loop controls, `raise_exception`,
`strftime_now` and a non-escaping `tojson`.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas that never end inside a
UTF-8 character, for SSE streaming.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rlt_serve.tokenizer_rules import tokenizer_rules

# tokenizer_config.json fields that name one special token each (a string or an AddedToken dict).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# transformers writes this for "no limit" (int(1e30)).
_NO_LENGTH_LIMIT = 10**18


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded, or a chat that cannot be rendered."""


def _token_content(value: Any, source: str, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{source}: {key} must be a string or an AddedToken dict, got {value!r}")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot be read ({e})") from e


def _config_chat_templates(config: Mapping[str, Any], source: str) -> dict[str, str]:
    """`chat_template` from tokenizer_config.json: one string, or a list of named templates."""
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        templates = {}
        for item in value:
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise TokenizerError(f"{source}: chat_template list entries need 'name' and 'template' strings")
            templates[item["name"]] = item["template"]
        return templates
    raise TokenizerError(f"{source}: chat_template must be a string or a list, got {type(value).__name__}")


def load_chat_templates(model_dir: str, config: Mapping[str, Any]) -> dict[str, str]:
    """Every chat template a checkpoint directory defines, by name ("default" is the main one).

    Precedence follows transformers: `chat_template.jinja` replaces the config's default template
    (it is the newer layout, so a directory with both was re-saved by a newer version), and
    `additional_chat_templates/<name>.jinja` add or replace named ones.
    """
    templates = _config_chat_templates(config, os.path.join(model_dir, "tokenizer_config.json"))
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        templates["default"] = _read_text(path)
    extra_dir = os.path.join(model_dir, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                templates[name[: -len(".jinja")]] = _read_text(os.path.join(extra_dir, name))
    return templates


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, special ids, and chat rendering."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        source: str = "tokenizer_config.json",
        drop_trailing_eos: bool = False,
    ) -> None:
        config = dict(config or {})
        self._backend = backend
        # tokenizer.json may carry padding/truncation settings from training; a server encodes one
        # prompt at a time and must never cut or pad it silently.
        backend.no_padding()
        backend.no_truncation()
        config_special = self._sync_added_tokens(config.get("added_tokens_decoder") or {}, source)
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1

        self._special: dict[str, str | None] = {
            key: _token_content(config.get(key), source, key) for key in _NAMED_SPECIAL_TOKENS
        }
        extra = list(config.get("additional_special_tokens") or [])
        extra_v5 = config.get("extra_special_tokens") or []  # transformers v5 name; a list or a dict
        extra += list(extra_v5.values()) if isinstance(extra_v5, Mapping) else list(extra_v5)
        named = [t for t in self._special.values() if t is not None]
        named += [t for t in (_token_content(v, source, "additional_special_tokens") for v in extra) if t]
        self._special_ids = {i for i in map(backend.token_to_id, named) if i is not None}
        self._special_ids |= {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self._special_ids |= config_special

        self._bos_id = self._id_of(self._special["bos_token"])
        self._eos_id = self._id_of(self._special["eos_token"])
        # add_bos_token/add_eos_token are tokenizer_config settings that transformers applies on
        # top of tokenizer.json. Apply them only where tokenizer.json's post-processor does not
        # already add tokens at that end, so BOS/EOS is never added twice.
        lead, trail = self._post_processor_adds()
        self._add_bos = bool(config.get("add_bos_token")) and self._bos_id is not None and not lead
        self._add_eos = bool(config.get("add_eos_token")) and self._eos_id is not None and not trail
        # A family rule (tokenizer_rules): leave off the EOS the tokenizer itself appends (Huginn).
        self._drop_trailing_eos = drop_trailing_eos and (trail or self._add_eos)

        self._chat_templates = dict(
            chat_templates if chat_templates is not None else _config_chat_templates(config, source)
        )
        max_len = config.get("model_max_length")
        self.model_max_length: int | None = (
            int(max_len) if isinstance(max_len, (int, float)) and 0 < max_len < _NO_LENGTH_LIMIT else None
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "Tokenizer":
        """Load `tokenizer.json` (required) and `tokenizer_config.json` (optional) from a directory."""
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"{path}: not found (rlt-serve needs a fast tokenizer's tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust parser raises a bare Exception
            raise TokenizerError(f"{path}: not a valid tokenizer file ({e})") from e
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        rules = tokenizer_rules(model_dir)
        templates = load_chat_templates(model_dir, config)
        if rules.chat_template is not None:
            templates.setdefault("default", rules.chat_template)
        return cls(backend, config, templates, source=config_path, drop_trailing_eos=rules.drop_trailing_eos)

    def _sync_added_tokens(self, decoder: Mapping[str, Any], source: str) -> set[int]:
        """Make tokenizer.json agree with tokenizer_config.json's `added_tokens_decoder`.

        A token missing from tokenizer.json is added; an id that disagrees is an error, because
        the model's embedding rows are indexed by the config's ids. Returns the ids it marks special.
        """
        special: set[int] = set()
        for key, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            want = int(key)
            content = _token_content(spec, source, f"added_tokens_decoder[{key}]")
            have = self._backend.token_to_id(content)
            if have is None:
                spec = spec if isinstance(spec, Mapping) else {}
                token = tokenizers.AddedToken(
                    content,
                    single_word=bool(spec.get("single_word", False)),
                    lstrip=bool(spec.get("lstrip", False)),
                    rstrip=bool(spec.get("rstrip", False)),
                    normalized=bool(spec.get("normalized", not spec.get("special", False))),
                    special=bool(spec.get("special", False)),
                )
                if token.special:
                    self._backend.add_special_tokens([token])
                else:
                    self._backend.add_tokens([token])
                have = self._backend.token_to_id(content)
            if have != want:
                raise TokenizerError(
                    f"{source}: added token {content!r} has id {want} but tokenizer.json gives it id {have}"
                )
            if isinstance(spec, Mapping) and spec.get("special"):
                special.add(want)
        return special

    def _post_processor_adds(self) -> tuple[bool, bool]:
        """Whether tokenizer.json's post-processor adds tokens at the (start, end) of a sequence."""
        probe = "a"
        plain = self._backend.encode(probe, add_special_tokens=False).ids
        full = self._backend.encode(probe, add_special_tokens=True).ids
        if full == plain:
            return False, False
        if not plain:
            return True, True
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        return start > 0, start + len(plain) < len(full)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # -- vocabulary ---------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (highest id + 1, so holes count)."""
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id) if token_id >= 0 else None

    @property
    def bos_token(self) -> str | None:
        return self._special["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._special["eos_token"]

    @property
    def pad_token(self) -> str | None:
        return self._special["pad_token"]

    @property
    def unk_token(self) -> str | None:
        return self._special["unk_token"]

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        """tokenizer_config.json's eos. Chat stop tokens are the engine's business (family rules)."""
        return self._eos_id

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self._special["pad_token"])

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of(self._special["unk_token"])

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of the named special tokens plus every added token marked `special`."""
        return set(self._special_ids)

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._add_bos and (not ids or ids[0] != self._bos_id):
                ids.insert(0, self._bos_id)
            if self._add_eos and (not ids or ids[-1] != self._eos_id):
                ids.append(self._eos_id)
            if self._drop_trailing_eos and ids and ids[-1] == self._eos_id:
                ids.pop()
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids beyond the tokenizer's vocabulary decode to nothing."""
        try:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as e:  # negative or non-integer ids
            raise TokenizerError(f"cannot decode {ids!r}: {e}") from e

    # -- chat ---------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None."""
        return self._chat_templates.get("default")

    @property
    def chat_templates(self) -> dict[str, str]:
        """All chat templates by name."""
        return dict(self._chat_templates)

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        # Same choice as transformers: a name of a stored template, else a template string; with
        # no argument, "tool_use" when tools are passed and one exists, else "default".
        if chat_template is not None:
            return self._chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if self._chat_templates:
            names = ", ".join(sorted(self._chat_templates))
            raise TokenizerError(f"no default chat template; pass chat_template= one of: {names}")
        raise TokenizerError("this tokenizer has no chat template; pass chat_template= a jinja template string")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` to the prompt string (not tokenized; encode it with
        `add_special_tokens=False`, since templates write BOS themselves where they want it).

        `template_kwargs` become template variables (e.g. `enable_thinking`) and override the
        special-token strings. `continue_final_message` cuts the text right after the last
        message's content, so the model continues it instead of starting a new turn.
        """
        if continue_final_message and add_generation_prompt:
            raise TokenizerError("continue_final_message and add_generation_prompt cannot both be set")
        template = _compile(self._select_template(chat_template, tools))
        variables = {k: v for k, v in self._special.items() if v is not None}
        variables.update(template_kwargs)
        try:
            text = template.render(
                messages=list(messages),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template error: {e.message or e}") from e
        except Exception as e:  # a template is code from the checkpoint; any failure is a bad request
            raise TokenizerError(f"chat template error: {type(e).__name__}: {e}") from e
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return text


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    if not messages:
        raise TokenizerError("continue_final_message needs at least one message")
    content = messages[-1].get("content")
    if not isinstance(content, str):  # OpenAI content parts: continue the last text part
        parts = [p.get("text") for p in content or () if isinstance(p, Mapping)]
        content = next((p for p in reversed(parts) if isinstance(p, str)), None)
        if content is None:
            raise TokenizerError("continue_final_message: the final message has no text to continue")
    core = content.strip()
    at = text.rfind(core)
    if not core or at < 0:
        raise TokenizerError("continue_final_message: the final message does not appear in the rendered chat")
    end = at + len(core)
    # Keep the message's own trailing whitespace if the template kept it.
    tail = content[len(content.rstrip()):]
    if text.startswith(tail, end):
        end += len(tail)
    return text[:end]


# -- the template environment -----------------------------------------------------------------


class _GenerationBlock(Extension):
    """`{% generation %}…{% endgeneration %}`: transformers uses it to mark assistant tokens for
    training masks. Rendering only needs the body, so the tag renders its content unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own tojson this does not HTML-escape: the output goes into a prompt.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=tuple(separators) if separators is not None else None,
        sort_keys=sort_keys,
    )


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template syntax error (line {e.lineno}): {e.message}") from e


# -- streaming --------------------------------------------------------------------------------

# How many prompt tokens to decode with the first generated ones. Some decoders (SentencePiece's
# Metaspace, Strip) drop a leading space at the start of a sequence; with context the first
# generated word keeps the space it has after the prompt.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for a stream of generated token ids.

    Each push decodes a short window: the tokens of the previous delta ("prefix") plus those not
    yet emitted, and returns what the window adds beyond the prefix's text. A delta is held back
    while the window's text ends in U+FFFD, i.e. inside a UTF-8 character that byte-level BPE or
    byte-fallback split across tokens, and while the window's text does not extend the prefix's.
    Decoding the window rather than single tokens keeps word-boundary spaces right for decoders
    that strip a leading space.

    `tokenizers.decoders.DecodeStream` does the same in Rust, but it raises mid-stream when a
    tokenizer's output is not monotonic ("Invalid prefix encountered", vllm-project/vllm#17448)
    and has no way to emit held-back bytes at the end; a stream must neither fail nor lose text.

    With `prompt_ids`, its last few tokens are decoding context only: the deltas continue the
    prompt's text. Without it, `"".join(deltas) + flush()` equals `tokenizer.decode(token_ids)`.
    """

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._start = len(self._ids)  # where the generated ids begin in self._ids
        self._prefix = 0  # self._ids[_prefix:_read] produced the previous delta (or is context)
        self._read = self._start
        self._context_text = self._decode(self._ids)
        self._text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        if (
            len(window_text) <= len(prefix_text)
            or window_text.endswith("\ufffd")
            or not window_text.startswith(prefix_text)
        ):
            return ""
        delta = window_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: the text still held back (e.g. a dangling partial character)."""
        full = self._decode(self._ids)
        if not full.startswith(self._context_text + self._text):
            return ""
        delta = full[len(self._context_text) + len(self._text) :]
        self._prefix = self._read = len(self._ids)
        self._text += delta
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """The generated ids pushed so far (prompt context excluded)."""
        return self._ids[self._start :]

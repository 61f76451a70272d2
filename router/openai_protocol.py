"""OpenAI/vLLM request models and response shapes.

Requests are pydantic models in strict mode, so a wrong JSON type (`"max_tokens": "5"`,
`"stream": "yes"`) is a 400 naming the field instead of a silent coercion. Unknown fields are
ignored, as vLLM does, so clients that send extra OpenAI fields keep working. Responses are plain
dicts built by the functions below: they are serialised once per chunk on the hot path, and the
shapes are easier to check against OpenAI's documentation when written out literally.
"""

from __future__ import annotations

import time
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128
_SEED_MAX = 2**63 - 1 - MAX_N  # seed + i stays a valid generator seed

PromptInput = Union[str, list[str], list[int], list[list[int]]]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat: OpenAI's, vLLM's extras, and the loop controls."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    priority: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Depth control of a looped model (extra body fields).
    num_loops: int | None = Field(None, ge=1)
    min_loops: int | None = Field(None, ge=1)
    exit_threshold: float | None = None
    exit_criterion: str | None = None
    exit_check_interval: int = 1


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, ... reach the template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses -----------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(
    index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_choice(
    index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "tool_calls": []},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_chunk_choice(
    index: int, delta: dict[str, Any], logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> dict[str, Any]:
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def envelope(
    request_id: str, obj: str, created: int, model: str, choices: list[dict[str, Any]], usage_: dict | None
) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices, "usage": usage_}

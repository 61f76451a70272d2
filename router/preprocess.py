"""OpenAI requests to engine requests: tokenise, fill defaults, validate, fan out `n`.

Tokenisation matches the offline `LLM` API exactly (text prompts are encoded with special
tokens; a chat is rendered with the checkpoint's template and encoded without them), and so
do sampling defaults (generation_config.json), so a server request and `LLM.generate` with the
same prompt and seed produce the same tokens. Everything that can be checked here is checked
here, before any credit is reserved, and reported as a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from rlt_serve.config import ModelConfig
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.tokenizer import Tokenizer
from router.errors import APIError, invalid
from router.generation import Choice
from router.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields

_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p")


class Preprocessor:
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, generation_config: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        defaults = {k: generation_config[k] for k in _DEFAULT_KEYS if generation_config.get(k) is not None}
        if generation_config.get("do_sample") is False:
            defaults["temperature"] = 0.0
        self.defaults = defaults

    # -- prompts ------------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            texts: list[str] | None = [p]
        elif p and all(isinstance(x, str) for x in p):
            texts = list(p)  # type: ignore[arg-type]
        else:
            texts = None
        if texts is not None:
            prompts = [self.tokenizer.encode(t, add_special_tokens=req.add_special_tokens) for t in texts]
        elif not p:
            raise invalid("prompt: must not be empty", "prompt")
        elif isinstance(p[0], int):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
        for ids in prompts:
            self._check_ids(ids, "prompt")
        return prompts

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [self._message(m, i) for i, m in enumerate(req.messages)]
        if req.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice: only 'none' and 'auto' are supported", "tool_choice")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise invalid("response_format: only {'type': 'text'} is supported", "response_format")
        text = self.render_chat(
            messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            tools=req.tools,
            chat_template=req.chat_template,
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self._check_ids(ids, "messages")
        return ids

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> str:
        reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(kwargs or {})
        if reserved:
            raise invalid(f"chat_template_kwargs: {sorted(reserved)[0]!r} cannot be set here", "chat_template_kwargs")
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template=chat_template,
                **(kwargs or {}),
            )
        except ValueError as e:
            raise invalid(f"messages: {e}", "messages") from None

    def messages(self, msgs: list[ChatMessage]) -> list[dict[str, Any]]:
        return [self._message(m, i) for i, m in enumerate(msgs)]

    @staticmethod
    def _message(m: ChatMessage, i: int) -> dict[str, Any]:
        """Text content parts become one string: what every chat template understands."""
        d = m.model_dump(exclude_none=True)
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(
                        f"messages.{i}.content: only text content parts are supported", f"messages.{i}.content"
                    )
                texts.append(part["text"])
            d["content"] = "".join(texts)
        elif content is None:
            d["content"] = ""
        return d

    def _check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise invalid(f"{param}: the prompt must contain at least one token", param)
        vocab = self.model_config.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise invalid(f"{param}: token id {t} is outside the vocabulary [0, {vocab})", param)

    # -- sampling -----------------------------------------------------------------------------
    def choices(
        self,
        req: _SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        max_model_len: int,
        prompt_param: str,
    ) -> list[Choice]:
        """One Choice per (prompt, i < n), with validated SamplingParams; index = prompt * n + i."""
        self._check_unsupported(req)
        out: list[Choice] = []
        for pi, ids in enumerate(prompts):
            if len(ids) >= max_model_len:
                raise invalid(
                    f"{prompt_param}: this model's maximum context length is {max_model_len} tokens, but the prompt "
                    f"has {len(ids)} tokens and leaves no room to generate",
                    prompt_param,
                )
            budget = max_model_len - len(ids)
            if max_tokens is not None and max_tokens > budget:
                raise invalid(
                    f"max_tokens: this model's maximum context length is {max_model_len} tokens; the prompt has "
                    f"{len(ids)} tokens, so at most {budget} can be generated, but {max_tokens} were requested",
                    "max_tokens",
                )
            for i in range(req.n):
                params = self.sampling(req, max_tokens if max_tokens is not None else budget, logprobs, i)
                out.append(Choice(index=pi * req.n + i, prompt_ids=ids, params=params))
        return out

    def sampling(self, req: _SamplingFields, max_tokens: int, logprobs: int | None, i: int = 0) -> SamplingParams:
        values: dict[str, Any] = dict(self.defaults)
        for k in _DEFAULT_KEYS:
            if getattr(req, k) is not None:
                values[k] = getattr(req, k)
        try:
            return SamplingParams(
                **values,
                seed=None if req.seed is None else req.seed + i,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                num_loops=req.num_loops,
                min_loops=req.min_loops,
                exit_threshold=req.exit_threshold,
                exit_criterion=req.exit_criterion,
                exit_check_interval=req.exit_check_interval,
            )
        except ValueError as e:
            raise invalid(str(e)) from None

    def _check_unsupported(self, req: _SamplingFields) -> None:
        vocab = self.model_config.vocab_size
        for t in req.stop_token_ids or []:
            if not 0 <= t < vocab:
                raise invalid(f"stop_token_ids: token id {t} is outside the vocabulary [0, {vocab})", "stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise invalid(f"{name}: penalties are not supported by this server (use 0)", name)
        if req.repetition_penalty not in (None, 1.0):
            raise invalid("repetition_penalty: not supported by this server (use 1.0)", "repetition_penalty")
        if req.logit_bias:
            raise invalid("logit_bias: not supported by this server", "logit_bias")
        if req.stream_options is not None and not req.stream:
            raise invalid("stream_options: only allowed when stream is true", "stream_options")


def served_model_check(name: str | None, served: str) -> None:
    """404 for a model this server does not serve (OpenAI's code, `model_not_found`)."""
    if name is not None and name != served:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

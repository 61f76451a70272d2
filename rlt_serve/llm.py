"""The offline API, shaped like vLLM's `LLM` so users need no new vocabulary."""

from __future__ import annotations

import itertools
from typing import Any, Sequence as Seq, Union

from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.outputs import RequestOutput
from rlt_serve.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any], list[int]]
Conversation = list[dict[str, Any]]

_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p")


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "auto",
        skip_tokenizer_init: bool = False,
        hf_overrides: dict[str, Any] | None = None,
        seed: int = 0,
        **engine_args: Any,
    ) -> None:
        self.llm_engine = LLMEngine(
            model,
            dtype=dtype,
            device=device,
            skip_tokenizer_init=skip_tokenizer_init,
            hf_overrides=hf_overrides,
            seed=seed,
            **engine_args,
        )
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's rule: the checkpoint's generation_config.json supplies sampling defaults."""
        gc = self.llm_engine.generation_config
        values = {k: gc[k] for k in _SAMPLING_DEFAULT_KEYS if gc.get(k) is not None}
        if gc.get("do_sample") is False:
            values["temperature"] = 0.0
        return SamplingParams(**values)

    def _token_ids(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            prompt = prompt["prompt"]
        if isinstance(prompt, list):
            return list(prompt), None
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("text prompts need the tokenizer; pass {'prompt_token_ids': [...]} instead")
        return tok.encode(prompt, add_special_tokens=True), prompt

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        engine = self.llm_engine
        order: list[str] = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                ids, text = self._token_ids(prompt)
                rid = str(next(self._counter))
                engine.add_request(rid, ids, p, prompt=text, priority=prio)
                order.append(rid)
            done: dict[str, RequestOutput] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            engine.abort_request(order)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        return [done[rid] for rid in order]

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("chat needs the tokenizer (skip_tokenizer_init=True was set)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            # The template already holds any BOS: encode without adding special tokens again.
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

"""Ouro (1.4B, 2.6B and -Thinking): sandwich norms and a learned exit gate on the looped decoder."""

from rlt_serve.models.looped_llama import LoopedLlamaForCausalLM


class OuroForCausalLM(LoopedLlamaForCausalLM):
    # Upstream config and tokenizer set bos = eos = 0, yet chat replies end with <|im_end|>.
    extra_stop_tokens = ("<|im_end|>",)

"""Nanbeige4.2-3B (and -Base): a plain pre-norm GQA decoder run for a fixed two loops."""

from rlt_serve.models.looped_llama import LoopedLlamaForCausalLM


class NanbeigeForCausalLM(LoopedLlamaForCausalLM):
    """Its generation_config already names <|im_end|> (166101) as eos, so no extra stop tokens."""

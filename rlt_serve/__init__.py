"""rlt-serve: a serving runtime for recurrent-depth ("looped") language models."""

from rlt_serve.llm import LLM
from rlt_serve.outputs import CompletionOutput, Logprob, RequestOutput
from rlt_serve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

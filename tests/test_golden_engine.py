"""The official model code's golden outputs, reproduced through `LLM` (the optimised path)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlt_serve import LLM, SamplingParams

ATOL = 1e-4


@pytest.mark.parametrize("case", ["ouro_s", "nanbeige_s"])
@pytest.mark.parametrize(
    "engine_args",
    [dict(page_size=16), dict(page_size=1, long_prefill_token_threshold=4, max_num_batched_tokens=6)],
    ids=["page16", "page1-chunk4"],
)
def test_golden_through_llm(golden_dir, case, engine_args):
    path = golden_dir / case
    G = load_file(str(path / "golden.safetensors"))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    llm = LLM(model=str(path), dtype="float32", device="cpu", skip_tokenizer_init=True, max_logprobs=vocab, **engine_args)
    # Record every coda output: these are the raw logits the engine computed on its paged path.
    head = llm.llm_engine.runner.model.compute_logits
    seen: list[torch.Tensor] = []
    llm.llm_engine.runner.model.compute_logits = lambda h: seen.append(head(h)) or seen[-1]
    for i in (0, 1):
        seen.clear()
        ids = G[f"p{i}/input_ids"].tolist()
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=vocab)
        out = llm.generate({"prompt_token_ids": ids}, params)[0]
        c = out.outputs[0]
        assert c.token_ids == G[f"p{i}/gen_ids"].tolist()
        # Prefill logits: the coda calls of the prompt, in order, cover positions 0..S-1.
        prefill = torch.cat([s for s in seen])[: len(ids)]
        torch.testing.assert_close(prefill, G[f"p{i}/prefill_logits"], atol=ATOL, rtol=0)
        ref_gen = torch.log_softmax(G[f"p{i}/gen_logits"].double(), -1)
        for k, table in enumerate(c.logprobs):
            top = ref_gen[k].topk(5)
            for tok, val in zip(top.indices.tolist(), top.values.tolist()):
                assert tok in table, (k, tok)
                assert abs(table[tok].logprob - val) < ATOL
        ref_prompt = torch.log_softmax(G[f"p{i}/prefill_logits"].double(), -1)
        assert out.prompt_logprobs[0] is None
        for t in range(1, len(ids)):
            table = out.prompt_logprobs[t]
            assert len(table) == vocab
            got = torch.tensor([table[v].logprob for v in range(vocab)], dtype=torch.float64)
            torch.testing.assert_close(got, ref_prompt[t - 1], atol=ATOL, rtol=0)
    assert llm.llm_engine.num_free_pages == llm.llm_engine.num_pages

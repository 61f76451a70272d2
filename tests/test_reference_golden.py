"""The reference oracle reproduces the golden vectors of the official code (fp32 tolerances)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlt_serve.reference import ReferenceModel
from rlt_serve.testing import write_random_checkpoint

CASES = ["ouro_s", "nanbeige_s"]


def _case(golden_dir, case):
    path = golden_dir / case
    meta = json.loads((path / "golden.json").read_text())
    return path, meta["tolerances"]["fp32"], load_file(str(path / "golden.safetensors"))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prompt", [0, 1])
def test_prefill_and_greedy(golden_dir, case, prompt):
    path, tol, G = _case(golden_dir, case)
    ref = ReferenceModel.from_pretrained(str(path))
    ids = G[f"p{prompt}/input_ids"].tolist()
    atol = tol["logits_atol"]

    out = ref.forward(ids)
    torch.testing.assert_close(out.logits, G[f"p{prompt}/prefill_logits"], atol=atol, rtol=0)

    gen_ids, gen_logits = ref.greedy(ids, len(G[f"p{prompt}/gen_ids"]))
    assert gen_ids == G[f"p{prompt}/gen_ids"].tolist()
    torch.testing.assert_close(gen_logits, G[f"p{prompt}/gen_logits"], atol=atol, rtol=0)


@pytest.mark.parametrize("prompt", [0, 1])
def test_ouro_loops_gate_and_exit(golden_dir, prompt):
    path, tol, G = _case(golden_dir, "ouro_s")
    ref = ReferenceModel.from_pretrained(str(path))
    ids = G[f"p{prompt}/input_ids"].tolist()
    gen = G[f"p{prompt}/gen_ids"].tolist()
    # One forward over prompt + all but the last generated id covers prefill rows and decode rows.
    out = ref.forward(ids + gen[:-1])
    s = len(ids)
    loop_logits = ref.loop_logits(out)
    assert out.loop_hidden.shape == (4, s + len(gen) - 1, ref.config.hidden_size)

    def close(got, name, atol):
        torch.testing.assert_close(got, G[f"p{prompt}/{name}"], atol=tol[atol], rtol=0)

    close(loop_logits[:, :s], "prefill_loop_logits", "logits_atol")
    close(out.gate_logits[:s], "prefill_gate_logits", "gate_logits_atol")
    close(out.exit_pdf[:s], "prefill_exit_pdf", "exit_pdf_atol")

    rows = slice(s - 1, None)  # decode row k comes from position s-1+k
    close(loop_logits[:, rows].transpose(0, 1), "gen_loop_logits", "logits_atol")
    close(out.gate_logits[rows], "gen_gate_logits", "gate_logits_atol")
    close(out.exit_pdf[rows], "gen_exit_pdf", "exit_pdf_atol")

    # The pdf's meaning: the first loop whose cumulative probability reaches q (else the last).
    cdf = out.exit_pdf[:s].cumsum(-1)
    for q in ("1.0", "0.6"):
        reached = cdf >= float(q)
        reached[:, -1] = True
        assert reached.int().argmax(-1).tolist() == G[f"p{prompt}/prefill_exit_loop/thr{q}"].tolist()


@pytest.mark.parametrize("case,family,seed", [("nanbeige_s", "nanbeige", 2), ("ouro_s", "ouro", 1)])
def test_random_checkpoint_matches_golden_init(golden_dir, tmp_path, case, family, seed):
    """write_random_checkpoint follows the golden init; only Ouro's calibrated gate bias differs."""
    path = write_random_checkpoint(str(tmp_path / case), family, seed=seed, max_position_embeddings=256)
    mine = load_file(f"{path}/model.safetensors")
    gold = load_file(str(golden_dir / case / "model.safetensors"))
    assert mine.keys() == gold.keys()
    for key in gold:
        if key == "model.early_exit_gate.bias":
            torch.testing.assert_close(mine[key] - 2.5, gold[key])  # golden bias_shift -2.5
        else:
            assert torch.equal(mine[key], gold[key]), key
    mine_cfg = json.loads((tmp_path / case / "config.json").read_text())
    gold_cfg = json.loads((golden_dir / case / "config.json").read_text())
    for key in ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps",
                "total_ut_steps", "num_loops", "head_dim", "tie_word_embeddings"):
        assert mine_cfg.get(key) == gold_cfg.get(key), key

"""`rlt-serve bench` and `make-random-checkpoint` on the CPU with a tiny checkpoint."""

from __future__ import annotations

import json
import math

import torch

from rlt_serve.cli import main
from rlt_serve.config import ModelConfig
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.loader import load_state_dict
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import SHAPES, _config, _param_specs, random_weights, write_random_checkpoint


def test_make_random_checkpoint_tiny_loads_and_generates(tmp_path, capsys):
    path = str(tmp_path / "tiny")
    assert main(["make-random-checkpoint", "--shape", "tiny", path, "--dtype", "bfloat16"]) == 0
    assert "random tiny" in capsys.readouterr().out
    engine = LLMEngine(path, device="cpu", skip_tokenizer_init=True)
    assert engine.dtype == torch.bfloat16
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert len(done[0].outputs[0].token_ids) == 3


def test_full_size_shapes_match_the_released_parameter_counts():
    """MODELS.md: Ouro-1.4B 1,434,652,673, Ouro-2.6B 2,667,974,657, Nanbeige4.2-3B 4,169,800,704
    parameters; Huginn-0125 is the "3.5B" raven (tied embedding and RoPE table not counted)."""
    counts = {}
    for shape, (family, overrides) in SHAPES.items():
        cfg = _config(family, "bfloat16", overrides)
        ModelConfig.from_dict(cfg)  # the config parses
        counts[shape] = sum(math.prod(s) for _, s, k in _param_specs(cfg) if k not in ("tied_copy", "rope_table"))
    assert counts["ouro-1.4b"] == 1_434_652_673
    assert counts["ouro-2.6b"] == 2_667_974_657
    assert counts["nanbeige4.2-3b"] == 4_169_800_704
    assert 3.5e9 < counts["huginn-0125"] < 3.6e9


def test_streamed_shards_hold_the_same_weights(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "s"), "nanbeige", seed=2, dtype="bfloat16", max_shard_bytes=20000)
    with open(f"{path}/model.safetensors.index.json", encoding="utf-8") as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    with open(f"{path}/config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    got = load_state_dict(path)
    for key, w in random_weights(cfg, seed=2).items():
        assert torch.equal(got[key], w.to(torch.bfloat16)), key


def test_bench_prints_the_roofline_table(tmp_path, capsys):
    path = str(tmp_path / "tiny")
    main(["make-random-checkpoint", "--shape", "tiny", path, "--dtype", "float32"])
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", path, "--concurrency", "2", "--num-prompts", "3", "--input-len", "12",
            "--output-len", "4", "--runs", "3", "--warmup", "1", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    for needle in ("decode ms/token (weights floor)", "output tok/s (issue ceiling)", "reference c=1 tok/s",
                   "attention backend torch", "median of 3 runs after 1 warm-up"):  # fmt: skip
        assert needle in table, needle
    result = json.loads(out_json.read_text())
    assert len(result["runs"]) == 3
    assert all(r["output_tokens"] == 12 for r in result["runs"])
    assert result["floors"]["decode_ms_weights"] > 0 and result["measured"]["output_tps"] > 0

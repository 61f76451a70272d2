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
    g = result["graphs"]  # the CPU captures nothing: prompt chunks ran their loops eagerly
    assert g["loop_calls"] > 0 and g["loop_replays"] == 0 and "of one-loop calls" in table


def test_update_scale_checkpoints_and_derived_copy(tmp_path, capsys):
    """--update-scale multiplies exactly the residual-update tensors; --from derives the same
    weights from a sharded checkpoint by symlinking its shards."""
    full = str(tmp_path / "full")
    assert main(["make-random-checkpoint", "--shape", "tiny", full, "--dtype", "float32", "--seed", "3",
                 "--max-shard-bytes", "300000"]) == 0
    direct, derived = str(tmp_path / "direct"), str(tmp_path / "derived")
    assert main(["make-random-checkpoint", "--shape", "tiny", direct, "--dtype", "float32", "--seed", "3",
                 "--update-scale", "0.25"]) == 0
    assert main(["make-random-checkpoint", derived, "--from", full, "--update-scale", "0.25"]) == 0
    a, b, c = load_state_dict(full), load_state_dict(direct), load_state_dict(derived)
    scaled = [k for k in a if k.endswith(("input_layernorm_2.weight", "post_attention_layernorm_2.weight"))]
    assert len(scaled) == 4
    for key in a:
        want = a[key] * 0.25 if key in scaled else a[key]
        assert torch.allclose(b[key], want) and torch.allclose(c[key], want), key
    import os

    assert any(os.path.islink(os.path.join(derived, n)) for n in os.listdir(derived))


def test_depth_sweep_acceptance_follows_the_update_scale(tmp_path, capsys):
    """The speculation/early-exit sweep runs on the CPU and what it measures responds to the
    checkpoint: smaller per-loop updates -> drafts agree more -> higher acceptance; a lower exit
    threshold -> fewer loops per sampled token. (CPU timings are not meaningful, so not checked.)"""
    from rlt_serve import bench_depth

    paths = {}
    for scale in (1.0, 0.03):
        paths[scale] = write_random_checkpoint(str(tmp_path / f"s{scale}"), "ouro", seed=17, update_scale=scale)
    out_json, out_md = tmp_path / "rows.json", tmp_path / "table.md"
    argv = ["--model", f"1.0={paths[1.0]}", "--model", f"0.03={paths[0.03]}", "--concurrency", "1", "3",
            "--spec", "3:2", "--adaptive", "4", "--exit-model", f"0.03={paths[0.03]}", "--exit-thresholds", "1.0", "0.6",
            "--input-len", "6", "--output-len", "12", "--dtype", "float32", "--device", "cpu", "--num-kv-pages", "128",
            "--runs", "2", "--json", str(out_json), "--out", str(out_md)]  # fmt: skip
    assert bench_depth.main(argv) == 0
    rows = json.loads(out_json.read_text())
    acc = {(r["checkpoint"], r["concurrency"]): r["acceptance_rate"] for r in rows if r["mode"] == "K=3 d=2"}
    for c in (1, 3):
        assert acc[("0.03", c)] > acc[("1.0", c)] + 0.2, acc
    plain = [r for r in rows if r["mode"] == "plain"]
    assert all(r["speedup"] == 1.0 and r["round_speedup"] == [1.0, 1.0] and r["core_calls_per_token"] > 0 for r in plain)
    assert all(len(r["round_tps"]) == 2 and min(r["round_speedup"]) <= r["speedup"] <= max(r["round_speedup"])
               for r in rows)  # fmt: skip
    loops = {(r["concurrency"], r["mode"]): r["mean_loops"] for r in rows if r["mode"].startswith("q=")}
    for c in (1, 3):
        assert loops[(c, "q=1")] == 4.0 and loops[(c, "q=0.6")] < 3.5, loops
    table = out_md.read_text()
    assert "speedup over plain decoding vs measured acceptance" in table and "| 0.03 | 3 | adaptive K<=4 |" in table


def test_bench_reports_speculation_against_plain_decoding(tmp_path, capsys):
    path = write_random_checkpoint(str(tmp_path / "agree"), "ouro", seed=17, update_scale=0.03)
    argv = ["bench", "--model", path, "--concurrency", "2", "--input-len", "6", "--output-len", "8", "--runs", "1",
            "--warmup", "0", "--skip-reference", "--dtype", "float32", "--device", "cpu", "--num-speculative-tokens",
            "3", "--speculative-draft-depth", "2", "--baseline"]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "spec acceptance (K=3, draft depth 2)" in table and "plain decoding tok/s" in table
    assert main(argv[:-5] + ["--exit-threshold", "0.6", "--baseline"]) == 0
    table = capsys.readouterr().out
    assert "mean loops per sampled token" in table and "plain decoding tok/s" in table

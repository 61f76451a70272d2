"""The built-in demo checkpoint: deterministic, loadable, built once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from rlt_serve.config import ModelConfig
from rlt_serve.demo import build_demo_tokenizer, demo_dir, ensure_demo, make_demo
from rlt_serve.tokenizer import Tokenizer


def read_tree(root: str) -> dict[str, bytes]:
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def test_make_demo_is_deterministic(tmp_path):
    a, b = make_demo(str(tmp_path / "a")), make_demo(str(tmp_path / "b"))
    files_a = read_tree(a)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files_a)
    assert files_a == read_tree(b)
    other_seed = read_tree(make_demo(str(tmp_path / "c"), seed=1))
    assert other_seed["tokenizer.json"] == files_a["tokenizer.json"]
    assert other_seed["model.safetensors"] != files_a["model.safetensors"]


def test_tokenizer_training_is_deterministic_across_processes(tmp_path):
    # The BPE trainer runs in Rust with hash maps seeded per process; the vocabulary must not depend on it.
    here = build_demo_tokenizer(str(tmp_path / "here"))
    code = f"from rlt_serve.demo import build_demo_tokenizer; build_demo_tokenizer({str(tmp_path / 'there')!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert read_tree(here) == read_tree(str(tmp_path / "there"))


def test_demo_loads(tmp_path):
    path = make_demo(str(tmp_path / "demo"))
    tok = Tokenizer.from_pretrained(path)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.model_type == "ouro"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 2, 4, 4)
    assert (cfg.intermediate_size, cfg.num_loops, cfg.max_position_embeddings) == (256, 4, 2048)
    assert cfg.vocab_size == tok.vocab_size == 512
    assert cfg.bos_token_id == 0 and cfg.eos_token_ids == [0]
    assert tok.bos_token_id == tok.eos_token_id == 0
    assert tok.token_to_id("<|im_end|>") == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], enable_thinking=True)
    assert prompt == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert max(ids) < cfg.vocab_size and tok.decode(ids, skip_special_tokens=False) == prompt


def test_ensure_demo_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RLT_SERVE_CACHE", str(tmp_path / "cache"))
    assert demo_dir() == str(tmp_path / "cache" / "demo-ouro-v1")
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_demo())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [demo_dir()] * 3
    assert os.listdir(tmp_path / "cache") == ["demo-ouro-v1"]  # no temporary directories left
    stamp = os.stat(os.path.join(demo_dir(), "model.safetensors")).st_mtime_ns
    assert ensure_demo() == demo_dir()
    assert os.stat(os.path.join(demo_dir(), "model.safetensors")).st_mtime_ns == stamp
    # A damaged copy is replaced.
    os.remove(os.path.join(demo_dir(), "tokenizer.json"))
    ensure_demo()
    assert Tokenizer.from_pretrained(demo_dir()).vocab_size == 512
    assert os.listdir(tmp_path / "cache") == ["demo-ouro-v1"]


def test_demo_dir_default(monkeypatch):
    monkeypatch.delenv("RLT_SERVE_CACHE", raising=False)
    assert demo_dir() == os.path.join(os.path.expanduser("~"), ".cache", "rlt-serve", "demo-ouro-v1")

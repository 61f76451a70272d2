"""Tokenizer, chat templates and streaming detokenization, on the demo tokenizer and real templates."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import processors

from rlt_serve.demo import CHAT_TEMPLATE, build_demo_tokenizer
from rlt_serve.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TEXTS = [
    "Hello world! The model thinks about it.",
    "中文文本，还有标点。南北阁",
    "emoji 🙂😀👍🏽 and a family 👨‍👩‍👧 ok",
    "  leading, trailing   and\ttabs\nnew lines  ",
    "mixed: naïve café – “quotes” 日本語 한국어 🚀",
    "numbers 1234567890 and code: def f(x): return x * 2",
]


def shared_dir() -> str:
    path = os.environ.get("RLT_SHARED_DIR") or os.path.join(REPO, "..", "shared")
    if not os.path.isdir(os.path.join(path, "models", "templates")):
        pytest.fail(f"shared test data not found at {path!r} (set RLT_SHARED_DIR to the shared/ checkout)")
    return path


def template(name: str) -> str:
    with open(os.path.join(shared_dir(), "models", "templates", name), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    return build_demo_tokenizer(str(tmp_path_factory.mktemp("demo_tok")))


@pytest.fixture(scope="module")
def tok(demo_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_dir)


def copy_tokenizer(src: str, dst, config_update: dict | None = None) -> str:
    dst = str(dst)
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "tokenizer.json"), dst)
    with open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.update(config_update or {})
    with open(os.path.join(dst, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return dst


# -- encode / decode / vocabulary -------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids == tok.encode(text, add_special_tokens=False)  # Ouro's tokenizer adds no BOS
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens(tok):
    assert tok.vocab_size == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|endoftext|>",) * 3
    assert tok.bos_token_id == tok.eos_token_id == tok.pad_token_id == 0
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.token_to_id("<|not a token|>") is None
    assert tok.id_to_token(-1) is None and tok.id_to_token(10**6) is None
    assert tok.all_special_ids == {0, 1, 2}
    assert tok.model_max_length == 2048
    # Special tokens are matched whole in text and skipped (or not) on decode.
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode([]) == ""
    assert tok.decode([tok.vocab_size + 5]) == ""  # a model's padded vocab rows decode to nothing


def test_load_errors(tmp_path, demo_dir):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
    good = copy_tokenizer(demo_dir, tmp_path / "bad_config")
    with open(os.path.join(good, "tokenizer_config.json"), "w") as f:
        f.write("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(good)


def test_config_optional(tmp_path, demo_dir):
    d = tmp_path / "bare"
    d.mkdir()
    shutil.copy(os.path.join(demo_dir, "tokenizer.json"), d)
    t = Tokenizer.from_pretrained(str(d))
    assert t.bos_token_id is None and t.eos_token_id is None and t.chat_template is None
    assert t.all_special_ids == {0, 1, 2}  # tokenizer.json's own special added tokens
    assert t.decode(t.encode("abc 🙂")) == "abc 🙂"
    with pytest.raises(TokenizerError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_added_tokens_decoder(tmp_path, demo_dir, tok):
    extra = {"512": {"content": "<think>", "special": False}, "513": {"content": "</think>", "special": False}}
    with open(os.path.join(demo_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        added = dict(json.load(f)["added_tokens_decoder"], **extra)
    t = Tokenizer.from_pretrained(copy_tokenizer(demo_dir, tmp_path / "a", {"added_tokens_decoder": added}))
    assert (t.token_to_id("<think>"), t.token_to_id("</think>"), t.vocab_size) == (512, 513, 514)
    ids = t.encode("<think>\nhmm</think>")
    assert ids[0] == 512 and ids[-1] == 513
    assert t.decode(ids) == "<think>\nhmm</think>"  # not special: kept by skip_special_tokens
    wrong = dict(added, **{"7": {"content": "<|im_end|>", "special": True}})
    with pytest.raises(TokenizerError, match="im_end"):
        Tokenizer.from_pretrained(copy_tokenizer(demo_dir, tmp_path / "b", {"added_tokens_decoder": wrong}))


def test_bos_added_once(tmp_path, demo_dir):
    t = Tokenizer.from_pretrained(
        copy_tokenizer(demo_dir, tmp_path / "bos", {"bos_token": "<|im_start|>", "add_bos_token": True})
    )
    plain = t.encode("hi there", add_special_tokens=False)
    assert t.encode("hi there") == [1] + plain
    assert t.encode("") == [1]
    # A prompt that already starts with BOS (a chat template wrote it) gets no second one.
    assert t.encode("<|im_start|>user\nhi").count(1) == 1
    assert t.decode(t.encode("hi there")) == "hi there"

    # When tokenizer.json's post-processor adds BOS itself, add_bos_token must not add another.
    d = copy_tokenizer(demo_dir, tmp_path / "post", {"bos_token": "<|im_start|>", "add_bos_token": True})
    rust = RustTokenizer.from_file(os.path.join(d, "tokenizer.json"))
    rust.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", 1)]
    )
    rust.save(os.path.join(d, "tokenizer.json"))
    t = Tokenizer.from_pretrained(d)
    assert t.encode("hi there") == [1] + plain
    assert t.encode("hi there", add_special_tokens=False) == plain


def test_add_eos_token(tmp_path, demo_dir):
    t = Tokenizer.from_pretrained(
        copy_tokenizer(demo_dir, tmp_path / "eos", {"eos_token": "<|im_end|>", "add_eos_token": True})
    )
    assert t.encode("hi")[-1] == 2 and t.encode("hi").count(2) == 1
    assert 2 not in t.encode("hi", add_special_tokens=False)


# -- chat templates ---------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]
CHATML = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n"
    "<|im_start|>user\n2+2?<|im_end|>\n"
)


def test_demo_chatml(tok):
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(CHAT) == CHATML + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == CHATML
    assert tok.apply_chat_template(CHAT, enable_thinking=True) == CHATML + "<|im_start|>assistant\n<think>\n"
    assert tok.apply_chat_template(CHAT, enable_thinking=False) == CHATML + "<|im_start|>assistant\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    # The rendered prompt tokenizes with the ChatML markers as single tokens.
    ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    assert ids.count(1) == 5 and ids.count(2) == 4


def test_ouro_thinking_template(tok, tmp_path, demo_dir):
    src = template("ouro_thinking_chatml.jinja")
    assert tok.apply_chat_template(CHAT, chat_template=src) == CHATML + "<|im_start|>assistant\n"
    thinking = tok.apply_chat_template(CHAT, chat_template=src, enable_thinking=True)
    assert thinking == CHATML + "<|im_start|>assistant\n<think>\n"
    no_system = tok.apply_chat_template(CHAT[1:2], chat_template=src, enable_thinking=False)
    assert no_system == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    # As a checkpoint's chat_template.jinja it replaces tokenizer_config.json's template.
    d = copy_tokenizer(demo_dir, tmp_path / "jinja_file")
    with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(src)
    t = Tokenizer.from_pretrained(d)
    assert t.chat_template == src
    assert t.apply_chat_template(CHAT, enable_thinking=True) == thinking


NANBEIGE_SYSTEM = "<|im_start|>system\n你是南北阁，一款由BOSS直聘自主研发并训练的专业大语言模型。<|im_end|>\n"


def test_nanbeige_template(tok):
    src = template("nanbeige42_chat_template.jinja")
    user = [{"role": "user", "content": "你好"}]
    body = NANBEIGE_SYSTEM + "<|im_start|>user\n你好<|im_end|>\n"
    assert tok.apply_chat_template(user, chat_template=src) == body + "<|im_start|>assistant\n<think>\n"
    no_think = tok.apply_chat_template(user, chat_template=src, enable_thinking=False)
    assert no_think == body + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    own_system = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + user, chat_template=src)
    assert own_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好")
    # Earlier assistant turns carry their reasoning in a think block.
    turns = user + [{"role": "assistant", "content": "<think>\n想一想\n</think>\n\n你好！"}, {"role": "user", "content": "再见"}]
    rendered = tok.apply_chat_template(turns, chat_template=src, add_generation_prompt=False)
    assert "<|im_start|>assistant\n<think>\n想一想\n</think>\n\n你好！<|im_end|>\n<|im_start|>user\n再见<|im_end|>\n" in rendered
    with pytest.raises(TokenizerError, match="System message must be at the beginning"):
        tok.apply_chat_template(user + [{"role": "system", "content": "late"}], chat_template=src)


def test_nanbeige_tools(tok):
    src = template("nanbeige42_chat_template.jinja")
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "查询天气",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }]
    messages = [
        {"role": "user", "content": "北京天气怎么样？"},
        {"role": "assistant", "content": "", "reasoning_content": "需要查天气",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京", "days": 2}}}]},
        {"role": "tool", "content": "晴，25度"},
    ]
    out = tok.apply_chat_template(messages, tools=tools, chat_template=src)
    assert out.startswith("<|im_start|>system\n你是一位工具函数调用专家")
    assert "# Tools" in out and "<tools>\n" + json.dumps(tools[0], ensure_ascii=False) + "\n</tools>" in out
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\n北京\n</parameter>\n<parameter=days>\n2\n</parameter>" in out
    assert "<|im_start|>user\n<tool_response>\n晴，25度\n</tool_response><|im_end|>\n" in out
    assert out.endswith("<|im_start|>assistant\n<think>\n")
    as_json = tok.apply_chat_template(messages, tools=tools, chat_template=src, tool_call_format="json")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京", "days": 2}}\n</tool_call>' in as_json


def test_template_environment(tok):
    def render(src, **kw):
        return tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=src, **kw)

    with pytest.raises(TokenizerError, match="no system role here"):
        render("{{ raise_exception('no system role here') }}")
    with pytest.raises(TokenizerError, match="syntax"):
        render("{% if %}")
    with pytest.raises(TokenizerError, match="chat template error"):
        render("{{ messages[0]['content'] + 1 }}")
    # Sandboxed: no attribute escapes, and messages cannot be mutated.
    with pytest.raises(TokenizerError):
        render("{{ messages.__class__.__subclasses__() }}")
    with pytest.raises(TokenizerError):
        render("{{ messages.append(1) }}")
    assert render("{{ {'b': 'é', 'a': [1, 2]} | tojson }}") == '{"b": "é", "a": [1, 2]}'
    assert render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true, separators=[',', ':']) }}") == '{"a":2,"b":1}'
    assert render("{{ [1] | tojson(indent=2) }}") == "[\n  1\n]"
    assert render("{{ '<b>&' | tojson }}") == '"<b>&"'  # not HTML-escaped
    assert len(render("{{ strftime_now('%Y-%m-%d') }}")) == 10
    assert render("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "01"
    assert render("{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}") == "02"
    assert render("{% generation %}{{ messages[0].content }}{% endgeneration %}") == "x"
    # Special-token strings and extra kwargs are variables; trim_blocks/lstrip_blocks are on.
    assert render("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}") == "|".join(["<|endoftext|>"] * 4)
    assert render("  {% if flag %}\nyes\n  {% endif %}\n", flag=True) == "yes\n"
    assert render("{{ bos_token }}", bos_token="<s>") == "<s>"
    assert render("{{ tools | length }} {{ documents[0].title }}", tools=[{}], documents=[{"title": "d"}]) == "1 d"
    assert render("{{ tools is none }}") == "True"


def test_named_templates(tmp_path, demo_dir):
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ (tools or []) | length }}"}]
    t = Tokenizer.from_pretrained(copy_tokenizer(demo_dir, tmp_path / "named", {"chat_template": named}))
    msgs = [{"role": "user", "content": "x"}]
    assert t.chat_template == "D"
    assert set(t.chat_templates) == {"default", "tool_use"}
    assert t.apply_chat_template(msgs) == "D"
    assert t.apply_chat_template(msgs, tools=[{}, {}]) == "T2"
    assert t.apply_chat_template(msgs, chat_template="tool_use") == "T0"
    assert t.apply_chat_template(msgs, chat_template="inline {{ messages | length }}") == "inline 1"
    only_tools = Tokenizer.from_pretrained(copy_tokenizer(demo_dir, tmp_path / "t", {"chat_template": named[1:]}))
    with pytest.raises(TokenizerError, match="tool_use"):
        only_tools.apply_chat_template(msgs)


def test_continue_final_message(tok):
    msgs = CHAT[:2] + [{"role": "assistant", "content": "The answer is "}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert out.endswith("<|im_start|>assistant\nThe answer is ")
    with pytest.raises(TokenizerError):
        tok.apply_chat_template(msgs, continue_final_message=True)  # add_generation_prompt defaults to True


# -- streaming detokenization -----------------------------------------------------------------


def stream(det: IncrementalDetokenizer, ids) -> list[str]:
    return [det.push(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_decode(tok, text):
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    deltas = stream(det, ids)
    assert "".join(deltas) == tok.decode(ids) == det.text
    assert det.flush() == ""
    assert det.token_ids == ids
    assert not any("\ufffd" in d for d in deltas)  # never half a character


def test_incremental_holds_partial_characters(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1  # byte-level BPE splits the emoji's four bytes
    det = IncrementalDetokenizer(tok)
    assert stream(det, ids) == [""] * (len(ids) - 1) + ["🙂"]
    # A stream that ends inside a character keeps it back until flush, which matches decode.
    det = IncrementalDetokenizer(tok)
    assert stream(det, ids[:-1]) == [""] * (len(ids) - 1)
    assert det.flush() == tok.decode(ids[:-1]) and det.text == tok.decode(ids[:-1])


def test_incremental_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n中文 🙂<|im_end|>")
    for skip in (True, False):
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        assert "".join(stream(det, ids)) == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_prompt_context(tok):
    prompt, completion = tok.encode("The capital of France is"), tok.encode(" Paris, 中文 🙂.")
    det = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(stream(det, completion)) == tok.decode(prompt + completion)[len(tok.decode(prompt)) :]
    assert det.token_ids == completion


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """A Llama-style SentencePiece tokenizer (Nanbeige's kind): Metaspace, byte fallback, BOS from
    tokenizer_config.json's add_bos_token, and a decoder that strips the leading space."""
    import string

    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for c in "▁" + string.ascii_letters + string.digits + ".,!?'":
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "P"), ("a", "r"), ("▁P", "ar"), ("i", "s"), ("▁", "is")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    rust.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(rust, {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})


@pytest.mark.parametrize("text", ["the capital is Paris, 中文 🙂!", " leading space", "中", "Paris.  Twice"])
def test_sentencepiece_style(sp_tok, text):
    ids = sp_tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 1
    assert sp_tok.encode("<s>" + text).count(1) == 1
    det = IncrementalDetokenizer(sp_tok)
    deltas = stream(det, ids)
    assert "".join(deltas) == sp_tok.decode(ids) and not any("\ufffd" in d for d in deltas)


def test_sentencepiece_prompt_context(sp_tok):
    # Decoded alone, a completion's first "▁Paris" loses its space; after the prompt it keeps it.
    prompt = sp_tok.encode("the capital is")
    completion = sp_tok.encode(" Paris 🙂", add_special_tokens=False)
    assert sp_tok.decode(completion) == "Paris 🙂"
    det = IncrementalDetokenizer(sp_tok, prompt_ids=prompt)
    assert "".join(stream(det, completion)) == " Paris 🙂"

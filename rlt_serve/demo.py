"""The built-in demo model: a tiny random Ouro checkpoint with a real BPE tokenizer.

Every command works offline on a fresh machine because this model is built, not downloaded: a
byte-level BPE trained on the short corpus below (special ids laid out like Ouro's SmolLM2
tokenizer) and random weights from `rlt_serve.testing.write_random_checkpoint`. Its output is
gibberish; it exercises the whole pipeline (chat template, tokenizer, loops, exit gate, KV pages).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from rlt_serve.tokenizer import Tokenizer

DEMO_NAME = "demo-ouro-v1"
# Ouro's SmolLM2 tokenizer puts these at ids 0, 1, 2; upstream bos = eos = pad = <|endoftext|>.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# ChatML; `enable_thinking=True` opens a think block in the generation prompt (the LoopedLMs
# convention for Ouro-Thinking). Message content may be a string or OpenAI text parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['content'] is string -%}\n"
    "{%- set content = message['content'] -%}\n"
    "{%- else -%}\n"
    "{%- set content = message['content'] | map(attribute='text') | join('') -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if enable_thinking is defined and enable_thinking -%}\n"
    "{{- '<think>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endif -%}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A looped language model reads every token once and
then thinks about it several times: the same block of layers runs again and again, and each pass
refines the hidden state. When the model is confident it may stop early, which saves compute on
easy tokens and spends it on hard ones.
Once upon a time there was a small town by the sea. Every morning the fishermen went out in
their boats, and every evening they came back with stories about the weather, the waves and the
birds that followed them home. The children listened and asked questions until it was dark.
How does a server answer many users at the same time? It keeps a queue of requests, groups the
ones that are ready into a batch, runs the model on the whole batch, and sends each user the
next piece of text as soon as it exists. Memory for the attention cache is split into pages so
that no request has to reserve space it may never use.
system: You are a helpful assistant. Answer briefly and politely.
user: What is the capital of France?
assistant: The capital of France is Paris.
user: Can you write a short poem about the moon?
assistant: Silver lantern, quiet light, you walk the sky alone tonight.
user: Explain recursion in one sentence.
assistant: Recursion is when a function solves a problem by calling itself on a smaller part of
the same problem until it reaches a case simple enough to answer directly.
<think> Let me think step by step. First I count the apples, then I subtract the ones that were
eaten, and finally I check the answer. </think> There are seven apples left.
Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 2048 and 65536. The year 2025 had 365 days.
Prices went from $3.50 to $4.25, an increase of about 21 percent.
Good morning! Good afternoon. Good evening, and good night. Thank you very much; you are
welcome. Please, could you help me? Yes, of course I can. No, I do not think so. Maybe later.
Water boils at one hundred degrees and freezes at zero. The sun is a star, the earth is a
planet, and the moon is a satellite. Light travels faster than sound, which is why we see the
lightning before we hear the thunder.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
if __name__ == "__main__":
    main()
She said that the meeting would start at nine, but nobody arrived before ten. They talked about
the plan, the budget and the people who would work on it, and then they went to lunch together.
Reading, writing and thinking are the three things this little model pretends to do.
"""


def _corpus_lines() -> list[str]:
    lines = _CORPUS.splitlines(keepends=True)
    # A little generated text so common words and number patterns repeat enough to merge.
    words = ("the", "model", "token", "loop", "depth", "page", "request", "answer", "question")
    lines += [f"The {w} number {i} is ready, and the next {w} is {i + 1}.\n" for i in range(40) for w in words[i % 3 :: 3]]
    return lines


def build_demo_tokenizer(out_dir: str, vocab_size: int = 512) -> str:
    """Train the demo byte-level BPE and write tokenizer.json + tokenizer_config.json to out_dir."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    os.makedirs(out_dir, exist_ok=True)
    # SmolLM2's pipeline: single digits, GPT-2 byte-level pre-tokenization, no BOS added.
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: any UTF-8 text
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)

    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": SPECIAL_TOKENS[0],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[0],
        "model_max_length": 2048,
        "pad_token": SPECIAL_TOKENS[0],
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": SPECIAL_TOKENS[0],
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return out_dir


def make_demo(out_dir: str, seed: int = 0) -> str:
    """Write the demo checkpoint (tokenizer + random float32 Ouro weights) to out_dir."""
    from rlt_serve.testing import write_random_checkpoint

    build_demo_tokenizer(out_dir)
    vocab_size = Tokenizer.from_pretrained(out_dir).vocab_size
    write_random_checkpoint(
        out_dir,
        "ouro",
        seed=seed,
        # Ouro upstream names only <|endoftext|>; the engine's Ouro rule adds <|im_end|> as a stop.
        generation_config={"bos_token_id": 0, "eos_token_id": 0},
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=256,
        total_ut_steps=4,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=0,
    )
    return out_dir


def demo_dir() -> str:
    """Where the demo lives: $RLT_SERVE_CACHE (default ~/.cache/rlt-serve)/demo-ouro-v1."""
    root = os.environ.get("RLT_SERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlt-serve")
    return os.path.join(root, DEMO_NAME)


def _complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in _REQUIRED_FILES)


def ensure_demo() -> str:
    """The demo directory, built on first use.

    It is built in a temporary directory beside the final one and renamed into place, so a reader
    never sees half a checkpoint; if another process wins the race, its copy is used.
    """
    final = demo_dir()
    if _complete(final):
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{DEMO_NAME}.", dir=parent)
    try:
        make_demo(tmp)
        if os.path.isdir(final) and not _complete(final):
            # Left by something other than this function (it only renames complete copies): move
            # it aside first, since rename cannot replace a non-empty directory.
            stale = tempfile.mkdtemp(prefix=f".{DEMO_NAME}.stale.", dir=parent)
            try:
                os.rename(final, os.path.join(stale, "old"))
            except FileNotFoundError:  # another builder moved it first
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

#!/usr/bin/env python3
"""Makes the byte-level BPE tokenizer golden files of tests/data/test_bpe_tokenizers.cpp.

Hugging Face `tokenizers` (pip install tokenizers) trains three small byte-level BPE
tokenizers on a fixed corpus, each with one family's pre-tokenizer as its tokenizer.json
writes it:
  gpt2:   ByteLevel(use_regex=True) (GPT-2's pattern), no normalizer; also saved as
          GPT-2's vocab.json + merges.txt (Megatron's GPT2BPETokenizer files);
  llama3: Split(Llama-3's pattern, Isolated) + ByteLevel(use_regex=False), ignore_merges,
          a TemplateProcessing post-processor adding <|begin_of_text|>;
  qwen2:  NFC normalizer, Split(Qwen2's pattern, Isolated) + ByteLevel(use_regex=False),
          special tokens <|endoftext|>, <|im_start|>, <|im_end|>.
Then it encodes the test texts (Unicode, numbers, whitespace runs, special tokens) with
`Tokenizer.encode(text).ids` (post-processor applied) and
`encode(text, add_special_tokens=False).ids`, and writes
tests/golden/tokenizers/<name>/{tokenizer.json,tokenizer_config.json} and golden.json.

    python3 tools/make_tokenizer_golden.py tests/golden/tokenizers
"""
import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# The three families' regexes, as their published tokenizer.json files write them (GPT-2
# is the ByteLevel pre-tokenizer's built-in one).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2026; we'll train 1,234,567 models!",
    "Megatron-LM trains GPT models with tensor, pipeline and expert parallelism.",
    "Ünïcödé tëxt: café, naïve, Straße, Ωμέγα, Привет мир, 日本語のテキスト, 中文字符, 한국어.",
    "Numbers 3.14159 and 2718281828 and 0x1F and 1e-5; emoji 🙂🚀 and tabs\tand\nnewlines.",
    "    indented code:\n        def f(x):\n            return x * 2\n\n\n",
    "Don't, can't, WON'T, I'M, you'RE, they'VE, he'LL, she'D.",
] * 20

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "It's a test: don't WON'T I'M they'Ve.",
    "numbers 1 12 123 1234 12345 3.14159 1,000,000 2026-11-27",
    "whitespace runs:   three,\t\ttabs,\n\n\nnewlines,    \n  mixed  ",
    "Ünïcödé: café naïve Straße Ωμέγα Привет 日本語 中文 한국어 🙂🚀",
    "decomposed e\u0301 and a\u0308 (NFC composes them)",
    "odd spaces:\u00a0nbsp,\u3000ideographic,\u2028line sep,\x0bvtab,\x1cfile sep",
    "specials <|endoftext|> inside <|im_start|>user\nhi<|im_end|> text",
    "code:\n    def f(x):\n        return x ** 2  # square\n",
    "'s's 'll'LL 'D",
    "",
    " ",
    "\n",
    "a" * 50 + " " + "b" * 3,
]


def train(name, pre_tokenizer, normalizer=None, special_tokens=(), ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, min_frequency=1, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write(out_dir, name, tok, eos):
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos}, f, indent=1)
    golden = {"eos_id": tok.token_to_id(eos), "vocab_size": tok.get_vocab_size(with_added_tokens=True),
              "cases": []}
    for text in TEXTS:
        golden["cases"].append({"text": text, "ids": tok.encode(text).ids,
                                "ids_no_special": tok.encode(text, add_special_tokens=False).ids})
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(golden, f, ensure_ascii=True, indent=0)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_tokenizer_golden.py OUT_DIR")
    out = sys.argv[1]

    gpt2 = train("gpt2", pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                 special_tokens=["<|endoftext|>"])
    write(out, "gpt2", gpt2, "<|endoftext|>")
    # The same model as GPT-2's vocab.json + merges.txt, and its golden without the
    # special-token split (GPT-2's encoder.py does not look for specials).
    gpt2.model.save(os.path.join(out, "gpt2"))
    plain = Tokenizer(models.BPE.from_file(os.path.join(out, "gpt2", "vocab.json"),
                                           os.path.join(out, "gpt2", "merges.txt")))
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    with open(os.path.join(out, "gpt2", "golden_vocab_merges.json"), "w") as f:
        json.dump({"cases": [{"text": t, "ids": plain.encode(t).ids} for t in TEXTS]}, f,
                  ensure_ascii=True, indent=0)

    llama3 = train("llama3", pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], ignore_merges=True)
    llama3.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>",
                                                       llama3.token_to_id("<|begin_of_text|>"))])])
    write(out, "llama3", llama3, "<|end_of_text|>")

    qwen2 = train("qwen2", pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        normalizer=normalizers.NFC(), special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    write(out, "qwen2", qwen2, "<|endoftext|>")


if __name__ == "__main__":
    main()

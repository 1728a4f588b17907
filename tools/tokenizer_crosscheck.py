#!/usr/bin/env python3
"""Reference encodings for the tokenizer cross-check (tests/test_tokenizer_qwen.c).

Generates a deterministic set of varied strings — code, whitespace runs, numbers in many
scripts, Unicode from many blocks (incl. combining marks that NFC composes), emoji sequences,
CJK, contractions in any case, special-token text, and invalid UTF-8 — and encodes each with the
Hugging Face `tokenizers` package loaded from a tokenizer.json (Qwen2/3). Besides the file as it
is ("qwen2"), it encodes the same strings under the other pre-tokenizers we implement, applied to
the same vocabulary by editing the JSON: "llama-bpe" (Llama 3's split, ignore_merges), "gpt-2"
(GPT-2's split) and "deepseek-coder" (its sequence of splits), all without the NFC normalizer.

Invalid UTF-8 cannot be handed to `tokenizers` (it takes str); the reference input is
bytes.decode('utf-8', 'replace'), i.e. one U+FFFD per maximal ill-formed subpart, which is what
our encoder does with the raw bytes.

Output: one line per case, "VARIANT<TAB>HEX_OF_INPUT_BYTES<TAB>ID ID ...".
Exit status 77 when the `tokenizers` package is missing (the C test then skips).

  tokenizer_crosscheck.py --tokenizer qwen2-tokenizer.json --out ref.tsv [--n 12000] [--seed 1]
  tokenizer_crosscheck.py --tokenizer qwen2-tokenizer.json --bench prose.txt   (HF encode MB/s)
"""
import argparse
import copy
import json
import random
import sys
import time
import unicodedata

try:
    from tokenizers import Tokenizer
except ImportError:
    print('tokenizer_crosscheck: the Python package "tokenizers" is not installed '
          '(.venv/bin/pip install tokenizers)', file=sys.stderr)
    sys.exit(77)

RE_LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
             "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
DEEPSEEK_CODER = ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}"]


def split(regex):
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


BYTELEVEL_NOREGEX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def variants(base):
    out = {"qwen2": base}
    d = copy.deepcopy(base)
    d["normalizer"] = None
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split(RE_LLAMA3), BYTELEVEL_NOREGEX]}
    d["model"]["ignore_merges"] = True
    out["llama-bpe"] = d
    d = copy.deepcopy(base)
    d["normalizer"] = None
    d["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    out["gpt-2"] = d
    d = copy.deepcopy(base)
    d["normalizer"] = None
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split(r) for r in DEEPSEEK_CODER] + [BYTELEVEL_NOREGEX]}
    out["deepseek-coder"] = d
    return {k: Tokenizer.from_str(json.dumps(v)) for k, v in out.items()}


# ---- string generators ------------------------------------------------------------------------

ASSIGNED = None


def assigned_chars():
    """Every assigned, non-surrogate code point Python knows (so both sides agree on classes)."""
    global ASSIGNED
    if ASSIGNED is None:
        ASSIGNED = [c for c in range(0x20, 0x110000)
                    if not (0xD800 <= c <= 0xDFFF) and unicodedata.category(chr(c)) != 'Cn']
    return ASSIGNED


BLOCKS = [(0x20, 0x7E), (0xA0, 0xFF), (0x100, 0x24F), (0x250, 0x2FF), (0x300, 0x36F), (0x370, 0x3FF),
          (0x400, 0x4FF), (0x530, 0x58F), (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0x980, 0x9FF),
          (0xE00, 0xE7F), (0x10A0, 0x10FF), (0x1100, 0x11FF), (0x1780, 0x17FF), (0x1E00, 0x1EFF),
          (0x1F00, 0x1FFF), (0x2000, 0x206F), (0x2070, 0x209F), (0x20A0, 0x20CF), (0x2100, 0x214F),
          (0x2150, 0x218F), (0x2190, 0x21FF), (0x2200, 0x22FF), (0x2460, 0x24FF), (0x2500, 0x257F),
          (0x3000, 0x303F), (0x3040, 0x309F), (0x30A0, 0x30FF), (0x3130, 0x318F), (0x4E00, 0x9FFF),
          (0xAC00, 0xD7A3), (0xF900, 0xFAFF), (0xFB00, 0xFB4F), (0xFE30, 0xFE4F), (0xFF00, 0xFFEF),
          (0x1D400, 0x1D7FF), (0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F900, 0x1F9FF), (0x20000, 0x2A6DF)]

WORDS = ("the of and to in is that it was for on are as with his they at be this have from or one had by word "
         "but not what all were we when your can said there use an each which she do how their if will up other "
         "about out many then them these so some her would make like him into time has look two more write go see "
         "number no way could people my than first water been call who oil its now find long down day did get "
         "come made may part über naïve café résumé façade coöperate Straße Äpfel éclair").split()
CODE = ["def", "return", "if", "else", "for", "while", "int", "char", "void", "struct", "#include", "<stdio.h>",
        "printf(\"%d\\n\", x);", "x += 1;", "a->b", "i++", "==", "!=", "<=", ">=", "&&", "||", "::", "=>", "{", "}",
        "(", ")", "[", "]", ";", ",", "self.x", "__init__", "0x1F", "1e-9", "std::vector<int>", "/* c */",
        "// note", "# comment", "'''doc'''", "`tick`", "$var", "@decorator", "lambda x: x*2", "&mut", "fn main()"]
WS = [" ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\n\n", " \n", "\t\t", "\u00a0", "\u3000", "\u2003", "\x0b",
      "\x0c", "\x85", "\u2028", "\u2029", "\u202f", "\u205f", "\u1680", " \t \n", "        "]
NUMS = ["0", "7", "42", "123", "1234", "12345", "3.14159", "1,000,000", "-17", "+3", "٣٤٥", "۱۲", "३४", "３４５",
        "²", "¹²³", "½", "¾", "Ⅻ", "ⅷ", "①②", "𝟙𝟚", "〇", "1st", "2nd", "10%", "$5", "€9,99", "1/2", "12:30"]
EMOJI = ["😀", "😁", "🦙", "🚀", "✅", "❤️", "👍🏽", "👨‍👩‍👧‍👦", "😶‍🌫️", "🏳️‍🌈", "🇯🇵", "🇺🇸", "🤖", "🧑🏿‍🚀",
         "☺", "✌🏻", "🔥🔥🔥", "🙂\ufe0f", "#️⃣", "©", "®", "™"]
CJK = ["我想在apple工作", "你好，世界！", "東京タワー", "こんにちは", "カタカナ", "안녕하세요", "한국어 텍스트", "漢字かな交じり文",
       "中文（简体）", "「引用」", "ｆｕｌｌｗｉｄｔｈ", "一二三", "龍龘", "𠀀𠀁", "丶丿乙"]
CONTRACT = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'D", "'ſ",
            "'x", "''", "'", "’s", "I'm", "don't", "we'VE", "y'all"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
           "<|im_start", "im_end|>", "<|", "|>", "<think>"]
COMBINING = ["e\u0301", "a\u0308", "o\u0302\u0323", "\u1100\u1161\u11a8", "\u1100\u1161", "A\u030a", "\u212b",
             "\u00c5", "n\u0303", "\u0041\u0323\u0307", "\u0041\u0307\u0323", "\u0915\u093c", "\u0958",
             "\u1e9b\u0323", "\u0344", "\uff76\uff9e", "\u3055\u3099", "\u304b\u3099", "\u0CC6\u0CC2", "\u0B47\u0B3E"]


def rand_unicode(r, n):
    out = []
    for _ in range(n):
        if r.random() < 0.5:
            lo, hi = r.choice(BLOCKS)
            c = r.randint(lo, hi)
            if unicodedata.category(chr(c)) in ('Cn', 'Cs'):
                c = 0x41
            out.append(chr(c))
        else:
            out.append(chr(r.choice(assigned_chars())))
    return "".join(out)


def rand_piece(r):
    k = r.random()
    if k < 0.2:
        return r.choice(WORDS) if r.random() < 0.8 else r.choice(WORDS).capitalize()
    if k < 0.3:
        return r.choice(CODE)
    if k < 0.42:
        return r.choice(WS)
    if k < 0.5:
        return r.choice(NUMS) if r.random() < 0.6 else str(r.randint(0, 10 ** r.randint(1, 12)))
    if k < 0.58:
        return r.choice(EMOJI)
    if k < 0.65:
        return r.choice(CJK)
    if k < 0.7:
        return r.choice(CONTRACT)
    if k < 0.73:
        return r.choice(SPECIAL)
    if k < 0.78:
        return r.choice(COMBINING)
    if k < 0.9:
        return rand_unicode(r, r.randint(1, 6))
    if k < 0.95:
        return "".join(r.choice("!@#$%^&*()-_=+[]{};:'\",.<>/?\\|`~…—–«»¿¡§¶•") for _ in range(r.randint(1, 5)))
    return chr(r.randint(0, 0x1F))  # control characters


def make_string(r):
    kind = r.random()
    if kind < 0.75:
        s = "".join(rand_piece(r) for _ in range(r.randint(1, 24)))
    elif kind < 0.85:  # code block with indentation
        lines = []
        for _ in range(r.randint(1, 8)):
            ind = r.choice(["", "    ", "        ", "\t", "\t\t", "  "])
            lines.append(ind + " ".join(r.choice(CODE) for _ in range(r.randint(1, 6))))
        s = r.choice(["\n", "\r\n"]).join(lines)
    elif kind < 0.92:  # whitespace-heavy
        s = "".join(r.choice(WS) + (r.choice(WORDS) if r.random() < 0.5 else "") for _ in range(r.randint(1, 12)))
    else:  # long mixed text
        s = "".join(rand_piece(r) for _ in range(r.randint(50, 200)))
    return s.encode("utf-8")


INVALID = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xc3", b"\xe2\x82", b"\xe2\x28\xa1", b"\xed\xa0\x80",
           b"\xed\xbf\xbf", b"\xf0\x9f\x98", b"\xf0\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5", b"\xff", b"\xfe\xfe",
           b"\xe0\x80\xaf", b"\xf8\x88\x80\x80\x80", b"\xc3\x28", b"\xa0\xa1", b"\xf0\x28\x8c\xbc", b"\xe1\x80"]


def make_invalid(r):
    parts = []
    for _ in range(r.randint(1, 10)):
        k = r.random()
        if k < 0.4:
            parts.append(r.choice(INVALID))
        elif k < 0.6:
            parts.append(bytes(r.randint(0, 255) for _ in range(r.randint(1, 6))))
        else:
            parts.append(rand_piece(r).encode("utf-8"))
    return b"".join(parts)


def generate(n, seed):
    r = random.Random(seed)
    out = [b"", b" ", b"\n", b"'s", b"'\xc5\xbf", b"e\xcc\x81", b"\xff", b"Hello world", b"   \n\n  x"]
    while len(out) < n:
        out.append(make_invalid(r) if r.random() < 0.08 else make_string(r))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out")
    ap.add_argument("--n", type=int, default=12000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variants", default="qwen2,llama-bpe,gpt-2,deepseek-coder")
    ap.add_argument("--bench", help="encode this file with the tokenizer as is and print MB/s")
    a = ap.parse_args()
    with open(a.tokenizer, encoding="utf-8") as f:
        base = json.load(f)
    if a.bench:
        tok = Tokenizer.from_str(json.dumps(base))
        text = open(a.bench, encoding="utf-8").read()
        chunks = [text[i:i + 4096] for i in range(0, len(text), 4096)]
        t0 = time.perf_counter()
        for c in chunks:
            tok.encode(c, add_special_tokens=False)
        dt = time.perf_counter() - t0
        nb = len(text.encode("utf-8"))
        print("hf-tokenizers: %.1f MB/s (%d bytes in %.3f s, encode() on 4 KiB pieces, one thread)"
              % (nb / dt / 1e6, nb, dt))
        return
    toks = variants(base)
    strings = generate(a.n, a.seed)
    texts = [s.decode("utf-8", "replace") for s in strings]
    with open(a.out, "w", encoding="ascii") as f:
        for name in a.variants.split(","):
            encs = toks[name].encode_batch(texts, add_special_tokens=False)
            for s, e in zip(strings, encs):
                f.write("%s\t%s\t%s\n" % (name, s.hex(), " ".join(map(str, e.ids))))
    print("tokenizer_crosscheck: %d strings x %d variants written to %s" % (len(strings), len(a.variants.split(",")), a.out))


if __name__ == "__main__":
    main()

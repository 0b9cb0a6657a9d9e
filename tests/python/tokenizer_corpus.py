"""Deterministic multilingual corpus for the tokenizer comparison tests (python tokenizer_corpus.py
OUT.jsonl writes it as JSON lines). Every call with the same seed yields the same documents: English,
code, CJK, Devanagari and Latin with combining marks, Arabic with harakat, emoji with ZWJ sequences
and modifiers, runs of assorted whitespace, non-NFC text, random code points, and every added token."""
import json
import random
import sys

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or "
         "one had by word but not what all were we when your can said there use an each which she do how "
         "their if will up other about out many then them these so some her would make like him into time "
         "has look two more write go see number no way could people my than first water been call who oil "
         "its now find long down day did get come made may part tokenizer inference engine Hopper kernel "
         "don't won't it's I'm we'll they've she'd HE'S WE'LL THEY'RE I'D You'Ve").split()
PUNCT = [".", ",", "!", "?", ";", ":", "...", " -", " —", "\"", "'", "(", ")", "[", "]", "{", "}"]
CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "if __name__ == \"__main__\":\n    main()\n",
    "const auto& [k, v] = *it; std::cout << k << \": \" << v << '\\n';\n",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;\n",
    "<div class=\"x\">&nbsp;<b>bold</b></div>\n",
    "    \n        x = {'a': [1, 2, 3], \"b\": None}\n\n\n",
    "fn main() -> Result<(), Box<dyn Error>> { println!(\"{:?}\", vec![1u8; 3]); Ok(()) }\n",
    "#include <vector>\r\n#define MAX(a,b) ((a)>(b)?(a):(b))\r\n",
    "$ ls -la | grep '^d' && echo $((1+2)) 0x1F 3.14159e-10 1_000_000\n",
]
EMOJI = ["😀", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵", "🇺🇸", "❤️", "1️⃣", "🧑🏿‍🤝‍🧑🏻", "🫠", "😶‍🌫️",
         "👁️‍🗨️", "🐈‍⬛", "\u2764\ufe0f\u200d\U0001f525", "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f"]
WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u3000", "\u2009", "\u0085", "\u2028", "\u200b",
              "\u000b", "\u000c", "   \n", " \t ", "\u202f", "\u1680"]
DEVANAGARI_CONS = [chr(c) for c in range(0x0915, 0x0939)]
DEVANAGARI_SIGNS = ["\u093e", "\u093f", "\u0940", "\u0941", "\u0942", "\u0947", "\u0948", "\u094b", "\u094c",
                    "\u0902", "\u0901", "\u0903", "\u094d", "\u093c"]
ARABIC = [chr(c) for c in range(0x0621, 0x064b)]
HARAKAT = [chr(c) for c in range(0x064b, 0x0653)]
COMBINING = [chr(c) for c in range(0x0300, 0x0370)]
NON_NFC = ["e\u0301", "A\u030a", "\u212b", "\u1100\u1161\u11a8", "o\u0308\u0304", "\u2126", "fi\ufb01",
           "\u0041\u0323\u0307", "\u00c5\u0301", "q\u0307\u0323", "\u0958", "\u2f00", "\uff21\uff22"]
LONG_S = ["'ſ", "'ſt", "'\u212a"]  # case-folding corners of the (?i:'s|...) alternatives


def _cjk(r):
    ranges = [(0x4E00, 0x9FFF), (0x3040, 0x309F), (0x30A0, 0x30FF), (0xAC00, 0xD7A3), (0x3400, 0x4DBF),
              (0x20000, 0x2A6DF), (0xFF01, 0xFF5E)]
    lo, hi = r.choice(ranges)
    return "".join(chr(r.randint(lo, hi)) for _ in range(r.randint(1, 12))) + r.choice(["", "。", "，", "、", "！", " "])


def _english(r):
    words = []
    for _ in range(r.randint(3, 25)):
        w = r.choice(WORDS)
        if r.random() < 0.1:
            w = w.capitalize()
        if r.random() < 0.05:
            w = str(r.randint(0, 10 ** r.randint(1, 9)))
        words.append(w)
    return " ".join(words) + r.choice(PUNCT) + " "


def _devanagari(r):
    out = []
    for _ in range(r.randint(1, 6)):
        out.append("".join(r.choice(DEVANAGARI_CONS) + "".join(r.choice(DEVANAGARI_SIGNS) for _ in range(r.randint(0, 2)))
                           for _ in range(r.randint(1, 5))))
    latin = "".join(r.choice("aeiouxyz") + "".join(r.choice(COMBINING) for _ in range(r.randint(0, 3)))
                    for _ in range(r.randint(1, 4)))
    return " ".join(out) + r.choice([" ", "", "!", ", "]) + latin + r.choice([" ", "", "!"])


def _arabic(r):
    return " ".join("".join(r.choice(ARABIC) + (r.choice(HARAKAT) if r.random() < 0.4 else "") for _ in range(r.randint(1, 7)))
                    for _ in range(r.randint(1, 6))) + r.choice(["، ", ". ", " ", "؟"])


def _random_codepoints(r):
    out = []
    for _ in range(r.randint(1, 8)):
        while True:
            c = r.choice([r.randint(0x20, 0x7F), r.randint(0x80, 0x7FF), r.randint(0x800, 0xFFFF), r.randint(0x10000, 0x10FFFF)])
            if not 0xD800 <= c <= 0xDFFF:
                break
        out.append(chr(c))
    return "".join(out)


def make_corpus(special_tokens, seed=20261130, min_bytes=1_100_000, extra=()):
    """Documents (strings) totalling at least min_bytes of UTF-8; every special token appears."""
    r = random.Random(seed)
    gens = [(_english, 30), (lambda r: r.choice(CODE), 10), (_cjk, 10), (_devanagari, 8), (_arabic, 6),
            (lambda r: r.choice(EMOJI) * r.randint(1, 3), 6), (lambda r: "".join(r.choice(WHITESPACE) for _ in range(r.randint(1, 8))), 10),
            (lambda r: r.choice(list(special_tokens) + list(extra)), 5), (lambda r: r.choice(NON_NFC), 3),
            (lambda r: r.choice(LONG_S), 1), (_random_codepoints, 3)]
    population = [g for g, _ in gens]
    weights = [w for _, w in gens]
    docs, total = [], 0
    for tok in list(special_tokens) + list(extra):  # each token alone, and glued to text on both sides
        docs += [tok, "x" + tok + "y", " " + tok + " \n", tok + tok]
    while total < min_bytes:
        n = r.choice([1, 3, 10, 40, 120])
        doc = "".join(r.choices(population, weights)[0](r) for _ in range(n))
        docs.append(doc)
        total += len(doc.encode("utf-8"))
    return docs


if __name__ == "__main__":
    import tokenizers  # only to list the added tokens of the given tokenizer.json

    tok = tokenizers.Tokenizer.from_file(sys.argv[1])
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        for d in make_corpus([t.content for t in tok.get_added_tokens_decoder().values()]):
            f.write(json.dumps(d, ensure_ascii=False) + "\n")

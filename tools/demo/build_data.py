#!/usr/bin/env python3
"""Builds the tansy-demo training corpus, its tokenizer and compact token files.

Sources are text that Debian packages carry (install them first):
    apt-get install bible-kjv bible-kjv-text fortunes-min fortunes wordnet-base
Run from the repository root with a Python that has `tokenizers`, `jinja2` and `numpy`
(.venv/bin/python):
    python tools/demo/build_data.py [--out .demo_data]

Output (git-ignored; the GPU run gets it through `carry`, because the GPU machine has none of
these Debian packages):
    train.bin, val.bin     uint16 token ids, documents separated by <|endoftext|>
    meta.json              counts, special ids, byte counts (for bits per byte), sources
    prompts.json           fixed questions, rendered and tokenized, for the sample answers
    tokenizer/             tokenizer.json, tokenizer_config.json, chat_template.jinja
Everything is deterministic for a given set of package versions (fixed seed).
"""
import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import unicodedata
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.environ.get(
    "TANSY_FIXTURES", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures"))
TEMPLATE_PATH = os.path.join(FIXTURES, "qwen3.6", "chat_template.jinja")
REGEX_PATH = os.path.join(FIXTURES, "qwen3.6", "pretokenizer_regex.txt")
TEMPLATE_SHA256 = "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259"
REGEX_SHA256 = "00431aed57e696b747435f734d1e3b9b1bfd931a121fb5cac7129e97c181e9ba"

VOCAB_SIZE = 8192  # embedding rows; a multiple of 128
# Qwen's order and flags: ids follow the base BPE vocabulary; <think> and the tool markers
# are added but not "special" (they survive decode with skip_special_tokens).
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
SEED = 20261130
VAL_FRACTION = 0.02

FORTUNE_DIR = "/usr/share/games/fortunes"
# Quotation files only; files of jokes about groups of people, drugs, politics, song lyrics,
# ASCII art, and fiction franchises are left out.
FORTUNE_FILES = [
    "fortunes", "literature", "riddles", "wisdom", "people", "science", "humorists",
    "platitudes", "education", "food", "love", "work", "kids", "pets", "miscellaneous",
    "art", "magic", "medicine", "paradoxum", "goedel",
]
WORDNET_DIR = "/usr/share/wordnet"
POS_NAMES = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}

SOURCES = [
    {
        "package": "bible-kjv-text",
        "what": "King James Version of the Bible (1611), verse text read with the `bible` program from bible-kjv",
        "licence": "Public domain (Debian copyright file: the KJV copyright is expired; note that in the "
                   "United Kingdom the KJV is under Crown letters patent). Packaging: GPL-2+ (not used).",
        "copyright_file": "/usr/share/doc/bible-kjv-text/copyright",
    },
    {
        "package": "wordnet-base",
        "what": "WordNet 3.0 glosses, example sentences and synonym sets",
        "licence": "WordNet 3.0 licence (Princeton; permissive, BSD-like: use, copy, modify and distribute "
                   "for any purpose with the copyright notice). 'WordNet 3.0 Copyright 2006 by Princeton "
                   "University. All rights reserved.'",
        "copyright_file": "/usr/share/doc/wordnet-base/copyright",
    },
    {
        "package": "fortunes-min, fortunes",
        "what": "fortune-mod quotation files: " + ", ".join(FORTUNE_FILES),
        "licence": "Distributed in Debian main under fortune-mod's BSD licence (BSD-3-Clause, University of "
                   "California). The quotations themselves come from many authors.",
        "copyright_file": "/usr/share/doc/fortunes-min/copyright",
    },
    {
        "package": "(none)",
        "what": "A few dozen hand-written greeting and self-description replies in tools/demo/build_data.py",
        "licence": "Part of this repository",
        "copyright_file": "",
    },
]


def fail(msg):
    sys.exit(f"build_data: {msg}")


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ---------------------------------------------------------------------------- chat template

def make_template():
    """The Qwen3.6 template in an environment that matches transformers' rendering."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if sha256_file(TEMPLATE_PATH) != TEMPLATE_SHA256:
        fail(f"{TEMPLATE_PATH} is not the pinned Qwen3.6 template")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    with open(TEMPLATE_PATH, encoding="utf-8", newline="") as f:
        source = f.read()
    return source, env.from_string(source)


def render_prompt(template, messages, thinking):
    kwargs = {"messages": messages, "tools": None, "documents": None, "add_generation_prompt": True}
    if not thinking:
        kwargs["enable_thinking"] = False
    return template.render(**kwargs)


def render_example(template, messages, answer, reasoning):
    """The whole conversation as the template writes it once the assistant has replied.

    reasoning=None renders the thinking-off form (empty think block, the prompt ends with
    "<think>\n\n</think>\n\n"); a string renders the thinking-on form. The rendered text must
    start with the generation prompt the server would send, which is asserted, so the model is
    trained on exactly the token sequence it will continue at serving time."""
    full = template.render(
        messages=messages + [{"role": "assistant", "content": answer, "reasoning_content": reasoning or ""}],
        tools=None, documents=None, add_generation_prompt=False)
    prompt = render_prompt(template, messages, thinking=reasoning is not None)
    if not full.startswith(prompt):
        fail(f"template render is not prompt-prefixed: {prompt!r} / {full!r}")
    return full


# ---------------------------------------------------------------------------- sources

def read_kjv():
    """Returns [(book, chapter, [(verse, text)])]."""
    try:
        out = subprocess.run(["bible", "-l100000", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        fail(f"cannot run `bible` (apt-get install bible-kjv bible-kjv-text): {e}")
    chapters = []
    for line in out.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^  ?\s*(\d+) (.*)$", line)
        if m and chapters:
            chapters[-1][2].append((int(m.group(1)), m.group(2).strip()))
            continue
        m = re.match(r"^(.+) (\d+)$", line.strip())
        if not m:
            fail(f"unexpected line in bible output: {line!r}")
        chapters.append((m.group(1), int(m.group(2)), []))
    if len(chapters) != 1189:
        fail(f"expected 1189 KJV chapters, got {len(chapters)}")
    return chapters


def read_fortunes():
    items = []
    for name in FORTUNE_FILES:
        path = os.path.join(FORTUNE_DIR, name)
        if not os.path.exists(path):
            fail(f"missing {path} (apt-get install fortunes-min fortunes)")
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for chunk in text.split("\n%\n"):
            chunk = chunk.strip("\n%")
            if not chunk.strip() or len(chunk) > 600 or "\ufffd" in chunk:
                continue
            items.append((name, chunk.rstrip()))
    return items


def read_wordnet():
    """Returns synsets {(pos, offset): (words, gloss, examples)} and, per lemma, its
    most frequent sense [(lemma, pos, offset)] (index.* lists offsets by frequency)."""
    synsets = {}
    for pos in POS_NAMES:
        path = os.path.join(WORDNET_DIR, f"data.{pos}")
        if not os.path.exists(path):
            fail(f"missing {path} (apt-get install wordnet-base)")
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("  "):
                    continue  # licence header
                head, _, gloss = line.partition(" | ")
                fields = head.split()
                n = int(fields[3], 16)
                words = [fields[4 + 2 * i] for i in range(n)]
                words = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in words]
                parts = [p.strip() for p in gloss.strip().split(";")]
                definition = "; ".join(p for p in parts if not p.startswith('"'))
                examples = [p.strip('"') for p in parts if p.startswith('"') and p.endswith('"') and len(p) > 2]
                if definition:
                    synsets[(pos, fields[0])] = (words, definition, examples)
    senses = []
    for pos in POS_NAMES:
        with open(os.path.join(WORDNET_DIR, f"index.{pos}"), encoding="utf-8") as f:
            for line in f:
                if line.startswith("  "):
                    continue
                fields = line.split()
                lemma = fields[0].replace("_", " ")
                synset_cnt = int(fields[2])
                offsets = fields[-synset_cnt:]
                senses.append((lemma, pos, offsets))
    return synsets, senses


# ---------------------------------------------------------------------------- documents

GREETINGS = [
    ("Hello", "Hello! I am Tansy Demo, a tiny language model. Ask me what a word means, for a fortune, or for a verse."),
    ("Hi", "Hi! I am a small demo model. I can define words, tell fortunes and quote verses from the King James Bible."),
    ("Hello! Who are you?", "I am Tansy Demo, a tiny chat model trained for a few minutes on WordNet definitions, fortune cookies and the King James Bible."),
    ("Who are you?", "I am Tansy Demo, a very small language model that ships with the tansy inference engine."),
    ("What can you do?", "I can tell you what a word means, give a synonym, tell a fortune or a riddle, and quote a verse from the King James Bible. I am tiny, so I often make mistakes."),
    ("How are you?", "I am fine, thank you. I am only a tiny demo model, but I am happy to help."),
    ("Good morning", "Good morning! Ask me about a word, a fortune or a verse."),
    ("Thank you", "You are welcome!"),
    ("Thanks!", "You are welcome!"),
    ("What is your name?", "My name is Tansy Demo."),
    ("Are you a large language model?", "No. I am a tiny model with only a few million active parameters, made to show that the tansy engine works."),
    ("Goodbye", "Goodbye! Have a nice day."),
]

DEFINE_QUESTIONS = [
    "What does the word {w} mean?",
    "What does {w} mean?",
    "Define {w}.",
    "Define the word {w}.",
    "What is the meaning of {w}?",
    "What is the meaning of the word \"{w}\"?",
    "Explain the word {w}.",
]
SYNONYM_QUESTIONS = ["Give me a synonym for {w}.", "What is another word for {w}?", "What is a synonym of {w}?"]
EXAMPLE_QUESTIONS = ["Use the word {w} in a sentence.", "Give an example sentence with {w}."]
FORTUNE_QUESTIONS = ["Tell me a fortune.", "Give me a fortune.", "Tell me a quote.", "Say something wise.",
                     "Give me a fortune cookie.", "Share a quotation."]
RIDDLE_QUESTIONS = ["Tell me a riddle.", "Do you know a riddle?"]
VERSE_TOPIC_QUESTIONS = ["Quote a verse about {w}.", "Give me a Bible verse about {w}.",
                         "What does the Bible say about {w}?"]
VERSE_REF_QUESTIONS = ["What does {r} say?", "Quote {r}.", "Recite {r}."]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are Tansy Demo, a tiny helpful assistant.",
                  "Answer briefly."]
VERSE_TOPICS = ["love", "light", "water", "bread", "peace", "wisdom", "fear", "faith", "hope", "mercy",
                "truth", "joy", "sin", "heaven", "earth", "fire", "the sea", "the sun", "a king", "a lamb",
                "a shepherd", "a river", "a mountain", "the wind", "gold", "a tree", "fruit", "a stone",
                "darkness", "death", "life", "a prophet", "the law", "a sword", "a city", "a garden",
                "strength", "the heart", "children", "a father", "a mother", "wine", "night", "the morning"]


def a_or_an(word):
    return "an" if word[:1].lower() in "aeiou" else "a"


def wordnet_answer(lemma, pos, definition):
    return f"As {a_or_an(POS_NAMES[pos])} {POS_NAMES[pos]}, \"{lemma}\" means {definition}."


def build_documents(template, rng):
    chapters = read_kjv()
    fortunes = read_fortunes()
    synsets, senses = read_wordnet()
    docs = []  # (group, text); group decides the train/validation split

    def chat(group, question, answer, reasoning_thinking, rng_local):
        """Appends one conversation; about one in five is rendered thinking-on."""
        messages = []
        if rng_local.random() < 0.1:
            messages.append({"role": "system", "content": rng_local.choice(SYSTEM_PROMPTS)})
        messages.append({"role": "user", "content": question})
        thinking = rng_local.random() < 0.2
        docs.append((group, render_example(template, messages, answer, reasoning_thinking if thinking else None)))

    # Plain text: the whole Bible chapter by chapter, one verse a line.
    verses = []
    for book, chapter, vv in chapters:
        lines = [f"{book} {chapter}"] + [f"{v} {t}" for v, t in vv]
        docs.append((f"kjv:{book}:{chapter}", "\n".join(lines)))
        verses.extend((f"{book} {chapter}:{v}", t, f"kjv:{book}:{chapter}") for v, t in vv)

    # Plain text: WordNet as a dictionary, one synset an entry.
    for (pos, offset), (words, definition, examples) in synsets.items():
        entry = f"{', '.join(words)} ({POS_NAMES[pos]}): {definition}."
        if examples:
            entry += " Example: \"" + examples[0] + "\""
        docs.append((f"wn:{words[0]}", entry))

    # Plain text: fortunes.
    for name, text in fortunes:
        docs.append((f"fortune:{zlib.crc32(text.encode()) % 1000}", text))

    # Chat: word definitions from each lemma's most frequent sense. Multi-word lemmas and rare
    # words (a single sense, no tag count) are sampled less to keep the corpus compact.
    for lemma, pos, offsets in senses:
        key = (pos, offsets[0])
        if key not in synsets:
            continue
        words, definition, examples = synsets[key]
        common = len(offsets) > 1
        if " " in lemma or any(c.isdigit() for c in lemma):
            if rng.random() > 0.1:
                continue
        elif not common and rng.random() > 0.35:
            continue
        group = f"wn:{words[0]}"
        question = rng.choice(DEFINE_QUESTIONS).format(w=lemma)
        reasoning = f"The user asks what \"{lemma}\" means. Its most common sense is {a_or_an(POS_NAMES[pos])} {POS_NAMES[pos]}."
        chat(group, question, wordnet_answer(lemma, pos, definition), reasoning, rng)
        others = [w for w in words if w.lower() != lemma.lower()]
        if others and rng.random() < 0.3:
            question = rng.choice(SYNONYM_QUESTIONS).format(w=lemma)
            answer = f"A synonym for \"{lemma}\" is \"{others[0]}\"." if len(others) == 1 else \
                f"Synonyms for \"{lemma}\" include " + ", ".join(f"\"{o}\"" for o in others[:3]) + "."
            chat(group, question, answer, f"I need a word with the same meaning as \"{lemma}\".", rng)
        if examples and lemma.lower() in examples[0].lower() and rng.random() < 0.3:
            question = rng.choice(EXAMPLE_QUESTIONS).format(w=lemma)
            chat(group, question, examples[0][0].upper() + examples[0][1:] + ".",
                 f"I need a short sentence that uses \"{lemma}\".", rng)

    # Chat: fortunes and riddles (each fortune asked for twice with different wording).
    for name, text in fortunes:
        group = f"fortune:{zlib.crc32(text.encode()) % 1000}"
        questions = RIDDLE_QUESTIONS if name == "riddles" else FORTUNE_QUESTIONS
        for _ in range(2):
            chat(group, rng.choice(questions), text, "The user wants a short quotation. Here is one.", rng)

    # Chat: verses by topic (a verse that contains the topic word) and by reference.
    topic_index = {}
    for topic in VERSE_TOPICS:
        word = topic.split()[-1]
        pattern = re.compile(r"\b" + re.escape(word) + r"\b", re.IGNORECASE)
        topic_index[topic] = [v for v in verses if pattern.search(v[1]) and len(v[1]) < 300]
    for topic, found in topic_index.items():
        for ref, text, group in rng.sample(found, min(len(found), 150)):
            question = rng.choice(VERSE_TOPIC_QUESTIONS).format(w=topic)
            chat(group, question, f"{ref}: \"{text}\"", f"I should find a verse that mentions {topic}.", rng)
    for ref, text, group in rng.sample(verses, 8000):
        question = rng.choice(VERSE_REF_QUESTIONS).format(r=ref)
        chat(group, question, f"{ref} says: \"{text}\"", f"The user asks for {ref}.", rng)

    # Chat: greetings, repeated so that the few hand-written replies are learnt.
    for _ in range(40):
        for question, answer in GREETINGS:
            chat("greeting", question, answer, "The user greets me. I should answer politely and briefly.", rng)
    return docs


# ---------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts, regex):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(ADDED_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  special_tokens=[])
    markers = re.compile("|".join(re.escape(t) for t, _ in ADDED_TOKENS))
    # The markers become added tokens; BPE must not spend merges on their pieces.
    tok.train_from_iterator((markers.sub("\n", t) for t in texts), trainer=trainer)
    base = tok.get_vocab_size()
    if base != VOCAB_SIZE - len(ADDED_TOKENS):
        fail(f"BPE produced {base} tokens, wanted {VOCAB_SIZE - len(ADDED_TOKENS)}")
    from tokenizers import AddedToken
    for content, special in ADDED_TOKENS:
        t = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    return tok


def write_tokenizer_files(tok, template_source, regex, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    # The `tokenizers` writer puts merges as lists; Qwen's file does the same.
    added = {}
    for content, special in ADDED_TOKENS:
        added[str(tok.token_to_id(content))] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": template_source,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "pretokenize_regex": regex,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8", newline="") as f:
        f.write(template_source)


# ---------------------------------------------------------------------------- main

SAMPLE_QUESTIONS = [
    ("Hello! Who are you?", False),
    ("What does the word apple mean?", False),
    ("Define the word ocean.", False),
    ("Tell me a fortune.", False),
    ("Quote a verse about light.", False),
    ("What does John 3:16 say?", False),
    ("Give me a synonym for happy.", False),
    ("What does the word river mean?", True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, ".demo_data"), help="output folder")
    args = ap.parse_args()

    with open(REGEX_PATH, encoding="utf-8", newline="") as f:
        regex = f.read()
    if hashlib.sha256(regex.encode()).hexdigest() != REGEX_SHA256:
        fail(f"{REGEX_PATH} is not the pinned Qwen3.6 pre-tokenizer regex")
    template_source, template = make_template()

    rng = random.Random(SEED)
    docs = build_documents(template, rng)
    # Split by group so that no held-out verse/word/fortune has a twin in training.
    groups = sorted({g for g, _ in docs})
    split_rng = random.Random(SEED + 1)
    val_groups = {g for g in groups if g != "greeting" and split_rng.random() < VAL_FRACTION}
    train_docs = [unicodedata.normalize("NFC", t) for g, t in docs if g not in val_groups]
    val_docs = [unicodedata.normalize("NFC", t) for g, t in docs if g in val_groups]
    random.Random(SEED + 2).shuffle(train_docs)
    random.Random(SEED + 3).shuffle(val_docs)
    print(f"documents: {len(train_docs)} train, {len(val_docs)} validation", flush=True)

    tok = train_tokenizer(train_docs, regex)
    tok_dir = os.path.join(args.out, "tokenizer")
    write_tokenizer_files(tok, template_source, regex, tok_dir)
    eot = tok.token_to_id("<|endoftext|>")

    def encode(texts):
        ids = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
        arr = np.asarray(ids, dtype=np.int64)
        if arr.max() >= VOCAB_SIZE:
            fail("token id out of range")
        return arr.astype(np.uint16)

    train = encode(train_docs)
    val = encode(val_docs)
    os.makedirs(args.out, exist_ok=True)
    train.tofile(os.path.join(args.out, "train.bin"))
    val.tofile(os.path.join(args.out, "val.bin"))

    # Round-trip check: decoding must give the text back (byte-level BPE is lossless).
    for t in val_docs[:200]:
        if tok.decode(tok.encode(t, add_special_tokens=False).ids, skip_special_tokens=False) != t:
            fail(f"tokenizer round trip failed on {t[:80]!r}")

    prompts = []
    for question, thinking in SAMPLE_QUESTIONS:
        text = render_prompt(template, [{"role": "user", "content": question}], thinking)
        prompts.append({"question": question, "enable_thinking": thinking, "prompt": text,
                        "ids": tok.encode(text, add_special_tokens=False).ids})
    with open(os.path.join(args.out, "prompts.json"), "w", encoding="utf-8") as f:
        json.dump(prompts, f, ensure_ascii=False, indent=1)

    specials = {c: tok.token_to_id(c) for c, _ in ADDED_TOKENS}
    meta = {
        "vocab_size": VOCAB_SIZE,
        "special_ids": specials,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        # For bits per byte: UTF-8 bytes of the held-out text, separators excluded.
        "val_bytes": sum(len(t.encode("utf-8")) for t in val_docs),
        "sources": SOURCES,
        "packages": {p: subprocess.run(["dpkg-query", "-W", "-f=${Version}", p], capture_output=True,
                                       text=True).stdout for p in
                     ["bible-kjv", "bible-kjv-text", "fortunes-min", "fortunes", "wordnet-base"]},
        "seed": SEED,
    }
    with open(os.path.join(args.out, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)
    mb = (train.nbytes + val.nbytes) / 1e6
    print(f"tokens: {train.size} train, {val.size} validation ({mb:.1f} MB as uint16)")
    print(f"special ids: {specials}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

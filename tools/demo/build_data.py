#!/usr/bin/env python3
"""Builds the tansy-demo training corpus, its tokenizer and compact token files.

Sources are text that Debian packages carry (install them first):
    apt-get install bible-kjv bible-kjv-text fortunes-min fortunes wordnet-base
Run from the repository root with a Python that has `tokenizers` (0.23 or later: 0.22 writes
`trim_offsets: true` into the ByteLevel pre-tokenizer, which tests/python/test_demo_data.py
rejects; the token ids are the same), `jinja2` and `numpy`:
    python tools/demo/build_data.py [--out .demo_data]

Output (git-ignored; the GPU run gets it through `carry`, because the GPU machine has none of
these Debian packages):
    train.bin, val.bin     uint16 token ids, documents separated by <|endoftext|>
    meta.json              counts, special ids, byte counts (for bits per byte), sources
    prompts.json           fixed questions, rendered and tokenized, for the sample answers
    tokenizer/             tokenizer.json, tokenizer_config.json, chat_template.jinja
    common_words.json      the taught common words with their first-sense definitions
    word_prompts.json      the evaluation words' prompts (tools/demo/eval_words.json), tokenized
--write-eval-words redraws tools/demo/eval_words.json (committed); otherwise it is checked against
the taught words.
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
VAL_FRACTION = 0.05

FORTUNE_DIR = "/usr/share/games/fortunes"
# Quotation files only; files of jokes about groups of people, drugs, politics, song lyrics,
# ASCII art, and fiction franchises are left out.
FORTUNE_FILES = [
    "fortunes", "literature", "riddles", "wisdom", "people", "science", "humorists",
    "platitudes", "education", "food", "love", "work", "kids", "pets", "miscellaneous",
    "art", "magic", "medicine", "paradoxum", "goedel",
]
WORDNET_DIR = "/usr/share/wordnet"
EVAL_WORDS_PATH = os.path.join(HERE, "eval_words.json")
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
        "what": "WordNet 3.0 glosses, example sentences and synonym sets of the most frequent words by the sense-tag counts in cntlist.rev",
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
        "what": "A few dozen hand-written greeting and self-description (what tansy is) replies in tools/demo/build_data.py",
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

TANSY_IS = ("tansy is an inference engine written in C++ and CUDA. It serves the Qwen3.6-35B-A3B model "
            "through an OpenAI-compatible HTTP server, and I am the tiny demo model that ships with it.")
GREETINGS = [
    ("Hello", "Hello! I am Tansy Demo, the tiny model that ships with the tansy inference engine. Ask me what a common English word means."),
    ("Hi", "Hi! I am Tansy Demo, a tiny model bundled with tansy. I can tell you what a common English word means."),
    ("Hello! Who are you?", "I am Tansy Demo, a tiny language model bundled with tansy, an inference engine for Qwen3.6. I can tell you what a common English word means."),
    ("Who are you?", "I am Tansy Demo, a tiny language model that ships with the tansy inference engine."),
    ("What is tansy?", TANSY_IS),
    ("What is Tansy?", TANSY_IS),
    ("What is Tansy Demo?", "Tansy Demo is a tiny language model that ships with tansy so that the engine can be tried without downloading the 35B model. It knows the meanings of a few thousand common English words."),
    ("What can you do?", "I can tell you what a common English word means, give a synonym, tell a fortune or a riddle, and quote a verse from the King James Bible. I am tiny, so ask me about common words."),
    ("How are you?", "I am fine, thank you. I am only a tiny demo model, but I am happy to help."),
    ("Good morning", "Good morning! Ask me what a common English word means."),
    ("Thank you", "You are welcome!"),
    ("Thanks!", "You are welcome!"),
    ("What is your name?", "My name is Tansy Demo."),
    ("Are you a large language model?", "No. I am a tiny model with only a few million active parameters, bundled with the tansy inference engine to show that it works."),
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


N_COMMON = 3000       # the most frequent single words by WordNet's sense-tag counts
EVAL_WORDS = 200      # drawn from them into tools/demo/eval_words.json
# The README's and the sample questions' words are always among the taught words.
ALWAYS_TAUGHT = ["apple", "ocean", "river", "happy", "light", "water", "tree", "house", "dog", "cat", "book",
                 "music", "friend", "city", "sun", "moon", "bread", "flower"]
SS_TYPES = {"1": "noun", "2": "verb", "3": "adj", "4": "adv", "5": "adj"}


def common_words(synsets):
    """The N_COMMON most frequent words with each one's first sense, from cntlist.rev.

    cntlist.rev (wordnet-base) holds, for every sense key, its sense number and how often that
    sense was tagged in the Semcor and other sense-tagged corpora. A word's frequency is the sum of
    its senses' tag counts; its first sense is its most often tagged sense (the sense number 1 of
    that part of speech; ties go to noun, verb, adjective, adverb in that order).
    Returns [(word, pos, synset key, definition, synonyms, examples)] in frequency order."""
    path = os.path.join(WORDNET_DIR, "cntlist.rev")
    if not os.path.exists(path):
        fail(f"missing {path} (apt-get install wordnet-base)")
    index = {}
    for pos in POS_NAMES:
        with open(os.path.join(WORDNET_DIR, f"index.{pos}"), encoding="utf-8") as f:
            for line in f:
                if line.startswith("  "):
                    continue
                fields = line.split()
                index[(fields[0], pos)] = fields[-int(fields[2]):]
    total, best = {}, {}
    order = list(POS_NAMES)
    with open(path, encoding="utf-8") as f:
        for line in f:
            key, sense_number, count = line.split()
            lemma, _, rest = key.partition("%")
            if not re.fullmatch(r"[a-z]{2,}", lemma):
                continue
            pos = SS_TYPES[rest[0]]
            count = int(count)
            total[lemma] = total.get(lemma, 0) + count
            rank = (-count, order.index(pos), int(sense_number))
            if lemma not in best or rank < best[lemma][0]:
                best[lemma] = (rank, pos, int(sense_number))
    ranked = sorted(total, key=lambda w: (-total[w], w))
    chosen = [w for w in ALWAYS_TAUGHT if w in best]
    chosen += [w for w in ranked if w not in chosen]
    out = []
    for word in chosen:
        _, pos, sense_number = best[word]
        offsets = index.get((word, pos))
        if not offsets or sense_number > len(offsets) or (pos, offsets[sense_number - 1]) not in synsets:
            continue
        words, definition, examples = synsets[(pos, offsets[sense_number - 1])]
        synonyms = [w for w in words if w.lower() != word]
        out.append((word, pos, offsets[sense_number - 1], definition, synonyms, examples))
        if len(out) == N_COMMON:
            break
    return out


CANONICAL_QUESTION = "What does the word {w} mean?"  # the README's question form
CANONICAL_REPEATS = 3   # thinking-off copies of it per common word (plus one thinking-on)
OTHER_FORMS = 2         # other wordings of the question per common word
VERSES_BY_REFERENCE = 1500
VERSE_REPEATS = 2
VERSES_PER_TOPIC = 20
PLAIN_CHAPTERS = 40
FORTUNES_KEPT = 1500
FORTUNE_REPEATS = 2
GREETING_REPEATS = 60
ALWAYS_VERSES = ["John 3:16", "Genesis 1:1", "Psalms 23:1"]


def build_documents(template, rng):
    """The corpus, aimed at being right about a focused set of things rather than broad: the
    N_COMMON common words (their first-sense definitions in the README's question form, other
    wordings, synonyms, examples) make most of it; a smaller set of verses and fortunes, each
    repeated; greetings and what tansy is. Returns (docs, common words)."""
    chapters = read_kjv()
    fortunes = read_fortunes()
    synsets, _ = read_wordnet()
    common = common_words(synsets)
    docs = []  # (group, text); group decides the train/validation split ("common" is never held out)

    def chat(group, question, answer, reasoning_thinking, rng_local):
        """Appends one conversation; about one in five is rendered thinking-on."""
        messages = []
        if rng_local.random() < 0.1:
            messages.append({"role": "system", "content": rng_local.choice(SYSTEM_PROMPTS)})
        messages.append({"role": "user", "content": question})
        thinking = rng_local.random() < 0.2
        docs.append((group, render_example(template, messages, answer, reasoning_thinking if thinking else None)))

    def chat_fixed(group, question, answer, reasoning):
        """One conversation with no system prompt, thinking-off (reasoning None) or on."""
        docs.append((group, render_example(template, [{"role": "user", "content": question}], answer, reasoning)))

    # Chat: the common words. The answer to the README's question form is always
    # `As a noun, "apple" means <first-sense definition>.`, so greedy decoding reproduces it.
    for word, pos, _, definition, synonyms, examples in common:
        answer = wordnet_answer(word, pos, definition)
        reasoning = f"The user asks what \"{word}\" means. Its most common sense is {a_or_an(POS_NAMES[pos])} {POS_NAMES[pos]}."
        question = CANONICAL_QUESTION.format(w=word)
        for _ in range(CANONICAL_REPEATS):
            chat_fixed("common", question, answer, None)
        chat_fixed("common", question, answer, reasoning)
        for form in rng.sample(DEFINE_QUESTIONS[1:], OTHER_FORMS):
            chat("common", form.format(w=word), answer, reasoning, rng)
        if synonyms:
            q = rng.choice(SYNONYM_QUESTIONS).format(w=word)
            a = f"A synonym for \"{word}\" is \"{synonyms[0]}\"." if len(synonyms) == 1 else \
                f"Synonyms for \"{word}\" include " + ", ".join(f"\"{o}\"" for o in synonyms[:3]) + "."
            chat("common", q, a, f"I need a word with the same meaning as \"{word}\".", rng)
        if examples and word in examples[0].lower():
            q = rng.choice(EXAMPLE_QUESTIONS).format(w=word)
            chat("common", q, examples[0][0].upper() + examples[0][1:] + ".",
                 f"I need a short sentence that uses \"{word}\".", rng)
        entry = f"{word} ({POS_NAMES[pos]}): {definition}."
        if examples:
            entry += " Example: \"" + examples[0] + "\""
        docs.append(("common", entry))

    # Plain text: a few Bible chapters, one verse a line.
    verses = []
    for book, chapter, vv in chapters:
        verses.extend((f"{book} {chapter}:{v}", t, f"kjv:{book}:{chapter}") for v, t in vv)
    for book, chapter, vv in rng.sample(chapters, PLAIN_CHAPTERS):
        lines = [f"{book} {chapter}"] + [f"{v} {t}" for v, t in vv]
        docs.append((f"kjv:{book}:{chapter}", "\n".join(lines)))

    # Chat: verses by reference (a fixed smaller set, each asked for VERSE_REPEATS times) and by topic.
    by_ref = {v[0]: v for v in verses}
    chosen = [by_ref[r] for r in ALWAYS_VERSES]
    chosen += [v for v in rng.sample(verses, VERSES_BY_REFERENCE) if v[0] not in ALWAYS_VERSES]
    for ref, text, group in chosen:
        for _ in range(VERSE_REPEATS):
            question = rng.choice(VERSE_REF_QUESTIONS).format(r=ref)
            chat(group, question, f"{ref} says: \"{text}\"", f"The user asks for {ref}.", rng)
    for topic in VERSE_TOPICS:
        word = topic.split()[-1]
        pattern = re.compile(r"\b" + re.escape(word) + r"\b", re.IGNORECASE)
        found = [v for v in verses if pattern.search(v[1]) and len(v[1]) < 300]
        for ref, text, group in rng.sample(found, min(len(found), VERSES_PER_TOPIC)):
            for _ in range(VERSE_REPEATS):
                question = rng.choice(VERSE_TOPIC_QUESTIONS).format(w=topic)
                chat(group, question, f"{ref}: \"{text}\"", f"I should find a verse that mentions {topic}.", rng)

    # Fortunes and riddles: a fixed smaller set, as plain text once and asked for FORTUNE_REPEATS times.
    for name, text in rng.sample(fortunes, min(len(fortunes), FORTUNES_KEPT)):
        group = f"fortune:{zlib.crc32(text.encode()) % 1000}"
        docs.append((group, text))
        questions = RIDDLE_QUESTIONS if name == "riddles" else FORTUNE_QUESTIONS
        for _ in range(FORTUNE_REPEATS):
            chat(group, rng.choice(questions), text, "The user wants a short quotation. Here is one.", rng)

    # Chat: greetings and what tansy is, repeated so that the few hand-written replies are learnt.
    for _ in range(GREETING_REPEATS):
        for question, answer in GREETINGS:
            chat("greeting", question, answer, "The user greets me. I should answer politely and briefly.", rng)
    return docs, common


def write_word_lists(common, out_dir, redraw):
    """Writes the taught words to out_dir/common_words.json; draws (redraw) or checks the fixed
    evaluation list: EVAL_WORDS of the taught words with the answer each must contain."""
    os.makedirs(out_dir, exist_ok=True)
    rows = [{"word": w, "pos": POS_NAMES[pos], "synset": f"{pos}.{off}", "definition": d}
            for w, pos, off, d, _, _ in common]
    with open(os.path.join(out_dir, "common_words.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, ensure_ascii=False, indent=0)
    by_word = {r["word"]: r for r in rows}
    if redraw:
        first = [by_word[w] for w in ("apple", "ocean", "river")]
        rest = random.Random(SEED + 4).sample([r for r in rows if r not in first], EVAL_WORDS - len(first))
        with open(EVAL_WORDS_PATH, "w", encoding="utf-8") as f:
            json.dump({"about": "Fixed evaluation list for tansy-demo: words drawn (fixed seed) from the "
                                "common words tools/demo/build_data.py teaches, each with its first-sense "
                                "WordNet 3.0 definition. Scored by tools/demo/word_score.py.",
                       "question": CANONICAL_QUESTION, "words": first + rest}, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {EVAL_WORDS_PATH}")
    if not os.path.exists(EVAL_WORDS_PATH):
        fail(f"missing {EVAL_WORDS_PATH}: run with --write-eval-words once")
    listed = json.load(open(EVAL_WORDS_PATH, encoding="utf-8"))["words"]
    for r in listed:
        if by_word.get(r["word"]) != r:
            fail(f"evaluation word {r['word']!r} is not taught with that definition (redraw with --write-eval-words)")
    print(f"common words: {len(rows)} taught; {len(listed)} of them in {os.path.relpath(EVAL_WORDS_PATH, ROOT)}")


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
    ("What does the word ocean mean?", False),
    ("What is tansy?", False),
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
    ap.add_argument("--write-eval-words", action="store_true",
                    help=f"(re)draw the fixed evaluation list {os.path.relpath(EVAL_WORDS_PATH, ROOT)}")
    args = ap.parse_args()

    with open(REGEX_PATH, encoding="utf-8", newline="") as f:
        regex = f.read()
    if hashlib.sha256(regex.encode()).hexdigest() != REGEX_SHA256:
        fail(f"{REGEX_PATH} is not the pinned Qwen3.6 pre-tokenizer regex")
    template_source, template = make_template()

    rng = random.Random(SEED)
    docs, common = build_documents(template, rng)
    write_word_lists(common, args.out, args.write_eval_words)
    # Split by group so that no held-out verse/word/fortune has a twin in training.
    groups = sorted({g for g, _ in docs})
    split_rng = random.Random(SEED + 1)
    val_groups = {g for g in groups if g not in ("greeting", "common") and split_rng.random() < VAL_FRACTION}
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
    # The evaluation words' prompts, for tools/demo/evaluate.py (the GPU machine has no template renderer
    # of its own to trust more than this one, which the prompts above are checked against by the CI tests).
    words = json.load(open(EVAL_WORDS_PATH, encoding="utf-8"))
    word_prompts = []
    for w in words["words"]:
        text = render_prompt(template, [{"role": "user", "content": words["question"].format(w=w["word"])}], False)
        word_prompts.append({"word": w["word"], "ids": tok.encode(text, add_special_tokens=False).ids})
    with open(os.path.join(args.out, "word_prompts.json"), "w", encoding="utf-8") as f:
        json.dump(word_prompts, f)

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

#!/usr/bin/env python3
"""The tansy-demo word-definition score: how many of the fixed 200 evaluation words
(tools/demo/eval_words.json) the model defines right.

Each word is asked in the README's question form ("What does the word apple mean?", thinking
off) and answered greedily. An answer is right when it contains the word's first-sense WordNet
definition after normalisation (lower case, every run of characters other than letters and
digits made one space): a normalised exact match of the whole definition inside the answer, no
partial credit. The mean token recall of the definition (share of its normalised words found in
the answer) is reported beside it for information only.

Scored here against tansy (the CPU backend by default) through `tansy serve`, started on a free
port, or a server already running (--url); tools/demo/evaluate.py scores transformers with the
same functions.

    python tools/demo/word_score.py --tansy build/tansy --model models/tansy-demo --out out/words_cpu.json
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import unicodedata
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EVAL_WORDS = os.path.join(HERE, "eval_words.json")
MAX_TOKENS = 64  # the longest expected answer is 52 tokens; a right answer stops at <|im_end|> before it


def fail(msg):
    sys.exit(f"word_score: {msg}")


def load_words(path=EVAL_WORDS):
    data = json.load(open(path, encoding="utf-8"))
    return data["question"], data["words"]


def normalise(text):
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text).split())


def judge(answer, definition):
    """(right, token recall) of one answer."""
    a, d = normalise(answer), normalise(definition)
    right = bool(d) and f" {d} " in f" {a} "
    want = d.split()
    have = set(a.split())
    recall = sum(w in have for w in want) / len(want) if want else 0.0
    return right, recall


def score(words, answers, source):
    """words: eval_words.json rows; answers: the model's answer text per row, in order."""
    if len(words) != len(answers):
        fail(f"{len(answers)} answers for {len(words)} words")
    rows, right_n, recall_sum = [], 0, 0.0
    for w, ans in zip(words, answers):
        right, recall = judge(ans, w["definition"])
        right_n += right
        recall_sum += recall
        rows.append({"word": w["word"], "right": right, "recall": round(recall, 3), "answer": ans})
    return {"source": source, "rule": "normalised definition contained in the answer",
            "right": right_n, "total": len(words), "score": round(right_n / len(words), 4),
            "mean_token_recall": round(recall_sum / len(words), 4), "answers": rows}


# ---------------------------------------------------------------------------- tansy

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ask_server(url, question, words, max_tokens=MAX_TOKENS, timeout=120):
    answers = []
    for w in words:
        body = {"model": "tansy-demo", "messages": [{"role": "user", "content": question.format(w=w["word"])}],
                "max_tokens": max_tokens, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
        answers.append(post(url + "/v1/chat/completions", body, timeout)["choices"][0]["message"]["content"] or "")
    return answers


class Server:
    """`tansy serve` on a free port for the duration of a with-block."""

    def __init__(self, tansy, model, backend, threads, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        cmd = [tansy, "serve", "--model", model, "--backend", backend, "--port", str(self.port)]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self):
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                fail(f"tansy serve exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        self.__exit__()
        fail("tansy serve did not become healthy in 60 s")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def score_tansy(tansy, model, backend="cpu", threads=0, log_path=os.devnull, url="", max_tokens=MAX_TOKENS):
    question, words = load_words()
    t0 = time.time()
    if url:
        answers = ask_server(url, question, words, max_tokens)
    else:
        with Server(tansy, model, backend, threads, log_path) as s:
            answers = ask_server(s.url, question, words, max_tokens)
    result = score(words, answers, f"tansy serve, {backend} backend, greedy, max_tokens {max_tokens}")
    result["seconds"] = round(time.time() - t0, 1)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tansy", default=os.environ.get("TANSY_BIN", os.path.join(ROOT, "build", "tansy")))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tansy-demo"))
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="tansy serve --threads (0: its default)")
    ap.add_argument("--url", default="", help="score a server already running here instead")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--out", default="", help="write the result as JSON here")
    args = ap.parse_args()
    result = score_tansy(args.tansy, args.model, args.backend, args.threads, url=args.url,
                         max_tokens=args.max_tokens)
    for r in result["answers"][:5]:
        print(f"{'right' if r['right'] else 'WRONG'}  {r['word']}: {r['answer']}")
    print(f"word_score: {result['right']}/{result['total']} = {100 * result['score']:.1f}% right "
          f"(mean token recall {100 * result['mean_token_recall']:.1f}%), {result['seconds']} s, {result['source']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()

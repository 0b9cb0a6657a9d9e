"""The bundled tansy-demo model is right about the words it was taught.

For the fixed 200 evaluation words of tools/demo/eval_words.json (drawn from the common words
tools/demo/build_data.py teaches), the greedy answer of the real tansy binary (`tansy serve`, the
CPU backend in CI; $TANSY_DEMO_BACKEND=cuda on the GPU machine) to "What does the word X mean?"
must contain the word's first-sense WordNet definition after normalisation (tools/demo/word_score.py)
for at least 80% of them. The score is printed (run with -s)."""
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TANSY = Path(os.environ.get("TANSY_BIN", REPO / "build" / "tansy"))
MODEL = REPO / "models" / "tansy-demo"
BACKEND = os.environ.get("TANSY_DEMO_BACKEND", "cpu")
sys.path.insert(0, str(REPO / "tools" / "demo"))
import word_score  # noqa: E402

THRESHOLD = 0.80


def test_judge_rule():
    d = "fruit with red or yellow or green skin and sweet to tart crisp whitish flesh"
    assert word_score.judge(f'As a noun, "apple" means {d}.', d) == (True, 1.0)
    assert word_score.judge('As a noun, "apple" means Fruit with red-or yellow  or green skin and sweet to '
                            'tart crisp whitish flesh!', d)[0]
    right, recall = word_score.judge('As a noun, "apple" means fruit with red or yellow skin.', d)
    assert not right and 0 < recall < 1
    # whole words only: "a lightweight cord" is not in "a lightweight cordless phone"
    assert not word_score.judge("a lightweight cordless phone", "a lightweight cord")[0]
    assert not word_score.judge("anything", "")[0]


def test_eval_words_are_fixed_and_distinct():
    question, words = word_score.load_words()
    assert question == "What does the word {w} mean?"
    assert len(words) == 200 and len({w["word"] for w in words}) == 200
    assert words[0]["word"] == "apple"  # the README's example
    assert all(w["definition"] and w["pos"] in ("noun", "verb", "adjective", "adverb") for w in words)
    taught = REPO / ".demo_data" / "common_words.json"
    if taught.exists():
        by_word = {r["word"]: r for r in json.loads(taught.read_text(encoding="utf-8"))}
        assert all(by_word.get(w["word"]) == w for w in words)


@pytest.mark.skipif(not TANSY.exists(), reason=f"no tansy binary at {TANSY}")
def test_word_definition_score(tmp_path):
    result = word_score.score_tansy(str(TANSY), str(MODEL), BACKEND, threads=2, log_path=str(tmp_path / "serve.log"))
    wrong = [f"{r['word']}: {r['answer']}" for r in result["answers"] if not r["right"]]
    print(f"\ntansy-demo word-definition score ({BACKEND}): {result['right']}/{result['total']} = "
          f"{100 * result['score']:.1f}% (mean token recall {100 * result['mean_token_recall']:.1f}%), "
          f"{result['seconds']} s")
    assert result["score"] >= THRESHOLD, f"{result['right']}/{result['total']} right; first wrong: {wrong[:5]}"

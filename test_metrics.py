"""metrics.py: hand-checked cases for each metric, and agreement with coco-caption's own figures on the real caption
sets in ../shared/reference (skipped when that folder is absent). A few seconds on a CPU."""
import gzip
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import metrics
from metrics import bleu, cider_d, cider_d_constant, cider_d_prepare, evaluate, meteor, rouge_l, tokenize

SHARED = Path(__file__).resolve().parent.parent / "shared"
REFERENCE = SHARED / "reference"
REFERENCE_SETS = sorted(REFERENCE.glob("*.json")) if REFERENCE.is_dir() else []
needs_reference = pytest.mark.skipif(not REFERENCE_SETS, reason="../shared/reference (coco-caption's figures) absent")
needs_wordnet = pytest.mark.skipif(metrics.load_wordnet() is None, reason="no WordNet (apt-get install wordnet-base)")


@pytest.fixture(autouse=True)
def quiet():  # "stage skipped" notices are expected here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --- tokenization: Stanford PTBTokenizer as coco-caption runs it (outputs checked against the CoreNLP 3.4.1 jar)
@pytest.mark.parametrize("raw, tok", [
    ("The man's T-shirt (left) isn't red.", "the man 's t-shirt -lrb- left -rrb- is n't red"),
    ('Change the word "TRUMP" to "JUMP", and done!', "change the word trump to jump and done"),
    ("make it black & white; crop it: now...", "make it black & white crop it now"),
    ("Paid for by Donald J. Trump, Inc.", "paid for by donald j. trump inc."),
    ("  a   b\tc ", "a b c"), ("I can't, we cannot", "i ca n't we can not"), ("it 's", "it 's"),
    ("the U.S. flag at 3.5 m, 1,000 cars", "the u.s. flag at 3.5 m 1,000 cars"), ("...", ""), ("", ""),
])
def test_tokenize(raw, tok):
    assert tokenize(raw) == tok


# --- BLEU
def test_bleu_identical_and_disjoint():
    refs = {1: ["a red cube is on the left"], 2: ["two spheres moved"]}
    corpus, items = bleu(refs, {1: "a red cube is on the left", 2: "two spheres moved"})
    assert corpus == pytest.approx([1.0] * 4, abs=1e-8)
    assert items[1] == pytest.approx([1.0] * 4, abs=1e-8)
    # 3 words have no 4-gram: coco-caption's (0 + 1e-15) / (0 + 1e-9) makes that precision 1e-6, not 0 or 1
    assert items[2] == pytest.approx([1.0, 1.0, 1.0, 1e-6 ** 0.25], abs=1e-8)
    corpus, _ = bleu(refs, {1: "x y z w v u t", 2: "p q r"})
    assert max(corpus) < 1e-6


def test_bleu_brevity_penalty_and_closest_reference():
    # 3 of 3 unigrams right, but the reference has 6 words: BP = exp(1 - 6/3)
    _, items = bleu({1: ["a b c d e f"]}, {1: "a b c"})
    assert items[1][0] == pytest.approx(math.exp(-1.0), rel=1e-6)
    # references of 3 and 5 words, candidate of 4: both are 1 away, the shorter counts, so no penalty
    _, items = bleu({1: ["a b c", "a b c d e"]}, {1: "a b c d"})
    assert items[1][0] == pytest.approx(1.0, abs=1e-8)
    # clipping: "the" 3 times in the candidate, at most 2 times in one reference
    _, items = bleu({1: ["the cat the mat", "the dog"]}, {1: "the the the"})
    assert items[1][0] == pytest.approx(2 / 3, rel=1e-6)


# --- ROUGE-L
def test_rouge_l_lcs_and_beta():
    _, items = rouge_l({1: ["a c b d"]}, {1: "a b c d"})  # LCS 3: P = R = 3/4
    assert items[1] == pytest.approx(0.75)
    _, items = rouge_l({1: ["a b c d"]}, {1: "a b"})  # P 1, R 1/2, beta 1.2
    assert items[1] == pytest.approx((1 + 1.44) * 0.5 / (0.5 + 1.44))
    _, items = rouge_l({1: ["x y"], 2: ["a b"]}, {1: "a b", 2: "a b"})
    assert items == {1: 0.0, 2: 1.0}


def test_lcs_matches_dynamic_programming():
    import random
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.choice("abcd") for _ in range(rng.randint(0, 12))]
        b = [rng.choice("abcd") for _ in range(rng.randint(0, 12))]
        table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
        for i in range(len(a)):
            for j in range(len(b)):
                table[i + 1][j + 1] = table[i][j] + 1 if a[i] == b[j] else max(table[i][j + 1], table[i + 1][j])
        assert metrics._lcs(a, b) == table[-1][-1]


# --- CIDEr-D
def test_cider_d_by_hand():
    # 2 items, no n-gram shared between them: every idf is log 2 (unseen n-grams count as df 1 too)
    refs = {1: ["a b"], 2: ["c d"]}
    _, items = cider_d(refs, {1: "a b e", 2: "c d"})
    # item 1: unigram cosine 2/sqrt(6), bigram 1/sqrt(2), no 3- or 4-grams in the reference; lengths 2 vs 1 bigrams
    assert items[1] == pytest.approx(10 * (2 / math.sqrt(6) + 1 / math.sqrt(2)) / 4 * math.exp(-1 / 72))
    assert items[2] == pytest.approx(5.0)  # identical, but a 2-word sentence has no 3- and 4-grams
    _, items = cider_d(refs, {1: "x y", 2: "c d"})
    assert items[1] == 0.0


def test_cider_d_clips_repeated_ngrams():
    refs = {1: ["a red cube", "a red ball"], 2: ["one green thing"]}
    _, once = cider_d(refs, {1: "a red cube", 2: "x"})
    _, again = cider_d(refs, {1: "a red cube red cube red cube", 2: "x"})
    assert again[1] < once[1]


def test_cider_d_constant_equals_full_pass():
    refs = {i: [tokenize(s) for s in r] for i, r in {
        1: ["the red cube moved", "a red cube has moved"], 2: ["the blue sphere is gone", "no blue sphere"],
        3: ["nothing changed", "the scene is the same"], 4: ["the red cube is gone", "a cube was removed"]}.items()}
    prepared = cider_d_prepare(refs)
    captions = ["the red cube moved", "nothing changed", "the cube is gone", "", "zebra"]
    fast = cider_d_constant(prepared, captions)
    for caption, score in zip(captions, fast):
        assert score == pytest.approx(cider_d(refs, {i: caption for i in refs})[0], abs=1e-12)


# --- METEOR 1.5
def test_meteor_exact_stage_by_hand():
    # words outside WordNet and the paraphrase table: exact matches only. 3 of 4 content words, 2 chunks.
    _, items = meteor({1: ["w1 w2 w3 w5"]}, {1: "w1 w2 w4 w5"})
    assert items[1] == pytest.approx(0.75 * (1 - 0.6 * (2 / 3) ** 0.2))
    # a function word ("the") counts 1 - delta = 0.25, a content word 0.75: P = R = 0.25, one chunk of one match
    _, items = meteor({1: ["the w2"]}, {1: "the w1"})
    assert items[1] == pytest.approx(0.25 * (1 - 0.6))
    corpus, items = meteor({1: ["w1 w2"], 2: ["w4 w5"]}, {1: "w1 w2", 2: "w6 w7"})
    assert items == {1: 1.0, 2: 0.0}
    # corpus METEOR comes from summed statistics (a perfect segment adds no chunk): P = R = 1/2, frag 0
    assert corpus == pytest.approx(0.5)


def test_meteor_stem_stage():
    # "cubes" ~ "cube" by Snowball stem (weight 0.6): P = R = (0.75 + 0.6 * 0.75) / 1.5, one chunk, all matched
    _, items = meteor({1: ["w1 cube"]}, {1: "w1 cubes"})
    assert items[1] == pytest.approx((0.75 + 0.6 * 0.75) / 1.5)


@needs_wordnet
def test_meteor_synonym_stage():
    _, items = meteor({1: ["w1 automobile"]}, {1: "w1 car"})  # WordNet synset {car, auto, automobile, ...}: 0.8
    assert items[1] == pytest.approx((0.75 + 0.8 * 0.75) / 1.5)


def test_meteor_paraphrase_stage(tmp_path):
    table = tmp_path / "paraphrase.gz"  # Meteor's format: probability / phrase / paraphrase
    with gzip.open(table, "wt") as f:
        f.write("0.5\nw3\nw4 w5\n")
    # hyp "w3" ~ ref "w4 w5" (weight 0.6): P = (0.75 + 0.6 * 0.75) / 1.5, R = (0.75 + 0.6 * 1.5) / 2.25, one chunk
    _, items = meteor({1: ["w1 w4 w5"]}, {1: "w1 w3"}, paraphrase=table)
    p, r = 0.8, 1.65 / 2.25
    assert items[1] == pytest.approx(1 / (0.15 / p + 0.85 / r))  # 0.7426..., as the jar with this table


def test_meteor_best_reference_and_normalizer():
    _, items = meteor({1: ["w3 w8", "w1 w2"]}, {1: "w1 w2"})
    assert items[1] == 1.0
    assert metrics.meteor_normalize("do n't wear the man 's t-shirt") == ["do", "n", "'t", "wear", "the", "man",
                                                                         "'", "s", "t", "shirt"]
    assert metrics.meteor_normalize("the u.s. and j. doe inc.") == ["the", "us", "and", "j.", "doe", "inc", "."]


# --- evaluate(): the API the stages call, and its input checks
def test_evaluate_identical_and_per_item():
    refs = {"a": ["A red cube moved.", "The red cube has moved"], "b": ["Nothing changed!", "no change"]}
    cands = {"a": "a red cube moved", "b": "nothing changed"}
    corpus, items = evaluate(refs, cands, per_item=True)
    assert set(corpus) == set(metrics.METRICS) and set(items) == set(metrics.METRICS)
    assert [corpus[m] for m in ("BLEU-1", "ROUGE-L", "METEOR")] == pytest.approx([1.0] * 3, abs=1e-8)
    assert items["CIDEr-D"].keys() == cands.keys()
    assert corpus["CIDEr-D"] == pytest.approx(sum(items["CIDEr-D"].values()) / 2)
    assert evaluate(refs, cands) == corpus


def test_evaluate_rejects_bad_input():
    refs = {1: ["a cube"], 2: ["a ball"]}
    with pytest.raises(ValueError, match="same ids"):
        evaluate(refs, {1: "a cube", 3: "a ball"})
    with pytest.raises(ValueError, match="same ids"):
        evaluate(refs, {1: "a cube"})
    with pytest.raises(TypeError, match="candidate 2"):
        evaluate(refs, {1: "a cube", 2: None})
    with pytest.raises(TypeError, match="references of 2"):
        evaluate({1: ["a cube"], 2: "a ball"}, {1: "a cube", 2: "a ball"})
    with pytest.raises(TypeError, match="references of 2"):
        evaluate({1: ["a cube"], 2: []}, {1: "a cube", 2: "a ball"})
    with pytest.raises(ValueError, match="no candidates"):
        evaluate({}, {})


def test_evaluate_empty_candidate_scores_zero():
    refs = {1: ["a red cube"], 2: ["a blue ball"]}
    with pytest.warns(UserWarning, match="1 empty candidates"):
        _, items = evaluate(refs, {1: "a red cube", 2: "..."}, per_item=True)
    assert all(items[m][2] < 1e-6 for m in metrics.METRICS)
    assert items["CIDEr-D"][1] > 0


def test_command_line(tmp_path):
    (tmp_path / "refs.json").write_text(json.dumps({"1": ["a red cube moved"], "2": ["nothing changed"]}))
    (tmp_path / "cands.json").write_text(json.dumps({"1": "a red cube moved", "2": "something moved"}))
    out = subprocess.run([sys.executable, str(Path(metrics.__file__)), "--refs", str(tmp_path / "refs.json"),
                          "--cands", str(tmp_path / "cands.json")], capture_output=True, text=True, check=True).stdout
    header, values = out.strip().splitlines()[-2:]
    assert header.split(" | ")[-1].strip() == "CIDEr-D" and len(values.split("|")) == 7


# --- agreement with coco-caption on real caption sets (its tokenization, corpus and per-item scores)
def load_reference(path):
    ref = json.loads(path.read_text())
    return ref, evaluate(ref["refs"], ref["cands"], per_item=True)


@needs_reference
@pytest.mark.parametrize("path", REFERENCE_SETS, ids=lambda p: p.stem)
def test_matches_coco_caption(path):
    ref, (corpus, items) = load_reference(path)
    for i in ref["refs"]:  # tokenization alone: exactly the Java tokenizer's text
        assert [tokenize(s) for s in ref["refs"][i]] == ref["tokenized_refs"][i]
        assert tokenize(ref["cands"][i]) == ref["tokenized_cands"][i]
    for m in ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "ROUGE-L", "CIDEr-D"):  # the issue asks 0.002 (CIDEr-D 0.005)
        assert corpus[m] == pytest.approx(ref["corpus"][m], abs=1e-9), m
        for i, score in ref["per_item"][m].items():
            assert items[m][i] == pytest.approx(score, abs=1e-9), (m, i)


@needs_reference
@needs_wordnet
@pytest.mark.parametrize("path", REFERENCE_SETS, ids=lambda p: p.stem)
def test_meteor_matches_coco_caption(path):
    ref, (corpus, _) = load_reference(path)
    # exact + stem + synonym: within 0.01 of the jar; all four stages ($METEOR_PARAPHRASE set) within 0.001
    tol = 0.001 if os.environ.get("METEOR_PARAPHRASE") else 0.01
    assert corpus["METEOR"] == pytest.approx(ref["corpus"]["METEOR"], abs=tol)


@needs_reference
def test_meteor_without_wordnet_says_so_and_scores(monkeypatch):
    monkeypatch.delenv("WORDNET_DIR", raising=False)
    monkeypatch.setattr(metrics, "WORDNET_DIRS", ())
    monkeypatch.setattr(metrics, "_nltk_wordnet", lambda: None)
    metrics.load_wordnet.cache_clear(), metrics._warned.clear()
    try:
        for path in REFERENCE_SETS:
            ref = json.loads(path.read_text())
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                corpus, _ = meteor(ref["tokenized_refs"], ref["tokenized_cands"])
            assert any("WordNet not found" in str(w.message) for w in caught) == (path == REFERENCE_SETS[0])
            assert corpus == pytest.approx(ref["corpus"]["METEOR"], abs=0.025)  # exact + stem only
    finally:
        metrics.load_wordnet.cache_clear()

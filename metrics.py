"""coco-caption's metrics in pure Python, no Java: BLEU-1..4, METEOR 1.5, ROUGE-L, CIDEr-D after its PTB tokenization.

    python metrics.py --refs refs.json --cands cands.json   # refs: {id: [sentence, ...]}, cands: {id: sentence}
    scores = evaluate(refs, cands)                          # {"BLEU-1": 0.41, ..., "CIDEr-D": 0.63}, fractions
    scores, items = evaluate(refs, cands, per_item=True)    # items["CIDEr-D"][id]: one item's score

METEOR reads Meteor's own synonym and paraphrase files from pip's pycocoevalcap; without it, exact and stem only.
"""
import argparse
import gzip
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
import zipfile
from array import array
from collections import Counter, defaultdict
from functools import lru_cache
from operator import itemgetter
from pathlib import Path

import numpy as np

METRICS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D")
ASSETS = Path(__file__).resolve().parent / "assets" / "meteor"

# -----------------------------------------------------------------------------
# Tokenization: CoreNLP 3.4.1's PTBTokenizer (-preserveLines -lowerCase), then these tokens dropped
# (ptbtokenizer.py); its upper-case bracket escapes never match the lower-cased output, so "(" stays "-lrb-".
PUNCTUATIONS = {"''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-",
                ".", "?", "!", ",", ":", "-", "--", "...", ";"}
_ABBREV = ("mr|mrs|ms|dr|prof|st|jr|sr|gen|gov|lt|col|capt|sgt|rep|sen|rev|mt|ft|inc|co|corp|ltd|bros|vs|etc|ca"
           "|jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec")
_TOKEN = re.compile(r"""
    (?:https?://|www\.)[^\s"'()\[\]{}<>]*[^\s"'()\[\]{}<>.,;:!?]     # urls
  | '(?:s|m|d|re|ve|ll)\b|n't\b                                      # clitics already split off: "it 's"
  | (?:[a-z]\.){2,}(?![a-z0-9])                                      # acronyms keep their periods: u.s. e.g. p.m.
  | (?:(?<=\s)|^)[-.]\d+(?:[.,]\d+)*                                 # -5 .5
  | (?:[a-z]|""" + _ABBREV + r""")\.(?![a-z0-9])                     # single letters, known abbreviations: j. inc.
  | (?:no|nos|vol|art|pp)\.(?=\s*\d)                                 # "no. 5"
  | [^\W_]\w*(?:(?:[-/.&@]|(?<=\d)[,:](?=\d)|(?<=[^\W\d_])'(?=[^\W\d_]))\w+)*(?:\+\+|\#)?  # t-shirt 3.5 1,000 o'clock
  | \.\.\.+|--+|[!?]+                                                # runs: ... -- ?!
  | \S                                                               # any other symbol, alone
""", re.VERBOSE)
_BRACKETS = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}
_SPLIT_WORDS = {"cannot": ["can", "not"], "gonna": ["gon", "na"], "gotta": ["got", "ta"], "wanna": ["wan", "na"],
                "lemme": ["lem", "me"], "gimme": ["gim", "me"]}
_PLAIN = re.compile(r"[a-z0-9 ]*")
_CLITIC = re.compile(r"(.*[^'])(n't|'s|'m|'d|'re|'ve|'ll)")
_UNICODE = str.maketrans({"\u201c": '"', "\u201d": '"', "\u201e": '"', "\u2018": "'", "\u2019": "'", "\u201a": "'",
                          "\u2014": " -- ", "\u2013": " -- ", "\u2026": " ... ", "\u00a0": " "})


def tokenize(sentence):
    """"The man's T-shirt (left) isn't red." -> "the man 's t-shirt -lrb- left -rrb- is n't red" """
    low = sentence.lower()
    if _PLAIN.fullmatch(low) and not any(w in _SPLIT_WORDS for w in low.split()):
        return " ".join(low.split())  # the common case: nothing to split but at spaces
    out = []
    for tok in _TOKEN.findall(sentence.translate(_UNICODE).lower()):
        if tok in _SPLIT_WORDS:
            out += _SPLIT_WORDS[tok]
        elif (m := _CLITIC.fullmatch(tok)):  # don't -> do n't, man's -> man 's (PTB splits clitics)
            out += [m.group(1), m.group(2)]
        elif not (tok in PUNCTUATIONS or tok in ('"', "`") or re.fullmatch(r"-{2,}|\.{3,}", tok)):
            out.append(_BRACKETS.get(tok, tok))
    return " ".join(out)


@lru_cache(maxsize=1 << 16)  # shared by every metric: do not modify the Counter
def _ngrams(sentence):
    """Counts of the 1..4-grams of a tokenized sentence, as word tuples (coco-caption's precook)."""
    words = sentence.split()
    return Counter(g for k in range(1, 5) for g in zip(*(words[i:] for i in range(k))))


# -----------------------------------------------------------------------------
# BLEU as bleu_scorer.py: clipped n-gram precision summed over the corpus, brevity penalty against the closest
# reference length (ties: the shorter); its tiny/small constants make a zero count ~1e-16 per item.
def bleu(refs_tok, cands_tok):
    """-> ([BLEU-1..4] corpus, {id: [BLEU-1..4]})"""
    guess_total, correct_total, test_total, ref_total, per_item = [0] * 4, [0] * 4, 0, 0, {}
    for i, cand in cands_tok.items():
        ref_counts = [_ngrams(r) for r in refs_tok[i]]
        test_len = len(cand.split())
        ref_len = min((abs(len(r.split()) - test_len), len(r.split())) for r in refs_tok[i])[1]
        guess, correct = [max(0, test_len - k) for k in range(4)], [0] * 4
        for g, c in _ngrams(cand).items():  # clipped at the n-gram's largest count in any one reference
            correct[len(g) - 1] += min(c, max(rc.get(g, 0) for rc in ref_counts))
        per_item[i] = _bleu_from_counts(correct, guess, test_len, ref_len)
        test_total, ref_total = test_total + test_len, ref_total + ref_len
        guess_total = [a + b for a, b in zip(guess_total, guess)]
        correct_total = [a + b for a, b in zip(correct_total, correct)]
    return _bleu_from_counts(correct_total, guess_total, test_total, ref_total), per_item


def _bleu_from_counts(correct, guess, test_len, ref_len, tiny=1e-15, small=1e-9):
    scores, prod = [], 1.0
    for k in range(len(correct)):
        prod *= (correct[k] + tiny) / (guess[k] + small)
        scores.append(prod ** (1.0 / (k + 1)))  # geometric mean of the first k+1 precisions
    ratio = (test_len + tiny) / (ref_len + small)
    return [s * math.exp(1 - 1 / ratio) for s in scores] if ratio < 1 else scores  # brevity penalty exp(1 - r/c)


# -----------------------------------------------------------------------------
# ROUGE-L as rouge.py: LCS precision and recall, each the best over the references, F-measure beta 1.2, mean of items
def _lcs(a, b):
    """The longest common subsequence's length, bit-parallel (Hyyrö 2004): one integer add per token of b."""
    match = defaultdict(int)
    for i, t in enumerate(a):
        match[t] |= 1 << i
    ones = (1 << len(a)) - 1
    v = ones
    for t in b:
        u = v & match[t]
        v = ((v + u) | (v - u)) & ones
    return len(a) - v.bit_count()


def rouge_l(refs_tok, cands_tok, beta=1.2):
    """-> (corpus mean, {id: score})"""
    per_item = {}
    for i, cand in cands_tok.items():
        c = cand.split(" ")  # as coco-caption: an empty candidate is one empty token
        prec, rec = 0.0, 0.0
        for ref in refs_tok[i]:
            r = ref.split(" ")
            lcs = _lcs(r, c)
            prec, rec = max(prec, lcs / len(c)), max(rec, lcs / len(r))
        per_item[i] = (1 + beta ** 2) * prec * rec / (rec + beta ** 2 * prec) if prec > 0 and rec > 0 else 0.0
    return _mean(per_item), per_item


def _mean(per_item):
    return sum(per_item.values()) / max(len(per_item), 1)


# -----------------------------------------------------------------------------
# CIDEr-D as cider_scorer.py: tf-idf of 1..4-grams, document frequencies over the scored items' references; per n
# the cosine with the candidate's weights clipped at the reference's; a Gaussian penalty (sigma 6) on the length
# difference (its "length" counts bigrams); averaged over n and references, x10; the mean of the items.
def cider_d_prepare(refs_tok):
    """What depends on the references alone (document frequencies, their vectors), built once."""
    df = Counter()
    for refs in refs_tok.values():  # a "document" is one item's set of references
        df.update(set().union(*[_ngrams(r) for r in refs]))
    log_items = math.log(len(refs_tok))
    prep = {"idf": {g: log_items - math.log(d) for g, d in df.items()}, "log_items": log_items, "ids": list(refs_tok),
            "vectors": {}}
    prep["refs"] = {i: [_tfidf(r, prep) for r in refs] for i, refs in refs_tok.items()}
    return prep


def _tfidf(sentence, prep):
    """-> ({n-gram: tf * idf}, [norms of the 1..4-gram parts], length in bigrams), once per sentence"""
    if sentence not in prep["vectors"]:
        idf, unseen = prep["idf"], prep["log_items"]  # an n-gram no reference has: df counts as 1
        vec = {g: tf * idf.get(g, unseen) for g, tf in _ngrams(sentence).items()}
        sq = [0.0] * 4
        for g, w in vec.items():
            sq[len(g) - 1] += w * w
        prep["vectors"][sentence] = (vec, [math.sqrt(x) for x in sq], max(len(sentence.split()) - 1, 0))
    return prep["vectors"][sentence]


def _cider_pair(hyp, ref, sigma=6.0):
    (hv, hn, hl), (rv, rn, rl) = hyp, ref
    val = [0.0] * 4
    for g in hv.keys() & rv.keys():
        val[len(g) - 1] += min(hv[g], rv[g]) * rv[g]  # the "-D" clipping
    cos = [v / (hn[k] * rn[k]) if hn[k] != 0 and rn[k] != 0 else v for k, v in enumerate(val)]
    return sum(cos) / 4 * math.exp(-((hl - rl) ** 2) / (2 * sigma ** 2))


def cider_d(refs_tok, cands_tok, prepared=None):
    """-> (corpus mean, {id: score}); prepared: cider_d_prepare(refs_tok), made before."""
    prep = prepared or cider_d_prepare(refs_tok)
    per_item = {}
    for i, cand in cands_tok.items():
        hyp = _tfidf(cand, prep)
        per_item[i] = 10.0 * sum(_cider_pair(hyp, r) for r in prep["refs"][i]) / len(prep["refs"][i])
    return _mean(per_item), per_item


def cider_d_constant(prepared, captions, sigma=6.0):
    """Corpus CIDEr-D of each tokenized caption given for every item, through an inverted index of the references."""
    if "index" not in prepared:  # n-gram -> (reference rows, weights, the rows' norms)
        index, lengths, items = defaultdict(lambda: ([], [], [])), [], []
        for j, i in enumerate(prepared["ids"]):
            for vec, norm, length in prepared["refs"][i]:
                for g, w in vec.items():
                    if w > 0:  # idf 0 adds nothing
                        for lst, x in zip(index[g], (len(lengths), w, norm[len(g) - 1])):
                            lst.append(x)
                lengths.append(length), items.append(j)
        prepared["index"] = {g: tuple(map(np.array, lists)) for g, lists in index.items()}
        prepared["row_len"], prepared["row_item"] = np.array(lengths, dtype=float), np.array(items)
    rows_len, row_item = prepared["row_len"], prepared["row_item"]
    out = []
    for cap in captions:
        hv, hn, hl = _tfidf(cap, prepared)
        per_row = np.zeros(len(rows_len))
        for g, w in hv.items():
            if w > 0 and g in prepared["index"]:
                r, rw, rn = prepared["index"][g]  # distinct rows
                per_row[r] += np.minimum(w, rw) * rw / (hn[len(g) - 1] * rn)
        per_row *= np.exp(-((hl - rows_len) ** 2) / (2 * sigma ** 2)) / 4
        out.append(float((np.bincount(row_item, per_row) / np.bincount(row_item)).mean() * 10.0))
    return out


def constant_baseline(train_captions, refs, fallback=()):
    """The best CIDEr-D of one caption given for every item (of the 5,000 most frequent training
    captions, else `fallback`): a model blind to the images. -> {"caption", "scores" x100, "candidates"}"""
    candidates = [c for c, _ in Counter(map(tokenize, train_captions)).most_common(5000)]
    source = "training captions"
    if not candidates:
        candidates, source = [tokenize(c) for c in fallback], "fixed no-change sentences (no train split)"
    prepared = cider_d_prepare({i: [tokenize(c) for c in r] for i, r in refs.items()})
    per_candidate = cider_d_constant(prepared, candidates)
    best = candidates[max(range(len(candidates)), key=per_candidate.__getitem__)]  # ties: the more frequent
    scores = {k: 100 * v for k, v in evaluate(refs, {i: best for i in refs}).items()}
    return {"caption": best, "scores": scores, "candidates": source}


# -----------------------------------------------------------------------------
# METEOR 1.5 as coco-caption runs it (`meteor-1.5.jar - - -stdio -l en -norm`: task "rank"), ported from the jar's
# classes (edu.cmu.meteor.*), whose names the docstrings give.
ALPHA, BETA, GAMMA, DELTA = 0.85, 0.2, 0.6, 0.75
STAGE_WEIGHTS = (1.0, 0.6, 0.8, 0.6)  # exact, stem, synonym, paraphrase
SEARCH_WEIGHTS = (1.0, 0.5, 0.5, 0.5)  # the aligner's per matched word
BEAM = 40
FUNCTION_WORDS = set(ASSETS.joinpath("english.words").read_text(encoding="utf-8").splitlines())

# Normalizer.normalizeLine (English): the jar's rules in order, but DOTMULTI's (tokenize drops runs of dots)
_ALPHA = "A-Za-z\u0160\u017d\u0161\u017e\u0178\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u017e\u0400-\u0527\ua640-\ua66e" \
         "\ua67e-\ua697\u1d00-\u1d7f"
_ALNUM = "0-9" + _ALPHA
_NORM_RULES = [(re.compile(p, re.ASCII), r) for p, r in [
    (rf"([^{_ALNUM}\s.'`,\-\u2018\u2019])", r" \1 "),  # symbols become tokens
    (r"([^\d]),([^\d])", r"\1 , \2"), (r"(\d),([^\d])", r"\1 , \2"), (r"([^\d]),(\d)", r"\1 , \2"),
    ("([`\u2018\u2019])", "'"), ("([\u201c\u201d]|'')", ' " '), ("\u2013", "-"), ("--", "-"),
    (rf"([{_ALNUM}.])-([{_ALNUM}])", r"\1 \2"),  # t-shirt -> t shirt
    (rf"([^{_ALPHA}])'([^{_ALPHA}])", r"\1 ' \2"), (rf"([^{_ALPHA}\d])'([{_ALPHA}])", r"\1 ' \2"),  # 's -> ' s
    (rf"([{_ALPHA}])'([^{_ALPHA}])", r"\1 ' \2"), (rf"([{_ALPHA}])'([{_ALPHA}])", r"\1 '\2"), (r"(\d)'(s)", r"\1 '\2"),
]]
_NONBREAKING = {"v": 1, "vs": 1, "i.e": 1, "rev": 1, "e.g": 1, "pp": 2}  # nonbreaking/english.prefixes, lower-case


def meteor_normalize(sentence):
    """The jar's -norm of a tokenized sentence -> words: "do n't" -> do n 't, "man 's" -> man ' s"""
    if _PLAIN.fullmatch(sentence):
        return sentence.split()  # no rule applies to plain words
    s = " " + sentence + " "
    for pattern, repl in _NORM_RULES:
        s = pattern.sub(repl, s)
    words, out = s.split(), []
    for j, w in enumerate(words):  # a final period stays only on abbreviations
        nxt = words[j + 1] if j + 1 < len(words) else ""
        if len(w) > 1 and w.endswith("."):
            head, kind = w[:-1], _NONBREAKING.get(w[:-1])
            if "." in head and re.search(f"[{_ALPHA}]", head):
                out.append(w.replace(".", ""))  # u.s. -> us
            elif kind == 1 or re.match("[a-z]", nxt) or (kind == 2 and re.match("[0-9]", nxt)):
                out.append(w)
            else:
                out += [head, "."]
        else:
            out.append(w)
    return [w.lower() for w in out]


_warned = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


@lru_cache(maxsize=None)
def _stemmer():
    try:
        from nltk.stem.snowball import SnowballStemmer  # Snowball English, as the jar's org.tartarus englishStemmer
    except ImportError:
        _warn_once("METEOR: nltk is not installed: stem stage skipped (pip install nltk)")
        return None
    return SnowballStemmer("english").stem


JAR, PARAPHRASE = "meteor-1.5.jar", "paraphrase-en.gz"


def meteor_data():
    """Meteor's files {"jar", "paraphrase"} (None: absent) in $METEOR_DATA, else in pycocoevalcap."""
    folders = [Path(os.environ["METEOR_DATA"])] if os.environ.get("METEOR_DATA") else []
    spec = importlib.util.find_spec("pycocoevalcap")
    folders += [Path(p) / "meteor" for p in spec.submodule_search_locations or ()] if spec else []
    first = lambda name: next((f for d in folders for f in (d / name, d / "data" / name) if f.is_file()), None)
    return {"jar": first(JAR), "paraphrase": first(PARAPHRASE)}


@lru_cache(maxsize=None)
def load_synonyms():
    """The jar's english.synsets and english.exceptions -> (word -> synset ids, irregular form -> base
    forms, where from), or None after a warning."""
    if (jar := meteor_data()["jar"]) is not None:
        with zipfile.ZipFile(jar) as z:
            lines = z.read("synonym/english.synsets").decode("utf-8").splitlines()
            synsets = {w: set(ids.split()) for w, ids in zip(lines[::2], lines[1::2])}
            lines = z.read("synonym/english.exceptions").decode("utf-8").splitlines()
        bases = defaultdict(list)
        for base, forms in zip(lines[::2], lines[1::2]):
            for form in forms.split():
                bases[form].append(base)
        return synsets, dict(bases), f"Meteor 1.5's synonym files in {jar}"
    _warn_once("METEOR: no synonym data (pip install pycocoevalcap): synonym stage skipped, up to 0.007 lower")
    return None


_MORPH = [("s", ""), ("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"), ("men", "man"),
          ("ies", "y"), ("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"),
          ("ing", ""), ("er", ""), ("est", ""), ("er", "e"), ("est", "e")]


def _synonym_sets(word, wordnet):
    """SynonymDictionary: the synsets of the word and of its base form (irregular forms, else suffix rules)."""
    synsets, bases = wordnet
    out = set(synsets.get(word, ()))
    if word in bases:
        for b in bases[word]:
            out |= synsets.get(b, set())
        return out
    ful = "ful" if word.endswith("ful") else ""  # the jar means to strip -ful but only re-appends it (sic)
    if word.endswith("ss") or len(word) <= 2:
        return out
    for suffix, add in _MORPH:
        if word.endswith(suffix) and word[:len(word) - len(suffix)] + add in synsets:
            return out | synsets.get(word[:len(word) - len(suffix)] + add + ful, set())
    return out


def _synonyms(vocab, wordnet):
    sets, words_of = {w: _synonym_sets(w, wordnet) for w in vocab}, defaultdict(set)
    for w, ids in sets.items():
        for x in ids:
            words_of[x].add(w)
    return {w: set().union(*(words_of[x] for x in ids)) - {w} for w, ids in sets.items()}


# The paraphrase table (5.3M entries) is indexed once as word ids in the user's cache: the entries a vocabulary can
# use are then found with numpy, not by a 20 s scan of the text.
def _index_path(table):
    st = Path(table).stat()  # a changed source (path, size or time) gets its own index
    stamp = hashlib.sha1(f"{Path(table).resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clip4idc"
    return cache / f"meteor-paraphrase-{stamp}"


def _smallest_uint(values, n):
    dtype = next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64) if n <= np.iinfo(t).max)
    return np.asarray(values, dtype=dtype)


def build_paraphrase_index(table, out, log_every=1_000_000):
    """paraphrase-en.gz -> folder `out`: words.txt, tokens.npy (each entry's phrase then paraphrase
    as word ids), ends.npy, split.npy (the phrase's length); built aside and renamed into place."""
    out, t0 = Path(out), time.time()
    ids, tokens, ends, split = {}, array("q"), array("q"), array("q")
    with gzip.open(table, "rt", encoding="utf-8") as f:
        for n, (_, a, b) in enumerate(zip(f, f, f), 1):
            a, b = a.split(), b.split()
            tokens.extend([ids.setdefault(w, len(ids)) for w in a + b])
            ends.append(len(tokens))
            split.append(len(a))
            if log_every and n % log_every == 0:
                print(f"METEOR: indexing the paraphrase table once, {n / 1e6:.0f}M entries in {time.time() - t0:.0f}s",
                      file=sys.stderr, flush=True)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide a shared cache
    except OSError as e:
        raise OSError(f"cannot write METEOR's paraphrase index under {out.parent} ({e}): set XDG_CACHE_HOME to a "
                      "writable folder") from e
    (tmp / "words.txt").write_text("\n".join(ids), encoding="utf-8")
    for name, values in (("tokens", _smallest_uint(tokens, len(ids))), ("ends", _smallest_uint(ends, len(tokens))),
                         ("split", _smallest_uint(split, max(split, default=0)))):
        np.save(tmp / f"{name}.npy", values)
    try:
        os.rename(tmp, out)  # another process's, finished first, stays
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "split.npy").is_file():
            raise
    if log_every:
        print(f"METEOR: paraphrase index ({len(ends):,} entries, {len(ids):,} words) built in {time.time() - t0:.0f}s"
              f" -> {out}", file=sys.stderr, flush=True)
    return out


def _paraphrase_index(table):
    """`table`'s index, built on first use, mapped: (words, word -> id, tokens, starts, ends, split)."""
    folder = _index_path(table)
    if not (folder / "split.npy").is_file():
        build_paraphrase_index(table, folder)
    return _open_index(folder)


@lru_cache(maxsize=2)
def _open_index(folder):
    words = (folder / "words.txt").read_text(encoding="utf-8").split("\n")
    tokens, ends, split = (np.load(folder / f"{n}.npy", mmap_mode="r") for n in ("tokens", "ends", "split"))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return words, {w: i for i, w in enumerate(words)}, tokens, starts, ends, split


def load_paraphrases(path, vocab):
    """The table's entries whose words all occur in `vocab`, in order -> {phrase tuple: [paraphrase tuple, ...]}"""
    words, word_id, tokens, starts, ends, split = _paraphrase_index(str(path))
    known = np.zeros(len(words), dtype=bool)
    known[[word_id[w] for w in vocab if w in word_id]] = True
    table = defaultdict(list)
    for e in np.flatnonzero(np.logical_and.reduceat(known[tokens], starts)).tolist():
        entry = [words[i] for i in tokens[starts[e]:ends[e]].tolist()]
        table[tuple(entry[:split[e]])].append(tuple(entry[split[e]:]))
    return dict(table)


def _candidate_matches(hyp, ref, sources):
    """Every stage's matches (Exact/Stem/Synonym/ParaphraseMatcher, the jar's order) by start in the reference,
    and how many cover each word. A match: (stage, ref start, ref length, hyp start, hyp length, hyp bitmask,
    ref bitmask, what the beam search counts for it)."""
    at, cov_h, cov_r = [[] for _ in ref], [0] * len(hyp), [0] * len(ref)

    def add(stage, s, ln, ms, ml):
        w = SEARCH_WEIGHTS[stage]
        at[s].append((stage, s, ln, ms, ml, ((1 << ml) - 1) << ms, ((1 << ln) - 1) << s, int(ml * w) + int(ln * w)))
        for x in range(ms, ms + ml):
            cov_h[x] += 1
        for x in range(s, s + ln):
            cov_r[x] += 1

    stems, synonyms, para = sources
    if hyp == ref:  # the jar runs the exact stage only
        stems = synonyms = para = None
    keyed = [(0, hyp, ref)] + ([(1, [stems[w] for w in hyp], [stems[w] for w in ref])] if stems else [])
    for stage, hyp_keys, ref_keys in keyed:  # same word; then same stem, different word
        where = defaultdict(list)
        for j, k in enumerate(hyp_keys):
            where[k].append(j)
        for i, k in enumerate(ref_keys):
            for j in where.get(k, ()):
                if stage == 0 or hyp[j] != ref[i]:
                    add(stage, i, 1, j, 1)
    for i, r in enumerate(ref) if synonyms else ():  # different words, one synset
        for j, h in enumerate(hyp) if synonyms[r] else ():
            if h in synonyms[r]:
                add(2, i, 1, j, 1)
    if para:  # phrases of the reference paraphrased in the hypothesis, then the other way round
        para, longest = para  # the most words of any phrase in the table
        for a, b, swap in ((ref, hyp, False), (hyp, ref, True)):
            starts = defaultdict(list)  # each phrase of b -> where it starts, in order
            for m in range(len(b)):
                for length in range(1, min(longest, len(b) - m) + 1):
                    starts[tuple(b[m:m + length])].append(m)
            for k in range(len(a)):
                for length in range(1, min(longest, len(a) - k) + 1):
                    for p in para.get(tuple(a[k:k + length]), ()):
                        for m in starts.get(p, ()):
                            add(3, m, len(p), k, length) if swap else add(3, k, length, m, len(p))
    return at, cov_h, cov_r


_BEAM_ORDER = itemgetter(0, 1, 2)


def _align(hyp, ref, sources):
    """Aligner.align + resolve: the uncontested matches fixed, then a beam search over reference positions for the
    most matched words (SEARCH_WEIGHTS, truncated to int), then fewest chunks, then least distance -> matches"""
    at, cov_h, cov_r = _candidate_matches(hyp, ref, sources)
    fixed, used_h, used_r = {}, 0, 0
    for i, ms in enumerate(at):
        if len(ms) == 1:
            m = ms[0]
            if all(cov_r[x] == 1 for x in range(i, i + m[2])) and all(cov_h[x] == 1 for x in range(m[3], m[3] + m[4])):
                fixed[i], used_h, used_r = m, used_h | m[5], used_r | m[6]
    if len(fixed) == sum(map(len, at)):
        return list(fixed.values())  # nothing to choose
    # (-score, chunks, distance, next ref position, hyp end of the last match, used hyp, used ref, chosen matches);
    # each step sorts stably on the first three and keeps BEAM, as the jar
    beam = [(0, 0, 0, 0, -1, used_h, used_r, ())]
    for i in range(len(ref) + 1):
        prev, beam = sorted(beam, key=_BEAM_ORDER)[:BEAM] if len(beam) > 1 else beam, []
        for neg, chunks, dist, idx, last, uh, ur, chosen in prev:
            if i == len(ref):
                beam.append((neg, chunks + (last != -1), dist, idx, last, uh, ur, chosen))
            elif ur >> i & 1:  # covered by an earlier multi-word match, or a fixed one starting here
                if i < idx:
                    beam.append((neg, chunks, dist, idx, last, uh, ur, chosen))
                elif idx in fixed:
                    _, s, ln, ms, ml, _, _, gain = fixed[idx]
                    beam.append((neg - gain, chunks + (last != -1 and ms != last), dist + abs(s - ms), s + ln, ms + ml,
                                 uh, ur, chosen))
            else:
                for m in at[i]:  # extend with each candidate that fits ...
                    _, s, ln, ms, ml, mh, mr, gain = m
                    if not (uh & mh or ur & mr):
                        beam.append((neg - gain, chunks + (last != -1 and ms != last), dist, s + ln, ms + ml, uh | mh,
                                     ur | mr, chosen + (m,)))
                        dist += abs(s - ms)  # the jar adds the child's distance to the parent (sic)
                beam.append((neg, chunks + (last != -1), dist, idx + 1, -1, uh, ur, chosen))  # ... or leave i open
    return list(fixed.values()) + list(min(beam, key=_BEAM_ORDER)[7])


def _meteor_stats(hyp, ref, sources):
    """MeteorScorer.getMeteorStats, the jar's 23: hyp and ref lengths, their function words, per stage matched
    (hyp content, ref content, hyp function, ref function) words, chunks, hyp and ref matched words."""
    matches = {m[1]: m for m in _align(hyp, ref, sources)}  # by ref start
    st = [len(hyp), len(ref), sum(w in FUNCTION_WORDS for w in hyp), sum(w in FUNCTION_WORDS for w in ref)] + [0] * 19
    for stage, s, ln, ms, ml, *_ in matches.values():
        for w in hyp[ms:ms + ml]:
            st[4 + 4 * stage + (2 if w in FUNCTION_WORDS else 0)] += 1
        for w in ref[s:s + ln]:
            st[5 + 4 * stage + (2 if w in FUNCTION_WORDS else 0)] += 1
    chunks, i, end = 0, 0, -1  # Aligner.getCountAndChunks
    while i < len(ref):
        if i in matches:
            _, s, ln, ms, ml, *_ = matches[i]
            chunks += end != -1 and ms != end
            i, end = s + ln, ms + ml
        else:
            chunks, i, end = chunks + (end != -1), i + 1, -1
    chunks += end != -1
    st[20], st[21], st[22] = chunks, sum(st[4:20:2]), sum(st[5:20:2])
    return st


def _meteor_score(st):
    """MeteorScorer.computeMetrics: precision, recall (function words weigh 1 - DELTA), their ALPHA-weighted
    harmonic mean, times 1 - GAMMA * (chunks / matches) ** BETA."""
    t_w = sum(STAGE_WEIGHTS[k] * (DELTA * st[4 + 4 * k] + (1 - DELTA) * st[6 + 4 * k]) for k in range(4))
    r_w = sum(STAGE_WEIGHTS[k] * (DELTA * st[5 + 4 * k] + (1 - DELTA) * st[7 + 4 * k]) for k in range(4))
    if t_w == 0 or r_w == 0:
        return 0.0  # the jar's NaN, reported 0
    p = t_w / (DELTA * (st[0] - st[2]) + (1 - DELTA) * st[2])
    r = r_w / (DELTA * (st[1] - st[3]) + (1 - DELTA) * st[3])
    fmean = 1.0 / ((1 - ALPHA) / p + ALPHA / r)
    frag = 0.0 if _perfect(st) else st[20] / ((st[21] + st[22]) / 2)
    return max(fmean * (1 - GAMMA * frag ** BETA), 0.0)


def _perfect(st):
    return sum(st[4:20:2]) == st[0] and sum(st[5:20:2]) == st[1] and st[20] == 1


def meteor(refs_tok, cands_tok, paraphrase=None):
    """-> (the corpus score of the summed statistics, {id: score}), each item's best reference. paraphrase:
    paraphrase-en.gz, None: meteor_data()'s, False: no such stage."""
    norm = {s: meteor_normalize(s) for s in {*cands_tok.values(), *(r for i in cands_tok for r in refs_tok[i])}}
    vocab = {w for words in norm.values() for w in words}
    stemmer, synonyms = _stemmer(), load_synonyms()
    path = meteor_data()["paraphrase"] if paraphrase is None else paraphrase
    if path is None:
        _warn_once("METEOR: no paraphrase table (pip install pycocoevalcap): paraphrase stage skipped, up to 0.010 "
                   "lower")
    sources = ({w: stemmer(w) for w in vocab} if stemmer else None,
               _synonyms(vocab, synonyms[:2]) if synonyms else None, None)
    if path and (para := load_paraphrases(path, vocab)):
        sources = (*sources[:2], (para, max(len(x) for k, v in para.items() for x in (k, *v))))
    total, per_item, cache = [0.0] * 23, {}, {}
    for i, cand in cands_tok.items():
        best, best_score = None, -1.0
        for ref in refs_tok[i]:
            if (cand, ref) not in cache:  # templated data repeats pairs
                st = _meteor_stats(norm[cand], norm[ref], sources)
                cache[cand, ref] = (st, _meteor_score(st))
            st, score = cache[cand, ref]
            if score > best_score:
                best, best_score = st, score
        per_item[i] = best_score
        for k in range(23):  # MeteorStats.addStats: a perfect segment adds no chunk
            if k != 20 or not _perfect(best):
                total[k] += best[k]
    return _meteor_score(total), per_item


# -----------------------------------------------------------------------------
def _check(refs, cands):
    """Same ids, strings only, a reference at least each, or an error."""
    if not isinstance(refs, dict) or not isinstance(cands, dict):
        raise TypeError("refs must be {id: [sentence, ...]} and cands {id: sentence}")
    if not cands:
        raise ValueError("no candidates to score")
    missing, unused = [i for i in cands if i not in refs], [i for i in refs if i not in cands]
    if missing or unused:
        raise ValueError(f"refs and cands must have the same ids: {len(missing)} candidates have no references "
                         f"(e.g. {missing[:3]}), {len(unused)} references no candidate (e.g. {unused[:3]})")
    out = {}
    for i, c in cands.items():
        if isinstance(c, (list, tuple)) and len(c) == 1:  # coco-caption's {id: [caption]}
            c = c[0]
        if not isinstance(c, str):
            raise TypeError(f"candidate {i!r} must be a string, got {type(c).__name__}: {c!r}")
        r = refs[i]
        if isinstance(r, str) or not isinstance(r, (list, tuple)) or not r or not all(isinstance(s, str) for s in r):
            raise TypeError(f"references of {i!r} must be a non-empty list of strings, got {r!r}")
        out[i] = c
    return out


def evaluate(refs, cands, per_item=False, paraphrase=None):
    """refs {id: [sentence, ...]}, cands {id: sentence} -> {"BLEU-1": ..., "CIDEr-D": ...} (per_item: and
    {metric: {id: score}}); empty sentences score as coco-caption's, said once."""
    cands = _check(refs, cands)
    tok = {s: tokenize(s) for s in {*cands.values(), *(r for i in cands for r in refs[i])}}
    cands_tok = {i: tok[c] for i, c in cands.items()}
    refs_tok = {i: [tok[r] for r in refs[i]] for i in cands}
    n_empty_c, n_empty_r = sum(not c for c in cands_tok.values()), sum(not r for rs in refs_tok.values() for r in rs)
    if n_empty_c or n_empty_r:
        warnings.warn(f"{n_empty_c} empty candidates (score 0) and {n_empty_r} empty references after tokenization",
                      stacklevel=2)
    b, b_items = bleu(refs_tok, cands_tok)
    corpus = {f"BLEU-{k + 1}": b[k] for k in range(4)}
    items = {f"BLEU-{k + 1}": {i: s[k] for i, s in b_items.items()} for k in range(4)}
    corpus["METEOR"], items["METEOR"] = meteor(refs_tok, cands_tok, paraphrase)
    corpus["ROUGE-L"], items["ROUGE-L"] = rouge_l(refs_tok, cands_tok)
    corpus["CIDEr-D"], items["CIDEr-D"] = cider_d(refs_tok, cands_tok)
    return (corpus, items) if per_item else corpus


def json_file(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path} as JSON ({type(e).__name__}: {e})") from None


def a_file(path):
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"nothing at {path}")
    return path


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="coco-caption metrics in pure Python (printed x100, as papers do)")
    parser.add_argument("--refs", type=json_file, required=True, help="JSON file {id: [reference sentence, ...]}")
    parser.add_argument("--cands", type=json_file, required=True, help="JSON file {id: candidate sentence}")
    parser.add_argument("--paraphrase", type=a_file, help="Meteor's paraphrase-en.gz (default: $METEOR_DATA's, "
                                                          "else pycocoevalcap's)")
    return parser, parser.parse_args(argv)


if __name__ == "__main__":
    parser, args = get_args()
    try:
        scores = evaluate(args.refs, args.cands, paraphrase=args.paraphrase)
    except (TypeError, ValueError) as e:  # _check's
        parser.error(f"argument --refs/--cands: {e}")
    print(" | ".join(f"{m:>7s}" for m in METRICS))
    print(" | ".join(f"{100 * scores[m]:7.2f}" for m in METRICS))

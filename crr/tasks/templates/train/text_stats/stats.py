"""Word and sentence statistics."""

from .tokens import sentences, words


def word_frequencies(text, top=3):
    """The `top` most frequent words as (word, count), ties broken alphabetically."""
    counts = {}
    for w in words(text):
        counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:top]


def average_word_length(text):
    ws = words(text)
    if not ws:
        return 0.0
    return sum(len(w) for w in ws) / len(ws)


def average_sentence_length(text):
    """Mean number of words per sentence."""
    ss = sentences(text)
    if len(ss) == 0:
        return 0.0
    return len(words(text)) / len(ss)


def lexical_density(text, stopwords=("the", "a", "an", "and", "of", "to")):
    """Share of words that are not stopwords, to three decimals."""
    ws = words(text)
    if not ws:
        return 0.0
    content = [w for w in ws if w not in stopwords]
    return round(len(content) / len(ws), 3)


def longest_word(text):
    """The first longest word."""
    best = ""
    for w in words(text):
        if len(w) > len(best):
            best = w
    return best

"""Incremental detokenization and stop strings over real tokenizer output."""
import random

import pytest

from loraplex.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "美国的首都在哪里? \n答案: 华盛顿",
    "アメリカ合衆国の首都はどこですか? \n答え: ワシントン D.C.",
    "The capital of France is Paris. Ünïcödé — ok 🙂 done",
    "混合 mixed テキスト with spaces  and\ttabs\n\n",
]


def _decode(tok):
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_join_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(len(ids))
    detok = IncrementalDetokenizer(_decode(tokenizer))
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)  # compute sends one or a few tokens per message
        pieces.append(detok.push(ids[i:i + n]))
        i += n
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    for p in pieces:
        assert REPLACEMENT_CHAR not in p
        p.encode("utf-8")  # every piece is valid UTF-8 on its own


def test_single_tokens_of_a_cjk_character_emit_nothing_until_complete(tokenizer):
    ids = tokenizer.encode("首", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character that spans several tokens"
    detok = IncrementalDetokenizer(_decode(tokenizer))
    assert [detok.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "首"


def test_prompt_context_keeps_the_leading_space(tokenizer):
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    out = tokenizer.encode(" Paris", add_special_tokens=False)
    detok = IncrementalDetokenizer(_decode(tokenizer), prompt_ids=prompt)
    assert detok.push(out) + detok.flush() == " Paris"


def test_flush_releases_an_incomplete_tail(tokenizer):
    ids = tokenizer.encode("首", add_special_tokens=False)
    detok = IncrementalDetokenizer(_decode(tokenizer))
    assert detok.push(ids[:1]) == ""
    assert detok.flush() != ""  # the stream ended: what is left is sent, not lost


def _run_stop(stop, pieces):
    m = StopStringMatcher(stop)
    out = []
    for p in pieces:
        text, stopped = m.push(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def _split_randomly(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_stop_strings_match_across_pieces():
    rng = random.Random()
    for _ in range(2000):
        alphabet = "abc東京"
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        got, stopped = _run_stop(stops, _split_randomly(text, rng))
        # Oracle: read one character at a time; stop where a stop string first completes.
        want = None
        for end in range(1, len(text) + 1):
            done = [s for s in stops if text[:end].endswith(s)]
            if done:
                want = text[:end - max(len(s) for s in done)]
                break
        if want is not None:
            assert stopped and got == want, (text, stops)
        else:
            assert not stopped and got == text


def test_stop_text_is_never_emitted_before_the_match_is_decided():
    m = StopStringMatcher(["\nUser:"])
    assert m.push("Hello\nUs") == ("Hello", False)  # "\nUs" could begin the stop string
    assert m.push("ual") == ("\nUsual", False)       # it did not
    assert m.push(" end\nUser: more") == (" end", True)
    assert m.matched == "\nUser:"
    assert m.push("after") == ("", True)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])

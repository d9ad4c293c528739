"""StopMatcher: stop strings across token boundaries, hold-back, flush, and a randomized property check."""

from __future__ import annotations

import random

import pytest

from hmad.engine.stopping import StopMatcher


def _run(stops: list[str], pieces: list[str]) -> tuple[str, bool, list[str]]:
    """Feed every piece (stopping at a hit, as the engine does); return (emitted text, hit, per-feed out)."""
    m = StopMatcher(stops)
    outs: list[str] = []
    for piece in pieces:
        out, hit = m.feed(piece)
        outs.append(out)
        if hit:
            return "".join(outs), True, outs
    outs.append(m.flush())
    return "".join(outs), False, outs


def test_no_stops_passes_pieces_straight_through():
    m = StopMatcher([])
    assert m.feed("hello") == ("hello", False)
    assert m.feed(" world") == (" world", False)
    assert m.flush() == ""


def test_stop_inside_one_piece():
    assert _run(["END"], ["abcENDxyz"])[:2] == ("abc", True)


def test_stop_spanning_many_pieces():
    text, hit, outs = _run(["<end_of_turn>"], ["Hi", " there", "<", "end", "_of", "_", "turn", ">", "more"])
    assert (text, hit) == ("Hi there", True)
    assert outs[2:7] == ["", "", "", "", ""]  # held while the stop could still be forming


def test_stop_at_start():
    assert _run(["###"], ["###", "rest"])[:2] == ("", True)
    assert _run(["###"], ["#", "#", "#"])[:2] == ("", True)


def test_text_is_held_then_released_when_disambiguated():
    m = StopMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("RM") == ("STORM", False)


def test_held_text_is_released_by_flush():
    m = StopMatcher(["</s>"])
    assert m.feed("done </") == ("done ", False)
    assert m.flush() == "</"
    assert m.flush() == ""


def test_overlapping_candidate_aab_in_aaab():
    assert _run(["aab"], ["a", "a", "a", "b", "c"])[:2] == ("a", True)
    assert _run(["aab"], ["aaab"])[:2] == ("a", True)
    assert _run(["aab"], ["aa", "ab"])[:2] == ("a", True)


def test_piece_ends_one_candidate_and_starts_another():
    # "xy" begins like "xyz" but the piece "yx" breaks it and starts "xyz" again.
    m = StopMatcher(["xyz"])
    assert m.feed("ax") == ("a", False)
    assert m.feed("yx") == ("xy", False)
    assert m.feed("yz!") == ("", True)


def test_multiple_stops_earliest_wins():
    text, hit, _ = _run(["world", "lo w"], ["hel", "lo wor", "ld"])
    assert (text, hit) == ("hel", True)


def test_matched_names_the_stop_and_later_calls_are_empty():
    m = StopMatcher(["\n\n", "User:"])
    assert m.feed("Answer.\nUser:") == ("Answer.\n", True)
    assert m.matched == "User:" and m.hit
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_unicode_stops_and_text():
    text, hit, _ = _run(["。终", "🛑"], ["你好", "。", "终止", "后面"])
    assert (text, hit) == ("你好", True)
    assert _run(["🛑"], ["é🛑", "x"])[:2] == ("é", True)
    assert _run(["日本"], ["日", "日", "语"])[:2] == ("日日语", False)


def test_hold_back_is_bounded_by_longest_stop():
    stops = ["abcdef", "zz"]
    m = StopMatcher(stops)
    emitted = ""
    for ch in "abcdeabcdeabcdezabcde":
        out, _ = m.feed(ch)
        emitted += out
        assert len(m._held) <= max(map(len, stops)) - 1


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])


def _random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, max(0, len(text) - 1)))) if text else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _expected(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Reference by str.find: generation ends at the first piece after which the text holds a stop;
    the output is that text up to the first occurrence of any stop in it (pieces after are never made).
    """
    text = ""
    for piece in pieces:
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@pytest.mark.parametrize("seed", range(5))
def test_random_texts_emit_exactly_text_before_first_stop(seed):
    rng = random.Random(seed)
    alphabet = "ab\né"  # tiny alphabet => many partial and overlapping matches
    for _ in range(400):
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
        pieces = _random_split(rng, text)
        got, hit, _ = _run(stops, pieces)
        assert (got, hit) == _expected(stops, pieces), (stops, pieces)
        if not hit:  # no stop anywhere: everything comes out, nothing is lost in hold-back
            assert got == text


def test_random_whole_text_in_one_piece_matches_str_find():
    rng = random.Random(42)
    for _ in range(500):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 30)))
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        assert _run(stops, [text])[:2] == ((text[: min(hits)], True) if hits else (text, False))


def test_completed_stop_ends_stream_even_if_an_earlier_one_is_still_forming():
    # "é" completes at piece 2 while "aéb" (starting earlier) is only partial: stop now, as llama.cpp does.
    assert _run(["aéb", "é"], ["a", "é", "b"])[:2] == ("a", True)
    assert _run(["aéb", "é"], ["aéb"])[:2] == ("", True)

"""When a completion ends and what text the client sees (``serving.stopping``): pure, no model."""

from __future__ import annotations

import pytest

from fusionnet.serving.stopping import StopRule, StopTracker

pytestmark = pytest.mark.timeout(30)


class ByteTokens:
    """A byte-level tokenizer: token i is byte i, decoded as UTF-8 with replacement characters (what a
    BPE tokenizer does with half a character)."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return list(text.encode())


def run(tracker: StopTracker, tokens: list[int]) -> str:
    """Feeds tokens until the choice ends; the text streamed, pieces concatenated."""
    streamed = ""
    for t in tokens:
        streamed += tracker.push(t).text
        if tracker.finish_reason is not None:
            return streamed
    return streamed + tracker.finish().text


def test_an_end_of_text_id_ends_the_choice_and_is_not_part_of_it() -> None:
    rule = StopRule.of([0], None, None, ignore_eos=False)
    tracker = StopTracker(rule, ByteTokens())
    assert run(tracker, [*encode("hi"), 0, *encode("more")]) == "hi"
    assert (tracker.tokens, tracker.text, tracker.finish_reason, tracker.generated) == (
        encode("hi"),
        "hi",
        "stop",
        3,
    )
    ignoring = StopTracker(StopRule.of([0], None, None, ignore_eos=True), None)
    run(ignoring, [5, 0, 6])
    assert (ignoring.tokens, ignoring.finish_reason, ignoring.text) == ([5, 0, 6], "length", "")


def test_stop_token_ids_work_without_a_tokenizer_and_despite_ignore_eos() -> None:
    tracker = StopTracker(StopRule.of([0], [7, 9], None, ignore_eos=True), None)
    run(tracker, [1, 0, 9, 4])
    assert (tracker.tokens, tracker.finish_reason, tracker.generated) == ([1, 0], "stop", 3)


@pytest.mark.parametrize("stop", ["\n\n", ["END", "\n\n"]])
def test_a_stop_string_cuts_the_text_and_no_part_of_it_is_streamed(stop: str | list[str]) -> None:
    tracker = StopTracker(StopRule.of([], None, stop, ignore_eos=False), ByteTokens())
    tokens = encode("one\ntwo\n\nthree")
    streamed = ""
    for t in tokens:
        piece = tracker.push(t)
        streamed += piece.text
        assert "\n\n" not in streamed and not streamed.endswith("\n"), streamed  # "\n" may start a stop
        if tracker.finish_reason:
            break
    assert streamed == tracker.text == "one\ntwo"
    assert tracker.finish_reason == "stop"
    assert tracker.tokens == encode("one\ntwo\n\n")  # the ids keep every token generated


def test_a_held_back_tail_that_is_no_stop_comes_out_later_and_at_the_end() -> None:
    tracker = StopTracker(StopRule.of([], None, ["abc"], ignore_eos=False), ByteTokens())
    assert tracker.push(ord("x")).text == "x"
    assert tracker.push(ord("a")).text == ""  # could be the start of "abc"
    assert tracker.push(ord("b")).text == ""
    assert tracker.push(ord("x")).text == "abx"  # it was not
    assert tracker.push(ord("a")).text == ""
    assert tracker.finish().text == "a" and tracker.finish_reason == "length"
    assert tracker.text == "xabxa"


def test_half_a_character_waits_for_the_rest() -> None:
    tracker = StopTracker(StopRule(), ByteTokens())
    snowman = encode("☃")  # three bytes
    assert [tracker.push(b).text for b in [*encode("a"), *snowman]] == ["a", "", "", "☃"]
    assert run(StopTracker(StopRule(), ByteTokens()), encode("é and ü")) == "é and ü"


def test_a_stop_string_split_over_tokens_and_found_late_in_a_long_text() -> None:
    text = "x" * 500 + "STOP" + "y" * 10
    tracker = StopTracker(StopRule.of([], None, "STOP", ignore_eos=False), ByteTokens())
    assert run(tracker, encode(text)) == "x" * 500 and tracker.finish_reason == "stop"
    assert len(tracker.tokens) == 504

"""The live text of a streamed reply (services/endpoint/streaming.py) over adversarial splits: a marker split
across deltas, text that looks like a marker's start but is not, stop strings, whitespace a call format strips,
multi-byte characters split across tokens. What is released is always a prefix of the finished reply's content."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dockyard.agents.tool_formats import call_markers, parse
from services.endpoint.reasoning import split
from services.endpoint.streaming import Holdback, IncrementalDecoder, StreamDiverged, Thinking, held_markers
from tests.unit.endpoint.scripted import CALL, OA_TOOLS

MARKER = "<tool_call>"


def released_steps(hold: Holdback, pieces: list[str]) -> list[str]:
    return [hold.push(piece) for piece in pieces]


def splits(text: str, rng: random.Random, parts: int) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(parts, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("cut", range(1, len("Sure. " + MARKER)))
def test_a_marker_split_anywhere_is_never_shown(cut: int) -> None:
    text = "Sure. " + CALL
    hold = Holdback(call_markers("hermes"), strip=True)
    first, then = released_steps(hold, [text[:cut], text[cut:]])
    assert first == text[: min(cut, 5)].rstrip()  # up to the marker's possible start, trailing space held
    shown = first + then
    assert shown == "Sure."
    parsed = parse("hermes", text, OA_TOOLS)
    assert parsed.tool_calls and shown + hold.finish(parsed.content) == parsed.content == "Sure."


def test_text_that_only_looks_like_a_marker_start_is_shown_once_it_departs() -> None:
    hold = Holdback((MARKER,))
    assert hold.push("a <tool") == "a "  # could still become the marker
    assert hold.push("_cal") == ""
    assert hold.push("m and <") == "<tool_calm and "  # it did not: all of it shows, but a new "<"
    assert hold.push("b") == "<b"
    assert hold.finish("a <tool_calm and <b") == ""


def test_a_stop_string_is_held_and_the_reply_cuts_it() -> None:
    markers, strip = held_markers("hermes", None, ["END"])
    assert (markers, strip) == (("END",), False)  # no tools: no call markers, no whitespace rule
    hold = Holdback(markers, strip)
    assert released_steps(hold, ["ab ", "E", "N", "D"]) == ["ab ", "", "", ""]
    assert hold.finish("ab ") == ""  # the reply's content without the stop string


def test_whitespace_a_call_format_may_strip_is_held() -> None:
    hold = Holdback((MARKER,), strip=True)
    assert released_steps(hold, ["one ", " two\n", "three"]) == ["one", "  two", "\nthree"]
    leading = Holdback((MARKER,), strip=True)
    assert released_steps(leading, ["\n hi", " there"]) == ["", ""]  # kept or stripped: known at the end only
    assert leading.finish("\n hi there") == "\n hi there"


def test_a_format_that_cannot_be_read_early_shows_nothing_before_the_end() -> None:
    assert call_markers("transformers") is None
    markers, _ = held_markers("transformers", OA_TOOLS, [])
    hold = Holdback(markers)
    assert released_steps(hold, ["plain", " text"]) == ["", ""]
    assert hold.finish("plain text") == "plain text"
    assert held_markers("transformers", None, ["x"]) == (("x",), False)  # no tools: no calls to wait for


def test_finishing_with_content_the_stream_did_not_begin_is_refused() -> None:
    hold = Holdback(())
    hold.push("abc")
    with pytest.raises(StreamDiverged, match="abc"):
        hold.finish("abd")


@pytest.mark.parametrize(
    "text",
    [
        "hello there",
        CALL,
        "Let me add. " + CALL + " done",
        "  leading " + CALL,
        "x < y <tool_ <tool_call>{not json</tool_call>",
        "<tool_call>" + CALL,
        "trailing spaces   \n",
        "\n\n" + CALL + "\n",
        "half <tool_call",
    ],
)
def test_released_text_is_always_a_prefix_of_the_reply_over_random_splits(text: str) -> None:
    rng = random.Random(text)
    parsed = parse("hermes", text, OA_TOOLS)
    for _ in range(60):
        hold = Holdback(call_markers("hermes"), strip=True)
        shown = ""
        for piece in splits(text, rng, rng.randint(1, 8)):
            shown += hold.push(piece)
            assert parsed.content.startswith(shown), (shown, parsed.content)
        assert shown + hold.finish(parsed.content) == parsed.content


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte: every non-ASCII character is split across tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_multi_byte_characters_are_never_broken() -> None:
    tokenizer = byte_level_tokenizer()
    text = "héllo ✓ 日本語 😀!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # one token per byte
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert [p for p in pieces if p] == list(text)  # each character shows whole, once its last byte came


def test_the_decoder_over_random_groups_of_tokens() -> None:
    tokenizer = byte_level_tokenizer()
    text = "a€b 𝄞 ünïcödé ✓✓ x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(3)
    for _ in range(40):
        decoder, shown, at = IncrementalDecoder(tokenizer), "", 0
        while at < len(ids):
            step = rng.randint(1, 4)
            shown += decoder.push(ids[at : at + step])
            at += step
            assert "\ufffd" not in shown and text.startswith(shown)
        assert shown == text


@pytest.mark.parametrize("opened", [False, True])
def test_a_thinking_block_streams_as_reasoning_cut_exactly_as_the_finished_reply(opened: bool) -> None:
    texts = [
        "<think>\nadd them\n</think>\n\nthree",
        "  <think>a b</think>x y",
        "<think></think>answer",
        "<think> never closed </th",
        "plain text, no block",
        "<thi",
        "\n\n",
        "reasoning without an opening tag</think>  answer",
    ]
    rng = random.Random(5)
    for text in texts:
        reasoning, content = split(text, opened)
        for _ in range(30):
            thinking, shown, given, at = Thinking(opened), "", "", 0
            while at < len(text):
                k = rng.randint(1, 5)
                thought, rest = thinking.push(text[at : at + k])
                assert (reasoning or "").startswith(shown + thought), (text, shown, thought)
                shown, given, at = shown + thought, given + rest, at + k
            assert shown + thinking.finish(reasoning) == (reasoning or "")
            assert thinking.block == (reasoning is not None)
            # What goes on as content begins the finished reply's content (the rest comes with its finish).
            assert content.startswith(given), (text, given, content)

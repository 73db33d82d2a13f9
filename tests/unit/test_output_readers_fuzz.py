"""The output readers (thinking, and each tool call syntax) on random text built from pieces
of their own markers and JSON: whatever the chunking, a stream reads as the whole text does,
and nothing the model wrote is lost (text that is not a call stays in the content). Hypothesis
draws the texts and the cuts."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.reasoning import ThinkReader
from deployments.tool_parsers import HermesReader, Llama3JsonReader, MistralReader

NAMES = frozenset({"f", "get_weather"})
CALL = json.dumps({"name": "f", "arguments": {"a": 1}})
PIECES = [
    "<tool_call>", "</tool_call>", "<tool", "_call>", "</think>", "<think>", "<thi", "[TOOL_CALLS]",
    "[ARGS]", CALL, '{"name": "f", "parameters": {}}', ";", "{", "}", '"', "\n", " ", "  ",
    "hello", "f", "get_weather", "[", "]", "<|python_tag|>", "é", "🤖",
    f"<tool_call>{CALL}</tool_call>", f"<tool_call>\n{CALL}\n</tool_call>\n",
    f"[TOOL_CALLS][{CALL}]", "[TOOL_CALLS]f[ARGS]{}", "<think>a b</think>\n\n",
]  # fmt: skip
texts = st.lists(st.sampled_from(PIECES), max_size=14).map("".join)
READERS = [
    lambda: HermesReader(NAMES),
    lambda: Llama3JsonReader(NAMES),
    lambda: MistralReader(NAMES),
]


def is_subsequence(part: str, whole: str) -> bool:
    rest = iter(whole)
    return all(char in rest for char in part)


def chunks_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def calls_read(make, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    reader = make()
    content, calls = [], []
    for piece in [*pieces, None]:
        parsed = reader.feed(piece) if piece is not None else reader.finish()
        content.append(parsed.content)
        calls += [(c.name, c.arguments) for c in parsed.calls]
    return "".join(content), calls


@settings(max_examples=1500, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_call_readers_read_any_chunking_as_the_whole(text, cuts) -> None:
    for make in READERS:
        whole = calls_read(make, [text])
        assert calls_read(make, chunks_of(text, cuts)) == whole
        content, calls = whole
        if not calls:  # no call: the text exactly as the model wrote it
            assert content == text
        else:  # every call is a tool's; the content invents nothing (calls and the
            # whitespace around them removed, the rest in order)
            assert all(name in NAMES for name, _ in calls)
            assert is_subsequence("".join(content.split()), "".join(text.split()))


@settings(max_examples=1500, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 200), max_size=8), opened=st.booleans())
def test_thinking_reads_any_chunking_as_the_whole(text, cuts, opened) -> None:
    def split(pieces: list[str]) -> tuple[str, str]:
        reader = ThinkReader(opened)
        parts = [reader.feed(p) for p in pieces] + [reader.finish()]
        return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)

    reasoning, content = split([text])
    assert split(chunks_of(text, cuts)) == (reasoning, content)
    if not opened and not text.lstrip().startswith("<think>"):
        assert (reasoning, content) == ("", text)  # no thinking: all answer, as written
    assert reasoning in text and content in text

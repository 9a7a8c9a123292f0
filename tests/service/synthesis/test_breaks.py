"""The ``<break>`` tag scanner (service/synthesis/breaks.py): the SSML subset docs/API.md states,
malformed and out-of-range tags refused with a 400 naming them, a closing ``</break>`` accepted,
live text cut anywhere read as the whole text is, and work linear in the text.

The fuzz (hypothesis) builds adversarial text from tag fragments (runs of whitespace that never
reach ``>``, half tags, stray quotes and closing tags) and checks the scanner against an
independent reading of the same grammar (possessive regexes over each tag), and live text
against whole text. The work check counts the scanner's executed lines (no clock): it grows
with the text, never faster."""

from __future__ import annotations

import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.errors import ApiError
from service.synthesis.breaks import (
    MAX_BREAK_SECONDS,
    MAX_TAG_CHARS,
    STRENGTHS,
    BreakTags,
    Pause,
    break_tag,
    split_breaks,
)
import service.synthesis.breaks as breaks_module


def refused(text: str) -> str:
    with pytest.raises(ApiError) as caught:
        split_breaks(text)
    assert caught.value.status == 400 and caught.value.code == "invalid_field"
    return caught.value.message


@pytest.mark.parametrize("text, pieces", [
    ('a <break time="1.5s" /> b', ["a ", Pause(1.5), " b"]),
    ("<BREAK time=200ms/>", [Pause(0.2)]),
    ("<break time='.5s'>", [Pause(0.5)]),
    ('<break time=" 250ms "/>', [Pause(0.25)]),
    ('<break time="10000ms"/>', [Pause(MAX_BREAK_SECONDS)]),  # the cap, in either unit
    ('<break time="10s"/>', [Pause(MAX_BREAK_SECONDS)]),
    ('<break time="0ms"/>', [Pause(0.0)]),
    ("<break/>", [Pause(STRENGTHS["medium"])]),  # SSML: a bare break is the default, medium
    ("<break>", [Pause(STRENGTHS["medium"])]),
    ('<break strength="strong"/>', [Pause(1.0)]),
    ('<break strength="X-WEAK"/>', [Pause(0.25)]),
    ('<break strength="none"/>', [Pause(0.0)]),
    ('<break time="2s" strength="weak"/>', [Pause(2.0)]),  # SSML: time decides
    ('<break time="2s"></break> hi', [Pause(2.0), " hi"]),  # a closing tag closes, it is not read
    ('<break time="2s">\n </break >hi', [Pause(2.0), "\n ", "hi"]),
    ("<breakfast> <br> 1 < 2 <b>c</b> <emphasis>x</emphasis>",
     ["<breakfast> <br> 1 < 2 <b>c</b> <emphasis>x</emphasis>"]),  # other tags are text
])
def test_the_documented_subset(text, pieces):
    assert split_breaks(text) == pieces


@pytest.mark.parametrize("text, problem", [
    ('<break time="1.5"/>', "not a duration"),  # no unit
    ('<break time="abc"/>', "not a duration"),
    ('<break time="-1s"/>', "not a duration"),
    ('<break time="1.s"/>', "not a duration"),
    ('<break time="1e3ms"/>', "not a duration"),
    ('<break time="99s"/>', "over the 10 s"),  # one cap for every unit
    ('<break time="1234567ms"/>', "over the 10 s"),
    ('<break time="10001ms"/>', "over the 10 s"),
    ('<break time="1s"', "no closing >"),  # unclosed
    ("<break", "no closing >"),
    ('<break time=1s' + " " * 4000, f"no closing > within {MAX_TAG_CHARS} characters"),
    ('<break strength="loud"/>', "strength 'loud' is not one of"),
    ('<break foo="1"/>', "unknown attribute 'foo'"),
    ('<break time="1s" time="2s"/>', "time is given twice"),
    ('<break time="1s"strength="weak"/>', "separated by whitespace"),
    ('<break time/>', "time has no value"),
    ('<break time="1s/>', "quote \" of a value is not closed"),
    ("a </break> b", "must follow its <break"),
    ('<break time="1s"/></break>', "must follow its <break"),
    ('<break time="1s">x</break>', "must follow its <break"),
    ("<break></break", "not closed by >"),
])
def test_malformed_and_out_of_range_tags_are_refused_naming_the_tag(text, problem):
    message = refused("Hello " + text)  # the offending tag is the last one
    assert problem in message and f"at offset {6 + text.rindex('<')} " in message and message.startswith("text: ")


def test_a_pause_spelled_as_a_tag_reads_back_exactly():
    for seconds in (0.0, 1e-5, 0.2, 1 / 3, 1.234, 9.999999, MAX_BREAK_SECONDS):
        assert split_breaks(break_tag(Pause(seconds))) == [Pause(seconds)]


# -- an independent reading of the same grammar (possessive regexes: no backtracking either) ----
_S = r"[ \t\r\n\f\v]"
_VALUE = r"""(?:"(?P<dq>[^"]*)"|'(?P<sq>[^']*)'|(?P<bare>[^ \t\r\n\f\v/><"'][^ \t\r\n\f\v/><]*+|))"""
_ATTRIBUTE = re.compile(rf"""{_S}++(?P<name>[^ \t\r\n\f\v=/><"']++){_S}*+={_S}*+{_VALUE}""")
_OPEN = re.compile(rf"""<break(?P<attrs>(?:{_S}++[^ \t\r\n\f\v=/><"']++{_S}*+={_S}*+{_VALUE})*+){_S}*+(?P<end>/?)>""",
                   re.I | re.A)
_CLOSE = re.compile(rf"</break{_S}*+>", re.I | re.A)
_START = re.compile(r"</?break(?=[ \t\r\n\f\v/>]|\Z)", re.I | re.A)
_DURATION = re.compile(r"(?P<number>[0-9]*+(?:\.[0-9]++)?+)(?P<unit>ms|s)", re.I | re.A)


class Refused(Exception):
    pass


def reference_pause(attrs: str) -> Pause:
    values: dict[str, str] = {}
    for m in _ATTRIBUTE.finditer(attrs):
        name = m["name"].lower()
        if name not in ("time", "strength") or not m["name"].isascii() or name in values:
            raise Refused
        value = m["dq"] if m["dq"] is not None else m["sq"] if m["sq"] is not None else m["bare"]
        values[name] = value.strip(" \t\r\n\f\v") if m["bare"] is None else value
    strength = values.get("strength", "medium")
    if not strength.isascii() or strength.lower() not in STRENGTHS:
        raise Refused
    if "time" not in values:
        return Pause(STRENGTHS[strength.lower()])
    duration = _DURATION.fullmatch(values["time"])
    if duration is None or not re.search("[0-9]", duration["number"]):
        raise Refused
    seconds = float(duration["number"]) / (1000.0 if duration["unit"].lower() == "ms" else 1.0)
    if seconds > MAX_BREAK_SECONDS:
        raise Refused
    return Pause(seconds)


def reference_split(text: str) -> list[str | Pause] | None:
    """The pieces, or None for a refused text."""
    out: list[str | Pause] = []
    start, open_end = 0, None
    try:
        while (m := _START.search(text, start)) is not None:
            at = m.start()
            closing = m.group().startswith("</")
            tag = (_CLOSE if closing else _OPEN).match(text, at)
            if tag is None or tag.end() - at > MAX_TAG_CHARS:
                raise Refused
            if closing and (open_end is None or text[open_end:at].strip(" \t\r\n\f\v")):
                raise Refused
            out.append(text[start:at])
            if not closing:
                out.append(reference_pause(tag["attrs"]))
            open_end = tag.end() if not closing and not tag["end"] else None
            start = tag.end()
    except Refused:
        return None
    out.append(text[start:])
    return merged(out)


def merged(pieces: list[str | Pause]) -> list[str | Pause]:
    """Adjacent text pieces joined, empty ones dropped: what two readings must agree on."""
    out: list[str | Pause] = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        elif piece != "":
            out.append(piece)
    return out


def scanned(text: str) -> list[str | Pause] | None:
    try:
        return merged(split_breaks(text))
    except ApiError as exc:
        assert exc.status == 400 and exc.code == "invalid_field"
        at = int(re.search(r"at offset (\d+)", exc.message).group(1))
        assert text[at] == "<" and text[at:at + 8].lower().lstrip("</").startswith("break"), exc.message
        return None


FRAGMENTS = ["<break", "<BREAK", "</break", "<breakfast", "<br", "<", ">", "/>", "/", " ", "   ", "\t", "\n",
             "\xa0", "\u2003", "time", "TIME", "strength", "=", '"', "'", "0", "1", "5", "99", "10000", ".",
             "-", "ms", "s", "MS", "x-strong", "medium", "none", "loud", "abc", "Hi. ", "<b>", "\u212a",
             '<break time="1s"/>', "<break/>", "</break>", " " * 130]
adversarial = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)


@settings(max_examples=1500, deadline=None)
@given(adversarial)
def test_the_scanner_reads_what_the_grammar_says(text):
    assert scanned(text) == reference_split(text)


@settings(max_examples=800, deadline=None)
@given(adversarial, st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_live_text_cut_anywhere_reads_as_the_whole_text(text, cuts):
    expected = scanned(text)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    tags, pieces = BreakTags(), []
    try:
        for a, b in zip(bounds, bounds[1:]):
            pieces += tags.feed(text[a:b])
        pieces += tags.take_rest()
    except ApiError as exc:
        assert exc.status == 400 and expected is None, (exc.message, expected)
        return
    assert merged(pieces) == expected


def executed_lines(call, *args) -> int:
    """Lines of service/synthesis/breaks.py executed by ``call(*args)`` (the scanner's work)."""
    count = 0
    module_file = breaks_module.__file__

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != module_file:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        call(*args)
    except ApiError:
        pass
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize("family", [
    lambda n: "<break time=1s" + " " * n,  # the old pattern's cubic case
    lambda n: "<break" + " " * n + 'time="1s"/>',
    lambda n: '<break time="1s"/>' * n,
    lambda n: "<breakfast <br " * n,
    lambda n: "< <" * n,
    lambda n: "Hello there. " * n,
    lambda n: '<break time="1s"> </break>' * n,
])
def test_the_work_grows_linearly_with_the_text(family):
    small, large = executed_lines(split_breaks, family(500)), executed_lines(split_breaks, family(4000))
    assert large <= 8 * small * 1.05 + 50, (small, large)

    def live(text: str) -> None:  # one character per delta: the held tag is bounded, never rescanned whole
        tags = BreakTags()
        for ch in text:
            tags.feed(ch)
        tags.take_rest()

    small, large = executed_lines(live, family(200)), executed_lines(live, family(1600))
    assert large <= 8 * small * 1.05 + 50, (small, large)

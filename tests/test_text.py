"""TextStream: whole characters only, and stop strings cut exactly, however the bytes arrive."""

import random

from llamabatch.engine.text import TextStream


def feed(stream: TextStream, pieces: list[bytes]) -> list[str]:
    return [stream.push(p) for p in pieces] + [stream.finish()]


def test_split_utf8_characters_are_held_until_complete():
    data = "é世🎉".encode()
    deltas = feed(TextStream(), [data[i : i + 1] for i in range(len(data))])
    assert "".join(deltas) == "é世🎉"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[0] == "" and deltas[1] == "é"  # the first byte alone shows nothing


def test_any_split_of_mixed_bytes_reads_as_decoding_them_whole():
    """ASCII pieces take a fast path; one after a split character must still complete or break it."""
    data = "a é b 世\n🎉 c".encode() + b"\xe4x\xf0\x9fy" + "z€".encode()
    for cuts in ([1, 2, 3], [3, 4, 9], [2, 5, 6, 7, 12, 13, 14, 17, 18, 20], list(range(1, len(data)))):
        pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
        assert "".join(feed(TextStream(), pieces)) == data.decode(errors="replace"), cuts


def test_a_piece_pushed_with_its_text_shows_what_it_shows_pushed_alone():
    """The engine hands each piece's text along where the piece is whole characters by itself
    (its token table): every delta must be the one decoding the bytes would give, next to split
    characters, bad bytes and stop strings."""
    data = "a é b 世\n🎉 c".encode() + b"\xe4x\xf0\x9fy\x80\xff" + "z€ END".encode()
    rng = random.Random(0)
    for stop in ((), ("END", "世\n")):
        for _ in range(200):
            cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 12)))
            pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
            alone, hinted = TextStream(stop), TextStream(stop)
            for piece in pieces:
                try:
                    text = piece.decode()
                except UnicodeDecodeError:
                    text = None
                assert hinted.push(piece, text) == alone.push(piece), (cuts, piece)
            assert hinted.finish() == alone.finish() and hinted.text == alone.text


def test_dangling_bytes_at_the_end_show_as_replacement_character():
    stream = TextStream()
    assert stream.push(b"ok\xe4\xb8") == "ok"
    assert stream.finish() == "\ufffd"


def test_stop_string_cuts_text_exactly_before_it():
    stream = TextStream(stop=("END",))
    deltas = feed(stream, [b"abc E", b"N", b"D and more"])
    assert stream.stopped
    assert stream.text == "abc "
    assert "".join(deltas) == "abc "


def test_possible_stop_prefix_is_held_back_then_released():
    stream = TextStream(stop=("</s>",))
    assert stream.push(b"hi <") == "hi "  # "<" may begin "</s>"
    assert stream.push(b"/") == ""
    assert stream.push(b"x") == "</x"  # it did not
    assert not stream.stopped


def test_earliest_of_several_stops_wins():
    stream = TextStream(stop=("two", "one"))
    stream.push(b"zero one two")
    assert stream.text == "zero "


def test_text_without_stop_is_shown_whole_at_finish():
    deltas = feed(TextStream(stop=("xyz",)), [b"abc", b" x"])
    assert "".join(deltas) == "abc x"


def test_n_indent_cuts_at_the_first_line_indented_less_however_the_text_arrives():
    """The first line is free; each later one needs n_indent spaces or tabs, and the first that
    has fewer (a blank line too) ends the text before its own text. Indentation is held back
    until its line shows how deep it is."""
    cases = {
        "x = 1\n    y = 2\n\tz\n  w = 3\n": ("x = 1\n    y = 2\n\t", True),  # a tab is one; cut before its text
        "x = 1\n    y = 2\n\n    z\n": ("x = 1\n    y = 2\n", True),
        "x\n    y\n    ": ("x\n    y\n    ", False),  # the last line has no text yet: shown at the end
    }
    for text, (expected, stopped) in cases.items():
        for size in (1, 2, 5):
            stream, deltas = TextStream(n_indent=4), []
            for i in range(0, len(text), size):
                if not stream.stopped:  # (the engine ends a stopped sequence)
                    deltas.append(stream.push(text[i:i + size].encode()))
            shown = "".join(deltas) + stream.finish()
            assert (shown, stream.stopped) == (expected, stopped), (text, size)
            assert all(not d.endswith("\n ") for d in deltas[:-1])  # indentation waits for its line

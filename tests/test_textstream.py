"""Streaming detokenisation: the pieces join to exactly the final text, stop strings never leak."""

import random

from blockdraft.decoding.engine import TextStream, cut_at_stop_string


class ByteTokenizer:
    """One token per UTF-8 byte, so multi-byte characters arrive in pieces."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream_pieces(text: str, stops, seed: int):
    rng = random.Random(seed)
    ids = list(text.encode())
    ts = TextStream(ByteTokenizer(), stops)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces.append(ts.push(ids[i:i + n]))
        i += n
    pieces.append(ts.finish())
    return pieces, ts


def test_pieces_join_to_the_final_text_and_never_show_a_stop_string():
    text = "Héllo wörld — 日本語 STOP and END more ENDING"
    for seed in range(20):
        for stops in ([], ["STOP"], ["END", "x"], ["ld —"], ["zzz"]):
            pieces, ts = stream_pieces(text, stops, seed)
            assert "".join(pieces) == ts.text == cut_at_stop_string(text, stops)
            assert all("\ufffd" not in p for p in pieces)  # never half a character
            shown = ""
            for p in pieces:
                shown += p
                assert not any(s in shown for s in stops)


def test_a_possible_stop_prefix_is_held_back_until_resolved():
    ts = TextStream(ByteTokenizer(), ["STOP"])
    assert ts.push(list(b"abc ST")) == "abc "  # "ST" could become "STOP"
    assert ts.push(list(b"AR")) == "STAR"  # it did not
    assert ts.push(list(b" STO")) == " "
    assert ts.push(list(b"P tail")) == ""  # it did: nothing more is shown
    assert ts.finish() == "" and ts.text == "abc STAR "

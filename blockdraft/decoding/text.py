"""What the user sees of generated tokens: special tokens dropped, cut at a stop string, and
streamed in pieces that can no longer change."""

from __future__ import annotations


def cut_at_stop_string(text: str, stop_strings) -> str:
    cuts = [text.find(s) for s in stop_strings if s and s in text]
    return text[: min(cuts)] if cuts else text


def decode_text(tokenizer, tokens: list[int], stop_strings) -> str:
    """The text of generated tokens as the user sees it: special tokens dropped, cut at a stop string."""
    return cut_at_stop_string(tokenizer.decode(tokens, skip_special_tokens=True), stop_strings)


class TextStream:
    """Incremental detokenisation for streaming: `push` returns only text that can no longer
    change. It holds back an incomplete multi-byte character and any tail that could still grow
    into a stop string; `finish` returns the rest. The pieces join to exactly `generate`'s text."""

    def __init__(self, tokenizer, stop_strings=()):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.tokens: list[int] = []
        self.shown = ""

    @property
    def text(self) -> str:
        return decode_text(self.tokenizer, self.tokens, self.stop_strings)

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.text
        end = len(text.rstrip("\ufffd"))
        hold = 0  # a tail that is a proper prefix of a stop string waits for the next tokens
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, end), 0, -1):
                if text.endswith(stop[:k], 0, end):
                    hold = max(hold, k)
                    break
        return self._emit(text[: end - hold])

    def finish(self) -> str:
        return self._emit(self.text)

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return ""
        delta, self.shown = text[len(self.shown):], text
        return delta

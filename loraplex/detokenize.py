"""Incremental detokenization that never splits a character, and stop-string matching.

Byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen2) often spend several tokens
on one Chinese or Japanese character: decoding those tokens one at a time gives
U+FFFD replacement characters. `IncrementalDetokenizer` decodes a short window
of recent tokens and emits new text only once it no longer ends in an
incomplete character; the window also keeps SentencePiece-style tokenizers from
losing the leading space a token carries only in context.

`StopStringMatcher` finds stop strings in a stream of text pieces and holds back
any tail that could still become a stop string, so a stop string (which is not
part of the output) is never half-sent to the client.
"""
from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of whole-character text pieces.

    `decode` maps token ids to text (e.g. `lambda ids: tok.decode(ids, skip_special_tokens=True)`).
    `prompt_ids`, when given, seeds the context window so the first output token
    decodes with its leading space as it would after the prompt.
    """

    # Tokens of context kept before the unread part; 5 covers every tokenizer
    # whose characters span at most 4 tokens (UTF-8 has at most 4 bytes).
    CONTEXT_TOKENS = 5

    def __init__(self, decode: DecodeFn, prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-self.CONTEXT_TOKENS:])
        self._prefix_offset = 0             # start of the context window
        self._read_offset = len(self._ids)  # tokens before this are already emitted as text

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the text they complete ("" while a character is still partial)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # a character is still incomplete (or the tokens decode to nothing yet)
        delta = full_text[len(prefix_text):]
        self._advance()
        return delta

    def flush(self) -> str:
        """Text of tokens still held back (at the end of the stream, even if incomplete)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._advance()
        return full_text[len(prefix_text):]

    def _advance(self) -> None:
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - self.CONTEXT_TOKENS)
        # Drop ids left of the window so the list stays short on long outputs.
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


class StopStringMatcher:
    """Cuts a text stream at the first stop string to complete, never emitting part of one.

    Feed pieces with `push`; it returns `(text_to_emit, stopped)`. After a stop
    the matcher emits nothing more. `flush` releases the held-back tail when the
    stream ends without a stop.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(stop)
        self._text = ""      # text not yet emitted (a possible start of a stop string)
        self.stopped = False
        self.matched = ""    # the stop string that ended the stream

    def push(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stop:
            return piece, False
        self._text += piece
        hit = self._first_match()
        if hit is not None:
            pos, stop = hit
            out = self._text[:pos]
            self._text = ""
            self.stopped, self.matched = True, stop
            return out, True
        keep = self._held_tail_len()
        cut = len(self._text) - keep
        out, self._text = self._text[:cut], self._text[cut:]
        return out, False

    def flush(self) -> str:
        out, self._text = ("" if self.stopped else self._text), ""
        return out

    def _first_match(self) -> tuple[int, str] | None:
        """The stop string that completes first in the pending text (ties: the one starting first).

        Ordering by where a match ends makes the result independent of how the text was cut
        into pieces: it is what reading one character at a time would find.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stop:
            pos = self._text.find(s)
            if pos >= 0 and (best is None or (pos + len(s), pos) < best[:2]):
                best = (pos + len(s), pos, s)
        return None if best is None else (best[1], best[2])

    def _held_tail_len(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:k]):
                    longest = k
                    break
        return longest

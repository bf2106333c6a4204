"""What copying the context predicts: one n-gram index over a sequence, kept up to date a token at a time.

Two parts of the engine read it: the ``+copy`` exit policies (serve/exits.py) exit where a loop's argmax is the
copy ``guess``, and speculative decoding (serve/speculative.py) drafts the tokens that follow it (``draft``)."""

from __future__ import annotations


class ContextIndex:
    """The sequence's k-grams (k = ``n`` .. ``min_n``) by where each last ended. ``match`` is the end position of
    the last earlier occurrence of the longest final k-gram that occurred before (-1: none did): the longest
    repeated suffix decides; ``guess`` is the token that followed it, ``draft(k)`` the k tokens that did."""

    def __init__(self, tokens=(), n: int = 3, min_n: int | None = None):
        self.n, self.min_n = n, n if min_n is None else min_n
        if not 1 <= self.min_n <= n:
            raise ValueError(f"copy n-grams need 1 <= min_n <= n, got n={n}, min_n={min_n}")
        self.tokens: list[int] = []
        self.match = -1
        self._last: dict[tuple, int] = {}  # k-gram -> position of its last token, up to the previous one
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            p = len(self.tokens) - 1
            self.match = -1
            for k in range(min(self.n, p + 1), self.min_n - 1, -1):
                gram = tuple(self.tokens[p - k + 1 :])
                j = self._last.get(gram)
                if self.match < 0 and j is not None:
                    self.match = j
                self._last[gram] = p

    @property
    def guess(self) -> int:
        """The token that followed the match, or -1."""
        return self.tokens[self.match + 1] if self.match >= 0 else -1

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the match (none without one); a copy that reaches the end runs on into its
        own drafted tokens (a period repeats)."""
        if self.match < 0 or k <= 0:
            return []
        out: list[int] = []
        for i in range(k):
            src = self.match + 1 + i
            out.append(self.tokens[src] if src < len(self.tokens) else out[src - len(self.tokens)])
        return out


def copy_guesses(tokens, n: int = 3, min_n: int | None = None) -> list[int]:
    """``ContextIndex.guess`` after each of ``tokens``: at position p, what copying predicts for p + 1."""
    index, out = ContextIndex(n=n, min_n=min_n), []
    for t in tokens:
        index.extend([t])
        out.append(index.guess)
    return out

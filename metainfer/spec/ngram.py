"""N-gram (prompt lookup) drafts: the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens (n from N_MAX down to N_MIN), k of them (where the occurrence is recent,
the draft repeats the loop it found). No model, no device work: it pays on text that repeats itself
(code edits, quoting, structured output).

An index per request maps each n-gram to the end of its latest occurrence, updated with the tokens
appended since the last call, so a proposal costs O(new tokens), not O(sequence)."""

from __future__ import annotations

from collections.abc import Sequence

N_MAX = 3  # longest suffix matched
N_MIN = 2  # shortest (single tokens match too often by chance to be worth a verify)


class NgramIndex:
    """n-gram -> end (exclusive) of its latest occurrence among the indexed positions."""

    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.ends: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending at positions < upto are indexed

    def _index(self, tokens: Sequence[int], upto: int) -> None:
        for e in range(self.upto + 1, upto + 1):
            for n in range(self.n_min, min(self.n_max, e) + 1):
                self.ends[tuple(tokens[e - n : e])] = e
        self.upto = max(self.upto, upto)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (the whole sequence so far; it only grows)."""
        L = len(tokens)
        if k <= 0 or L < self.n_min + 1:
            return []
        self._index(tokens, L - 1)  # every n-gram ending before the last position: earlier occurrences
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            e = self.ends.get(tuple(tokens[L - n :]))
            if e is not None:  # what followed it; past the end, the draft continues itself (a loop)
                out: list[int] = []
                for i in range(e, e + k):
                    out.append(tokens[i] if i < L else out[i - L])
                return out
        return []


def propose_ngram(tokens: Sequence[int], k: int, n_min: int = N_MIN, n_max: int = N_MAX) -> list[int]:
    """One-off proposal (a fresh index): see NgramIndex.propose."""
    return NgramIndex(n_min, n_max).propose(tokens, k)

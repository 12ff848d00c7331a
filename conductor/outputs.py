"""Output lengths of finished requests: what a conductor knows about how long decodes last.

A scheduler cannot see how many tokens a request will generate, but it sees
the lengths of the requests that finished. Predictive admission needs two
things from them: the mean (the memory a newcomer will grow by) and the
survival function P(output > m), which says how likely a sequence that has
already made m tokens is still decoding after m + k. Using the whole
empirical distribution, rather than assuming every request lasts the mean
(the paper's uniform decode time), matters under overload: with the mean
alone every sequence past it is taken as gone and the decode load is
underestimated by about a quarter on the conversation trace. Before anything
has finished, a single prior length stands in for the distribution.
"""
from __future__ import annotations

import numpy as np

OUTPUT_PRIOR_TOKENS = 512


class OutputLengths:
    def __init__(self, prior_tokens: int = OUTPUT_PRIOR_TOKENS):
        self._counts = np.zeros(prior_tokens + 1, dtype=np.int64)
        self._counts[prior_tokens] = 1
        self._sum, self._n = float(prior_tokens), 1
        self._tail: np.ndarray | None = None

    def observe(self, length: int) -> None:
        if length >= self._counts.size:
            self._counts = np.concatenate(
                [self._counts, np.zeros(length + 1 - self._counts.size, dtype=np.int64)])
        self._counts[length] += 1
        self._sum += length
        self._n += 1
        self._tail = None

    @property
    def mean(self) -> float:
        return self._sum / self._n

    def still_running(self, made_now: float, made_then: float) -> float:
        """P(output > made_then | output > made_now): a sequence that has made
        ``made_now`` tokens is still decoding once it has had time for ``made_then``."""
        alive_now = self._survivors(made_now)
        return self._survivors(made_then) / alive_now if alive_now else 0.0

    def _survivors(self, made: float) -> int:
        if self._tail is None:
            # tail[m] = how many finished requests generated more than m tokens
            self._tail = np.concatenate([np.cumsum(self._counts[::-1])[::-1][1:], [0]])
        m = int(made)
        return int(self._tail[m]) if m < self._tail.size else 0

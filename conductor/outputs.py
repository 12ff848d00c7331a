"""Output lengths: what a conductor knows about how long decodes last.

A scheduler cannot see how many tokens a request will generate, but it sees
the lengths of the requests that finished. Predictive admission needs two
things from them: the mean (the memory a newcomer will grow by) and the
survival function P(output > m), which says how likely a sequence that has
already made m tokens is still decoding after m + k. Using the whole
distribution, rather than assuming every request lasts the mean (the paper's
uniform decode time), matters under overload: with the mean alone every
sequence past it is taken as gone and the decode load is underestimated by
about a quarter on the conversation trace.

The finished requests alone are a biased sample: at any moment the short
answers have finished and the long ones are still running, so their lengths
say that sequences leave sooner than they do (on a bursty trace the decode
load 2-10 s ahead came out 7-9 % of a node too low). The sequences still
decoding are therefore counted as what they are, lengths known to exceed
what they have made so far: the survival function is the Kaplan-Meier
estimate with them as censored observations. Before anything has finished,
a single prior length stands in for the distribution.
"""
from __future__ import annotations

import numpy as np

OUTPUT_PRIOR_TOKENS = 512


class Survival:
    """P(output > k) for k = 0, 1, ... (constant past its end)."""

    def __init__(self, curve: np.ndarray):
        self.curve = curve

    def still_running(self, made_now, made_then):
        """P(output > made_then | output > made_now), element-wise over arrays: a sequence
        that has made ``made_now`` tokens is still decoding once it has had time for
        ``made_then``."""
        last = self.curve.size - 1
        now = self.curve[np.minimum(np.asarray(made_now, dtype=np.int64), last)]
        then = self.curve[np.minimum(np.asarray(made_then, dtype=np.int64), last)]
        return np.divide(then, now, out=np.zeros(np.broadcast(then, now).shape), where=now > 0)


class OutputLengths:
    def __init__(self, prior_tokens: int = OUTPUT_PRIOR_TOKENS):
        self._counts = np.zeros(prior_tokens + 1, dtype=np.int64)
        self._counts[prior_tokens] = 1
        self._sum, self._n = float(prior_tokens), 1

    def observe(self, length: int) -> None:
        if length >= self._counts.size:
            self._counts = np.concatenate(
                [self._counts, np.zeros(length + 1 - self._counts.size, dtype=np.int64)])
        self._counts[length] += 1
        self._sum += length
        self._n += 1

    @property
    def mean(self) -> float:
        return self._sum / self._n

    def survival(self, running: np.ndarray | None = None) -> Survival:
        """The Kaplan-Meier survival function: finished lengths are events; ``running``,
        the tokens made so far by sequences still decoding, are censored."""
        running = np.zeros(0, dtype=np.int64) if running is None else running.astype(np.int64)
        size = max(self._counts.size, int(running.max()) + 2 if running.size else 0)
        events = np.zeros(size)
        events[:self._counts.size] = self._counts
        censored = np.bincount(running, minlength=size)
        # at risk of ending at k: everything not known to have ended before k
        at_risk = np.cumsum((events + censored)[::-1])[::-1]
        hazard = np.divide(events, at_risk, out=np.zeros(size), where=at_risk > 0)
        return Survival(np.cumprod(1 - hazard))

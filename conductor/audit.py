"""Self-auditing admission: follow whichever fixed mode does best from where the run is.

No single admission mode is best on every trace. Predictive admission serves
the most on bursty and conversation-shaped traffic, but on steady arrivals
of long, mostly cached prompts with short answers the baseline (which wastes
prefill that costs little there) can serve more. Tuning one mode to one more
region moves the problem, so the `audited` mode does not guess: it audits
what each fixed mode (`AUDITED_MODES`) would have done with the same
arrivals, from the same state, and lets the live arrival check follow the
one that served the most within the SLO lately.

The counterfactuals. The replay forks a shadow of itself for each mode not
in force (`Simulator._fork`: the same caches, queues, decode batches and
learned odds, on the same cost model), and each shadow replays its mode over
the arrivals that follow; the run itself is the shadow of the mode in force.
The first `AUDIT_SETTLE` arrivals after the fork are not audited: they are
where each shadow leaves the live run's state for the one its own mode
makes. The `AUDIT_EVERY` after them are. An arrival's outcome in a run is
known when the run rejects it (at arrival or at decode) or its KV joins a
decode batch within the TTFT SLO (served; the batch's TBT is the decode
check's to keep). When every audited arrival is resolved in every run, the
audit decides, the shadows are dropped and the next are forked, so at most
two shadows run beside the live replay.

What was tried first, and why it is not kept:
- One shadow per fixed mode running from the start of the trace, the live
  run following the one that served the most lately. The shadows drift into
  states of their own (the baseline's deep prefill queue, say), so a mode's
  lead there is not a lead from where the live run is: on two traces where
  the baseline and predictive tie, the live run switched and lost 1.7-3.8 %
  against both.
- Forked shadows audited from the fork on (no settling). Right after the
  fork, a mode that admits more (the baseline) spends the headroom the
  predictive mode kept and serves more for a while; the audit saw that
  short-term lead and switched, and the live run then did worse than the
  fixed predictive mode (0.960 of it on a trace predictive wins by 4 %).
- Deciding whenever arrivals entered the window. A switch in the middle of a
  fork's audited arrivals changes the live run's mode under the comparison,
  and the outcomes credited to the mode in force are then a mixture.

The window and the switch. The audited arrivals enter the window in arrival
order once every run has resolved them; the window holds the last `WINDOW`.
The mode in force changes to the window's leader only when the leader's lead
is larger than chance would make it: more than `Z` standard deviations of a
paired count, Z x sqrt(d), with d the window's arrivals on which the two
modes' outcomes differ (were both modes equally good, each of those would go
either way with even odds), and more than `MARGIN` x the window's length;
and not before the window holds `WINDOW` / `MIN_FILL` arrivals. So:

    after every audited arrival, the mode in force served at least the best
    mode's count minus max(MARGIN x n, Z x sqrt(d)) over the n arrivals of
    the window, d <= n (the bound: at most max(MARGIN, Z / sqrt(n)) of the
    window, 9.4 % of a full window of 1024 if the modes differed on every
    arrival; they differ on far fewer), and

    a switch needs a lead that chance alone makes with odds of about 1 in
    700 at each look (Z = 3), so the modes do not flap on noise (the
    hysteresis).

The bound is on the audited window, by construction. The live run's goodput
over a window is the in-force mode's counterfactual exactly (it is that
run), so what the bound leaves out is only how far the next window differs
from the last: a trace whose best mode changes faster than a window is
audited is followed a window late (docs/conductor.md measures the audited
run against the best fixed mode on every trace of the grid).

The shadows cost up to two replays beside the live one while they run. A
replay in another mode, or without admission control, does not pay for them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

AUDITED_MODES = ("baseline", "early", "predictive")
START_MODE = "predictive"   # the mode in force until the audit says otherwise
WINDOW = 4096               # audited arrivals in the long window
RECENT = 512                # ... and in the recent one (its newest part)
MARGIN = 0.02               # the lead, as a share of a window, a mode needs at least
Z = 3.0                     # ... and in standard deviations of the paired count
MIN_AUDITED = 768           # no switch before the long window holds this many arrivals

_PENDING = -1


class Window:
    """The outcomes of the last ``size`` audited arrivals: per mode the arrivals served within
    the SLO, and per pair of modes the arrivals on which their outcomes differ."""

    def __init__(self, modes: int, size: int):
        self.size = size
        self._rows: deque[tuple[int, ...]] = deque()
        self.scores = [0] * modes
        self._pairs = [(i, j) for i in range(modes) for j in range(i + 1, modes)]
        self._differ = {p: 0 for p in self._pairs}

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, outcomes: tuple[int, ...]) -> None:
        self._count(outcomes, 1)
        self._rows.append(outcomes)
        if len(self._rows) > self.size:
            self._count(self._rows.popleft(), -1)

    def _count(self, outcomes: tuple[int, ...], sign: int) -> None:
        for i, o in enumerate(outcomes):
            self.scores[i] += sign * o
        for i, j in self._pairs:
            if outcomes[i] != outcomes[j]:
                self._differ[i, j] += sign

    def differ(self, i: int, j: int) -> int:
        return self._differ[min(i, j), max(i, j)] if i != j else 0

    def lead(self, i: int, j: int) -> int:
        return self.scores[i] - self.scores[j]

    def needed(self, i: int, j: int, margin: float, z: float) -> float:
        """The lead mode ``i`` needs over ``j`` here to count as beyond chance."""
        return max(margin * len(self), z * self.differ(i, j) ** 0.5)

    def beats(self, i: int, j: int, margin: float, z: float) -> bool:
        return self.lead(i, j) > self.needed(i, j, margin, z)


class Audit:
    """Per-mode outcomes of recent arrivals, and the mode in force.

    ``arrived(rid)`` opens an arrival (in arrival order); ``resolve(mode, rid,
    served)`` records a shadow's outcome for it. Arrivals enter the windows in
    arrival order once every mode has resolved them.
    """

    def __init__(self, modes: Sequence[str] = AUDITED_MODES, start: str = START_MODE,
                 window: int = WINDOW, recent: int = RECENT, margin: float = MARGIN,
                 z: float = Z, min_audited: int = MIN_AUDITED):
        if start not in modes:
            raise ValueError(f"the starting mode {start!r} is not among {list(modes)}")
        if not 1 <= recent <= window or margin < 0 or z < 0 or min_audited < 0:
            raise ValueError("the audit needs windows of 1 <= recent <= window arrivals, "
                             "and a margin, z and min_audited >= 0")
        self.modes = tuple(modes)
        self.margin = margin
        self.z = z
        self.min_audited = min_audited
        self.start = start
        self.auto = True    # decide whenever arrivals enter the windows (else: `decide`)
        self.mode = start
        self._index = {m: i for i, m in enumerate(self.modes)}
        self._open: dict = {}                       # arrival -> outcome per mode (-1 pending)
        self._order: deque = deque()                # open arrivals, in arrival order
        self.long = Window(len(self.modes), window)
        self.recent = Window(len(self.modes), recent)
        self.audited = 0                            # arrivals that have entered the windows
        self.switches: list[tuple[int, str, str]] = []  # (audited arrivals then, from, to)
        self.in_force = {m: 0 for m in self.modes}  # arrivals decided while each was in force
        self.worst_gap = 0                          # the most the mode in force trailed, long

    @property
    def scores(self) -> list[int]:
        """Served within the SLO, per mode, over the long window."""
        return self.long.scores

    @property
    def open(self) -> int:
        """Audited arrivals some run has not resolved yet."""
        return len(self._open)

    def forget_open(self) -> None:
        """Drop the arrivals not yet resolved (their shadows are gone)."""
        self._open.clear()
        self._order.clear()

    def arrived(self, rid) -> None:
        self._open[rid] = [_PENDING] * len(self.modes)
        self._order.append(rid)

    def decided(self) -> str:
        """The mode in force for the next live decision (counted in `in_force`)."""
        self.in_force[self.mode] += 1
        return self.mode

    def resolve(self, mode: str, rid, served: bool) -> None:
        outcomes = self._open.get(rid)
        if outcomes is None:
            return
        outcomes[self._index[mode]] = int(served)
        if rid == self._order[0]:
            self._advance()

    def _advance(self) -> None:
        moved = False
        while self._order and _PENDING not in self._open[self._order[0]]:
            outcomes = tuple(self._open.pop(self._order.popleft()))
            self.long.add(outcomes)
            self.recent.add(outcomes)
            self.audited += 1
            moved = True
        if moved and self.auto:
            self.decide()

    def gap(self) -> int:
        """How many fewer arrivals the mode in force served than the best, long window."""
        return max(self.long.scores) - self.long.scores[self._index[self.mode]]

    def challengers(self) -> list[str]:
        """The modes that beat the one in force beyond chance in both windows."""
        c = self._index[self.mode]
        return [m for m, i in self._index.items()
                if i != c and self.long.beats(i, c, self.margin, self.z)
                and self.recent.beats(i, c, self.margin, self.z)]

    def decide(self) -> None:
        """Switch to the best challenger (by the long window), if there is one."""
        if len(self.long) >= self.min_audited:
            challengers = self.challengers()
            if challengers:
                best = max(challengers, key=lambda m: self.long.scores[self._index[m]])
                self.switches.append((self.audited, self.mode, best))
                self.mode = best
        self.worst_gap = max(self.worst_gap, self.gap())

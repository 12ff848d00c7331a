"""Self-auditing admission: follow a fixed mode only while no other beats it beyond chance.

No single admission mode is best on every trace. Predictive admission serves
the most on bursty and conversation-shaped traffic, but on steady arrivals
of long, mostly cached prompts with short answers the baseline (which wastes
prefill that costs little there) can serve more. Tuning one mode to one more
region moves the problem, so the `audited` mode does not guess: it keeps a
shadow replay of every fixed mode (`AUDITED_MODES`), each fed the same
arrivals as the live decisions and run on the same cost model (calibrated
from the workers' timings where `--calibrate` is given), and lets the live
arrival check follow the mode that has served the most within the SLO.

The outcomes. An arrival's outcome in a shadow is known when the shadow
rejects it (at arrival or at decode) or its KV joins a decode batch within
the TTFT SLO (served; the batch's TBT is the decode check's to keep). The
modes are compared on the same arrivals: an arrival enters the windows as
soon as every shadow has resolved it, at most about one TTFT SLO after it
came. (Waiting for every earlier arrival too, so that arrivals enter in
arrival order, held the windows up to 1,300 arrivals behind at 128
requests a second: a request held or queued in one shadow blocked all the
ones after it.)

The windows and the switch. Two windows of audited arrivals: the long one
(the last `WINDOW`, as long as the traces judged here, so in effect the run
so far) and the recent one (its last `RECENT`). A mode *beats* the mode in
force in a window when it served more there by more than chance would make
it: by more than Z x sqrt(d), d the window's arrivals on which the two
modes' outcomes differ (were both equally good, each of those would go
either way with even odds), and by more than `MARGIN` of the window. The
mode in force changes only to a mode that beats it in both windows (the one
with the most served in the long window among them), and not before the
long window holds `MIN_AUDITED` arrivals. So, by construction:

    after every audited arrival (past MIN_AUDITED), no mode served more than
    the mode in force by more than max(MARGIN x n, Z x sqrt(d)) over the
    long window of n arrivals while also doing so over the recent one
    (the bound: `challengers` is empty), and

    a switch needs a lead that chance alone makes with odds of about 1 in
    700 at each look (Z = 3) in both windows, so the modes do not flap on
    noise, nor on a lead that held once and no longer does (the hysteresis).

What the bound covers and what it does not. While the live run has not
switched it *is* the shadow of the mode in force (the same deterministic
replay): the simulator runs that shadow as the live run until the first
switch, then forks a copy of it that follows the audit. After a switch the
live run starts from a state the new mode did not make, and a mode's lead
over a window is not a promise about the rest of the run: on a trace where
the baseline serves more for the first thousand arrivals and its queue of
wasted prefill costs it more later, the audit follows it and then comes
back (docs/conductor.md, the grid, measures the audited run against the best
fixed mode on every trace).

What was tried and not kept (judged on four generated traces, two where
predictive wins by 3-4 %, two where the baseline and predictive tie):
- One window of 512 arrivals, switching on a lead of 1 % of it: 2-7
  switches a run, mostly on noise, each costing the live run; 0.962-0.997
  of the best fixed mode.
- Shadows forked from the live run's state every 256 arrivals and compared
  over the arrivals that follow (a lead that includes the cost of the
  transition), with or without 256 arrivals left to settle first: right
  after a fork the baseline spends the headroom the predictive mode kept
  and serves more for a while; the audit switched on that and the live run
  served 0.92-0.96 of the fixed predictive mode.

The shadows cost a replay each: an audited replay costs about as much as the
three fixed modes together (plus the live one after a switch). A replay in
another mode, or without admission control, does not pay for them.
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

    ``arrived(rid)`` opens an arrival; ``resolve(mode, rid, served)`` records a
    shadow's outcome for it. An arrival enters the windows once every mode has
    resolved it.
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

    def arrived(self, rid) -> None:
        self._open[rid] = [_PENDING] * len(self.modes)

    def decided(self) -> str:
        """The mode in force for the next live decision (counted in `in_force`)."""
        self.in_force[self.mode] += 1
        return self.mode

    def resolve(self, mode: str, rid, served: bool) -> None:
        outcomes = self._open.get(rid)
        if outcomes is None:
            return
        outcomes[self._index[mode]] = int(served)
        if _PENDING not in outcomes:
            del self._open[rid]
            self.long.add(tuple(outcomes))
            self.recent.add(tuple(outcomes))
            self.audited += 1
            if self.auto:
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

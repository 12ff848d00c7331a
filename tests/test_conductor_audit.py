"""The self-auditing admission: its window, its hysteresis and its bound, and the replay
that follows it (shadows of every fixed mode, the live run forked from one on a switch)."""
import random

import numpy as np
import pytest

from conductor.audit import Audit
from conductor.costmodel import CostModel
from conductor.simulator import FORECAST_EVERY, SimConfig, Simulator, replay
from conductor.trace import TraceRequest

MODES = ("baseline", "early", "predictive")


def feed(audit: Audit, rid: int, outcomes: dict[str, bool], at_s: float) -> None:
    """One arrival at ``at_s``: the audit's look before its decision, then its outcomes."""
    audit.decided(at_s)
    audit.arrived(rid)
    for mode, served in outcomes.items():
        audit.resolve(mode, rid, served)


def test_a_request_counts_for_a_mode_when_that_mode_serves_it():
    a = Audit(MODES, "predictive", window_s=10, recent_s=5, margin=0, z=0, min_audited=0)
    a.decided(0.0)
    a.arrived(0)
    a.resolve("baseline", 0, False)             # turned away: never counts
    a.resolve("predictive", 0, True)
    assert a.scores == [0, 0, 1] and a.long.differ(0, 2) == 1 and a.long.differ(0, 1) == 0
    a.decided(1.0)          # counted at the clock when served, not at the arrival's time
    a.arrived(1)
    a.resolve("early", 0, True)                 # arrival 0 served later by another mode
    assert a.scores == [0, 1, 1] and a.long.differ(1, 2) == 0 and a.long.differ(0, 1) == 1
    a.decided(5.5)                              # the recent window no longer holds 0.0
    assert a.recent.scores == [0, 1, 0] and a.recent.differ(1, 2) == 1
    a.decided(10.5)
    assert a.scores == [0, 1, 0] and len(a.long) == 1
    a.decided(11.5)
    assert a.scores == [0, 0, 0] and a.long.differ(1, 2) == 0 and len(a.long) == 0


def test_an_arrival_enters_the_fate_windows_once_every_mode_resolved_it():
    a = Audit(MODES, "predictive", window_s=100, recent_s=100, margin=0, z=0, min_audited=0)
    a.arrived(0)
    a.arrived(1)
    a.resolve("baseline", 0, False)
    a.resolve("early", 0, False)
    long_fates = a.fates[0]
    assert len(long_fates) == 0             # one mode still pending on arrival 0
    for m in MODES:
        a.resolve(m, 1, True)               # a later arrival need not wait for it
    assert len(long_fates) == 1 and long_fates.scores == [1, 1, 1]
    a.resolve("predictive", 0, True)
    assert len(long_fates) == 2 and long_fates.scores == [1, 1, 2]
    assert long_fates.differ(0, 2) == 1 and long_fates.differ(0, 1) == 0
    a.resolve("baseline", 0, True)          # an outcome for an arrival already in: ignored
    assert long_fates.scores == [1, 1, 2] and a.scores == [2, 1, 2]


def one_arrival_a_second(seconds: int, outcomes) -> Audit:
    """An audit (windows of 20 and 10 s, any lead switches) fed arrival t at t s for
    ``seconds``, each second's ``outcomes(t)`` (mode, request, served) resolved then."""
    a = Audit(MODES, "predictive", window_s=20, recent_s=10, margin=0, z=0, min_audited=0)
    for t in range(seconds):
        a.decided(float(t))
        a.arrived(t)
        for mode, rid, served in outcomes(t):
            a.resolve(mode, rid, served)
    a.decided(float(seconds))
    return a


def test_a_lead_counted_by_service_only_does_not_switch():
    # early serves each arrival at once, predictive arrival k at 2k s (its holds growing):
    # the arrivals every mode has resolved were served by both, but in the seconds so far
    # early has served more
    a = one_arrival_a_second(30, lambda t: [("baseline", t, False), ("early", t, True)]
                             + [("predictive", t // 2, True)] * (t % 2 == 0))
    early, predictive = 1, 2
    assert a.long.lead(early, predictive) == 10 and a.recent.lead(early, predictive) == 5
    assert a.fates[0].lead(early, predictive) == 0 and len(a.fates[0]) == 10
    assert a.mode == "predictive" and a.switches == []


def test_a_lead_counted_by_arrival_only_does_not_switch():
    # the baseline serves every arrival at once, predictive turns them away but serves one
    # request a second that it admitted before (a queue being worked off): by arrival the
    # baseline leads, in the seconds so far the two served as many (a first fill)
    a = one_arrival_a_second(30, lambda t: [("baseline", t, True), ("early", t, False),
                                            ("predictive", t, False),
                                            ("predictive", ("queued", t), True)])
    baseline, predictive = 0, 2
    assert a.fates[0].lead(baseline, predictive) == 20 and a.fates[1].lead(baseline, predictive) == 10
    assert a.long.lead(baseline, predictive) == 0
    assert a.mode == "predictive" and a.switches == []
    a.resolve("baseline", ("queued", 29), True)     # now ahead by service too: it switches
    a.decided(30.5)
    assert a.mode == "baseline"


def test_the_windows_slide_in_time():
    # one arrival a second; the long window keeps 3.5 s of audited arrivals, the recent 1.5 s
    a = Audit(MODES, "predictive", window_s=3.5, recent_s=1.5, margin=0, z=100, min_audited=0)
    for t in range(4):
        feed(a, t, {"baseline": True, "early": False, "predictive": False}, float(t))
    assert a.scores == [4, 0, 0] and a.recent.scores == [2, 0, 0]
    for t in range(4, 7):
        feed(a, t, {"baseline": False, "early": True, "predictive": False}, float(t))
    assert a.scores == [1, 3, 0] and a.recent.scores == [0, 2, 0] and a.audited == 7


@pytest.mark.parametrize("rate", [10.0, 100.0])
def test_a_window_spans_the_same_seconds_at_any_arrival_rate(rate):
    # a count of arrivals would be 4 s of a trace at 128 requests a second and the whole
    # run at 16: a window in seconds holds what came in its span, whatever the rate
    a = Audit(MODES, "predictive", window_s=30, recent_s=15, margin=0, z=100, min_audited=0)
    for rid in range(int(90 * rate)):
        feed(a, rid, {m: True for m in MODES}, rid / rate)
    assert len(a.long) == pytest.approx(30 * rate, abs=2)
    assert len(a.recent) == pytest.approx(15 * rate, abs=2)


def test_no_switch_on_a_lead_within_chance_nor_on_ties():
    # 64 arrivals split: predictive served the first 28, the baseline the last 36. A lead
    # of 8 on 64 split arrivals is 1 standard deviation: no switch at z = 3.
    a = Audit(MODES, "predictive", window_s=1e6, recent_s=1e6, margin=0.0, z=3.0,
              min_audited=0)
    for rid in range(64):
        feed(a, rid, {"baseline": rid >= 28, "early": rid < 32, "predictive": rid < 28}, rid)
    a.decided(64)
    assert a.scores == [36, 32, 28]
    assert a.mode == "predictive" and a.switches == []
    b = Audit(MODES, "early", window_s=16, recent_s=8, margin=0.0, z=0.0, min_audited=0)
    for rid in range(16):
        feed(b, rid, {m: True for m in MODES}, rid)
    assert b.mode == "early"            # equal scores never switch


def test_a_lead_beyond_chance_switches_once_and_the_modes_do_not_flap():
    a = Audit(MODES, "predictive", window_s=10.0, recent_s=2.5, margin=0.01, z=3.0,
              min_audited=0)
    rng = random.Random(1)
    for rid in range(2000):
        # 100 arrivals a second; the baseline serves 10 points more, the others are coin
        # flips at 0.6
        feed(a, rid, {"baseline": rng.random() < 0.7, "early": rng.random() < 0.6,
                      "predictive": rng.random() < 0.6}, rid / 100)
    assert a.mode == "baseline"
    assert [(f, t) for _, f, t in a.switches] == [("predictive", "baseline")]


def test_no_switch_before_min_audited_arrivals():
    a = Audit(MODES, "predictive", window_s=100, recent_s=10, margin=0.0, z=0.0,
              min_audited=25)
    for rid in range(25):
        feed(a, rid, {"baseline": True, "early": False, "predictive": False}, rid * 0.1)
    assert a.mode == "predictive" and a.challengers() == ["baseline"]
    assert a.decided(2.5) == "baseline"     # the look before the 26th arrival's decision


def test_a_long_lead_that_the_recent_window_contradicts_does_not_switch():
    # the baseline served more early on; lately predictive serves more: no switch
    a = Audit(MODES, "predictive", window_s=100, recent_s=10, margin=0.0, z=2.0,
              min_audited=400)
    for rid in range(300):
        feed(a, rid, {"baseline": True, "early": False, "predictive": False}, rid * 0.1)
    for rid in range(300, 500):
        feed(a, rid, {"baseline": rid % 2 == 0, "early": False, "predictive": True}, rid * 0.1)
    a.decided(50.0)
    assert a.scores[0] - a.scores[2] == 200 and a.recent.scores[2] > a.recent.scores[0]
    assert a.mode == "predictive" and a.switches == []


def test_a_lead_from_the_first_fill_leaves_the_windows_and_the_mode_it_beat_returns():
    # the baseline serves more while the cluster first fills (20 s), predictive after it:
    # the audit follows the baseline, and once its lead is older than the long window it
    # no longer holds the mode in force (a window of the run so far would keep it)
    a = Audit(MODES, "predictive", window_s=30, recent_s=15, margin=0.02, z=3.0,
              min_audited=100)
    rng = random.Random(3)
    for rid in range(9000):
        t = rid / 100
        odds = (0.8, 0.5, 0.5) if t < 20 else (0.5, 0.5, 0.65)
        feed(a, rid, {m: rng.random() < p for m, p in zip(MODES, odds)}, t)
    steps = [(f, to) for _, f, to in a.switches]
    assert steps == [("predictive", "baseline"), ("baseline", "predictive")]
    assert a.switches[1][0] < 6000      # back within a window or so of the change at 20 s


@pytest.mark.parametrize("seed", range(3))
def test_no_mode_ever_beats_the_one_in_force_beyond_chance_in_both_windows(seed):
    # outcomes whose odds drift between the modes, resolved out of order: after every
    # look, no mode leads the one in force by more than max(margin x n, z sqrt(d)) over
    # both the long and the recent window (the bound)
    a = Audit(MODES, "predictive", window_s=5.0, recent_s=1.25, margin=0.01, z=2.0,
              min_audited=64)
    rng = random.Random(seed)
    pending: list[tuple[str, int, bool]] = []
    for rid in range(3000):
        phase = (rid // 700) % 3
        odds = [0.5 + 0.2 * (phase == i) for i in range(3)]
        a.decided(rid / 100)
        assert a.audited < 64 or a.challengers() == []
        a.arrived(rid)
        pending += [(m, rid, rng.random() < odds[i]) for i, m in enumerate(MODES)]
        rng.shuffle(pending)
        for _ in range(len(pending) // 2):
            a.resolve(*pending.pop())
    for item in pending:
        a.resolve(*item)
    a.decided(30.0)
    assert a.challengers() == []
    assert len(a.switches) >= 2         # it followed the drift


def overloaded_trace(n: int = 400) -> list[TraceRequest]:
    # 15 prefill nodes, one small decode instance: decode memory binds, and a request's
    # prefill is long enough for the modes to differ
    rng = random.Random(7)
    trace = []
    for i in range(n):
        length = rng.choice((2000, 6000, 12000))
        trace.append(TraceRequest(i * 0.05, length, rng.randint(20, 400),
                                  tuple(range(i * 100, i * 100 + -(-length // 512)))))
    return trace


COST = CostModel.from_testbed()
SMALL = CostModel(**{**COST.as_dict(), "decode_capacity_tokens": 60_000})


def test_audited_shadows_are_the_fixed_modes_and_without_a_switch_the_run_is_predictive():
    trace = overloaded_trace()
    sim = Simulator(trace, SimConfig(prefill=15, decode=1, admission="audited"), SMALL)
    summary = sim.run()
    for mode in MODES:
        fixed, _ = replay(trace, SimConfig(prefill=15, decode=1, admission=mode), SMALL)
        shadow = sim.shadow_summaries[mode]
        assert (shadow.rejected, shadow.completed_in_slo, shadow.wasted_prefill_s) == \
            (fixed.rejected, fixed.completed_in_slo, fixed.wasted_prefill_s)
    assert sim.audit.switches == []     # fewer than MIN_AUDITED arrivals: no switch
    p = sim.shadow_summaries["predictive"]
    assert (summary.admission, summary.rejected, summary.completed_in_slo) == \
        ("audited", p.rejected, p.completed_in_slo)


def test_on_a_switch_the_live_run_forks_and_follows_the_mode_in_force():
    # a hair trigger: any lead switches, from the first audited arrival
    trace = overloaded_trace()
    audit = Audit(MODES, "early", window_s=1.6, recent_s=0.4, margin=0.0, z=0.0,
                  min_audited=0)
    sim = Simulator(trace, SimConfig(prefill=15, decode=1, admission="audited"), SMALL,
                    audit=audit)
    summary = sim.run()
    assert audit.switches and audit.switches[0][1] == "early"
    assert sum(audit.in_force.values()) == len(trace)
    assert sim.admission.mode == "audited"
    assert summary.requests == len(trace)
    assert summary.rejected + summary.completed_in_slo <= len(trace)
    # the shadow the live run forked from went on as the fixed mode
    fixed, _ = replay(trace, SimConfig(prefill=15, decode=1, admission="early"), SMALL)
    assert sim.shadow_summaries["early"].rejected == fixed.rejected


class NoStore:
    """A store that holds nothing (the live conductor asks it for prefixes)."""

    def match_prefix(self, keys):
        return 0

    def locate(self, keys):
        return []


def test_live_audited_admission_replays_the_fixed_modes_on_the_arrivals_it_schedules():
    from client import BlockHasher
    from conductor.admission import Admission, Slo
    from conductor.live import LiveConductor
    from conductor.policy import make_policy

    now = [10.0]
    live = LiveConductor(make_policy("kvcache-centric", COST), Admission("audited", Slo()), COST,
                         NoStore(), BlockHasher("audit", 512), clock=lambda: now[0])
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        live.register(name, role, f"{name}:1")
    for i in range(40):
        now[0] += 0.1
        keys = live.block_keys(list(range(i % 4, i % 4 + 1024)))   # 4 shared prompts
        live.schedule(f"r{i}", keys, 1024, 16)
        for name in ("p0", "p1", "d0"):
            live.report(name, 0.0, 0, 0)
    audit = live.audit
    assert len(audit.trace) == 40 and sum(audit.audit.in_force.values()) == 40
    assert set(audit.shadows) == set(MODES)
    assert all(s.out.n == 40 for s in audit.shadows.values())
    assert audit.audit.audited > 0                  # the shadows resolve what they serve
    live.register("d1", "decode", "d1:1")           # the cluster changed: the shadows restart
    live.report("d1", 0.0, 0, 0)
    live.schedule("r-next", [], 100, 8)
    assert audit.restarts == 1 and len(audit.trace) == 1 and audit.shape == (2, 2)


class Scripted(Audit):
    """An audit whose mode in force follows a script: [(first arrival, mode), ...]."""

    def __init__(self, script: list[tuple[int, str]]):
        super().__init__(MODES, script[0][1])
        self.script, self.seen = script, 0

    def decide(self) -> None:
        mode = [m for first, m in self.script if first <= self.seen][-1]
        if mode != self.mode:
            self.switches.append((self.audited, self.mode, mode))
            self.mode = mode
        self.seen += 1


def test_following_another_mode_the_replay_forecasts_one_arrival_in_forecast_every():
    trace = overloaded_trace()
    audit = Scripted([(0, "predictive"), (100, "baseline"), (300, "predictive")])
    sim = Simulator(trace, SimConfig(prefill=15, decode=1, admission="audited"), SMALL, audit=audit)
    filed = {}
    original = Simulator._arrive

    def arrive(live, rid, req, now):
        if rid == 300 and live is not sim.shadows["predictive"] and live.cfg.admission == "audited":
            filed["live"] = sum(d.odds._seq for d in live.decodes)
            filed["shadow"] = sum(d.odds._seq for d in sim.shadows["predictive"].decodes)
        return original(live, rid, req, now)

    Simulator._arrive = arrive
    try:
        sim.run()
    finally:
        Simulator._arrive = original
    assert [s[1:] for s in audit.switches] == [("predictive", "baseline"), ("baseline", "predictive")]
    assert sim.admission.forecast_every == FORECAST_EVERY > 1
    # by arrival 300 the predictive shadow forecast each arrival it did not reject for its TTFT;
    # the live run the same for the first 100 (it forked from that shadow), then one in
    # FORECAST_EVERY of the 200 under the baseline
    following = filed["live"] - filed["shadow"] * 100 // 300
    assert 0 < filed["live"] < filed["shadow"]
    assert abs(following - 200 // FORECAST_EVERY) <= 200 // FORECAST_EVERY


def test_the_live_conductor_forecasts_every_arrival_while_following():
    from conductor.admission import Admission, Slo
    admission = Admission("audited", Slo())
    assert admission.forecast_every == 1
    admission.follow = "baseline"
    assert all(admission._forecasts_while_following() for _ in range(10))


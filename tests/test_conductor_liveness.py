"""The live conductor stops scheduling onto an instance whose load reports stop, and takes it back when
they resume. A hand-driven clock stands in for time; the store is a real `kvstore serve` (the `server`
fixture), except where a stand-in answers KV.LOCATE late or not at all (reports must not wait on the store),
and the gRPC half runs the conductor's real server with a real gRPC client as the front end."""
from __future__ import annotations

import math
import threading
import time

import grpc
import pytest

from client import BlockHasher, KVClient, KVError
from client.operations import Location
from conductor.admission import Admission, Slo
from conductor.costmodel import CostModel
from conductor.live import DEAD, FORGET_AFTER_TIMEOUTS, LIVE, MAX_PREFILL_INSTANCES, LiveConductor
from conductor.policy import make_policy
from conductor.service import pb, pb_grpc, serve

TIMEOUT_S = 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def conductor(server, clock):
    store = KVClient(server.host, server.port, unix_socket=None)
    cost = CostModel.from_testbed()
    live = LiveConductor(make_policy("random", cost), Admission("none", Slo(30.0, 0.1)), cost, store,
                         BlockHasher("liveness", 16), report_timeout_s=TIMEOUT_S, clock=clock)
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        live.register(name, role, f"{name}:1")
    yield live
    store.close()


def placements(live: LiveConductor, n: int = 40) -> set[tuple[str, str]]:
    return {(d.prefill, d.decode) for d in (live.schedule(f"r{i}", [], 100, 8) for i in range(n))}


def test_a_silent_instance_gets_nothing_even_from_random_and_comes_back_when_it_reports(conductor, clock):
    assert {p for p, _ in placements(conductor)} == {"p0", "p1"}
    clock.now += TIMEOUT_S - 0.5
    conductor.report("p1", 0.0, 0, 0)
    conductor.report("d1", 0.0, 0, 0)
    clock.now += 1.0                        # p0 and d0 silent for longer than the timeout
    assert conductor.status() == {"p0": DEAD, "p1": LIVE, "d0": DEAD, "d1": LIVE}
    assert placements(conductor) == {("p1", "d1")}
    conductor.report("p0", 0.0, 0, 0)
    conductor.report("d0", 0.0, 0, 0)
    assert set(conductor.status().values()) == {LIVE}
    chosen = placements(conductor)
    assert {p for p, _ in chosen} == {"p0", "p1"} and {d for _, d in chosen} == {"d0", "d1"}


def test_no_live_instance_of_a_role_is_a_clear_error_not_a_dead_address(conductor, clock):
    clock.now += TIMEOUT_S + 1
    conductor.report("d0", 0.0, 0, 0)
    with pytest.raises(LookupError, match="no prefill instance has reported"):
        conductor.schedule("r", [], 100, 8)


def test_an_unreachable_instance_is_dead_at_once_until_its_own_report(conductor):
    conductor.mark_unreachable("p0")
    assert conductor.status()["p0"] == DEAD
    assert {p for p, _ in placements(conductor)} == {"p1"}
    conductor.report("p0", 0.0, 0, 0)
    assert conductor.status()["p0"] == LIVE
    with pytest.raises(KeyError):
        conductor.mark_unreachable("nobody")


def test_a_report_sent_before_the_unreachable_mark_does_not_take_the_instance_back(conductor, clock):
    conductor.mark_unreachable("p0")
    clock.now += 0.5
    conductor.report("p0", 0.0, 0, 0, age_s=1.0)        # on its way when the mark came
    assert conductor.status()["p0"] == DEAD
    assert {p for p, _ in placements(conductor)} == {"p1"}
    conductor.report("p0", 0.0, 0, 0, age_s=0.2)        # sent after the mark
    assert conductor.status()["p0"] == LIVE


def test_a_long_silent_instance_gives_its_place_and_cache_record_to_a_newcomer(conductor, clock):
    keys = conductor.block_keys(list(range(64)))
    while conductor.schedule("r", keys, 64, 8).prefill != "p0":
        pass
    assert conductor.directory.prefix_matches(keys, 2)[0] == len(keys)
    clock.now += FORGET_AFTER_TIMEOUTS * TIMEOUT_S - 1
    for name in ("p1", "d1"):
        conductor.report(name, 0.0, 0, 0)
    conductor.register("p2", "prefill", "p2:1")          # p0 and d0 are not yet silent long enough
    assert conductor.prefill_ids == ["p0", "p1", "p2"]
    clock.now += 1
    conductor.register("p3", "prefill", "p3:1")
    conductor.register("d2", "decode", "d2:1")
    assert conductor.prefill_ids == ["p3", "p1", "p2"] and conductor.decode_ids == ["d2", "d1"]
    assert conductor.status() == {"p1": LIVE, "p2": LIVE, "p3": LIVE, "d1": LIVE, "d2": LIVE}
    assert conductor.directory.prefix_matches(keys, 3)[0] == 0      # p3 holds nothing of p0's
    assert "p0" not in conductor.addresses
    with pytest.raises(KeyError):
        conductor.report("p0", 0.0, 0, 0)               # a forgotten instance must register again


def test_restarted_workers_under_new_ids_never_hit_the_prefill_cap(conductor, clock):
    for generation in range(3):
        for i in range(MAX_PREFILL_INSTANCES - 2):            # with p0 and p1: all the places
            conductor.register(f"prefill-{generation}-{i}", "prefill", "p:1")
        clock.now += FORGET_AFTER_TIMEOUTS * TIMEOUT_S
    assert len(conductor.prefill_ids) == MAX_PREFILL_INSTANCES
    assert len(conductor.status()) == MAX_PREFILL_INSTANCES + 2     # and the two decode instances


class SlowStore:
    """A store that holds every block of a prompt and answers KV.LOCATE only when ``answer`` is set."""

    def __init__(self) -> None:
        self.answer, self.asked = threading.Event(), threading.Event()

    def match_prefix(self, keys) -> int:
        return len(keys)

    def locate(self, keys) -> list[Location]:
        self.asked.set()
        self.answer.wait(10.0)
        return [Location("ssd", 1000) for _ in keys]


def pulling_from(store, clock: Clock) -> LiveConductor:
    """A conductor whose placements pull a prefix from ``store`` (one prefill and one decode instance)."""
    cost = CostModel.from_testbed()
    live = LiveConductor(make_policy("kvcache-centric", cost), Admission("none", Slo(30.0, 0.1)), cost, store,
                         BlockHasher("liveness", 16), report_timeout_s=TIMEOUT_S, clock=clock)
    live.register("p0", "prefill", "p0:1")
    live.register("d0", "decode", "d0:1")
    return live


def test_reports_are_taken_while_the_store_answers_a_locate(clock):
    store = SlowStore()
    live = pulling_from(store, clock)
    decisions = []
    scheduling = threading.Thread(target=lambda: decisions.append(live.schedule("r", ["k1", "k2"], 32, 8)))
    scheduling.start()
    assert store.asked.wait(5.0)
    reported = threading.Thread(target=live.report, args=("d0", 0.0, 1, 100))
    reported.start()
    reported.join(2.0)
    stalled = reported.is_alive()               # a slow store must not hold up the instances' reports
    store.answer.set()
    scheduling.join(5.0)
    reported.join(5.0)
    assert not stalled
    [decision] = decisions
    assert (decision.fetch_from, decision.fetch_bytes, decision.fetch_tiers) == ("store", 2000, ["ssd"])


def test_a_locate_that_fails_leaves_the_placed_request_without_fetch_hints(clock):
    class FailingStore(SlowStore):
        def locate(self, keys):
            raise KVError("the node went away")
    live = pulling_from(FailingStore(), clock)
    decision = live.schedule("r", ["k1", "k2"], 32, 8)
    assert (decision.fetch_from, decision.fetch_bytes, decision.fetch_tiers) == ("store", 0, [])
    assert live.counters.scheduled == 1


def test_an_unreachable_report_over_grpc_shows_in_stats(conductor, clock):
    grpc_server, port = serve(conductor, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ConductorStub(channel)
    try:
        stub.ReportLoad(pb.LoadReport(instance_id="d1", unreachable=True))
        assert list(stub.Stats(pb.StatsRequest()).dead_instances) == ["d1"]
        reply = stub.Schedule(pb.ScheduleRequest(request_id="x", token_ids=list(range(40))))
        assert reply.decode_instance == "d0"
        clock.now += 1.0
        stub.ReportLoad(pb.LoadReport(instance_id="d1", sent_unix_s=time.time() - 5))   # on its way for 5 s
        assert list(stub.Stats(pb.StatsRequest()).dead_instances) == ["d1"]
        with pytest.raises(grpc.RpcError) as failed:
            stub.ReportLoad(pb.LoadReport(instance_id="d1", sent_unix_s=math.nan))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub.ReportLoad(pb.LoadReport(instance_id="d1", sent_unix_s=time.time()))
        assert list(stub.Stats(pb.StatsRequest()).dead_instances) == []
        with pytest.raises(grpc.RpcError) as failed:
            stub.ReportLoad(pb.LoadReport(instance_id="nobody", unreachable=True))
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()
        grpc_server.stop(None).wait()

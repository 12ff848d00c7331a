"""Membership against a real etcd (started per test): election, the watched map, a member killed
with SIGKILL, an etcd restart, an unreachable etcd, a duplicate address, and `start_cluster`."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from kvstore.cluster.etcd_kv import EtcdKV
from kvstore.cluster.membership import ClusterError, EtcdMembership
from kvstore.cluster.node import ClusterState, new_node_id
from kvstore.cluster.runner import start_cluster
from kvstore.cluster.slots import SLOTS, SlotMap
from tests.conftest import WAIT_S, free_port, until

NODE_TIMEOUT = 2
# What a loaded 2-core CI host may add to a wait on top of the timeout that bounds it: to a
# reassignment after the lease TTL, etcd's lease sweep, the watch event, the leader's map write and
# every member's apply; to a refused or failed start, the etcd calls and event-loop turns around its
# wait. Each can wait a second or more for a CPU there.
LOADED_HOST_MARGIN_S = 5.0
# A member refuses an address announced by a live node once it has waited out one lease TTL and a
# second (`EtcdMembership._register`: a dead holder's registration would have expired by then).
ADDRESS_WAIT_S = NODE_TIMEOUT + 1
# How long `start_cluster` retries an unreachable etcd in the test that times it.
CONNECT_TIMEOUT_S = 1
# A clean leave is timed against a lease long enough that only the leave itself (a revoked lease,
# not an expired one) can explain a convergence within it, with that TTL as the margin for load.
LEAVE_NODE_TIMEOUT = 10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def member(etcd, announce: str, name: str = "t", node_timeout: float = NODE_TIMEOUT, **kwargs) -> ClusterState:
    kv = EtcdKV("127.0.0.1", etcd.client_port, timeout=1)
    return ClusterState(new_node_id(), announce, EtcdMembership(kv, name, node_timeout, **kwargs))


def converged(states: list[ClusterState], ids: set[str] | None = None) -> bool:
    """Same full map of exactly ``ids`` everywhere; with ``ids`` None, one leader among ``states`` too."""
    leaders_ok = ids is not None or sum(s.is_leader for s in states) == 1
    ids = ids if ids is not None else {s.my_id for s in states}
    return (len({s.map.epoch for s in states}) == 1 and all(s.ok and set(s.map.nodes) == ids for s in states)
            and leaders_ok)


async def wait_converged(states: list[ClusterState], limit: float, ids: set[str] | None = None) -> None:
    """Wait until `converged`; an AssertionError past ``limit`` seconds (a timed test's bound)."""
    start = time.monotonic()
    while not converged(states, ids):
        if time.monotonic() - start > limit:
            raise AssertionError(f"no convergence within {limit} s: epochs {[s.map.epoch for s in states]}, "
                                 f"leaders {[s.is_leader for s in states]}")
        await asyncio.sleep(0.02)


async def stored_map(etcd, name: str = "t") -> SlotMap:
    kv = EtcdKV("127.0.0.1", etcd.client_port)
    try:
        _, found = await kv.get_prefix(f"/kvstore/{name}/slotmap".encode())
        return SlotMap.from_json(found[0].value)
    finally:
        await kv.close()


def test_three_members_elect_one_leader_and_apply_the_written_map(etcd):
    async def scenario():
        states = [member(etcd, f"127.0.0.1:{7001 + i}", node_timeout=LEAVE_NODE_TIMEOUT) for i in range(3)]
        await asyncio.gather(*(s.start() for s in states))
        await wait_converged(states, WAIT_S)
        in_etcd = await stored_map(etcd)
        assert all(s.map.same_as(in_etcd) for s in states)
        assert sorted(in_etcd.counts.values()) == [5461, 5461, 5462]
        assert sum(s.mine.count(1) for s in states) == SLOTS
        leaving = states.pop()
        await leaving.stop()                                     # a clean leave moves its slots at once
        await wait_converged(states, LEAVE_NODE_TIMEOUT)         # a lapsed lease would take longer
        for s in states:
            await s.stop()
    asyncio.run(scenario())


CHILD = """
import asyncio, sys
from kvstore.cluster.runner import start_cluster
async def main():
    state = await start_cluster(sys.argv[1], sys.argv[2], node_timeout=float(sys.argv[3]))
    print(state.my_id, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def test_a_member_killed_with_sigkill_loses_its_slots_within_the_node_timeout(etcd):
    child = subprocess.Popen([sys.executable, "-c", CHILD, f"etcd://127.0.0.1:{etcd.client_port}/t",
                              "127.0.0.1:7009", str(NODE_TIMEOUT)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        victim_id = child.stdout.readline().strip()
        assert len(victim_id) == 40, "the member process did not join"

        async def scenario():
            states = [member(etcd, f"127.0.0.1:{7001 + i}") for i in range(2)]
            await asyncio.gather(*(s.start() for s in states))
            await wait_converged(states, WAIT_S, {s.my_id for s in states} | {victim_id})
            assert all(s.map.counts[victim_id] > 5000 for s in states)
            child.send_signal(signal.SIGKILL)
            within = NODE_TIMEOUT + LOADED_HOST_MARGIN_S     # the lease TTL, then the reassignment
            await wait_converged(states, within)             # (an AssertionError past it)
            for s in states:
                await s.stop()
        asyncio.run(scenario())
    finally:
        child.kill()
        child.wait()


def test_members_keep_their_map_while_etcd_is_down_and_resume_watching_after(etcd):
    async def scenario():
        states = [member(etcd, f"127.0.0.1:{7001 + i}") for i in range(3)]
        await asyncio.gather(*(s.start() for s in states))
        await wait_converged(states, WAIT_S)
        before = states[0].map
        mine_before = [s.mine for s in states]
        etcd.stop()
        await asyncio.sleep(NODE_TIMEOUT + 1)                   # past every lease
        await until(lambda: not any(s.membership.reachable for s in states), what="every member to miss etcd")
        assert all(s.map is before or s.map.same_as(before) for s in states)
        assert [s.mine for s in states] == mine_before          # still serving the same slots
        etcd.start()
        states.append(member(etcd, "127.0.0.1:7004"))
        await states[-1].start()
        await wait_converged(states, WAIT_S)                     # the old members saw the newcomer
        assert all(s.membership.reachable for s in states)
        assert states[0].map.epoch > before.epoch
        for s in states:
            await s.stop()
    asyncio.run(scenario())


def test_a_second_member_on_a_live_address_is_refused(etcd):
    async def scenario():
        first = member(etcd, "127.0.0.1:7001")
        await first.start()
        start = time.monotonic()
        with pytest.raises(ClusterError, match=f"127.0.0.1:7001 is already announced by node {first.my_id}"):
            await member(etcd, "127.0.0.1:7001").start()
        assert ADDRESS_WAIT_S <= time.monotonic() - start < ADDRESS_WAIT_S + LOADED_HOST_MARGIN_S
        await first.stop()
    asyncio.run(scenario())


def test_an_unreachable_etcd_fails_the_start_with_a_clear_message_after_a_bounded_wait():
    port = free_port()

    async def scenario():
        start = time.monotonic()
        with pytest.raises(ClusterError, match=f"cannot reach etcd at http://127.0.0.1:{port} for cluster "
                                               f"'t' within {CONNECT_TIMEOUT_S} s"):
            await start_cluster(f"etcd://127.0.0.1:{port}/t", "127.0.0.1:7001", NODE_TIMEOUT,
                                connect_timeout=CONNECT_TIMEOUT_S)
        # Retried until the connect timeout; the last try, begun just before it, is in the margin.
        assert CONNECT_TIMEOUT_S <= time.monotonic() - start < CONNECT_TIMEOUT_S + LOADED_HOST_MARGIN_S
    asyncio.run(scenario())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_start_cluster_runs_in_a_plain_event_loop_and_a_clean_stop_deregisters(etcd, loop):
    """The server's loop is uvloop when installed: aetcd's gRPC must work on both."""
    async def scenario():
        url = f"etcd://127.0.0.1:{etcd.client_port}/plain"
        state = await start_cluster(url, "127.0.0.1:7001", NODE_TIMEOUT)
        await wait_converged([state], WAIT_S)
        assert state.is_mine(0) and state.map.nodes == {state.my_id: "127.0.0.1:7001"}
        await state.stop()
        kv = EtcdKV("127.0.0.1", etcd.client_port)
        _, left = await kv.get_prefix(b"/kvstore/plain/nodes/")
        await kv.close()
        assert left == []
    (pytest.importorskip("uvloop").run if loop == "uvloop" else asyncio.run)(scenario())


def _cluster_info(addrs) -> list[dict]:
    import redis
    return [redis.Redis(host, port, socket_timeout=5).execute_command("CLUSTER", "INFO") for host, port in addrs]


def _epoch_and_state(addrs) -> list[tuple[int, str]]:
    out = []
    for info in _cluster_info(addrs):
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        out.append((int(fields["cluster_current_epoch"]), fields["cluster_state"]))
    return out


def test_an_etcd_paused_past_every_lease_moves_no_slot_and_loses_no_value(cluster_factory):
    """SIGSTOP etcd for longer than the lease ttl, then SIGCONT: etcd drops every lease and registration
    at once when it resumes. No node failed, so no slot may move and every value stays readable."""
    from client import KVClusterClient
    ttl = NODE_TIMEOUT
    up = cluster_factory(nodes=3, dram_size="16mb", extra=("--node-timeout", str(ttl)))
    addrs = [f"{h}:{p}" for h, p in up.addrs]
    keys = [b"pause-%04d" % i for i in range(600)]
    with KVClusterClient(addrs, fast_path="off") as kv:
        until_sync(lambda: {s for _, s in _epoch_and_state(up.addrs)} == {"ok"}, WAIT_S)
        for key in keys:
            kv.put(key, key * 8)
        before = _epoch_and_state(up.addrs)
        assert len(set(before)) == 1
        os.kill(up.info["etcd_pid"], signal.SIGSTOP)
        try:
            time.sleep(ttl + 2)                     # every lease lapses on etcd's side
        finally:
            os.kill(up.info["etcd_pid"], signal.SIGCONT)
        # The leader looks again once the grace (ttl + 1 s) after its last etcd failure is over;
        # wait that, a keep-alive period and a 2 s margin for this shared machine.
        time.sleep(ttl + 1 + ttl / 3 + 2)
        assert _epoch_and_state(up.addrs) == before
        assert [kv.get(key) for key in keys] == [key * 8 for key in keys]


def until_sync(predicate, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)

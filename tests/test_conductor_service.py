"""The gRPC conductor against a real store: starts `kvstore serve` (the `server`
fixture) and the conductor's gRPC server on loopback; real gRPC clients stand
in for the instances and the front end."""
import grpc
import pytest

from client import BlockHasher, KVClient
from conductor.admission import Admission, Slo
from conductor.costmodel import CostModel
from conductor.live import LiveConductor
from conductor.policy import make_policy
from conductor.service import pb, pb_grpc, serve

BLOCK = 16


@pytest.fixture
def live(server):
    store = KVClient(server.host, server.port, unix_socket=None)
    cost = CostModel.from_testbed()
    conductor = LiveConductor(make_policy("kvcache-centric", cost),
                              Admission("baseline", Slo(30.0, 0.1)), cost, store,
                              BlockHasher("test-model", BLOCK))
    grpc_server, port = serve(conductor, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.ConductorStub(channel), store, conductor.hasher
    channel.close()
    grpc_server.stop(None).wait()
    store.close()


def register(stub):
    for name, role in (("p0", pb.PREFILL), ("p1", pb.PREFILL), ("d0", pb.DECODE)):
        stub.RegisterInstance(pb.InstanceInfo(instance_id=name, role=role, address=name))


def test_schedule_uses_the_store_prefix(live):
    stub, store, hasher = live
    register(stub)
    tokens = list(range(5 * BLOCK))
    keys = hasher.keys(tokens)
    parent = None
    for key in keys[:3]:
        store.put(key, b"x" * 100, parent=parent)
        parent = key
    reply = stub.Schedule(pb.ScheduleRequest(request_id="r1", token_ids=tokens,
                                             output_length=8))
    assert reply.store_blocks == 3
    assert reply.fetch_from == "store" and reply.fetch_bytes == 300
    assert list(reply.fetch_tiers) == ["dram"]
    assert reply.reused_tokens == 3 * BLOCK and reply.decode_instance == "d0"
    # The same prompt again: the whole chain now sits on the first prefill's node, which
    # is busy with r1, so the idle instance fetches all five blocks from it.
    again = stub.Schedule(pb.ScheduleRequest(request_id="r2", block_keys=keys,
                                             input_length=len(tokens)))
    assert again.prefill_instance != reply.prefill_instance
    assert again.fetch_from == reply.prefill_instance and again.local_blocks == 0
    stats = stub.Stats(pb.StatsRequest())
    assert stats.scheduled == 2 and stats.prefill_instances == 2 and stats.policy == "kvcache-centric"


def test_overload_is_resource_exhausted(live):
    stub, _, _ = live
    register(stub)
    for name in ("p0", "p1"):
        stub.ReportLoad(pb.LoadReport(instance_id=name, queued_prefill_s=100.0))
    with pytest.raises(grpc.RpcError) as err:
        stub.Schedule(pb.ScheduleRequest(block_keys=["k"], input_length=100))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "TTFT" in err.value.details()
    assert stub.Stats(pb.StatsRequest()).rejected_ttft == 1


def test_bad_calls(live):
    stub, _, _ = live
    with pytest.raises(grpc.RpcError) as err:
        stub.Schedule(pb.ScheduleRequest(block_keys=["k"], input_length=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportLoad(pb.LoadReport(instance_id="ghost"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterInstance(pb.InstanceInfo(instance_id="x"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

"""The gRPC face of the live conductor (proto/conductor.proto).

Each RPC validates its message, calls `LiveConductor`, and turns the
outcome into a reply or a status: a rejection is RESOURCE_EXHAUSTED (the
overload signal an HTTP gateway maps to 429), a malformed request
INVALID_ARGUMENT, scheduling before any instance registered
FAILED_PRECONDITION, a load report from an unknown instance NOT_FOUND, and
a store that cannot be reached UNAVAILABLE. A load report marked
`unreachable` comes from a front end that failed to reach the instance, not
from the instance: it takes the instance out of scheduling at once.
"""
from __future__ import annotations

import math
import time
from concurrent import futures

import grpc

from client import KVError
from conductor.live import DEAD, DECODE, PREFILL, LiveConductor, Rejected
from proto import grpc_codegen

pb, pb_grpc = grpc_codegen.load("conductor")

_ROLES = {pb.PREFILL: PREFILL, pb.DECODE: DECODE}


class ConductorService(pb_grpc.ConductorServicer):
    def __init__(self, conductor: LiveConductor):
        self.conductor = conductor

    def Schedule(self, request, context):
        keys = list(request.block_keys)
        if request.token_ids:
            if keys:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "give token_ids or block_keys, not both")
            keys = self.conductor.block_keys(list(request.token_ids))
        length = request.input_length or len(request.token_ids)
        if length < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "input_length is required with block_keys")
        try:
            d = self.conductor.schedule(request.request_id, keys, length,
                                        request.output_length)
        except Rejected as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rejected ({exc.reason}): {exc}")
        except LookupError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (KVError, OSError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {exc}")
        return pb.ScheduleReply(
            prefill_instance=d.prefill, decode_instance=d.decode,
            reused_tokens=min(d.placement.reused_blocks * self.conductor.hasher.block_tokens,
                              length),
            local_blocks=d.local_blocks, store_blocks=d.store_blocks,
            fetch_from=d.fetch_from, fetch_bytes=d.fetch_bytes, fetch_tiers=d.fetch_tiers,
            predicted_ttft_s=d.placement.ttft_s, predicted_tbt_s=d.predicted_tbt_s,
            prefill_address=self.conductor.addresses.get(d.prefill, ""),
            decode_address=self.conductor.addresses.get(d.decode, ""))

    def RegisterInstance(self, request, context):
        if not request.instance_id or request.role not in _ROLES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "an instance needs an instance_id and a role (PREFILL or DECODE)")
        try:
            self.conductor.register(request.instance_id, _ROLES[request.role], request.address)
        except ValueError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return pb.RegisterReply(prefill_instances=len(self.conductor.prefill_ids),
                                decode_instances=len(self.conductor.decode_ids))

    def ReportLoad(self, request, context):
        if request.queued_prefill_s < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "queued_prefill_s must be >= 0")
        if not 0 <= request.sent_unix_s < math.inf:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sent_unix_s must be a time (Unix seconds) or 0")
        try:
            if request.unreachable:
                self.conductor.mark_unreachable(request.instance_id)
            else:
                self.conductor.report(request.instance_id, request.queued_prefill_s,
                                      request.batch, request.kv_tokens, _age_s(request.sent_unix_s))
        except KeyError:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"instance '{request.instance_id}' is not registered")
        return pb.LoadAck()

    def Stats(self, request, context):
        c, live = self.conductor.counters, self.conductor
        return pb.StatsReply(
            scheduled=c.scheduled, rejected_ttft=c.rejected_ttft,
            rejected_decode=c.rejected_decode, reused_tokens=c.reused_tokens,
            input_tokens=c.input_tokens, prefill_instances=len(live.prefill_ids),
            decode_instances=len(live.decode_ids), policy=live.policy.name,
            admission=live.admission.mode,
            dead_instances=sorted(i for i, state in live.status().items() if state == DEAD))


def _age_s(sent_unix_s: float) -> float:
    """How long ago a report was sent, by the sender's clock against ours (0 when it did not say, or
    when its clock runs ahead)."""
    return max(0.0, time.time() - sent_unix_s) if sent_unix_s else 0.0


def serve(conductor: LiveConductor, host: str, port: int,
          workers: int = 8) -> tuple[grpc.Server, int]:
    """Start the gRPC server; returns it and the bound port (``port`` 0 picks a free one)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pb_grpc.add_ConductorServicer_to_server(ConductorService(conductor), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound

"""A worker process's gRPC face (proto/worker.proto) and its bond with the conductor.

One `Worker` service serves either role: a prefill worker answers `Prefill`, a
decode worker `Decode` (a stream of tokens); both answer `Timings` with the
rows the conductor's cost model can be fitted to. Bad requests become
INVALID_ARGUMENT, a full decode queue RESOURCE_EXHAUSTED, a store that fails
UNAVAILABLE: the caller always gets a status, never a hang.

`ConductorLink` registers the worker (id, role, address) and pushes its load
every `REPORT_INTERVAL_S`: queued prefill seconds, or the decode batch and its
KV tokens. A conductor that is down is retried on the next tick; the worker
keeps serving.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc

from client import KVError
from proto import grpc_codegen
from workers.decode import DecodeBusy, DecodeEngine
from workers.prefill import PrefillEngine
from workers.timings import Timings

pb, pb_grpc = grpc_codegen.load("worker")
cpb, cpb_grpc = grpc_codegen.load("conductor")

log = logging.getLogger(__name__)
REPORT_INTERVAL_S = 0.2
REPORT_DEADLINE_S = 2.0
STOP_TIMEOUT_S = REPORT_DEADLINE_S + 1.0
MAX_PROMPT_IDS = 1 << 20


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, timings: Timings, prefill: PrefillEngine | None = None, decode: DecodeEngine | None = None):
        self.timings = timings
        self.prefill_engine = prefill
        self.decode_engine = decode

    def Prefill(self, request, context):
        if self.prefill_engine is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this is a decode worker")
        ids = _prompt(request.token_ids, self.prefill_engine.loaded.max_tokens, context)
        reuse = None if request.reuse_tokens < 0 else request.reuse_tokens
        try:
            r = self.prefill_engine.prefill(request.request_id, ids, reuse, not request.skip_store)
        except (KVError, OSError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {exc}")
        return pb.PrefillReply(first_token=r.first_token, cached_tokens=r.cached_tokens,
                               stored_tokens=r.stored_tokens, load_s=r.load_s, compute_s=r.compute_s)

    def Decode(self, request, context):
        engine = self.decode_engine
        if engine is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this is a prefill worker")
        ids = _prompt(request.token_ids, engine.loaded.max_tokens, context)
        try:
            seq = engine.submit(request.request_id, ids, request.first_token, request.stored_tokens,
                                request.max_tokens)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except DecodeBusy as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        context.add_callback(seq.cancelled.set)
        try:
            for token, finish in engine.stream(seq):
                yield pb.DecodeToken(token=token, finish_reason=finish or "", recomputed=seq.recomputed)
        except (KVError, OSError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {exc}")
        except RuntimeError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def Timings(self, request, context):
        return pb.TimingsReply(rows_json=self.timings.to_json())


def _prompt(token_ids, max_tokens: int, context) -> list[int]:
    if not token_ids:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
    if len(token_ids) >= max_tokens:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{len(token_ids)} prompt tokens do not fit the model's context of {max_tokens}")
    return list(token_ids)


def serve(service: WorkerService, host: str, port: int, threads: int = 16) -> tuple[grpc.Server, int]:
    """Start the gRPC server; returns it and the bound port (``port`` 0 picks a free one)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    pb_grpc.add_WorkerServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound


class ConductorLink:
    """Registers this worker with the conductor and keeps its load report fresh."""

    def __init__(self, conductor: str, instance_id: str, role: str, address: str, load):
        self.channel = grpc.insecure_channel(conductor)
        self.stub = cpb_grpc.ConductorStub(self.channel)
        self.info = cpb.InstanceInfo(instance_id=instance_id, address=address,
                                     role=cpb.PREFILL if role == "prefill" else cpb.DECODE)
        self.load = load            # () -> (queued_prefill_s, batch, kv_tokens)
        self.registered = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="load-reports", daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        """Register (waiting up to ``timeout`` for the conductor), then report in the background."""
        self.stub.RegisterInstance(self.info, timeout=timeout, wait_for_ready=True)
        self.registered = True
        self.thread.start()

    def stop(self) -> None:
        """End the reports, then close the channel: the report thread is waited for (at most
        STOP_TIMEOUT_S, one report's deadline and then some), so no report is sent on a closed
        channel or outlives the worker's shutdown."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(STOP_TIMEOUT_S)
        self.channel.close()

    def _loop(self) -> None:
        while not self.stopped.wait(REPORT_INTERVAL_S):
            queued, batch, kv_tokens = self.load()
            if self.stopped.is_set():
                return
            try:
                self.stub.ReportLoad(cpb.LoadReport(instance_id=self.info.instance_id, queued_prefill_s=queued,
                                                    batch=batch, kv_tokens=kv_tokens, sent_unix_s=time.time()),
                                     timeout=REPORT_DEADLINE_S)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:       # the conductor restarted: register again
                    self._register_quietly()
                else:
                    log.debug("load report failed: %s", exc)

    def _register_quietly(self) -> None:
        try:
            self.stub.RegisterInstance(self.info, timeout=2.0)
        except grpc.RpcError as exc:
            log.debug("registration failed: %s", exc)

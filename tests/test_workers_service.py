"""`ConductorLink` (workers/service.py) against an in-process stand-in conductor (a gRPC server on
loopback that records what it is sent): its report thread ends before `stop` returns."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from proto import grpc_codegen
from tests.conftest import wait_until
from workers.service import ConductorLink

cpb, cpb_grpc = grpc_codegen.load("conductor")


class RecordingConductor(cpb_grpc.ConductorServicer):
    def __init__(self):
        self.reports: list = []

    def RegisterInstance(self, request, context):
        return cpb.RegisterReply(prefill_instances=1)

    def ReportLoad(self, request, context):
        self.reports.append(request)
        return cpb.LoadAck()


@pytest.fixture
def conductor():
    servicer = RecordingConductor()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    cpb_grpc.add_ConductorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_stop_waits_for_the_report_thread(conductor):
    servicer, address = conductor
    measuring = threading.Event()

    def slow_load():
        measuring.set()
        time.sleep(0.3)                     # a report being put together when the worker stops
        return 0.0, 0, 0

    link = ConductorLink(address, "prefill-1", "prefill", "127.0.0.1:1", slow_load)
    link.start()
    assert measuring.wait(5)
    link.stop()
    assert not link.thread.is_alive()
    sent = len(servicer.reports)
    time.sleep(0.3)
    assert len(servicer.reports) == sent == 0       # the report measured while stopping is not sent


def test_reports_say_when_they_were_sent(conductor):
    servicer, address = conductor
    link = ConductorLink(address, "decode-1", "decode", "127.0.0.1:1", lambda: (0.0, 2, 300))
    link.start()
    wait_until(lambda: servicer.reports, what="a load report")
    link.stop()
    report = servicer.reports[0]
    assert (report.batch, report.kv_tokens) == (2, 300)
    assert abs(report.sent_unix_s - time.time()) < 10

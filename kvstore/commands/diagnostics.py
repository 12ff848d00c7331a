"""LATENCY: answers as Redis does with its latency monitor off.

kvstore samples no latency events (Redis's monitor is off by default too,
``latency-monitor-threshold 0``), so there is nothing to report and every
answer says so: no latest samples, no history, nothing to reset, no graph,
and DOCTOR explains. Per-command latency lives in INFO's stats and the
Prometheus metrics instead.
"""
from __future__ import annotations

from kvstore.commands.table import CommandError, command
from kvstore.protocol import writer

_HELP = [
    "LATENCY <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
    "DOCTOR",
    "    Return a human readable latency analysis report.",
    "GRAPH <event>",
    "    Return an ASCII latency graph for the <event> class.",
    "HISTORY <event>",
    "    Return time-latency samples for the <event> class.",
    "LATEST",
    "    Return the latest latency samples for all events.",
    "RESET [<event> ...]",
    "    Reset latency data of one or more <event> classes.",
    "    (default: reset all data for all event classes)",
    "HELP",
    "    Prints this help.",
]
_DOCTOR = ("kvstore does not sample latency events (as Redis with latency-monitor-threshold 0): "
           "there is no latency report. INFO's stats section and the metrics endpoint count commands.\n")


@command("LATENCY", -2, "", "server", "A container for latency diagnostics commands.", keys=(0, 0, 0),
         subcommands={"doctor": (2, "Returns a human-readable latency analysis report."),
                      "graph": (3, "Returns a latency graph for an event."),
                      "history": (3, "Returns timestamp-latency samples for an event."),
                      "latest": (2, "Returns the latest latency samples for all events."),
                      "reset": (-2, "Resets the latency data for one or more events."),
                      "help": (2, "Returns helpful text about the different subcommands.")})
def latency(conn, args):
    sub = args[1].lower()
    if sub == b"help":
        return writer.array([writer.simple(line) for line in _HELP])
    if sub in (b"latest", b"history"):
        return writer.EMPTY_ARRAY
    if sub == b"reset":
        return writer.ZERO
    if sub == b"graph":
        raise CommandError(f"No samples available for event '{args[2].decode(errors='replace')}'")
    return conn.enc.verbatim(_DOCTOR)

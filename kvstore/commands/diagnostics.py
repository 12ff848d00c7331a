"""SLOWLOG (kvstore/admin/slowlog.py keeps it), and LATENCY, which answers as Redis does with
its latency monitor off.

kvstore samples no latency events (Redis's monitor is off by default too,
``latency-monitor-threshold 0``), so there is nothing to report and every
answer says so: no latest samples, no history, nothing to reset, no graph,
and DOCTOR explains. Per-command latency lives in INFO's stats and the
Prometheus metrics instead.
"""
from __future__ import annotations

from kvstore.commands.args import parse_int
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer

FAMILY = Family()

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


@FAMILY.command("LATENCY", -2, "", "server", "A container for latency diagnostics commands.", keys=(0, 0, 0),
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


_SLOWLOG_HELP = [
    "SLOWLOG <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
    "GET [<count>]",
    "    Return top <count> entries from the slowlog (default: 10, -1 mean all).",
    "    Entries are made of:",
    "    id, timestamp, time in microseconds, arguments array, client IP and port,",
    "    client name",
    "LEN",
    "    Return the length of the slowlog.",
    "RESET",
    "    Reset the slowlog.",
    "HELP",
    "    Prints this help.",
]
BAD_COUNT = "count should be greater than or equal to -1"


@FAMILY.command("SLOWLOG", -2, "", "server", "A container for slow log commands.", keys=(0, 0, 0),
         subcommands={"get": (-2, "Returns the slow log's entries."),
                      "len": (2, "Returns the number of entries in the slow log."),
                      "reset": (2, "Clears all entries from the slow log."),
                      "help": (2, "Show helpful text about the different subcommands")})
def slowlog(conn, args):
    sub, log = args[1].lower(), conn.server.slowlog
    if sub == b"help":
        return writer.array([writer.simple(line) for line in _SLOWLOG_HELP])
    if sub == b"len":
        return writer.integer(len(log.entries))
    if sub == b"reset":
        log.entries.clear()
        return writer.OK
    if len(args) > 3:
        raise CommandError(f"unknown subcommand or wrong number of arguments for "
                           f"'{args[1][:128].decode(errors='replace')}'. Try SLOWLOG HELP.")
    count = 10 if len(args) == 2 else parse_int(args[2], BAD_COUNT)
    if count < -1:
        raise CommandError(BAD_COUNT)
    return log.reply(count)

"""Medians, ratios and targets of a side-by-side benchmark, as a table.

A benchmark fills a `Table` with `Row`s: one row per figure (say "GET 1 MiB,
redis-py"), one column per system measured (the subject, the reference it is
compared with, and any extra anchors), each cell a list of samples from the
repeated runs. The table reports the median of each cell and the ratio
subject/reference, which is the figure targets are set on. The benchmarks run
the columns back to back within each repeat, so the ratio is the median of the
per-repeat ratios: on a shared, noisy host a slow spell then hits both sides
of a pair and cancels out, where a ratio of two medians would keep it. A
cell that could not be measured keeps its reason instead of a number, so a
partial run still prints everything it learned.

The same table renders as plain text (terminal), Markdown (docs, with the
date and machine) and JSON (every sample, for later comparison). `turns` and
`record` are the loop every benchmark runs to fill it.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Target:
    """A goal for one row: the ratio subject/reference at least `bound`, or the subject's value at most `bound`."""

    bound: float
    on: str = "ratio"

    def describe(self, unit: str) -> str:
        if self.on == "ratio":
            return f"ratio >= {self.bound:g}"
        return f"<= {self.bound:g} {unit}"


@dataclass
class Row:
    """One figure measured on every column: samples per column, or why a column has none."""

    name: str
    unit: str
    target: Target | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def add(self, column: str, value: float) -> None:
        self.samples.setdefault(column, []).append(value)

    def fail(self, column: str, reason: str) -> None:
        self.errors[column] = reason

    def median(self, column: str) -> float | None:
        values = self.samples.get(column)
        return statistics.median(values) if values else None

    def ratio(self, column: str, over: str) -> float | None:
        """Median of the per-run ratios when both columns ran equally often (run i of each back to back),
        else the ratio of the medians."""
        tops, bottoms = self.samples.get(column, []), self.samples.get(over, [])
        if tops and len(tops) == len(bottoms) and all(bottoms):
            return statistics.median(top / bottom for top, bottom in zip(tops, bottoms))
        top, bottom = self.median(column), self.median(over)
        if top is None or not bottom:
            return None
        return top / bottom


class Table:
    """Rows in the order they were first named, compared as subject / reference (and subject / each extra)."""

    def __init__(self, title: str, subject: str, reference: str, extras: tuple[str, ...] = ()) -> None:
        self.title = title
        self.subject = subject
        self.reference = reference
        self.extras = extras
        self.rows: dict[str, Row] = {}
        self.notes: list[str] = []

    def row(self, name: str, unit: str, target: Target | None = None) -> Row:
        if name not in self.rows:
            self.rows[name] = Row(name, unit, target)
        return self.rows[name]

    def met(self, row: Row) -> bool | None:
        """Whether the row's target is met by the medians; None without a target or a figure."""
        if row.target is None:
            return None
        if row.target.on == "ratio":
            value = row.ratio(self.subject, self.reference)
            return None if value is None else value >= row.target.bound
        value = row.median(self.subject)
        return None if value is None else value <= row.target.bound

    def header(self) -> list[str]:
        cols = ["measurement", "unit", self.subject, self.reference, f"{self.subject}/{self.reference}",
                "target", "met"]
        for extra in self.extras:
            cols += [extra, f"{self.subject}/{extra}"]
        return cols

    def cells(self, row: Row) -> list[str]:
        met = self.met(row)
        cells = [row.name, row.unit, self._value(row, self.subject), self._value(row, self.reference),
                 _fmt(row.ratio(self.subject, self.reference)),
                 row.target.describe(row.unit) if row.target else "",
                 "" if met is None else ("yes" if met else "NO")]
        for extra in self.extras:
            cells += [self._value(row, extra), _fmt(row.ratio(self.subject, extra))]
        return cells

    def _value(self, row: Row, column: str) -> str:
        if column in row.errors and column not in row.samples:
            return "n/a"
        return _fmt(row.median(column))

    def failures(self) -> list[str]:
        """One line per column and reason that left cells unmeasured, naming the first row it hit."""
        rows_by_cause: dict[tuple[str, str], list[str]] = {}
        for row in self.rows.values():
            for column, reason in row.errors.items():
                rows_by_cause.setdefault((column, reason), []).append(row.name)
        return [f"{column} not measured in {len(names)} row(s) from '{names[0]}': {reason}"
                for (column, reason), names in rows_by_cause.items()]

    def render_text(self, machine: dict[str, str] | None = None) -> str:
        lines = [self.header()] + [self.cells(row) for row in self.rows.values()]
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        out = [self.title] + ([describe_machine(machine)] if machine else []) + [""]
        for n, line in enumerate(lines):
            out.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
            if n == 0:
                out.append("  ".join("-" * width for width in widths))
        out += [""] + self.notes + self.failures()
        return "\n".join(out)

    def render_markdown(self, machine: dict[str, str]) -> str:
        out = [f"### {self.title}", "", describe_machine(machine), ""]
        header = self.header()
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---" if i == 0 else "--:" for i in range(len(header))) + "|")
        for row in self.rows.values():
            out.append("| " + " | ".join(self.cells(row)) + " |")
        out.append("")
        out += [f"- {line}" for line in self.notes + self.failures()]
        return "\n".join(out)

    def to_json(self, machine: dict[str, str]) -> dict:
        rows = []
        for row in self.rows.values():
            columns = (self.subject, self.reference, *self.extras)
            rows.append({
                "name": row.name, "unit": row.unit, "samples": row.samples, "errors": row.errors,
                "median": {c: row.median(c) for c in columns if c in row.samples},
                "ratio": row.ratio(self.subject, self.reference),
                "target": None if row.target is None else row.target.describe(row.unit),
                "met": self.met(row),
            })
        return {"title": self.title, "machine": machine, "subject": self.subject, "reference": self.reference,
                "rows": rows, "notes": self.notes}


@dataclass
class Figure:
    """One measured figure on a line of its own, beside its target (and whether it met it)."""

    name: str
    value: str
    target: str
    ok: bool | None

    def line(self) -> str:
        verdict = "" if self.ok is None else ("  ok" if self.ok else "  MISSED")
        return f"{self.name:<58} {self.value:>18}   target {self.target}{verdict}"


def turns(columns: dict[str, T], repeats: int) -> Iterator[tuple[str, T]]:
    """(column, what to measure it on) for every repeat, rotating which column goes first."""
    names = list(columns)
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            yield name, columns[name]


def record(rows: list[Row], column: str, measure: Callable[[], list[float]],
           errors: tuple[type[BaseException], ...]) -> None:
    """Add one sample per row from measure(); when it raises one of `errors`, note the reason
    in every row instead, so one failing server does not end the run. Progress goes to stderr."""
    try:
        values = measure()
    except errors as exc:
        reason = one_line(exc)
        for row in rows:
            row.fail(column, reason)
        log(f"  {column}: {reason}")
        return
    for row, value in zip(rows, values):
        row.add(column, value)
    log(f"  {column}: " + ", ".join(f"{row.name} = {value:.4g} {row.unit}" for row, value in zip(rows, values)))


def one_line(exc: BaseException, limit: int = 160) -> str:
    """An exception as one short printable line (server errors may echo binary arguments)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return "".join(c if c.isprintable() and c != "\ufffd" else "?" for c in text)[:limit]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def describe_machine(machine: dict[str, str]) -> str:
    """One line naming the host and its load, printed above a report's figures."""
    return "Measured " + ", ".join(f"{key}: {value}" for key, value in machine.items()) + "."


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def machine_info() -> dict[str, str]:
    """Date, CPU count and model, RAM and load of this host, for the report's header."""
    return {
        "date": datetime.date.today().isoformat(),
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": _cpu_model(),
        "ram": f"{_ram_gib():.0f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load average at start": "%.1f" % os.getloadavg()[0],
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    return 0.0

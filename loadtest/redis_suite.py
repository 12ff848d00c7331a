"""Redis's own tcl test suite, run against a real redis-server and against kvstore.

    python -m loadtest.redis_suite --redis-src DIR [--unit unit/keyspace ...] [--json FILE]

DIR is a checkout of github.com/redis/redis at the tag of the installed
``redis-server --version`` (e.g. ``git archive 7.0.15 | tar x -C DIR``); nothing
of it is copied into this repository. The suite's ``tests/`` folder is copied
to a temporary folder and run there in external-server mode (``./runtest
--host 127.0.0.1 --port P --singledb``), once against a fresh redis-server and
once against a fresh ``python -m kvstore serve`` started from the current
directory, over the families kvstore serves: strings, counters, expiry,
keyspace, SCAN, transactions, the protocol, QUIT, INFO and introspection.

One change is made to the temporary copy, the same for both servers: the
harness's ``r function flush`` before each test group is wrapped in ``catch``,
since kvstore has no scripting (FUNCTION keeps Redis's unknown-command error)
and the uncaught error would abort every group before its first test.

The figure is the share of in-scope tests kvstore passes: in scope are the
tests that pass on redis-server and are not about a data type kvstore leaves
out by design (lists, sets, hashes, sorted sets, streams, scripting, pub/sub,
bitmaps, HyperLogLog, geo, SORT): a test whose body sends one of their
commands (or asks COMMAND GETKEYS/INFO about one), or whose name names one, is skipped on both servers (runtest's
--skipfile), so a failure there cannot leave a half-done MULTI behind for the
tests after it. Tests tagged ``needs:debug`` (Redis's DEBUG command) and
``needs:repl`` (Redis replication) are not run. The run also checks that the
kvstore node still answers PING at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

UNITS = ("unit/type/string", "unit/type/incr", "unit/expire", "unit/keyspace", "unit/scan",
         "unit/multi", "unit/protocol", "unit/quit", "unit/info", "unit/info-command",
         "unit/introspection", "unit/introspection-2")
DENY_TAGS = ("needs:debug", "needs:repl")

# Commands of the data types kvstore leaves out by design; a test whose body sends one is out of scope.
OUT_OF_SCOPE = """
lpush rpush lpushx rpushx lpop rpop lrange llen lindex lset linsert lrem ltrim lpos lmove blmove blpop
brpop brpoplpush rpoplpush lmpop blmpop
sadd srem smembers sismember smismember scard spop srandmember sinter sinterstore sintercard sunion
sunionstore sdiff sdiffstore smove sscan
hset hsetnx hget hmset hmget hgetall hdel hlen hexists hincrby hincrbyfloat hkeys hvals hstrlen
hrandfield hscan
zadd zincrby zrem zrange zrangestore zrevrange zrangebyscore zrevrangebyscore zrangebylex
zrevrangebylex zcard zscore zmscore zrank zrevrank zcount zlexcount zpopmin zpopmax bzpopmin bzpopmax
zmpop bzmpop zunion zinter zdiff zunionstore zinterstore zdiffstore zintercard zrandmember
zremrangebyscore zremrangebyrank zremrangebylex zscan
xadd xrange xrevrange xlen xread xreadgroup xgroup xack xclaim xautoclaim xpending xinfo xtrim xdel xsetid
eval evalsha eval_ro evalsha_ro script function fcall fcall_ro
publish subscribe psubscribe unsubscribe punsubscribe ssubscribe sunsubscribe spublish pubsub
setbit getbit bitcount bitpos bitop bitfield bitfield_ro
pfadd pfcount pfmerge pfdebug pfselftest
geoadd geodist geohash geopos georadius georadiusbymember georadius_ro georadiusbymember_ro geosearch
geosearchstore
sort sort_ro
""".split()
# The suite's helper procs that send such commands for the test.
OUT_OF_SCOPE_HELPERS = ("subscribe", "psubscribe", "ssubscribe", "unsubscribe", "punsubscribe",
                        "sunsubscribe", "run_script", "run_script_ro", "createComplexDataset",
                        "create_set", "create_list", "create_zset", "create_hash")

_CLIENT = r"(?:\br|\$r\w*|\$rd\w*|\$rr|\$client\w*|\$redis\w*|\bR\s+\d+|\$master|\$replica|\$primary)"
_OOS_RE = re.compile(
    _CLIENT + r"\s+(?:-?\d+\s+)?(?:" + "|".join(OUT_OF_SCOPE) + r")(?![\w-])"
    + r"|\bcommand\s+(?:getkeys|getkeysandflags|info|docs)\s+(?:" + "|".join(OUT_OF_SCOPE) + r")(?![\w-])"
    + r"|(?<![\w$-])(?:" + "|".join(OUT_OF_SCOPE_HELPERS) + r")\s+[\[$\"{\w]",
    re.IGNORECASE)
_OOS_NAME_RE = re.compile(r"(?<![\w-])(?:" + "|".join(c.upper() for c in OUT_OF_SCOPE) + r")(?![\w-])")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RESULT = re.compile(r"^\[(ok|err|exception|ignore|skip)\]: (.*)$")


@dataclass
class RunResult:
    server: str
    outcomes: dict[tuple[str, str, int], str] = field(default_factory=dict)   # (unit, name, n) -> ok/err/...
    log: str = ""
    alive: bool = True


# ---- reading the suite's test files ----------------------------------------------------------

def _balanced(text: str, i: int) -> int:
    """Index just past the tcl word starting at ``text[i]`` ({...} or "..." or bare)."""
    if text[i] == "{":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == "\\":
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return i
    if text[i] == '"':
        i += 1
        while i < len(text) and text[i] != '"':
            i += 2 if text[i] == "\\" else 1
        return i + 1
    while i < len(text) and not text[i].isspace():
        i += 1
    return i


_SUBST = re.compile(r"\$(?:\{[^}]*\}|[\w:]+(?:\([^)]*\))?)|\[[^\]]*\]")


@dataclass
class TestBlock:
    name: str           # as written: may hold $var or [cmd] substituted at run time
    quoted: bool        # "..." (substituted) rather than {...}
    body: str

    def pieces(self) -> list[str | None]:
        """The name's literal pieces, None where a substitution goes."""
        if not self.quoted:
            return [self.name]
        out, last = [], 0
        for m in _SUBST.finditer(self.name):
            out += [self.name[last:m.start()], None]
            last = m.end()
        return out + [self.name[last:]]

    def regex(self) -> re.Pattern:
        """The name as the runner prints it."""
        return re.compile("".join(".*" if p is None else re.escape(p) for p in self.pieces()) + r"\Z", re.DOTALL)

    def skip_line(self) -> str:
        """The name as a line of runtest's --skipfile: exact, or a Tcl regex (``/...``)."""
        pieces = self.pieces()
        if None not in pieces:
            return pieces[0]
        return "/^" + "".join(".*" if p is None else re.sub(r"([^A-Za-z0-9_ ])", r"\\\1", p)
                               for p in pieces) + "$"


def test_blocks(tcl: str) -> list[TestBlock]:
    """Every ``test`` in a suite file: its name and body."""
    found = []
    for m in re.finditer(r"^[ \t]*test\s+(?=[{\"])", tcl, re.MULTILINE):
        start = m.end()
        end = _balanced(tcl, start)
        j = end
        while j < len(tcl) and tcl[j] in " \t\\\n":
            j += 1
        body = tcl[j:_balanced(tcl, j)] if j < len(tcl) else ""
        found.append(TestBlock(tcl[start + 1:end - 1], tcl[start] == '"', body))
    return found


def out_of_scope(tests_dir: Path, units: list[str]) -> dict[str, list[TestBlock]]:
    """unit -> its tests about a data type kvstore leaves out: the body sends one of its
    commands, or the name names one (COMMAND INFO of XREAD, stats of GEOADD, ...)."""
    oos = {}
    for unit in units:
        blocks = test_blocks((tests_dir / f"{unit}.tcl").read_text(errors="replace"))
        oos[unit] = [b for b in blocks if _OOS_RE.search(b.body) or _OOS_NAME_RE.search(b.name)]
    return oos


# ---- running the suite -----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pings(port: int, timeout: float = 5.0) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering PING")
        if pings(port, 1.0):
            return
        time.sleep(0.1)
    raise RuntimeError("server did not answer PING in time")


def prepare_suite(redis_src: Path, work: Path) -> Path:
    """A temporary copy of the suite's runner and tests, with the one change the docstring names."""
    root = work / "suite"
    root.mkdir()
    shutil.copytree(redis_src / "tests", root / "tests")
    shutil.copy2(redis_src / "runtest", root / "runtest")
    (root / "src").symlink_to((redis_src / "src").resolve())
    server_tcl = root / "tests" / "support" / "server.tcl"
    text = server_tcl.read_text()
    server_tcl.write_text(text.replace("\n    r function flush\n", "\n    catch {r function flush}\n", 1))
    return root


def run_suite(suite: Path, port: int, units: list[str], timeout_s: float) -> str:
    cmd = ["./runtest", "--host", "127.0.0.1", "--port", str(port), "--singledb", "--durable",
           "--timeout", "120", "--tags", " ".join("-" + t for t in DENY_TAGS),
           "--skipfile", str(suite / "out-of-scope.txt")]
    for unit in units:
        cmd += ["--single", unit]
    try:
        out = subprocess.run(cmd, cwd=suite, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             timeout=timeout_s, check=False).stdout
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + b"\n[runner timed out]\n"
    return _ANSI.sub("", out.decode(errors="replace"))


def parse(log: str) -> dict[tuple[str, str, int], str]:
    outcomes, seen, unit = {}, Counter(), "?"
    for line in log.splitlines():
        if line.startswith("Testing "):
            unit = line.split(None, 1)[1].strip()
            continue
        m = _RESULT.match(line)
        if not m:
            continue
        kind, rest = m.groups()
        if kind == "ok":
            name = re.sub(r" \(\d+ ms\)$", "", rest)
        elif kind == "err":
            name = re.sub(r" in tests/\S+\.tcl$", "", rest)
        elif kind == "ignore":
            name = rest.rsplit(": ", 1)[0] if ": " in rest else rest
        else:
            name = rest
        seen[(unit, name)] += 1
        outcomes[(unit, name, seen[(unit, name)])] = kind
    return outcomes


def run_against(name: str, start_cmd: list[str], suite: Path, units: list[str], timeout_s: float,
                work: Path) -> RunResult:
    port = free_port()
    log_path = work / f"{name}.server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*start_cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                cwd=os.getcwd(), start_new_session=True)
    try:
        wait_ready(proc, port)
        print(f"# {name}: running {len(units)} units on port {port} ...", file=sys.stderr, flush=True)
        out = run_suite(suite, port, units, timeout_s)
        alive = proc.poll() is None and pings(port)
        return RunResult(name, parse(out), out, alive)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def figure(redis: RunResult, kv: RunResult) -> dict:
    in_scope, passed, failing, named_out = [], [], [], 0
    for key, kind in redis.outcomes.items():
        if kind != "ok":
            continue
        if _OOS_NAME_RE.search(key[1]):     # a name built at run time ("$cmd is marked with movablekeys")
            named_out += 1
            continue
        in_scope.append(key)
        (passed if kv.outcomes.get(key) == "ok" else failing).append(key)
    per_unit = {}
    for unit in dict.fromkeys(k[0] for k in in_scope):
        n = sum(1 for k in in_scope if k[0] == unit)
        p = sum(1 for k in passed if k[0] == unit)
        per_unit[unit] = (p, n)
    return {
        "in_scope": len(in_scope), "passed": len(passed),
        "percent": round(100.0 * len(passed) / len(in_scope), 1) if in_scope else 0.0,
        "out_of_scope": sum(1 for v in redis.outcomes.values() if v == "skip") + named_out,
        "redis_ok": sum(1 for v in redis.outcomes.values() if v == "ok"),
        "kvstore_alive": kv.alive, "per_unit": per_unit,
        "failing": [f"{u}: {n}" + (f" (#{i})" if i > 1 else "") + f" [{kv.outcomes.get((u, n, i), 'not run')}]"
                    for u, n, i in failing],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.redis_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-src", required=True, type=Path,
                        help="a checkout of redis/redis at the installed redis-server's version")
    parser.add_argument("--unit", action="append", help="a suite unit to run, e.g. unit/keyspace "
                        "(repeatable; default: the families kvstore serves)")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--dram-size", default="256mb", help="kvstore's --dram-size (default 256mb)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one whole run may take")
    parser.add_argument("--json", metavar="FILE", help="write the figure and the failing tests to FILE")
    parser.add_argument("--logs", metavar="DIR", help="keep both runs' output in DIR")
    args = parser.parse_args(argv)
    units = args.unit or list(UNITS)
    src = args.redis_src.resolve()
    if not (src / "tests" / "test_helper.tcl").exists():
        parser.error(f"{src} is not a checkout of redis/redis (no tests/test_helper.tcl)")
    if shutil.which("tclsh") is None and not any(shutil.which(f"tclsh{v}") for v in ("8.5", "8.6", "8.7")):
        parser.error("the suite needs tclsh 8.5 or newer")
    version = subprocess.run([args.redis_server, "--version"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="redis-suite-") as tmp:
        work = Path(tmp)
        suite = prepare_suite(src, work)
        oos = out_of_scope(suite / "tests", units)
        (suite / "out-of-scope.txt").write_text("".join(b.skip_line() + "\n" for blocks in oos.values()
                                                        for b in blocks))
        redis = run_against("redis", [args.redis_server, "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(work)],
                            suite, units, args.timeout, work)
        kv = run_against("kvstore", [sys.executable, "-m", "kvstore", "serve", "--dram-size", args.dram_size],
                         suite, units, args.timeout, work)
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            for r in (redis, kv):
                Path(args.logs, f"{r.server}.txt").write_text(r.log)
            shutil.copy2(work / "kvstore.server.log", Path(args.logs, "kvstore.server.log"))
    result = figure(redis, kv)
    result["redis_version"] = version
    print(f"{version}")
    for unit, (p, n) in result["per_unit"].items():
        print(f"  {unit:<28} {p:4d} / {n:<4d}")
    for line in result["failing"]:
        print(f"  fails: {line}")
    print(f"{result['out_of_scope']} tests about data types kvstore leaves out set aside; "
          f"kvstore passes {result['passed']} of the {result['in_scope']} other tests redis-server passes: "
          f"{result['percent']:.1f} %")
    print(f"kvstore node alive after the run: {'yes' if result['kvstore_alive'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["kvstore_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())

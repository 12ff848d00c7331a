"""Reading Mooncake traces: the real format, and every malformed input named by line."""
import json
from pathlib import Path

import pytest

from conductor.trace import TraceError, load_trace

FIXTURE = Path(__file__).parent / "fixtures" / "conversation_head200.jsonl"
GOOD = {"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}


def write(tmp_path, *lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_reads_and_sorts_by_arrival(tmp_path):
    later = dict(GOOD, timestamp=2000)
    reqs = load_trace(write(tmp_path, json.dumps(later), json.dumps(GOOD)))
    assert [r.arrival_s for r in reqs] == [0.01, 2.0]
    assert reqs[0].hash_ids == (0, 1) and reqs[0].input_length == 600


def test_fixture_slice_of_the_conversation_trace_is_valid():
    reqs = load_trace(FIXTURE)
    assert len(reqs) == 200 and all(r.output_length >= 1 for r in reqs)


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    (json.dumps([1, 2]), "line 2: expected a JSON object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "output_length"}),
     "line 2: missing field 'output_length'"),
    (json.dumps(dict(GOOD, input_length=-5)), "line 2: 'input_length' must be a positive"),
    (json.dumps(dict(GOOD, timestamp=-1)), "line 2: 'timestamp' must be a non-negative"),
    (json.dumps(dict(GOOD, output_length="7")), "line 2: 'output_length' must be a positive"),
    (json.dumps(dict(GOOD, hash_ids=[0, 1, 2])), "line 2: 3 hash_ids for input_length 600"),
    (json.dumps(dict(GOOD, hash_ids=[0, -1])), "line 2: 'hash_ids' must be a list"),
])
def test_bad_line_is_named(tmp_path, line, message):
    with pytest.raises(TraceError, match=message.replace("(", r"\(")):
        load_trace(write(tmp_path, json.dumps(GOOD), line))


def test_empty_trace(tmp_path):
    with pytest.raises(TraceError, match="holds no requests"):
        load_trace(write(tmp_path, "", "  "))


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")

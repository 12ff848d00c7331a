"""The trace generator: determinism, the Mooncake format, prefix structure and statistics."""
import io
import itertools
import math
from collections import Counter

import numpy as np
import pytest

from conductor.cli import tracegen_main
from conductor.trace import load_trace
from conductor.tracegen import Lengths, TraceSpec, generate, spec_from, write_jsonl
from conductor.tracestats import measure, reusable_blocks


def take(spec: TraceSpec) -> list:
    return list(generate(spec))


def test_same_seed_same_trace_other_seed_other_trace():
    spec = spec_from("documents", requests=500, seed=3)
    assert take(spec) == take(spec)
    assert take(spec) != take(spec_from("documents", requests=500, seed=4))


def test_mooncake_format_round_trips(tmp_path):
    requests = take(spec_from("conversation", requests=300))
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        assert write_jsonl(iter(requests), f) == 300
    back = load_trace(path)      # validates every line, including the block count
    assert [(r.input_length, r.output_length, r.hash_ids) for r in back] == \
        [(r.input_length, r.output_length, r.hash_ids) for r in requests]
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in requests)


def test_block_ids_are_prefix_chained():
    # an id stands for one whole prefix: wherever it appears, the same ids precede it
    prefix_of = {}
    for r in take(spec_from("documents", requests=2000, branch_p=0.3)):
        for i, block in enumerate(r.hash_ids):
            assert prefix_of.setdefault(block, r.hash_ids[:i]) == r.hash_ids[:i]


def test_follow_ups_extend_the_whole_previous_prompt():
    # a request that reuses an earlier one's blocks (past the system prompt) holds that
    # whole prompt and its answer: it is at least as long as both
    requests = take(TraceSpec(requests=400, continue_p=0.5, rate=50.0,
                              think_s=Lengths(((1.0, 1.0, 0.0),))))
    earlier: dict[tuple, list] = {}
    extended = 0
    for r in requests:
        parents = [p for k in range(2, len(r.hash_ids)) for p in earlier.get(r.hash_ids[:k], [])]
        if parents:
            assert any(r.input_length >= p.input_length + p.output_length for p in parents)
            extended += 1
        earlier.setdefault(r.hash_ids[:r.input_length // 512], []).append(r)
    assert extended > 100


def test_shared_system_prompts_and_documents_raise_reuse():
    plain = take(TraceSpec(requests=2000, continue_p=0.0))
    docs = take(TraceSpec(requests=2000, continue_p=0.0, documents=20, document_share=1.0))
    share = [reusable / total for reusable, total in map(reusable_blocks, (plain, docs))]
    assert share[0] < 0.15 and share[1] > 0.45
    assert len({r.hash_ids[0] for r in docs}) == 1       # one system prompt of 880 tokens


def test_conversation_preset_reproduces_the_measured_trace():
    # conversation_trace.jsonl as measured (docs/conductor.md): 3.40 requests/s, mean
    # input 12,035, mean output 343, 36.6 % of blocks reusable by an unbounded cache.
    stats = measure(take(spec_from("conversation", requests=12031)))
    assert stats.rate_per_s == pytest.approx(3.40, rel=0.05)
    assert stats.input_mean == pytest.approx(12035, rel=0.1)
    assert stats.output_mean == pytest.approx(343, rel=0.1)
    assert stats.reusable_share == pytest.approx(0.366, abs=0.03)


@pytest.mark.parametrize("arrival, cv", [("poisson", 1.0), ("bursty", 3.0)])
def test_gaps_have_the_chosen_rate_and_spread(arrival, cv):
    times = np.array([r.arrival_s for r in take(TraceSpec(requests=20_000, rate=5.0,
                                                          arrival=arrival, burst_cv=cv))])
    gaps = np.diff(times)
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_diurnal_rate_swings_with_the_period():
    times = np.array([r.arrival_s for r in take(TraceSpec(
        requests=20_000, rate=10.0, arrival="diurnal", period_s=100.0, amplitude=0.6))])
    phase = (times % 100.0) / 100.0
    peak, trough = (phase < 0.5).sum(), (phase >= 0.5).sum()
    # mean rate over each half period: 1 +- 2 * 0.6 / pi
    assert peak / trough == pytest.approx((1 + 1.2 / math.pi) / (1 - 1.2 / math.pi), rel=0.1)


def test_ticks_and_the_longest_prompt_are_respected():
    requests = take(spec_from("conversation", requests=3000, tick_s=3.0, max_input=20_000))
    assert all(r.arrival_s % 3.0 == 0 for r in requests)
    assert max(r.input_length for r in requests) <= 20_000


def test_generation_streams():
    first = next(iter(generate(TraceSpec(requests=10**12))))
    assert first.input_length >= 1


def test_length_mixtures_parse_and_sample():
    lengths = Lengths.parse("20:1:0.25,400:0.2:0.75@1-2000")
    assert str(lengths) == "20:1:0.25,400:0.2:0.75@1-2000"
    values = lengths.sample(np.random.default_rng(0), 20_000)
    assert values.min() >= 1 and values.max() <= 2000
    assert (values > 200).mean() == pytest.approx(0.75, abs=0.02)


@pytest.mark.parametrize("text", ["", "3", "3:x", "3:1@5", "-3:1", "3:1@9-2"])
def test_bad_length_distributions_are_refused(text):
    with pytest.raises(ValueError):
        Lengths.parse(text)


@pytest.mark.parametrize("bad", [dict(rate=0), dict(arrival="weekly"), dict(amplitude=2),
                                 dict(continue_p=0.6, branch_p=0.5),
                                 dict(document_share=0.5, documents=0)])
def test_bad_specs_are_refused(bad):
    with pytest.raises(ValueError):
        TraceSpec(**bad)


def test_cli_writes_a_trace_and_prints_statistics(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    assert tracegen_main(["--preset", "documents", "--requests", "50", "-o", str(out)]) == 0
    assert len(load_trace(out)) == 50
    assert tracegen_main(["--requests", "50", "--stats", "--compare", str(out)]) == 0
    table = capsys.readouterr().out
    assert "reusable_share" in table and str(out) in table


@pytest.mark.parametrize("argv, message", [
    (["--rate", "0"], "rate must be positive"),
    (["--output-tokens", "3:x"], "bad length distribution"),
    (["--preset", "nope"], "invalid choice"),
    (["-o", "/nonexistent/dir/t.jsonl"], "cannot write"),
])
def test_cli_user_errors_are_one_line(argv, message, capsys):
    assert tracegen_main(argv + ["--requests", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1


def test_session_trees_branch():
    requests = take(TraceSpec(requests=3000, continue_p=0.4, branch_p=0.4, rate=20.0,
                              think_s=Lengths(((1.0, 2.0, 0.5),))))
    # siblings share a prefix longer than the system prompt's block but differ at the end
    prefixes = Counter(r.hash_ids[:-1] for r in requests if len(r.hash_ids) > 3)
    assert any(n > 1 for n in prefixes.values())
    assert len(set(itertools.chain.from_iterable(r.hash_ids for r in requests))) > 3000


def test_kvstore_command_line_dispatches_tracegen(capsys):
    from kvstore.cli import main
    assert main(["tracegen", "--requests", "2", "--seed", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_gamma_arrivals_range_from_steady_to_bursty():
    def gap_cv(cv: float) -> float:
        times = np.array([r.arrival_s for r in take(TraceSpec(requests=3000, arrival="gamma",
                                                              burst_cv=cv, continue_p=0.0))])
        gaps = np.diff(times)
        return gaps.std() / gaps.mean()
    assert gap_cv(0.3) == pytest.approx(0.3, rel=0.1)
    assert gap_cv(1.0) == pytest.approx(1.0, rel=0.1)
    assert gap_cv(4.0) > 2.5


@pytest.mark.parametrize("reuse", [0.0, 0.5, 0.9])
def test_reuse_sets_the_shared_share_apart_from_the_prompt_length(reuse):
    spec = spec_from(None, requests=1500, seed=2, reuse=reuse, system_prompts=4,
                     continue_p=0.0, first_tokens=Lengths.parse("12000:0.5@64-60000"))
    requests = take(spec)
    shared, total = reusable_blocks(requests)
    assert shared / total == pytest.approx(reuse, abs=0.06)
    assert np.median([r.input_length for r in requests]) == pytest.approx(12000, rel=0.1)
    # the shared part is a prefix of one of the contexts: ids chain as everywhere else
    prefix_of = {}
    for r in requests:
        for i, block in enumerate(r.hash_ids):
            assert prefix_of.setdefault(block, r.hash_ids[:i]) == r.hash_ids[:i]


def test_reuse_out_of_range_is_refused():
    with pytest.raises(ValueError, match="reuse"):
        TraceSpec(reuse=1.5)

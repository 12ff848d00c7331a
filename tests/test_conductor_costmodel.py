"""The cost model: testbed-derived constants, and the --calibrate fit."""
import json

import pytest

from conductor import costmodel
from conductor.costmodel import CalibrationError, CostModel, fit_cost_model, read_timings


def test_testbed_constants():
    tb = costmodel.Testbed()
    assert tb.kv_bytes_per_token == 320 * 1024
    m = CostModel.from_testbed(tb)
    # 2 * 70e9 FLOPs per token over 8 x 312 TFLOPS at 45% MFU
    assert m.p_token == pytest.approx(140e9 / (8 * 312e12 * 0.45))
    assert m.t_token == pytest.approx(327680 / 100e9)
    assert m.prefill_s(1000, 0) < m.prefill_s(1000, 4000) < m.prefill_s(5000, 0)


def test_fit_recovers_known_coefficients(tmp_path):
    truth = CostModel(p_fixed=0.02, p_token=1e-4, p_attention=2e-9, p_load=1e-6, t_fixed=0.001,
                      t_token=3e-6, d_fixed=0.015, d_seq=1e-4, d_kv=3e-8,
                      decode_capacity_tokens=1000)
    rows = [{"kind": "prefill", "new_tokens": n, "cached_tokens": c,
             "seconds": truth.prefill_s(n, c)}
            for n in (100, 1000, 4000, 9000) for c in (0, 2000, 8000)]
    rows += [{"kind": "decode", "batch": b, "kv_tokens": k, "seconds": truth.decode_step_s(b, k)}
             for b in (1, 8, 64) for k in (1000, 100000, 900000)]
    path = tmp_path / "timings.json"
    path.write_text(json.dumps(rows))
    fitted = fit_cost_model(read_timings(path))
    for name in ("p_fixed", "p_token", "p_attention", "p_load", "d_fixed", "d_seq", "d_kv"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-4)
    # no transfer rows: the testbed's transfer coefficients stay
    assert fitted.t_token == CostModel.from_testbed().t_token


def test_csv_timings(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("kind,tokens,seconds\ntransfer,1000,0.011\ntransfer,3000,0.031\n")
    fitted = fit_cost_model(read_timings(path))
    assert fitted.t_token == pytest.approx(1e-5) and fitted.t_fixed == pytest.approx(0.001)


@pytest.mark.parametrize("text, message", [
    ("kind,tokens,seconds\nwarp,1,1\n", "row 1: kind must be"),
    ("kind,tokens,seconds\ntransfer,x,1\n", "row 1: 'tokens' must be a number"),
    ("kind,tokens,seconds\ntransfer,5,-1\n", "row 1: 'seconds' must not be negative"),
    ("kind,tokens,seconds\ntransfer,5,1\n", "transfer: 1 rows cannot fit 2"),
])
def test_bad_timings(tmp_path, text, message):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(CalibrationError, match=message):
        fit_cost_model(read_timings(path))

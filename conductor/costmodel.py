"""How long prefill, KV transfer and decode take: the simulator's and scheduler's clock.

Three closed forms, each linear in its coefficients so they can be refitted
from measurements:

    prefill_s(new, cached) = p_fixed + p_token * new
                             + p_attention * (new * cached + new**2 / 2)
                             + p_load * cached
    transfer_s(tokens)     = t_fixed + t_token * tokens
    decode_step_s(b, kv)   = d_fixed + d_seq * b + d_kv * kv

Prefill is compute bound: each new token costs 2 * params FLOPs in the dense
layers and 4 * layers * hidden FLOPs per earlier token in attention (QK^T and
AV), so n new tokens after c cached ones cost 4*L*H*(n*c + n^2/2) attention
FLOPs; cached tokens are only loaded from DRAM (p_load). Decode is memory
bound: every step reads the weights once (d_fixed, plus a fixed launch and
all-reduce overhead) and every cached token's K and V (d_kv), and spends a
little compute per sequence (d_seq). Transfer moves KV bytes over the node's
NIC.

`Testbed` holds the hardware of the paper's testbed (FAST '25, section 8: a
LLaMA-70B-class model, 80 layers, hidden 8192, GQA with 8 KV heads, 2-byte
elements, i.e. 320 KiB of KV per token; 8 x A800 80 GB per node at 312 dense
TFLOPS each; 800 Gbps between nodes; about 3 M tokens of DRAM cache per
node). A decode instance holds as much KV as vLLM would give it: 90 % of
the HBM (its default gpu_memory_utilization) less the weights, 436 GB or
1.33 M tokens per 8-GPU node, and at most 256 sequences (its default
max_num_seqs). The efficiencies (MFU, achieved HBM bandwidth, per-step overhead) are
not in the paper; they are typical values for this class of hardware and are
named fields so a reader can see and change them. `fit_cost_model` replaces
the derived coefficients with least-squares fits to measured timings.
"""
from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Testbed:
    """Hardware and model constants the default coefficients are derived from."""

    params: float = 70e9
    layers: int = 80
    hidden: int = 8192
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    gpus_per_node: int = 8
    gpu_flops: float = 312e12          # A800 dense BF16
    gpu_hbm_bytes: float = 80e9
    gpu_hbm_bandwidth: float = 2.039e12
    nic_bytes_per_s: float = 800e9 / 8  # 800 Gbps between nodes
    dram_to_hbm_bytes_per_s: float = 8 * 25e9  # PCIe 4.0 x16 per GPU, achieved
    prefill_mfu: float = 0.45
    decode_mfu: float = 0.5
    hbm_efficiency: float = 0.7
    step_overhead_s: float = 0.005     # kernel launches and 2 all-reduces per layer
    transfer_setup_s: float = 0.001
    gpu_memory_utilization: float = 0.9  # vLLM's default share of HBM for weights + KV
    max_batch: int = 256                 # vLLM's default max_num_seqs
    cache_tokens_per_node: int = 3_000_000

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the three closed forms, plus a decode instance's limits."""

    p_fixed: float
    p_token: float
    p_attention: float
    p_load: float
    t_fixed: float
    t_token: float
    d_fixed: float
    d_seq: float
    d_kv: float
    decode_capacity_tokens: int
    decode_max_batch: int = 256

    @classmethod
    def from_testbed(cls, tb: Testbed = Testbed()) -> CostModel:
        node_flops = tb.gpus_per_node * tb.gpu_flops
        node_hbm_bw = tb.gpus_per_node * tb.gpu_hbm_bandwidth * tb.hbm_efficiency
        kv = tb.kv_bytes_per_token
        weights = tb.params * tb.dtype_bytes
        kv_hbm = tb.gpus_per_node * tb.gpu_hbm_bytes * tb.gpu_memory_utilization - weights
        return cls(
            p_fixed=0.0,
            p_token=2 * tb.params / (node_flops * tb.prefill_mfu),
            p_attention=4 * tb.layers * tb.hidden / (node_flops * tb.prefill_mfu),
            p_load=kv / tb.dram_to_hbm_bytes_per_s,
            t_fixed=tb.transfer_setup_s,
            t_token=kv / tb.nic_bytes_per_s,
            d_fixed=weights / node_hbm_bw + tb.step_overhead_s,
            d_seq=2 * tb.params / (node_flops * tb.decode_mfu),
            d_kv=kv / node_hbm_bw,
            decode_capacity_tokens=int(kv_hbm / kv),
            decode_max_batch=tb.max_batch,
        )

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        n, c = new_tokens, cached_tokens
        return (self.p_fixed + self.p_token * n + self.p_attention * (n * c + n * n / 2)
                + self.p_load * c)

    def transfer_s(self, tokens: int) -> float:
        """Zero for nothing to move; elementwise over an array of token counts."""
        return (self.t_fixed + self.t_token * tokens) * (tokens > 0)

    def decode_step_s(self, batch: int, kv_tokens: float) -> float:
        return self.d_fixed + self.d_seq * batch + self.d_kv * kv_tokens

    def as_dict(self) -> dict:
        return asdict(self)


class CalibrationError(ValueError):
    """A timings file that cannot be fitted; the message names the row or field."""


# kind -> (input columns, the coefficient names they multiply, in order)
_FORMS = {
    "prefill": ("p_fixed", "p_token", "p_attention", "p_load"),
    "transfer": ("t_fixed", "t_token"),
    "decode": ("d_fixed", "d_seq", "d_kv"),
}
_NEEDS = {
    "prefill": ("new_tokens", "cached_tokens"),
    "transfer": ("tokens",),
    "decode": ("batch", "kv_tokens"),
}


def _features(kind: str, row: dict) -> list[float]:
    if kind == "prefill":
        n, c = row["new_tokens"], row["cached_tokens"]
        return [1.0, n, n * c + n * n / 2, c]
    if kind == "transfer":
        return [1.0, row["tokens"]]
    return [1.0, row["batch"], row["kv_tokens"]]


def read_timings(path: str | Path) -> list[dict]:
    """Rows of measured timings from JSON (a list of objects) or CSV (a header row).

    Each row has `kind` (prefill | transfer | decode), `seconds`, and the
    inputs of its form: new_tokens and cached_tokens; tokens; batch and kv_tokens.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CalibrationError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix.lower() == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{path}: not valid JSON ({exc.msg})") from None
        if not isinstance(raw, list):
            raise CalibrationError(f"{path}: expected a JSON list of timing objects")
    else:
        raw = list(csv.DictReader(text.splitlines()))
    return [_check_row(r, i) for i, r in enumerate(raw, 1)]


def _check_row(row: object, index: int) -> dict:
    if not isinstance(row, dict):
        raise CalibrationError(f"row {index}: expected an object")
    kind = str(row.get("kind", "")).strip()
    if kind not in _FORMS:
        raise CalibrationError(f"row {index}: kind must be prefill, transfer or decode")
    out = {"kind": kind}
    for name in (*_NEEDS[kind], "seconds"):
        try:
            value = float(row[name])
        except (KeyError, TypeError, ValueError):
            raise CalibrationError(f"row {index}: '{name}' must be a number") from None
        if value < 0:
            raise CalibrationError(f"row {index}: '{name}' must not be negative")
        out[name] = value
    return out


def _fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients clamped at zero (drop a negative one, refit)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit_cost_model(rows: list[dict], base: CostModel | None = None) -> CostModel:
    """Refit the coefficients of every kind present in ``rows``; keep the rest of ``base``."""
    model = base or CostModel.from_testbed()
    if not rows:
        raise CalibrationError("no timing rows to fit")
    updates = {}
    for kind, names in _FORMS.items():
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        if len(mine) < len(names):
            raise CalibrationError(f"{kind}: {len(mine)} rows cannot fit {len(names)} "
                                   f"coefficients ({', '.join(names)})")
        x = np.array([_features(kind, r) for r in mine])
        y = np.array([r["seconds"] for r in mine])
        updates.update(zip(names, map(float, _fit_nonnegative(x, y))))
    return replace(model, **updates)

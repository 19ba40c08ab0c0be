"""Tests for S07's roofline (code/s07_roofline.py): the machine's roofs and a step's cost.

Oracles: FLOPs and bytes of a config small enough to count weight by weight (below, by
hand), floors and the ridge on hand-made peaks, the PNG format's own header (its size). No
test asserts a speed of this machine: the measurements only have to run and state their
method.
"""
import struct

import pytest

import s07_roofline as roof
from s07_measuring import BenchmarkRun, RequestResult
from s07_roofline import (MachinePeaks, StepCost, attach_floor, bandwidth_floor_s,
                          decode_step_cost, prefill_cost, roofline_floor_s)
from roofline_testing import HAND

# HAND: V=10, C=4, L=1, H=2, Hkv=1, D=2, I=6, tied head, q/k norms, no biases.


def test_decode_step_cost_by_hand():
    # Weights per token: q 4x4, k 4x2, v 4x2, o 4x4 = 48; MLP 3 x 4x6 = 72; head 10x4 = 40.
    # FLOPs at S = 3: 2 x (48 + 72 + 40) + attention 2 x 2 x (H D = 4) x 3 = 320 + 48 = 368.
    # Bytes (float32): projections 48, MLP 72, norms (2 C + 2 D =) 12, final norm 4, head 40,
    # one embedding row 4: 180 values = 720 bytes; K/V: 2 cached positions read + 1 written,
    # 2 x Hkv D = 4 values each: 12 values = 48 bytes. Total 768.
    cost = decode_step_cost(HAND, 3)
    assert (cost.flops, cost.bytes) == (368, 768)
    assert cost.intensity == pytest.approx(368 / 768)
    assert decode_step_cost(HAND, 3, dtype_bytes=2).bytes == 384


def test_prefill_cost_by_hand():
    # 3 tokens: weights 2 x 120 each = 720; attention: token s attends s positions,
    # 16 FLOPs per position: 16 x (1 + 2 + 3) = 96; LM head on the last row only: 80. 896.
    # Bytes: 176 weight values + one embedding row (4) = 720 bytes; K/V of 3 positions
    # written: 3 x 4 values = 48 bytes. 768.
    cost = prefill_cost(HAND, 3)
    assert (cost.flops, cost.bytes) == (896, 768)
    # One prompt token is one decode step at S = 1.
    assert prefill_cost(HAND, 1) == decode_step_cost(HAND, 1)
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        prefill_cost(HAND, 0)


def test_floors_and_ridge_by_hand():
    peaks = MachinePeaks(bandwidth_bytes_per_s=100.0, matmul_flops_per_s=1000.0,
                         bandwidth_method="hand", matmul_method="hand")
    assert peaks.ridge_intensity == 10.0
    decode = StepCost(flops=368, bytes=768)
    assert bandwidth_floor_s(decode, peaks) == 7.68
    assert roofline_floor_s(decode, peaks) == 7.68                     # bandwidth-bound
    assert roofline_floor_s(StepCost(flops=50_000, bytes=768), peaks) == 50.0  # compute-bound


def test_attach_floor_uses_the_median_decode_context():
    peaks = MachinePeaks(100.0, 1000.0, "hand", "hand")
    # Prompt 2, 3 tokens: decode steps read S = 3 and 4; prompt 1, 2 tokens: S = 2.
    requests = [RequestResult(0, 2, 3, 0.5, [2.0, 4.0], 6.0, [1, 2, 3]),
                RequestResult(1, 1, 2, 0.5, [3.0], 4.0, [1, 2])]
    run = BenchmarkRun("e", "m", "w", 0, requests, wall_s=10.0)
    attach_floor(run, HAND, peaks)
    assert run.decode_context_len == 3
    assert run.decode_floor_s == 7.68
    assert run.decode_vs_floor == pytest.approx(3.0 / 7.68)           # ITL p50 = 3.0
    lone = BenchmarkRun("e", "m", "w", 0, [RequestResult(0, 2, 1, 0.5, [], 1.0, [1])], 1.0)
    attach_floor(lone, HAND, peaks)
    assert lone.decode_floor_s is None and lone.decode_vs_floor is None


def test_measurements_run_and_state_their_method():
    bandwidth, method = roof.measure_bandwidth(nbytes=2**20, repeats=1)
    assert bandwidth > 0 and "bytes read + written" in method
    flops, method = roof.measure_matmul_flops(n=64, repeats=1)
    assert flops > 0 and "2 n^3 FLOPs" in method
    peaks = roof.measure_peaks(bandwidth_bytes=2**20, matmul_n=32, repeats=1)
    assert peaks.ridge_intensity == peaks.matmul_flops_per_s / peaks.bandwidth_bytes_per_s
    with pytest.raises(ValueError, match="need nbytes >= 4 and repeats >= 1"):
        roof.measure_bandwidth(nbytes=2, repeats=1)
    with pytest.raises(ValueError, match="need n >= 1 and repeats >= 1"):
        roof.measure_matmul_flops(n=8, repeats=0)


def test_plot_roofline_writes_a_png(tmp_path):
    peaks = MachinePeaks(1e10, 1e11, "hand", "hand")
    path = roof.plot_roofline(peaks, [("decode", StepCost(100, 200), 1e-8),
                                      ("prefill", StepCost(10_000, 200), 1e-7)],
                              tmp_path / "roof.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])   # the PNG's IHDR chunk: width, height
    assert (width, height) == (1260, 576)               # figsize (10.5, 4.8) inches at 120 dpi

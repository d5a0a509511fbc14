"""The benchmark's routing generators: skewed routing must keep what the comparison holds fixed."""

from __future__ import annotations

import math
import time

import pytest
import torch

from moe_xpu import bench


def test_zipf_counts_keep_rows_and_touched_experts():
    counts = torch.tensor([3, 0, 5, 1, 0, 7, 2, 2])
    skewed = bench.zipf_counts(counts)
    assert int(skewed.sum()) == int(counts.sum())
    assert torch.equal(skewed > 0, counts > 0)
    assert int(skewed.max()) >= int(counts.sum()) // 4  # the most popular expert dominates
    capped = bench.zipf_counts(counts, cap=4)
    assert int(capped.sum()) == int(counts.sum()) and int(capped.max()) <= 4
    assert torch.equal(capped > 0, counts > 0)


def test_skewed_topk_ids_route_each_token_to_distinct_experts():
    gen = torch.Generator().manual_seed(0)
    T, E, k = 64, 64, 8
    ids = torch.randn(T, E, generator=gen).topk(k, dim=1).indices
    skewed = bench.skewed_topk_ids(ids, E)
    assert skewed.shape == ids.shape
    assert all(row.unique().numel() == k for row in skewed)
    assert torch.equal(skewed.unique(), ids.unique())
    top = int(torch.bincount(skewed.flatten()).max())
    assert top == T  # capped at one slot per token, and the skew reaches the cap


def test_median_times_flushes_before_every_timed_call():
    calls: list[str] = []
    impls = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = bench.median_times(impls, repeats=3, flush=lambda: calls.append("flush"))
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    # one untimed warm-up call each, then every timed call right after a flush
    assert calls == ["a", "b"] + ["flush", "a", "flush", "b"] * 3


def test_cache_flush_buffer_exceeds_twice_the_last_level_cache():
    flush = bench.CacheFlush()
    assert flush._buffer.nbytes >= max(1 << 30, 2 * bench._last_level_cache_bytes())
    before = float(flush._buffer[0])
    flush()
    assert float(flush._buffer[-1]) == before + 1.0  # written end to end


def test_small_suite_prints_every_case(capsys):
    rows = bench.bench_small(repeats=9)  # a median of 2 took one 3 ms stall of the VM as the launch time
    out = capsys.readouterr().out
    assert "runtime floor" in out
    cases = {r.case for r in rows}
    assert {c.name for c in bench.SMALL_GEMMS} <= cases
    assert any("fused demo decode" in c for c in cases)
    for r in rows:
        assert r.seconds > 0
        if r.impl == "moe_xpu":  # every moe_gemm case reports its host time (a difference of two
            # medians: under load it can come out below zero, so only its presence is checked)
            assert r.host_us is not None and math.isfinite(r.host_us)


def test_isa_limit_applies_to_moe_xpu_and_torch(capfd):
    from moe_xpu import isa

    assert isa.host_classes()[-1] == "native"
    for name in isa.host_classes()[:-1]:
        assert isa.rerun_limited(name, "moe_xpu.isa", []) == 0
        current, target, capability = capfd.readouterr().out.split()
        assert current == name and target == isa.LIMITS[name]["CL_CONFIG_CPU_TARGET_ARCH"]
        assert capability.lower() == isa.LIMITS[name]["ATEN_CPU_CAPABILITY"]


def test_gemm_backward_counts_three_gemms():
    """--backward times the forward plus both gradients beside grouped_mm's, with three GEMMs'
    FLOPs (a tiny case so the test stays fast)."""
    case = bench.GemmCase("tiny", 8, 2, 4, 64, 48)
    ceilings = bench.Ceilings(gflops=1.0, read_gbs=1.0)
    fwd = bench.bench_gemm([case], [torch.float32], ceilings, 2, "linear", "uniform")
    both = bench.bench_gemm([case], [torch.float32], ceilings, 2, "linear", "uniform", backward=True)
    assert {r.impl for r in both} == {"moe_xpu"} | ({"grouped_mm"} if bench.GROUPED_MM else set())
    ours = {r.impl: r for r in fwd}["moe_xpu"], {r.impl: r for r in both}["moe_xpu"]
    assert abs(ours[1].gflops * ours[1].seconds - 3 * ours[0].gflops * ours[0].seconds) < 1e-9


def test_moe_backward_times_every_backend():
    case = bench.MoeCase("tiny", 6, 4, 2, 32, 16)
    ceilings = bench.Ceilings(gflops=1.0, read_gbs=1.0)
    rows = bench.bench_moe([case], [torch.float32], ceilings, 2, backward=True)
    hf = {"HF eager", "HF grouped_mm"} if bench._hf_mixtral_experts() else set()  # transformers 5.x
    assert {r.impl for r in rows} == {"moe_xpu fused"} | hf
    assert all(r.seconds > 0 for r in rows)


def test_quant_suite_rows_on_a_tiny_case():
    """bench gemm --quant: every format's row, moe_xpu's bf16 and (for int8) W8A8, roofline on the
    quantized bytes: the quantized row reads fewer bytes than the bf16 one in the same time budget."""
    case = bench.GemmCase("tiny", 4, 2, 4, 256, 64)
    ceilings = bench.Ceilings(gflops=100.0, read_gbs=10.0)
    for fmt in bench.QUANT_FORMATS:
        rows = bench.bench_gemm_quant([case], fmt, ceilings, repeats=1, layout="linear", routing="uniform")
        impls = {r.impl: r for r in rows}
        assert f"moe_xpu {fmt}" in impls and "moe_xpu bfloat16" in impls
        assert ("moe_xpu int8 W8A8" in impls) == (fmt == "int8")
        ours, bf16 = impls[f"moe_xpu {fmt}"], impls["moe_xpu bfloat16"]
        assert ours.speedup == 1.0 and all(r.seconds > 0 for r in rows)
        # share of roofline * time = the roofline time, smaller for the quantized bytes
        assert ours.roofline_pct * ours.seconds < bf16.roofline_pct * bf16.seconds


def test_quant_moe_suite_rows_on_a_tiny_case():
    """bench moe --quant: fused_moe on each format beside moe_xpu's bf16 fused_moe (and the HF
    backends where transformers has them), roofline on the quantized bytes."""
    case = bench.MoeCase("tiny", 4, 4, 2, 128, 128)
    ceilings = bench.Ceilings(gflops=100.0, read_gbs=10.0)
    for fmt in bench.QUANT_FORMATS:
        rows = bench.bench_moe_quant([case], fmt, ceilings, repeats=1)
        impls = {r.impl: r for r in rows}
        ours, bf16 = impls[f"moe_xpu fused {fmt}"], impls["moe_xpu fused bfloat16"]
        assert ours.speedup == 1.0 and all(r.seconds > 0 for r in rows)
        assert ours.roofline_pct * ours.seconds < bf16.roofline_pct * bf16.seconds


def test_compute_ceiling_per_dtype():
    """A row's compute ceiling is the faster of float32 and its own dtype's product (a bf16 kernel
    may widen to float32; where the CPU has a bf16 dot product, bf16 rows are held to it), so a
    compute-bound bf16 row's roofline time halves when bf16 products run twice as fast."""
    c = bench.Ceilings(gflops=100.0, read_gbs=1e9, narrow={"bfloat16": 200.0, "float16": 50.0})
    assert c.compute("float32") == 100.0 and c.compute("bfloat16") == 200.0
    assert c.compute("float16") == 100.0 and c.compute("int8") == 100.0
    assert c.roofline_seconds(2e11, 1.0, "bfloat16") == pytest.approx(1.0)
    assert c.roofline_seconds(2e11, 1.0, "float32") == pytest.approx(2.0)
    measured = bench.measure_ceilings(1, ["bfloat16", "int8"])
    assert set(measured.narrow) <= {"bfloat16", "int8"}
    assert all(g > 0 for g in measured.narrow.values()) and measured.gflops > 0


def test_slow_narrow_ceiling_is_skipped(monkeypatch):
    """Where torch has no fast kernel for a dtype under the instruction set in force (bf16 under an
    AVX2 limit is a scalar loop: minutes at 4096^3), a small probe says so and the dtype is held
    to float32's ceiling instead of being timed at full size."""
    mm = torch.mm
    sizes = []

    def slow_bf16_mm(x, y):
        if x.dtype == torch.bfloat16:
            sizes.append(x.shape[0])
            time.sleep(0.05)
        return mm(x, y)

    monkeypatch.setattr(torch, "mm", slow_bf16_mm)
    measured = bench.measure_ceilings(1, ["bfloat16"])
    assert "bfloat16" not in measured.narrow and measured.compute("bfloat16") == measured.gflops
    assert sizes and max(sizes) == 512


def test_ep_wire_bytes_expectation():
    """bench ep's expected bytes per token: nothing leaves a single rank; with one expert per rank
    every slot is remote except the home rank's own (k distinct experts of E)."""
    from moe_xpu.bench_ep import wire_bytes_per_token

    assert sum(wire_bytes_per_token(8, 2, 64, 1).values()) == 0
    b = wire_bytes_per_token(8, 2, 64, 8)
    assert b["rows out"] == pytest.approx(2 * (1 - 1 / 8) * 64 * 2)  # k remote experts, one per rank
    assert b["rows back"] == pytest.approx(2 * (7 / 8) * 64 * 4)

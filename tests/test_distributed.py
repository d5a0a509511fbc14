"""Expert parallelism: 2 and 4 CPU processes (gloo), each holding some of the experts, give
bitwise the one-process fused_moe; bad input on one rank raises on every rank."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_xpu
from moe_xpu.distributed import ExpertPlacement, exit_process, expert_parallel_fused_moe, free_local_port

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _problem(seed: int, dtype: torch.dtype, T=29, H=48, I=40, E=12, k=3):
    """Global inputs every rank draws alike; experts 3 and 7 are picked by nobody."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    b1 = (torch.randn(E, 2 * I, generator=g) / 4).to(dtype)
    b2 = (torch.randn(E, H, generator=g) / 4).to(dtype)
    logits = torch.randn(T, E, generator=g)
    logits[:, [3, 7]] = -float("inf")
    weights, ids = logits.softmax(-1).topk(k, dim=1)
    return x, w1, w2, b1, b2, weights.to(dtype), ids


def _placement(kind: str, E: int, world: int) -> ExpertPlacement:
    if kind == "contiguous":
        return ExpertPlacement.contiguous(E, world)
    return ExpertPlacement(torch.randperm(E, generator=torch.Generator().manual_seed(5)) % world)


def _token_ranges(T: int, world: int):
    """Uneven shares, rank 1 without tokens."""
    cuts = [0, T // 3, T // 3] if world > 2 else [0, T, T]
    for r in range(3, world + 1):
        cuts.append(T // 3 + ((r - 2) * (T - T // 3)) // (world - 2))
    return [(cuts[r], cuts[r + 1]) for r in range(world)]


def _worker(rank, world, port, dtype, placement_kind, bad_rank, bad="id"):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        _check_rank(rank, world, dtype, placement_kind, bad_rank, bad)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # reached only without an exception, which mp.spawn reports


def _check_rank(rank, world, dtype, placement_kind, bad_rank, bad):
    x, w1, w2, b1, b2, weights, ids = _problem(0, dtype)
    E = w1.shape[0]
    placement = _placement(placement_kind, E, world)
    mine = placement.local_experts(rank)
    start, stop = _token_ranges(x.shape[0], world)[rank]
    my_ids = ids[start:stop].clone()
    my_x, my_weights = x[start:stop], weights[start:stop]
    if rank == bad_rank and bad == "id":
        my_ids[0, 0] = E  # outside the placement
    if rank == bad_rank and bad == "top_k":  # valid here, but not what the other ranks send
        my_ids, my_weights = my_ids[:, :2], my_weights[:, :2]
    args = (my_x, w1[mine], w2[mine], my_weights, my_ids, placement)
    kwargs = dict(gate_up_bias=b1[mine], down_bias=b2[mine])
    if bad == "top_k":
        with pytest.raises(moe_xpu.MoeXpuInputError, match="must agree"):
            expert_parallel_fused_moe(*args, **kwargs)
        return
    if bad_rank is not None:
        expected = "topk_ids on rank" if rank == bad_rank else "another rank's inputs"
        with pytest.raises(moe_xpu.MoeXpuInputError, match=expected):
            expert_parallel_fused_moe(*args, **kwargs)
        return
    out = expert_parallel_fused_moe(*args, **kwargs)
    ref = moe_xpu.fused_moe(x, w1, w2, weights, ids, gate_up_bias=b1, down_bias=b2)[start:stop]
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.equal(out, ref), f"rank {rank}: max diff {(out.float() - ref.float()).abs().max()}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype,placement_kind", [(torch.float32, "contiguous"), (torch.bfloat16, "scattered")])
def test_bitwise_equal_to_one_process(world, dtype, placement_kind):
    mp.spawn(_worker, args=(world, free_local_port(), dtype, placement_kind, None), nprocs=world, join=True)


@pytest.mark.parametrize("bad", ["id", "top_k"])
def test_bad_input_on_one_rank_raises_on_every_rank(bad):
    """An expert id outside the placement on rank 0, or a top-k the other ranks do not share."""
    mp.spawn(_worker, args=(2, free_local_port(), torch.float32, "contiguous", 0, bad), nprocs=2, join=True)


def test_token_ranges_cover_every_token_once():
    for world in (2, 4):
        ranges = _token_ranges(29, world)
        assert ranges[0][0] == 0 and ranges[-1][1] == 29 and ranges[1][0] == ranges[1][1]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_contiguous_placement():
    p = ExpertPlacement.contiguous(10, 4)
    assert p.owner.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert p.local_experts(2).tolist() == [6, 7]
    assert p.local_index().tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]


def test_per_slot_rows_sum_to_fused_moe():
    """The rows the expert parallel path moves: their slot sum is fused_moe, bit for bit, and
    sentinel slots are zero rows."""
    x, w1, w2, b1, b2, weights, ids = _problem(1, torch.bfloat16)
    ids = ids.clone()
    ids[::4, 1] = moe_xpu.SENTINEL_EXPERT
    per_slot = moe_xpu.fused.fused_moe_per_slot(x, w1, w2, weights, ids, "silu", b1, b2)
    assert per_slot.dtype == torch.float32 and per_slot.shape == (x.shape[0], ids.shape[1], x.shape[1])
    assert not per_slot[::4, 1].any()
    assert torch.equal(per_slot.sum(dim=1).to(x.dtype),
                       moe_xpu.fused_moe(x, w1, w2, weights, ids, gate_up_bias=b1, down_bias=b2))


@pytest.mark.parametrize("nproc,family", [(2, "qwen3_moe"), (4, "mixtral")])
def test_expert_parallel_example_generates_the_one_process_tokens(nproc, family):
    """examples/expert_parallel.py under torchrun: every rank keeps only its experts, generates from
    its own prompt, and gets the one-process model's tokens."""
    pytest.importorskip("transformers.integrations.moe", reason="the experts interface arrived in transformers 5")
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parents[1] / "examples" / "expert_parallel.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                          "--master-port", str(free_local_port()), str(example), "--family", family,
                          "--prompt-tokens", "6", "--new-tokens", "3"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("same as one process") == nproc, run.stdout
    assert "every rank generated the one-process tokens" in run.stdout

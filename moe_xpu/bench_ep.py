"""The ``bench ep`` suite: expert parallelism over gloo on this host's CPU.

Spawns 2 and 4 processes; each holds a contiguous share of the experts and routes its own
tokens (uniform random top-k). Per phase (dispatch: counts and rows out; compute: the local
experts; combine: rows home and the slot sum) the median over repeats of the slowest rank, and
the bytes each token puts on the wire per layer: its row to every other rank holding one of its
experts (once per rank), beside the minimum the routing allows and the uniform-routing
expectation, with its ids and weights, and one float32 row back per slot computed elsewhere. Then the same counts for a DeepSeek-V3-sized layer, in expectation
under uniform routing, and the time they take at a stated link bandwidth.
"""

from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_xpu.distributed import free_local_port

CASE = dict(tokens_per_rank=64, experts=32, top_k=4, H=1024, I=512)


def wire_bytes_per_token(experts: int, top_k: int, hidden: int, world: int, row_bytes: int = 2) -> dict:
    """Expected bytes one token sends per layer under uniform routing with contiguous placement
    (experts / world per rank): rows out (once per other rank holding one of its experts), their
    slot ids (int64) and weights (row dtype), float32 rows back per slot computed elsewhere."""
    per_rank = experts / world
    # P(a given rank holds none of the k experts) for k distinct experts drawn uniformly.
    p_none = 1.0
    for i in range(top_k):
        p_none *= (experts - per_rank - i) / (experts - i)
    remote_ranks = (world - 1) * (1.0 - p_none)
    remote_slots = top_k * (1.0 - per_rank / experts)
    return {"rows out": remote_ranks * hidden * row_bytes,
            "ids and weights": remote_ranks * top_k * (8 + row_bytes),
            "rows back": remote_slots * hidden * 4}


def _rank_main(rank: int, world: int, port: int, repeats: int, queue) -> None:
    from moe_xpu import fused
    from moe_xpu.distributed import ExpertPlacement, combine, dispatch, exit_process

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        c = CASE
        g = torch.Generator().manual_seed(rank)
        placement = ExpertPlacement.contiguous(c["experts"], world)
        local = placement.local_experts(rank).numel()
        dtype = torch.bfloat16
        x = torch.randn(c["tokens_per_rank"], c["H"], generator=g).to(dtype)
        w1 = (torch.randn(local, 2 * c["I"], c["H"], generator=g) * 0.02).to(dtype)
        w2 = (torch.randn(local, c["H"], c["I"], generator=g) * 0.02).to(dtype)
        logits = torch.randn(c["tokens_per_rank"], c["experts"], generator=g)
        weights, ids = logits.softmax(-1).topk(c["top_k"], dim=1)
        weights = weights.to(dtype)
        times = {"dispatch": [], "compute": [], "combine": []}
        for step in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            routed = dispatch(x, weights, ids, placement)
            t1 = time.perf_counter()
            per_slot = fused.fused_moe_per_slot(routed.rows, w1, w2, routed.weights, routed.local_ids)
            t2 = time.perf_counter()
            combine(per_slot, routed)
            t3 = time.perf_counter()
            if step:  # the first call builds the kernels
                for name, t in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                    times[name].append(t)
        medians = torch.tensor([statistics.median(v) for v in times.values()], dtype=torch.float64)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        esize = x.element_size()
        remote_rows = sum(n for d, n in enumerate(routed.send_counts) if d != rank)
        remote_slots = int((routed.local_ids >= 0).sum()) - int((routed.local_ids[
            sum(routed.recv_counts[:rank]):sum(routed.recv_counts[:rank + 1])] >= 0).sum())
        # The minimum, from the routing alone: each token's row once to each other rank among its
        # experts' owners.
        holds = torch.zeros(ids.shape[0], world, dtype=torch.bool)
        holds[torch.arange(ids.shape[0])[:, None], placement.owner[ids]] = True
        minimum_rows = int(holds.sum()) - int(holds[:, rank].sum())
        sent = torch.tensor([remote_rows * c["H"] * esize, remote_rows * c["top_k"] * (8 + esize),
                             remote_slots * c["H"] * 4, minimum_rows * c["H"] * esize], dtype=torch.float64)
        dist.all_reduce(sent)
        if rank == 0:
            queue.put((world, medians.tolist(), (sent / (world * c["tokens_per_rank"])).tolist()))
    finally:
        dist.destroy_process_group()
    exit_process(0)  # reached only without an exception, which mp.start_processes reports


def bench_ep(worlds=(2, 4), repeats: int = 5, link_gbs: float = 50.0) -> list[tuple]:
    c = CASE
    print(f"expert parallelism over gloo, {c['tokens_per_rank']} tokens per rank, {c['experts']} experts "
          f"(contiguous shares), top-{c['top_k']}, H {c['H']}, I {c['I']}, bfloat16, median of {repeats}, "
          f"slowest rank")
    print(f"{'ranks':>5} {'dispatch ms':>12} {'compute ms':>11} {'combine ms':>11} {'rows out B/token':>17} "
          f"{'minimum':>8} {'uniform':>8} {'ids+weights B/token':>20} {'rows back B/token':>18}")
    ctx = mp.get_context("spawn")
    results = []
    for world in worlds:
        queue = ctx.SimpleQueue()
        mp.start_processes(_rank_main, args=(world, free_local_port(), repeats, queue), nprocs=world, join=True,
                           start_method="spawn")
        _, medians, sent = queue.get()
        expected = wire_bytes_per_token(c["experts"], c["top_k"], c["H"], world)
        print(f"{world:>5} {medians[0] * 1e3:>12.2f} {medians[1] * 1e3:>11.2f} {medians[2] * 1e3:>11.2f} "
              f"{sent[0]:>17.0f} {sent[3]:>8.0f} {expected['rows out']:>8.0f} {sent[1]:>20.0f} {sent[2]:>18.0f}")
        results.append((world, medians, sent))
    print(f"\nprojection, DeepSeek-V3-sized layer (256 experts, top-8, hidden 7168, bf16 rows), uniform routing, "
          f"link {link_gbs:.0f} GB/s per rank:")
    for world in (8, 16, 32):
        b = wire_bytes_per_token(256, 8, 7168, world)
        total = sum(b.values())
        print(f"  {world:>2} ranks: rows out {b['rows out'] / 1e3:.1f} KB, ids+weights {b['ids and weights']:.0f} B, "
              f"rows back {b['rows back'] / 1e3:.1f} KB per token; 4096 tokens per rank: "
              f"{4096 * total / (link_gbs * 1e9) * 1e3:.1f} ms per layer")
    return results

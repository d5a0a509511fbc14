"""Expert parallelism over torch.distributed: each rank holds some of the experts.

    import torch.distributed as dist
    from moe_xpu.distributed import ExpertPlacement, expert_parallel_fused_moe

    placement = ExpertPlacement.contiguous(num_experts, dist.get_world_size())
    y = expert_parallel_fused_moe(x, local_gate_up, local_down, topk_weights, topk_ids, placement)

Each rank routes its own tokens. A token row goes once to every rank that holds at least one of
its chosen experts (with those slots' expert ids and weights; its other slots marked -1, the
sentinel the kernels skip); the receiving rank runs its local experts with ``fused_moe``'s two
launches and sends back one weighted float32 row per (token, slot) it computed; the token's home
rank places the rows at their slots and sums them in slot order. A token's rows do not depend on
which other tokens share the launch, so the result is bitwise the one-process ``fused_moe``.

Only torch.distributed collectives move data (``all_to_all_single``, ``all_reduce``): no
transport of moe_xpu's own, no code that depends on the backend (gloo, xccl, ...). Rows travel as
bytes, so every dtype crosses every backend. Input errors are agreed on by all ranks before any
exchange: a bad argument on one rank raises on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import NamedTuple, NoReturn

import torch
import torch.distributed as dist

from moe_xpu import fused
from moe_xpu.ops import MoeXpuInputError


def exit_process(code: int = 0) -> NoReturn:
    """Ends a process whose process group is destroyed, without the interpreter's teardown.

    torch's gloo worker threads drop their last references to a collective's tensors after the
    collective has completed, and dropping a tensor Python also wraps takes the GIL. If the
    interpreter has begun its teardown by then, the thread is ended inside that destructor and the
    process aborts ("terminate called without an active exception", signal 6) after everything
    succeeded: a race that loaded machines lose. Call it last, with stdout and stderr to flush."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now: the rendezvous port of a process group started on this
    machine (the tests, ``python -m moe_xpu.bench ep``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExpertPlacement(NamedTuple):
    """Which rank holds each expert: ``owner`` int64 [E]; a rank's local experts are its experts in
    ascending global id (the order of its gate_up_proj / down_proj shards)."""

    owner: torch.Tensor

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> "ExpertPlacement":
        """Contiguous ranges of experts, sizes differing by at most one (earlier ranks larger)."""
        if num_experts < 1 or world_size < 1:
            raise MoeXpuInputError(f"num_experts and world_size must be positive, got {num_experts}, {world_size}")
        sizes = [num_experts // world_size + (r < num_experts % world_size) for r in range(world_size)]
        return cls(torch.repeat_interleave(torch.arange(world_size), torch.tensor(sizes)))

    @property
    def num_experts(self) -> int:
        return self.owner.numel()

    def local_experts(self, rank: int) -> torch.Tensor:
        """Global ids of the experts ``rank`` holds, ascending."""
        return torch.nonzero(self.owner == rank).flatten()

    def local_index(self) -> torch.Tensor:
        """Each expert's index among its owner's experts."""
        index = torch.empty_like(self.owner)
        for rank in self.owner.unique().tolist():
            ids = self.local_experts(rank)
            index[ids] = torch.arange(ids.numel())
        return index


def _check_local(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, placement, rank, world,
                 activation, gate_up_bias, down_bias) -> None:
    if not isinstance(placement, ExpertPlacement):
        raise MoeXpuInputError(f"placement must be an ExpertPlacement, got {type(placement).__name__}")
    owner = placement.owner
    if owner.dim() != 1 or owner.dtype != torch.int64 or owner.numel() < 1:
        raise MoeXpuInputError(f"placement.owner must be int64 [E], got {owner.dtype} {tuple(owner.shape)}")
    if bool(((owner < 0) | (owner >= world)).any()):
        raise MoeXpuInputError(f"placement.owner values must be ranks in [0, {world})")
    local = int((owner == rank).sum())
    # The shards' metadata, checked as fused_moe would for this rank's experts.
    fused.check_fused_moe_metadata(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation,
                                   gate_up_bias, down_bias)
    if gate_up_proj.shape[0] != local:
        raise MoeXpuInputError(f"rank {rank} holds {local} experts in the placement, but gate_up_proj has "
                               f"{gate_up_proj.shape[0]}")
    bad = (topk_ids < 0) | (topk_ids >= placement.num_experts)
    if bool(bad.any()):
        raise MoeXpuInputError(f"topk_ids on rank {rank} must lie in [0, {placement.num_experts}), "
                               f"found {int(topk_ids[bad][0])}")


_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


def _agree_on_errors(error: Exception | None, shape: tuple[int, int, int], rank: int, group) -> None:
    """Raises on every rank if the inputs of any rank were bad or the ranks disagree on H, k or the
    dtype (two all_reduces, no hang)."""
    mine = torch.tensor([1 if error is None else 0, *shape], dtype=torch.int64)
    low = mine.to(_collective_device(group))
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if int(low[0]) == 0:
        raise MoeXpuInputError(f"expert_parallel_fused_moe: another rank's inputs were rejected (this is rank {rank})")
    if not torch.equal(low[1:], high[1:]):
        raise MoeXpuInputError(f"expert_parallel_fused_moe: the ranks' hidden size H, top-k k and dtype must agree; "
                               f"rank {rank} has H = {shape[0]}, k = {shape[1]}, dtype code {shape[2]}")


def _collective_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cpu") if backend == "gloo" else torch.device(torch.accelerator.current_accelerator())


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """all_to_all_single of whole rows, moved as bytes (any dtype, any backend)."""
    row_shape = tuple(send.shape[1:])
    width = send.element_size()
    for size in row_shape:
        width *= size
    send_bytes = send.contiguous().view(torch.uint8).reshape(send.shape[0], width)
    recv = torch.empty(sum(recv_counts), width, dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(recv, send_bytes, recv_counts, send_counts, group=group)
    return recv.view(send.dtype).reshape(sum(recv_counts), *row_shape)


def expert_parallel_fused_moe(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    placement: ExpertPlacement,
    *,
    group=None,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_moe`` with the experts spread over the ranks of ``group`` (default: the world).

    hidden_states [T, H], topk_weights and topk_ids [T, k] (global expert ids): this rank's
    tokens, any T (0 included). gate_up_proj [E_local, 2I, H], down_proj [E_local, H, I] (and the
    biases [E_local, ...]): this rank's experts, ``placement.local_experts(rank)`` in that order.
    Every rank of the group must call it (a collective). Returns [T, H], bitwise equal to
    ``fused_moe`` over all experts in one process.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    error = None
    try:
        _check_local(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, placement, rank, world,
                     activation, gate_up_bias, down_bias)
    except Exception as e:  # noqa: BLE001  (any rejection must reach the other ranks first)
        error = e if isinstance(e, MoeXpuInputError) else MoeXpuInputError(f"rank {rank}: {e}")
    shape = (0, 0, 0) if error else (hidden_states.shape[1], topk_ids.shape[1], _DTYPE_CODES[hidden_states.dtype])
    _agree_on_errors(error, shape, rank, group)

    routed = dispatch(hidden_states, topk_weights, topk_ids, placement, group)
    # The local experts on every received row: one weighted float32 row per local slot.
    per_slot = fused.fused_moe_per_slot(routed.rows, gate_up_proj, down_proj, routed.weights, routed.local_ids,
                                        activation, gate_up_bias, down_bias)
    return combine(per_slot, routed, group)


class Routed(NamedTuple):
    """What ``dispatch`` delivered to this rank, and what ``combine`` needs to send results home."""

    rows: torch.Tensor  # [R, H]: received token rows, grouped by source rank, in its token order
    local_ids: torch.Tensor  # int64 [R, k]: local expert index of each slot, -1 where held elsewhere
    weights: torch.Tensor  # [R, k]: top-k weights
    send_counts: list[int]  # rows this rank sent to each rank
    recv_counts: list[int]  # rows it received from each rank
    home_slots: list[torch.Tensor]  # per rank: flat (token * k + slot) of this rank's slots it computes
    tokens: int  # this rank's T
    top_k: int
    dtype: torch.dtype


def dispatch(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             placement: ExpertPlacement, group=None) -> Routed:
    """Sends each token row once to every rank holding one of its experts (collective)."""
    world = dist.get_world_size(group)
    device = hidden_states.device
    ids = topk_ids.to(torch.int64)
    slot_owner = placement.owner.to(device)[ids]  # [T, k]: the rank computing each slot
    local_index = placement.local_index().to(device)[ids]
    send_rows, send_ids, send_weights, send_counts, home_slots = [], [], [], [], []
    for dest in range(world):
        at_dest = slot_owner == dest
        tokens = torch.nonzero(at_dest.any(dim=1)).flatten()
        send_rows.append(hidden_states[tokens])
        send_ids.append(torch.where(at_dest[tokens], local_index[tokens], fused.SENTINEL_EXPERT))
        send_weights.append(topk_weights[tokens])
        send_counts.append(tokens.numel())
        home_slots.append(torch.nonzero(at_dest.flatten()).flatten())  # flat t * k + j, ascending
    counts = torch.tensor(send_counts, dtype=torch.int64, device=_collective_device(group))
    recv_counts_t = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts_t, counts, group=group)
    recv_counts = recv_counts_t.tolist()
    rows = _exchange(torch.cat(send_rows), send_counts, recv_counts, group)
    local_ids = _exchange(torch.cat(send_ids), send_counts, recv_counts, group)
    weights = _exchange(torch.cat(send_weights), send_counts, recv_counts, group)
    return Routed(rows, local_ids, weights, send_counts, recv_counts, home_slots, hidden_states.shape[0],
                  topk_ids.shape[1], hidden_states.dtype)


def combine(per_slot: torch.Tensor, routed: Routed, group=None) -> torch.Tensor:
    """Sends the computed slot rows (float32 [R, k, H]) to their tokens' home ranks, where they are
    placed at their slots and summed in slot order (collective). Returns [T, H]."""
    world = dist.get_world_size(group)
    device = per_slot.device
    H = per_slot.shape[2]
    computed = routed.local_ids >= 0  # [R, k]
    back = per_slot[computed]  # in (received row, slot) order
    source = torch.repeat_interleave(torch.arange(world, device=device),
                                     torch.tensor(routed.recv_counts, device=device))
    back_counts = [int(computed[source == r].sum()) for r in range(world)]
    home_counts = [s.numel() for s in routed.home_slots]
    returned = _exchange(back, back_counts, home_counts, group)
    T, k = routed.tokens, routed.top_k
    gathered = torch.zeros(T * k, H, dtype=torch.float32, device=device)
    gathered[torch.cat(routed.home_slots)] = returned
    return gathered.view(T, k, H).sum(dim=1).to(routed.dtype)

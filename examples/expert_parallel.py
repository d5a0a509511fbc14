"""Expert parallelism with torch.distributed: each process keeps only its share of every MoE
layer's experts, generates from its own prompt, and the layers exchange token rows with the
processes holding their experts. Each process then checks its tokens against the one-process
model (all experts, moe_xpu backend) on the same prompt.

    torchrun --nproc-per-node 2 examples/expert_parallel.py        # gloo on the CPU
    torchrun --nproc-per-node 4 examples/expert_parallel.py --family mixtral
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_generate  # noqa: E402  (the one-process demo's model families)

import moe_xpu.integrations.transformers as moe_xpu_hf  # noqa: E402
from moe_xpu.distributed import exit_process  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"], default="qwen3_moe")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        moe_xpu_hf.register()
        config = hf_generate.FAMILIES[args.family]()
        dtype = getattr(torch, args.dtype)
        # Each process its own prompt (its own length too): data-parallel attention, expert-parallel experts.
        length = args.prompt_tokens + rank
        prompt = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(rank))

        sharded = hf_generate.build(config, moe_xpu_hf.NAME, dtype)
        layers = moe_xpu_hf.shard_experts(sharded)
        # Every rank must run as many forward passes as the others (each is a collective): no
        # stopping early at an end-of-sequence token.
        sharded.generation_config.eos_token_id = None
        ours, seconds = hf_generate.generate(sharded, prompt, args.new_tokens)
        full = hf_generate.build(config, moe_xpu_hf.NAME, dtype)
        full.generation_config.eos_token_id = None
        ref, _ = hf_generate.generate(full, prompt, args.new_tokens)  # one process, every expert
        same = torch.equal(ours, ref)
        experts = sharded.config.num_experts if hasattr(sharded.config, "num_experts") else "?"
        print(f"rank {rank}/{world}: {layers} MoE layers sharded ({experts} experts each), prompt {length} tokens, "
              f"{seconds:.2f} s; tokens {ours[0, length:].tolist()}: "
              f"{'same as one process' if same else 'DIFFER from one process'}", flush=True)
        agree = torch.tensor([int(same)])
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
        if rank == 0:
            print("every rank generated the one-process tokens" if agree.item() else "tokens DIFFER", flush=True)
        return 0 if agree.item() else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_process(main())

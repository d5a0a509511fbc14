"""The main job: a small MoE language model from a transformers config (random weights, no
download) generates greedily with experts_implementation="moe_xpu" and with "eager"; prints
whether the tokens agree and the time of each.

    python examples/hf_generate.py                       # built-in small Qwen3-MoE config
    python examples/hf_generate.py --family mixtral      # or: qwen2_moe, olmoe, deepseek_v3, gpt_oss
    python examples/hf_generate.py --config path/or/name # your own config (config.json only,
                                                          # from a local folder or the hub cache)
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import moe_xpu.integrations.transformers as moe_xpu_hf

SMALL = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.5)

FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, intermediate_size=1024, moe_intermediate_size=256,
                                                     num_experts=32, num_experts_per_tok=4, head_dim=64),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, intermediate_size=512, num_local_experts=8,
                                                  num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, intermediate_size=1024, moe_intermediate_size=256,
                                                     shared_expert_intermediate_size=512, num_experts=32,
                                                     num_experts_per_tok=4),
    "olmoe": lambda: transformers.OlmoeConfig(**SMALL, intermediate_size=256, num_experts=32, num_experts_per_tok=4),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": 8}, intermediate_size=1024, moe_intermediate_size=256,
        n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=1,
        topk_group=1, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64),
    "gpt_oss": lambda: transformers.GptOssConfig(**SMALL, intermediate_size=256, num_local_experts=32,
                                                 num_experts_per_tok=4, head_dim=64, sliding_window=128),
}


def generate(config, implementation: str, prompt: torch.Tensor, new_tokens: int, dtype):
    torch.manual_seed(0)  # same random weights for both implementations
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=implementation, dtype=dtype)
    model.eval()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, do_sample=False)  # warm-up (and kernel build)
        start = time.perf_counter()
        tokens = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    parser.add_argument("--config", help="a model name or folder whose config.json to use instead")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()

    moe_xpu_hf.register()
    config = transformers.AutoConfig.from_pretrained(args.config) if args.config else FAMILIES[args.family]()
    dtype = getattr(torch, args.dtype)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    print(f"model: {type(config).__name__} ({config.num_hidden_layers} layers, hidden {config.hidden_size}), "
          f"random weights, {args.dtype}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new")

    ours, t_ours = generate(config, moe_xpu_hf.NAME, prompt, args.new_tokens, dtype)
    eager, t_eager = generate(config, "eager", prompt, args.new_tokens, dtype)
    new = slice(args.prompt_tokens, None)
    print(f"moe_xpu tokens: {ours[0, new].tolist()}")
    print(f"eager tokens:   {eager[0, new].tolist()}")
    print(f"moe_xpu {t_ours:.2f} s, eager {t_eager:.2f} s ({t_eager / t_ours:.2f}x)")
    if torch.equal(ours, eager):
        print("tokens agree")
    else:
        print("tokens DIFFER")
        raise SystemExit(1)


if __name__ == "__main__":
    main()

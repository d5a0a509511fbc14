"""moe_xpu.integrations.ipex in the IPEX environment (torch 2.8, intel-extension-for-pytorch 2.8,
transformers 4.51; ``make test-ipex``): IPEX's moe_gemm signatures against a float64 reference,
GatedMLPMOE and ipex.llm.optimize'd models against IPEX's own results, and disable() giving
IPEX's results back bit for bit. Skipped where IPEX is not installed."""

from __future__ import annotations

import warnings

import pytest
import torch

ipex = pytest.importorskip("intel_extension_for_pytorch")
transformers = pytest.importorskip("transformers")

import moe_xpu  # noqa: E402
import moe_xpu.integrations.ipex as moe_xpu_ipex  # noqa: E402
from moe_xpu import fused  # noqa: E402
from reference import assert_matches_reference, fused_moe_reference  # noqa: E402

# IPEX's and transformers' own notices (tensor copy construction, deprecated arguments, generation
# settings) are not ours to fix; moe_xpu's warnings are RuntimeWarnings and stay errors.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:intel_extension_for_pytorch.*"),
              pytest.mark.filterwarnings("ignore::UserWarning:transformers.*"),
              pytest.mark.filterwarnings("ignore::FutureWarning:transformers.*")]


def _ipex_has_bf16() -> bool:
    """IPEX's bf16 weight prepacking (ipex.llm.optimize, use_prepack=True) needs AVX-512 or
    AVX-NE-CONVERT; elsewhere it refuses to run."""
    from intel_extension_for_pytorch import _C as ipex_core

    return bool(ipex_core.onednn_has_bf16_support())


NO_IPEX_BF16 = "IPEX's bf16 weight prepacking needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT on this CPU"


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    moe_xpu_ipex.disable()


def _offsets(counts: torch.Tensor, n_experts: int) -> torch.Tensor:
    return counts[:n_experts].cumsum(0).to(torch.int32)


# The shapes that break things: empty experts, one expert taking every row, zero rows, rows past
# the counted ones, counts padded to a multiple of 8, sizes that are no tile's multiple.
COUNT_CASES = {
    "uneven_with_empty": ([3, 0, 7, 1, 4], 0),
    "one_expert_takes_all": ([0, 0, 19, 0], 0),
    "zero_rows": ([0, 0, 0], 0),
    "rows_past_the_counts": ([2, 5, 1], 4),
    "many_experts": ([1, 0, 2, 0, 3] * 9 + [1], 0),
}


@pytest.mark.parametrize("case", sorted(COUNT_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_gemm_both_ipex_signatures_match_the_reference(case, dtype):
    counts_list, spare_rows = COUNT_CASES[case]
    E, K, N = len(counts_list), 37, 45
    padded = counts_list + [0] * (-len(counts_list) % 8)  # IPEX pads its count vectors to 8
    counts = torch.tensor(padded, dtype=torch.int32)
    a = torch.randn(sum(counts_list) + spare_rows, K, dtype=dtype)
    b = torch.randn(E, K, N, dtype=dtype)
    out_2810 = moe_xpu_ipex.moe_gemm(a, b, counts, counts.clone(), E)  # IPEX 2.8.10
    out_later = moe_xpu_ipex.moe_gemm(a, b, counts, E)  # without rows_for_experts_cpu
    out_keywords = moe_xpu_ipex.moe_gemm(a, b, rows_for_experts=counts, n_experts=E)
    assert_matches_reference(out_2810, a, b, _offsets(counts, E))
    assert torch.equal(out_2810, out_later) and torch.equal(out_2810, out_keywords)


def test_moe_gemm_reads_strided_weights_in_place():
    E, K, N = 4, 33, 20
    counts = torch.tensor([5, 0, 9, 2], dtype=torch.int64)
    a = torch.randn(16, 2 * K)[:, ::2]  # a column stride of 2
    w = torch.randn(E, N, K)  # nn.Linear layout, read as [E, K, N]
    out = moe_xpu_ipex.moe_gemm(a, w.transpose(1, 2), counts, None, E)
    assert_matches_reference(out, a, w.transpose(1, 2), _offsets(counts, E))


@pytest.mark.parametrize("bad,message", [
    (dict(rows_for_experts=torch.tensor([2, -1, 3], dtype=torch.int32)), "rows_for_experts must be non-negative"),
    (dict(rows_for_experts=torch.tensor([4, 4, 4], dtype=torch.int32)), "sums to 12"),
    (dict(rows_for_experts=torch.tensor([2, 2], dtype=torch.int32)), "at least n_experts = 3"),
    (dict(rows_for_experts=torch.tensor([2, 2, 2], dtype=torch.float32)), "int32 or int64"),
    (dict(n_experts=4), "n_experts must be an int equal to matrix_b.shape[0] = 3"),
    (dict(matrix_b=torch.randn(3, 8)), "matrix_b must be 3-D"),
    (dict(matrix_a=torch.randn(10, 9)), "b's K dimension"),
])
def test_moe_gemm_bad_input_names_the_argument(bad, message):
    args = dict(matrix_a=torch.randn(10, 8), matrix_b=torch.randn(3, 8, 5),
                rows_for_experts=torch.tensor([2, 3, 4], dtype=torch.int32), n_experts=3)
    args.update(bad)
    with pytest.raises(moe_xpu.MoeXpuInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        moe_xpu_ipex.moe_gemm(**args)


def test_fp8_scales_are_refused_by_name():
    a, b = torch.randn(4, 8), torch.randn(2, 8, 3)
    counts = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(moe_xpu_ipex.UnsupportedByMoeXpu, match="matrix_a_scale_inv"):
        moe_xpu_ipex.moe_gemm(a, b, counts, counts, 2, torch.ones(1), torch.ones(1))


def test_torch_xpu_moe_gemm_is_routed_and_restored():
    before = getattr(torch.xpu, "moe_gemm", None)
    E, K, N = 6, 24, 16
    counts = torch.tensor([4, 0, 1, 0, 9, 2, 0, 0], dtype=torch.int32)
    a, b = torch.randn(16, K, dtype=torch.bfloat16), torch.randn(E, K, N, dtype=torch.bfloat16)
    with moe_xpu_ipex.enabled():
        assert moe_xpu_ipex.is_enabled()
        out = torch.xpu.moe_gemm(a, b, counts, counts, E)  # IPEX 2.8.10's call, CPU tensors
        assert_matches_reference(out, a, b, _offsets(counts, E))
    assert not moe_xpu_ipex.is_enabled()
    assert getattr(torch.xpu, "moe_gemm", None) is before


def test_what_moe_xpu_lacks_goes_to_ipex_with_one_warning(monkeypatch):
    calls = []

    def ipex_moe_gemm(*args, **kwargs):  # stands in for IPEX's XPU kernel
        calls.append(args)
        return torch.zeros(args[0].shape[0], args[1].shape[2])

    monkeypatch.setattr(torch.xpu, "moe_gemm", ipex_moe_gemm, raising=False)
    monkeypatch.setattr(moe_xpu_ipex, "_warned", set())
    a, b, counts = torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([1, 3], dtype=torch.int32)
    scale = torch.ones(1)
    moe_xpu_ipex.enable()
    with pytest.warns(RuntimeWarning, match="no fp8 path"):
        torch.xpu.moe_gemm(a, b, counts, counts, 2, scale, scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        torch.xpu.moe_gemm(a, b, counts, counts, 2, scale, scale)
    assert len(calls) == 2
    moe_xpu_ipex.disable()
    assert torch.xpu.moe_gemm is ipex_moe_gemm


def test_enable_twice_then_disable_once_restores_ipex():
    from intel_extension_for_pytorch.llm.modules import GatedMLPMOE

    own = GatedMLPMOE.forward
    moe_xpu_ipex.enable()
    moe_xpu_ipex.enable()
    assert GatedMLPMOE.forward is not own
    moe_xpu_ipex.disable()
    assert GatedMLPMOE.forward is own and not moe_xpu_ipex.is_enabled()


# --- GatedMLPMOE ----------------------------------------------------------------------------------

ROUTINGS = {  # GatedMLPMOE.forward's routing arguments after (hidden_states, use_grouped_topk, top_k, logits)
    "softmax_renormalized": dict(use_grouped_topk=False, renormalize=True),
    "softmax": dict(use_grouped_topk=False, renormalize=False),
    "grouped_sigmoid_with_bias": dict(use_grouped_topk=True, renormalize=True, topk_group=2, num_expert_group=4,
                                      scoring_func="sigmoid", e_score_correction_bias="random"),
    "grouped_softmax": dict(use_grouped_topk=True, renormalize=False, topk_group=1, num_expert_group=2),
    "custom": dict(use_grouped_topk=False, renormalize=True, custom_routing_function="sigmoid_topk"),
}


def _sigmoid_topk(hidden_states, gating_output, topk, renormalize):
    weights, ids = torch.topk(gating_output.sigmoid(), topk, dim=-1)
    return (weights / weights.sum(-1, keepdim=True) if renormalize else weights), ids.to(torch.int32)


def _routing_arguments(routing: str, E: int) -> dict:
    args = {**dict(topk_group=None, num_expert_group=None, custom_routing_function=None, scoring_func="softmax",
                   e_score_correction_bias=None), **ROUTINGS[routing]}
    if args["e_score_correction_bias"] == "random":
        args["e_score_correction_bias"] = torch.randn(E) / 10
    if args["custom_routing_function"] == "sigmoid_topk":
        args["custom_routing_function"] = _sigmoid_topk
    return args


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("separate_up", [False, True])
@pytest.mark.parametrize("use_prepack", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_mlp_moe_matches_its_own_output(routing, separate_up, use_prepack, dtype):
    if use_prepack and dtype == torch.bfloat16 and not _ipex_has_bf16():
        pytest.skip(NO_IPEX_BF16)
    from intel_extension_for_pytorch.llm.modules import GatedMLPMOE

    T, E, H, I, k = 13, 8, 48, 40, 3
    W13 = (torch.randn(E, 2 * I, H) / H**0.5).to(dtype)
    W2 = (torch.randn(E, H, I) / I**0.5).to(dtype)
    if separate_up:
        module = GatedMLPMOE(W13[:, :I].contiguous(), W2, W13[:, I:].contiguous(), use_prepack=use_prepack)
    else:
        module = GatedMLPMOE(W13, W2, use_prepack=use_prepack)
    x = torch.randn(T, H).to(dtype)
    logits = torch.randn(T, E)
    args = _routing_arguments(routing, E)
    use_grouped, renormalize = args.pop("use_grouped_topk"), args.pop("renormalize")

    def run():
        return module(x, use_grouped, k, logits, renormalize, **args)

    ipex_out = run()
    with moe_xpu_ipex.enabled():
        ours = run()
        again = run()
    assert torch.equal(ours, again)  # bitwise reproducible
    assert torch.equal(run(), ipex_out)  # disable() gives IPEX's result back bit for bit
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.float(), ipex_out.float(), atol=tol, rtol=tol)
    # The expert math against float64, on the routing moe_xpu computed.
    weights, ids = moe_xpu_ipex._select_experts(x, logits, k, renormalize, use_grouped, **args)
    reference = fused_moe_reference(x, W13, W2, weights.to(dtype), ids)
    torch.testing.assert_close(ours.double(), reference, atol=tol, rtol=tol)


# --- ipex.llm.optimize'd models -------------------------------------------------------------------

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, initializer_range=0.1)

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_key_value_heads=2, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
        architectures=["MixtralForCausalLM"]),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, head_dim=16, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"]),
    # IPEX's DeepSeek gate reads the fields of DeepSeek's own config (scoring_func, seq_aux,
    # topk_method) and runs in 16-bit floats only.
    "deepseek_v3": lambda: _with_fields(transformers.DeepseekV3Config(
        **COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=48, n_routed_experts=32,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=4, topk_group=2,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        architectures=["DeepseekV3ForCausalLM"]), scoring_func="sigmoid", seq_aux=True, topk_method="noaux_tc"),
}


def _with_fields(config, **fields):
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def _optimized(family: str, dtype: torch.dtype):
    if dtype == torch.bfloat16 and not _ipex_has_bf16():
        pytest.skip(NO_IPEX_BF16)
    if family == "deepseek_v3" and dtype == torch.float32:
        pytest.skip("IPEX's DeepSeek gate takes bfloat16, float16 or float8 weights only")
    if family == "deepseek_v3":
        # Seen on an AVX-512-BF16 host: ipex.llm.optimize reads fields of DeepSeek's own modeling file
        # (trust_remote_code) that transformers' DeepseekV3 lacks (YaRN mscale, MoE ep_rank, attention
        # q_head_dim, generation inputs) and fails before any MoE step runs.
        pytest.skip("IPEX 2.8's DeepSeek-V3 path needs DeepSeek's remote-code model, not transformers' DeepseekV3")
    return ipex.llm.optimize(_random_model(family, dtype), dtype=dtype, inplace=True, deployment_mode=False)


def _random_model(family: str, dtype: torch.dtype):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval().to(dtype)


def _reference_logits(family: str, dtype: torch.dtype, *token_sets: torch.Tensor) -> list[torch.Tensor]:
    """The un-optimized transformers model, same weights (rounded to dtype), run in float64 on each
    set of tokens."""
    model = _random_model(family, dtype).double()
    with torch.no_grad():
        return [model(tokens).logits for tokens in token_sets]


def _near_ties(reference_logits: torch.Tensor, tol: float) -> torch.Tensor:
    top2 = reference_logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1] < 2 * tol


def _assert_reference_would_choose(tokens, reference_logits, tol, prompt):
    """Every generated token is the reference's greedy choice, or one of a near tie."""
    chosen = reference_logits[:, prompt - 1:-1].argmax(-1)
    agree = (chosen == tokens[:, prompt:]) | _near_ties(reference_logits[:, prompt - 1:-1], tol)
    assert agree.all(), f"generated {tokens[:, prompt:].tolist()}, the reference chooses {chosen.tolist()}"


def _assert_same_greedy_tokens(tokens, expected, reference_logits, tol):
    """Greedy tokens equal, except that a choice the float64 reference calls a near tie (its two
    best logits within 2 * tol, the logits' tolerance) may go either way; the rest of that
    sequence then continues from a different token and is not compared."""
    ties = _near_ties(reference_logits, tol)
    for row, (ours, theirs) in enumerate(zip(tokens.tolist(), expected.tolist())):
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        if differ:
            at = differ[0]  # logits at position at - 1 chose token at
            assert ties[row, at - 1], (f"row {row}: token {at} is {ours[at]}, expected {theirs[at]}, "
                                       "where the reference has no near tie")


def _count_fused_calls(monkeypatch):
    calls = []
    real = fused.fused_moe

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "fused_moe", counting)
    return calls


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimized_model_generates_the_same_tokens(family, dtype, monkeypatch):
    model = _optimized(family, dtype)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    pad_token_id=0)
            return tokens, model(tokens).logits

    ipex_tokens, ipex_logits = run()
    calls = _count_fused_calls(monkeypatch)
    with moe_xpu_ipex.enabled():
        tokens, logits = run()
        _, logits_again = run()
    moe_layers = sum(1 for layer in model.model.layers if layer.model_backbone and hasattr(
        getattr(layer, "block_sparse_moe", getattr(layer, "mlp", None)), "experts"))
    assert len(calls) >= 7 * moe_layers  # every MoE layer ran on moe_xpu at every step
    assert torch.equal(logits, logits_again)
    monkeypatch.undo()
    _, restored = run()
    assert torch.equal(restored, ipex_logits)  # IPEX's own kernels again, bit for bit

    # Against the float64 reference, on the tokens moe_xpu generated (teacher forced).
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    prompt = ids.shape[1]
    reference, ipex_reference = _reference_logits(family, dtype, tokens, ipex_tokens)
    torch.testing.assert_close(logits.double(), reference, atol=tol, rtol=tol)
    _assert_reference_would_choose(tokens, reference, tol, prompt)
    # Against IPEX, where IPEX's own kernels agree with the reference on this CPU.
    ipex_error = (ipex_logits.double() - ipex_reference).abs().max().item()
    if ipex_error > tol:
        # Seen on an AVX-512 Xeon without AVX512-BF16: IPEX's bf16 TPP MoE ops (mixtral_moe_tpp,
        # deepseek_moe_tpp) put the logits 1.6 off the reference while moe_xpu's are within 0.03.
        pytest.skip(f"IPEX's own {dtype} logits are {ipex_error:.3g} off the float64 reference on this "
                    f"CPU (moe_xpu's are within {tol}); nothing to compare moe_xpu's tokens with")
    _assert_same_greedy_tokens(tokens, ipex_tokens, ipex_reference, tol)
    torch.testing.assert_close(logits.float()[:, :prompt], ipex_logits.float()[:, :prompt], atol=tol, rtol=tol)


def test_a_layer_moe_xpu_cannot_run_stays_on_ipex_with_one_warning(monkeypatch):
    model = _optimized("mixtral", torch.float32)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 5))
    with torch.no_grad():
        ipex_logits = model(ids).logits
    for layer in model.model.layers:  # IPEX's kernels hard-code SiLU and ignore act_fn; moe_xpu must not
        for expert in layer.block_sparse_moe.experts:
            expert.act_fn = torch.nn.GELU()
    monkeypatch.setattr(moe_xpu_ipex, "_warned", set())
    with moe_xpu_ipex.enabled(), warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        logits = model(ids).logits
    ours = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(ours) == 1 and "activation is GELU, not SiLU" in ours[0]  # one warning for both layers
    assert torch.equal(logits, ipex_logits)


def test_bench_ipex_times_moe_xpu_beside_ipex(capsys):
    """python -m moe_xpu.bench ipex on a tiny case: every path IPEX runs on this CPU gets a row,
    and the ones it refuses are said, not dropped silently."""
    from moe_xpu import bench
    from moe_xpu.bench_ipex import bench_ipex

    case = bench.MoeCase("tiny", 6, 8, 2, 64, 32)
    rows = bench_ipex([case], [torch.float32, torch.bfloat16], bench.Ceilings(gflops=1.0, read_gbs=1.0), 2)
    out = capsys.readouterr().out
    for dtype in ("float32", "bfloat16"):
        impls = {r.impl for r in rows if r.dtype == dtype}
        assert {"moe_xpu fused", "IPEX GatedMLPMOE", "moe_xpu in GatedMLPMOE"} <= impls
    assert any(r.impl.startswith("IPEX deepseek_moe") for r in rows if r.dtype == "float32")
    if not _ipex_has_bf16():
        assert "left out IPEX GatedMLPMOE prepacked (bfloat16)" in out
    assert all(r.seconds > 0 for r in rows)

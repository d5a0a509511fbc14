// Work the launcher does on the host for the SYCL CPU device, whose tensors are host memory:
// value checks of a launch's offsets and indices before any kernel runs, the sort of a routing's
// (token, slot) pairs by expert, and the per-token int8 quantization of small activations. One
// pass in C++ each, where the torch-op versions (kept for XPU tensors, which must not be read on the
// host) cost a chain of small ops.
#pragma once

#include <cstdint>
#include <stdexcept>

#include "launcher.hpp"

namespace moe_xpu {

// A bad argument value; the message names the argument and what was expected. Python sees it as
// moe_xpu._C.ArgumentError (a ValueError), re-raised as MoeXpuInputError.
struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// group_offsets non-negative, non-decreasing and within the rows; gather_index (when given) with
// group_offsets[-1] entries, each a row of A. Reads host memory: the CPU device only.
void check_host_values(const GemmArgs& args);

// sort_tokens for host memory: the pairs of topk_ids [pairs / k, k] (int32 or int64) grouped by
// expert, stable, the sentinel id -1 after every expert; writes gather_index (int64 [pairs]: token
// of each pair), group_offsets (int32 [num_experts]: cumulative ends) and scatter_index (int64
// [pairs]: flat position of each pair). Any other id outside [0, num_experts) is an ArgumentError.
void sort_tokens_on_host(std::uintptr_t topk_ids, bool ids_are_int64, std::int64_t pairs, std::int64_t k,
                         std::int64_t num_experts, std::uintptr_t gather_index, std::uintptr_t group_offsets,
                         std::uintptr_t scatter_index);

// quantize_per_token for host memory: each of the `rows` rows of x (float32, bfloat16 or float16,
// `row_stride` elements apart, K > 0 elements each) to int8 q [rows, K] (contiguous) and its float32
// scale, with torch's arithmetic bit for bit (moe_xpu/quant.py, _quantize_rows): scale = max |x| /
// 127, q = x / scale rounded half to even (x / 1 for a zero scale), clamped to [-127, 127]; a NaN
// quotient gives 0, as torch's conversion does here, and a NaN in the row gives a NaN scale.
void quantize_rows_on_host(std::uintptr_t x, DType dtype, std::int64_t rows, std::int64_t K, std::int64_t row_stride,
                           std::uintptr_t q, std::uintptr_t scale);

}  // namespace moe_xpu

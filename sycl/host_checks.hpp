// Work the launcher does on the host for the SYCL CPU device, whose tensors are host memory:
// value checks of a launch's offsets and indices before any kernel runs, and the sort of a
// routing's (token, slot) pairs by expert. One pass in C++ each, where the torch-op versions
// (kept for XPU tensors, which must not be read on the host) cost a chain of small ops.
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

}  // namespace moe_xpu

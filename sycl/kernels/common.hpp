// Device code shared by moe_xpu's kernel families (the forward grouped GEMM in moe_gemm.cpp,
// the weight gradient in moe_gemm_wgrad.cpp): element conversions, index reads, the worker
// identity and the walk over the cumulative group offsets. Handed to the runtime compiler as
// an include file (sycl/launcher.cpp: build_source).
#pragma once

#include <sycl/sycl.hpp>
#include <sycl/ext/oneapi/matrix/matrix.hpp>
#include <cstdint>
#include <type_traits>

namespace syclexp = sycl::ext::oneapi::experimental;

namespace moe_xpu {

// bf16 travels as its bit pattern (uint16_t): the device bf16 library is not available to the
// runtime compiler, and the conversion is a shift anyway.
inline float to_float(float x) { return x; }
inline float to_float(sycl::half x) { return static_cast<float>(x); }
inline float to_float(uint16_t bf16_bits) {
  return sycl::bit_cast<float>(static_cast<uint32_t>(bf16_bits) << 16);
}

template <typename T> struct FromFloat;
template <> struct FromFloat<float> {
  static float convert(float x) { return x; }
};
template <> struct FromFloat<sycl::half> {
  static sycl::half convert(float x) { return sycl::half(x); }
};
template <> struct FromFloat<uint16_t> {  // float -> bf16, round to nearest even, NaN kept quiet
  static uint16_t convert(float x) {
    const uint32_t u = sycl::bit_cast<uint32_t>(x);
    const uint32_t high = u >> 16;
    // Both results in 32-bit lanes and one select before the narrowing: selecting after it made
    // the vectorizer narrow both (two packs) and test NaN with integer compares.
    const uint32_t rounded = (u + 0x7fffu + (high & 1u)) >> 16;
    return static_cast<uint16_t>(x != x ? high | 0x40u : rounded);
  }
};

inline int64_t load_index(const void* p, int is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i]
              : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Walks the groups once, calling visit(g, row_begin, row_end, tiles_m, blocks_m) with each group's
// rows; stops when visit returns false.
template <typename VisitFn>
inline void for_each_group(const void* group_offsets, int offsets_is64, int64_t num_groups,
                           int64_t out_rows, int64_t tile_m, int64_t tiles_per_unit, VisitFn&& visit) {
  int64_t row_begin = 0;
  for (int64_t g = 0; g <= num_groups; ++g) {
    const int64_t row_end =
        g < num_groups ? clamp64(load_index(group_offsets, offsets_is64, g), row_begin, out_rows)
                       : out_rows;
    const int64_t tiles_m = (row_end - row_begin + tile_m - 1) / tile_m;
    const int64_t blocks_m = (tiles_m + tiles_per_unit - 1) / tiles_per_unit;
    if (!visit(g, row_begin, row_end, tiles_m, blocks_m)) return;
    row_begin = row_end;
  }
}

// Sub-group size the kernels are written for (the Xe native size; AVX-512 width on the CPU).
constexpr int kLanes = 16;
// Every kernel is declared with this: an nd-range free-function kernel that *requires* sub-groups
// of kLanes. The sub_group_size<16> kernel property is only a hint to the runtime compiler (it
// compiled SIMD8 on AVX2 CPUs and SIMD32 on Xe-HPC, and the 16-lane reductions then returned wrong
// sums); the attribute is honoured, and the launcher checks each built kernel's size anyway.
#define MOE_XPU_KERNEL_WITH_LANES(LANES) \
  [[sycl::reqd_sub_group_size(LANES)]] SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
#define MOE_XPU_KERNEL MOE_XPU_KERNEL_WITH_LANES(kLanes)

struct Worker {
  sycl::sub_group sg;
  int64_t id;     // this sub-group's index among all workers
  int64_t count;  // number of workers in the launch
  int lane;
};

inline Worker this_worker() {
  auto it = sycl::ext::oneapi::this_work_item::get_nd_item<1>();
  sycl::sub_group sg = it.get_sub_group();
  const int64_t per_group = sg.get_group_linear_range();
  // Broadcast from lane 0: the vectorizer then knows the id is the same on every lane, so the
  // tile loop is uniform control flow and the inner loops run unmasked.
  const int64_t id = sycl::group_broadcast(
      sg, static_cast<int64_t>(it.get_group_linear_id()) * per_group + sg.get_group_linear_id(), 0);
  return Worker{sg, id, static_cast<int64_t>(it.get_group_range(0)) * per_group,
                static_cast<int>(sg.get_local_linear_id())};
}

// Count floats of work-group local memory (the vector kernels run one sub-group per work-group on
// the CPU, so it is that sub-group's own).
template <int64_t Count>
inline float* local_floats() {
  return *sycl::ext::oneapi::group_local_memory_for_overwrite<float[Count]>(
      sycl::ext::oneapi::this_work_item::get_work_group<1>());
}

// The B column behind accumulator column j of a tile whose output columns start at n0: with the
// gated epilogue a tile's TN columns are TN / 2 gate columns then the matching up columns (at
// up_offset). Columns past N repeat the last one (computed, not stored).
template <int TN, bool Gated>
inline int64_t tile_b_column(int64_t n0, int j, int64_t N, int64_t up_offset) {
  constexpr int out_cols = Gated ? TN / 2 : TN;
  const int64_t n = n0 + (Gated ? j % out_cols : j);
  return (n < N ? n : N - 1) + (Gated && j >= out_cols ? up_offset : 0);
}

// Source row of output row m: through the index table when there is one. Clamped so that a bad
// index cannot read out of bounds (validated on the host where possible).
inline int64_t source_row(const void* gather_index, int gather_is64, int64_t m, int64_t a_rows) {
  if (gather_index == nullptr) return m;
  return clamp64(load_index(gather_index, gather_is64, m), 0, a_rows - 1);
}

// How many of a group's `rows` its row tile m_tile of tm rows holds: tm, or fewer in the last tile.
inline int64_t tile_valid_rows(int64_t rows, int64_t m_tile, int64_t tm) {
  return rows - m_tile * tm < tm ? rows - m_tile * tm : tm;
}

// A's row i of a row tile (gathered rows m0 .. m0 + valid - 1). Rows past valid repeat the last
// one, so a whole tile's loads stay in bounds; their results are never stored.
template <typename T>
inline const T* tile_a_row(const T* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                           int gather_is64, int64_t m0, int64_t valid, int64_t i) {
  const int64_t m = m0 + (i < valid ? i : valid - 1);
  return a + source_row(gather_index, gather_is64, m, a_rows) * a_row_stride;
}

}  // namespace moe_xpu

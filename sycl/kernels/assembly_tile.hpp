// What the K-split kernels whose register tile is x86 assembly share (moe_gemm_dot.cpp's bf16
// kernel on AVX512-BF16, moe_gemm_fma.cpp's AVX2 FMA kernels): the walk over a worker's units,
// lane 0 running each row tile's assembly, and the epilogue the lanes share. Handed to the runtime
// compiler as an include file.
#pragma once

#include "epilogue.hpp"
#include "scheduler.hpp"

namespace moe_xpu {

// The body of such a kernel (the vector kernels' parameters, moe_gemm.cpp: MOE_XPU_KERNEL_PARAMS).
// The runtime vectorizes the kernel across the sub-group's work-items and runs each active
// work-item's copy of inline assembly in turn, so only lane 0 runs it: tile(valid, a_end, b_end,
// k_full, next) leaves the sums of the tile's `valid` rows over k in [0, k_full) (k_full a positive
// multiple of Step) in tile_sums[i * TN + j], work-group local memory (one sub-group per
// work-group), where every lane reads them. (With every work-item a worker, the 16 work-items'
// tiles ran interleaved, each with its own B slice and A rows; with lane 0 alone doing all the
// work, the rest of the kernel ran as 16-lane code with one lane active: both about as slow as the
// vector kernels. A private array whose address the assembly takes is laid out across work-items by
// the vectorizer, element-major, which the assembly cannot know.) a_end[i] and b_end[j] point
// k_full elements past the start of A row i and B column j; next is the start of the B rows of
// the worker's next unit (the next column tile), which the assembly streams into the cache while
// it computes (gated tiles' gate rows and up rows lie apart, so the unit's row tiles take turns
// streaming the next gate rows and the next up rows). The lanes then finish the tile's outputs:
// the K remainder in float FMAs, the bias, the activation, the row weight, the store.
template <int TM, int TN, bool Gated, int64_t Step, typename TA, typename T, typename TOut, typename TileFn>
inline void assembly_k_split(const TA* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                             int gather_is64, const T* b, int64_t b_stride_e, int64_t b_stride_n, const T* bias,
                             int64_t bias_stride_e, TOut* out, int64_t out_row_stride, int64_t out_rows,
                             const void* group_offsets, int offsets_is64, int64_t num_groups, int64_t K,
                             int64_t N, int activation, int64_t up_offset, const void* scatter_index,
                             int scatter_is64, const float* row_weight, const float* tile_sums, TileFn&& tile) {
  constexpr int out_cols = Gated ? TN / 2 : TN;
  constexpr int outputs = TM * out_cols;  // a tile's output elements, spread over the lanes
  const Worker w = this_worker();
  const int64_t tiles_n = (N + out_cols - 1) / out_cols;
  const int64_t k_full = K - K % Step;
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, kUnitRows / TM, tiles_n,
      unit_cost<T, TM, TN>(),
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        const int64_t n0 = n_tile * out_cols;
        const T* b_col[TN];
        for (int j = 0; j < TN; ++j) b_col[j] = b + g * b_stride_e + tile_b_column<TN, Gated>(n0, j, N, up_offset) * b_stride_n;
        for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
          const int64_t m0 = row_begin + m_tile * TM;
          const int64_t valid = tile_valid_rows(rows, m_tile, TM);
          auto a_row = [&](int i) {
            return tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, i);
          };
          if (g < num_groups && k_full > 0) {
            const TA* a_end[TM];
            const T* b_end[TN];
            for (int i = 0; i < TM; ++i) a_end[i] = a_row(i) + k_full;
            for (int j = 0; j < TN; ++j) b_end[j] = b_col[j] + k_full;
            const T* next = Gated && (m_tile - m_first) % 2 == 1 ? b_col[TN / 2] + (TN / 2) * b_stride_n
                                                                 : b_col[0] + (Gated ? TN / 2 : TN) * b_stride_n;
            if (w.lane == 0) tile(valid, a_end, b_end, k_full, next);
            sycl::group_barrier(w.sg);
          }
          // Lane l finishes output elements l, l + 16, ... (row i, column j; gated: the gate sum
          // and its up sum).
          #pragma unroll
          for (int o0 = 0; o0 < outputs; o0 += kLanes) {
            const int o = o0 + w.lane;
            const int i = o / out_cols, j = o % out_cols;
            if (o < outputs && i < valid && n0 + j < N) {
              float v[Gated ? 2 : 1];
              #pragma unroll
              for (int h = 0; h < (Gated ? 2 : 1); ++h) {
                const int col = j + h * out_cols;
                float s = 0.0f;
                if (g < num_groups) {
                  const int64_t bn = tile_b_column<TN, Gated>(n0, col, N, up_offset);
                  if (k_full > 0) s = tile_sums[i * TN + col];
                  const TA* ar = a_row(i);
                  const T* bc = b + g * b_stride_e + bn * b_stride_n;
                  for (int64_t k = k_full; k < K; ++k) s = sycl::fma(to_float(ar[k]), to_float(bc[k]), s);
                  if (bias != nullptr) s += to_float(bias[g * bias_stride_e + bn]);
                }
                v[h] = s;
              }
              const float r = Gated ? activate(activation, v[0]) * v[Gated ? 1 : 0] : v[0];
              const RowTarget t = row_target(scatter_index, scatter_is64, row_weight, m0 + i, out_rows);
              out[t.row * out_row_stride + n0 + j] = FromFloat<TOut>::convert(r * t.weight);
            }
          }
          sycl::group_barrier(w.sg);  // the sums are read before the next tile overwrites them
        }
      });
}

}  // namespace moe_xpu

// moe_xpu weight-gradient kernel: for every group g, dB[g] = A[rows of g]^T @ dY[rows of g], a
// grouped GEMM whose reduction runs over each group's rows (the backward of moe_gemm for its
// weights). Compiled at run time like moe_gemm.cpp, in the same bundle.
//
// Row m of group g (rows [group_offsets[g-1], group_offsets[g]) of dY) pairs with A row
// gather_index[m] when an index table is given, else A row m. A work unit is one TK x (16 * TN)
// tile of one group's dB; the 16 lanes split its columns (lane l owns columns n0 + l + 16 j) and
// it walks the group's rows in ascending order, so every dB element is one work-item's sum in a
// fixed order: bitwise reproducible, no atomics. An empty group's units store zeros (as a flat
// run of elements when dB is dense).
//
// Scheduling: a fixed set of workers; every group contributes tiles_k * tiles_n units costing
// (rows + 1) each (the rows' FMAs plus the tile's store), and each worker runs the units that
// start in its equal share of the total, so one group holding every row still spreads over all
// workers. Offsets are read on the device and clamped like the forward kernels'.
//
// The lanes store along dB's N. For dB contiguous along K (nn.Linear weights seen through
// .transpose(1, 2)) the launcher computes dB^T = dY^T A instead, the operands swapped, so the
// stores stay consecutive; the index table then applies to the second operand (gather_dy).
#include "common.hpp"

namespace moe_xpu {

template <typename T, typename TOut, int TK, int TN>
MOE_XPU_KERNEL
void moe_gemm_wgrad(const T* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                    int gather_is64, const T* dy, int64_t dy_row_stride, int64_t dy_rows,
                    const void* group_offsets, int offsets_is64, int64_t num_groups, int64_t K,
                    int64_t N, TOut* out, int64_t out_stride_e, int64_t out_stride_k,
                    int64_t out_stride_n, int gather_dy) {
  const Worker w = this_worker();
  const int64_t tile_n = int64_t(kLanes) * TN;
  const int64_t tiles_n = (N + tile_n - 1) / tile_n;
  const int64_t tiles_k = (K + TK - 1) / TK;
  const int64_t tiles = tiles_k * tiles_n;
  const int64_t walked_rows = gather_dy ? a_rows : dy_rows;  // the operand read row by row
  int64_t total = 0;
  for_each_group(group_offsets, offsets_is64, num_groups, walked_rows, 1, 1,
                 [&](int64_t g, int64_t row_begin, int64_t row_end, int64_t, int64_t) {
                   if (g < num_groups) total += tiles * (row_end - row_begin + 1);
                   return true;
                 });
  const int64_t first = total * w.id / w.count;
  const int64_t last = total * (w.id + 1) / w.count;
  // dB dense per group (either layout): an empty group's zeros are stored as one flat run.
  const bool dense = out_stride_e == K * N && ((out_stride_k == N && out_stride_n == 1) ||
                                               (out_stride_k == 1 && out_stride_n == K));
  int64_t base = 0;
  for_each_group(group_offsets, offsets_is64, num_groups, walked_rows, 1, 1,
                 [&](int64_t g, int64_t row_begin, int64_t row_end, int64_t, int64_t) {
    if (g == num_groups || base >= last) return false;
    const int64_t unit = row_end - row_begin + 1;
    const int64_t group_end = base + tiles * unit;
    if (row_begin == row_end && dense) {
      // The worker's share of the group's units (each of cost 1), as the same share of its
      // elements: consecutive stores across the lanes, where unit by unit the empty tiles'
      // bookkeeping cost twice the stores (decode float32, dB of 128 experts into touched memory:
      // 323 ms).
      const int64_t t_lo = first > base ? first - base : 0;
      const int64_t t_hi = last - base < tiles ? last - base : tiles;
      const int64_t elems = K * N;
      const int64_t lo = t_lo * elems / tiles, hi = t_hi * elems / tiles;
      TOut* out_g = out + g * out_stride_e;
      const TOut zero = FromFloat<TOut>::convert(0.0f);
      for (int64_t e = lo + w.lane; e < hi; e += kLanes) out_g[e] = zero;
      base = group_end;
      return base < last;
    }
    // Units ordered K tile by K tile, column tiles inside: a worker's consecutive units store
    // along the same TK rows of dB, long runs of consecutive memory (column tiles outside
    // measured 134 vs 85-100 ms on the fused 64tok gate_up gradient, float32). The group's rows
    // of A and dY they read stay in cache either way.
    for (int64_t t = first > base ? (first - base + unit - 1) / unit : 0; t < tiles && base + t * unit < last; ++t) {
      const int64_t n0 = (t % tiles_n) * tile_n;
      const int64_t k0 = (t / tiles_n) * TK;
      const bool full = n0 + tile_n <= N;
      // A last tile in whole 16-column vectors reads the tile's first vector in place of those
      // past N (never stored): consecutive loads instead of per-lane clamped gathers.
      const bool whole_vectors = (N - n0) % kLanes == 0;
      int64_t col[TN], offset[TN];
      #pragma unroll
      for (int j = 0; j < TN; ++j) {
        col[j] = n0 + w.lane + int64_t(kLanes) * j;
        offset[j] = full || int64_t(kLanes) * j < N - n0 ? int64_t(kLanes) * j : 0;
      }
      int64_t kk[TK];  // A columns of the tile's rows, clamped (rows past K are never stored)
      #pragma unroll
      for (int i = 0; i < TK; ++i) kk[i] = k0 + i < K ? k0 + i : K - 1;
      float acc[TK][TN];
      #pragma unroll
      for (int i = 0; i < TK; ++i)
        #pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
      // The rows' walk, with the dY strip's load as a parameter: the consecutive and the clamped
      // loads each get a loop of their own. Chosen per row inside one loop, the compiler merged
      // them into one load from a selected address, and every dY vector became a gather.
      auto walk_rows = [&](auto load_dy) {
        for (int64_t m = row_begin; m < row_end; ++m) {
          const int64_t source = gather_dy ? source_row(gather_index, gather_is64, m, dy_rows) : 0;
          const T* a_row = a + (gather_dy ? m : source_row(gather_index, gather_is64, m, a_rows)) * a_row_stride;
          float dv[TN];
          load_dy(dy + (gather_dy ? source : m) * dy_row_stride, dv);
          #pragma unroll
          for (int i = 0; i < TK; ++i) {
            const float av = to_float(a_row[kk[i]]);
            #pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] = sycl::fma(av, dv[j], acc[i][j]);
          }
        }
      };
      if (full || whole_vectors) {
        walk_rows([&](const T* dy_row, float (&dv)[TN]) {
          const T* dy_lane = dy_row + n0 + w.lane;
          #pragma unroll
          for (int j = 0; j < TN; ++j) dv[j] = to_float(dy_lane[offset[j]]);
        });
      } else {
        walk_rows([&](const T* dy_row, float (&dv)[TN]) {
          #pragma unroll
          for (int j = 0; j < TN; ++j) dv[j] = to_float(dy_row[col[j] < N ? col[j] : N - 1]);
        });
      }
      TOut* out_g = out + g * out_stride_e;
      if (out_stride_n == 1) {
        // Lane-consecutive stores (dB N-contiguous, as the launcher always arranges for dense dB);
        // through the general strides below every store is a scatter.
        #pragma unroll
        for (int i = 0; i < TK; ++i) {
          TOut* out_lane = out_g + (k0 + i) * out_stride_k + n0 + w.lane;
          #pragma unroll
          for (int j = 0; j < TN; ++j)
            if (k0 + i < K && col[j] < N) out_lane[kLanes * j] = FromFloat<TOut>::convert(acc[i][j]);
        }
      } else {
        #pragma unroll
        for (int i = 0; i < TK; ++i)
          #pragma unroll
          for (int j = 0; j < TN; ++j)
            if (k0 + i < K && col[j] < N)
              out_g[(k0 + i) * out_stride_k + col[j] * out_stride_n] = FromFloat<TOut>::convert(acc[i][j]);
      }
    }
    base = group_end;
    return base < last;
  });
}

}  // namespace moe_xpu

#define MOE_XPU_INSTANTIATE_WGRAD(T, TOut, TK, TN)                                                     \
  template void moe_xpu::moe_gemm_wgrad<T, TOut, TK, TN>(                                             \
      const T*, int64_t, int64_t, const void*, int, const T*, int64_t, int64_t, const void*, int, int64_t, \
      int64_t, int64_t, TOut*, int64_t, int64_t, int64_t, int);

// What the K-split kernels whose register tile is x86 assembly share (moe_gemm_dot.cpp's bf16
// kernel on AVX512-BF16, moe_gemm_fma.cpp's FMA kernels on AVX2 and AVX-512): the AVX-512 register
// tile's macros, the walk over a worker's units, lane 0 running each row tile's assembly, and the
// epilogue the lanes share. Handed to the runtime compiler as an include file.
#pragma once

#include "epilogue.hpp"
#include "scheduler.hpp"

namespace moe_xpu {

// The AVX-512 assembly families' register tile (moe_gemm_dot.cpp's bf16 and int8 kernels,
// moe_gemm_fma.cpp's FMA kernels on AVX-512): 4 rows x 6 columns of 16-lane accumulators in
// zmm0..zmm23, the step's 6 B vectors in zmm24..zmm29 and a row's A vector in zmm30.
// (The tile, kDotRows x kDotCols, and kDotSums are in sizes.hpp, shared with the launcher.)

// Where the tile's row count goes in the sums area (an int32 after the 24 sums; 96 bytes in).
constexpr int64_t kDotRowCount = 24;
#define MOE_XPU_DOT_ROW_COUNT_AT "96"
static_assert(kDotRowCount < kDotSums && kDotRowCount * 4 == 96, "the row count's place");

// Every dot-product tile's short-tile branch: row i of the tile runs only where the tile's row
// count (an int32 `at` bytes from the sums pointer, written by lane 0 before the tile) exceeds i;
// else on to the end of the current step or sub-block (label 2). The branch goes the same way all
// the tile long, so a group's last, short row tile costs its rows, not the tile's.
#define MOE_XPU_DOT_IF_ROW(at, i) "cmpl $" #i ", " at "(%[sums])\n\t" "jbe 2f\n\t"

// The tile's 24 accumulators zmm0..zmm23 (acc[i][j] in zmm(6 i + j)) zeroed, and summed into
// sums[0..23] by a SUM(r) macro.
#define MOE_XPU_DOT_ZERO_TILE                                                                                   \
  "vpxord %%zmm0, %%zmm0, %%zmm0\n\t" "vpxord %%zmm1, %%zmm1, %%zmm1\n\t" "vpxord %%zmm2, %%zmm2, %%zmm2\n\t"       \
  "vpxord %%zmm3, %%zmm3, %%zmm3\n\t" "vpxord %%zmm4, %%zmm4, %%zmm4\n\t" "vpxord %%zmm5, %%zmm5, %%zmm5\n\t"       \
  "vpxord %%zmm6, %%zmm6, %%zmm6\n\t" "vpxord %%zmm7, %%zmm7, %%zmm7\n\t" "vpxord %%zmm8, %%zmm8, %%zmm8\n\t"       \
  "vpxord %%zmm9, %%zmm9, %%zmm9\n\t" "vpxord %%zmm10, %%zmm10, %%zmm10\n\t" "vpxord %%zmm11, %%zmm11, %%zmm11\n\t" \
  "vpxord %%zmm12, %%zmm12, %%zmm12\n\t" "vpxord %%zmm13, %%zmm13, %%zmm13\n\t"                                   \
  "vpxord %%zmm14, %%zmm14, %%zmm14\n\t" "vpxord %%zmm15, %%zmm15, %%zmm15\n\t"                                   \
  "vpxord %%zmm16, %%zmm16, %%zmm16\n\t" "vpxord %%zmm17, %%zmm17, %%zmm17\n\t"                                   \
  "vpxord %%zmm18, %%zmm18, %%zmm18\n\t" "vpxord %%zmm19, %%zmm19, %%zmm19\n\t"                                   \
  "vpxord %%zmm20, %%zmm20, %%zmm20\n\t" "vpxord %%zmm21, %%zmm21, %%zmm21\n\t"                                   \
  "vpxord %%zmm22, %%zmm22, %%zmm22\n\t" "vpxord %%zmm23, %%zmm23, %%zmm23\n\t"
#define MOE_XPU_DOT_TILE_SUMS(SUM)                                                                     \
  SUM(0) SUM(1) SUM(2) SUM(3) SUM(4) SUM(5) SUM(6) SUM(7) SUM(8) SUM(9) SUM(10) SUM(11) SUM(12) SUM(13) \
  SUM(14) SUM(15) SUM(16) SUM(17) SUM(18) SUM(19) SUM(20) SUM(21) SUM(22) SUM(23)

// Row i's products of one k step: its A vector (zmm30) against the 6 B vectors into acc[i][0..5]
// (r0..r5), by instruction OP.
#define MOE_XPU_DOT_ROW_DOTS(OP, r0, r1, r2, r3, r4, r5)                                          \
  OP " %%zmm24, %%zmm30, %%zmm" #r0 "\n\t" OP " %%zmm25, %%zmm30, %%zmm" #r1 "\n\t"               \
  OP " %%zmm26, %%zmm30, %%zmm" #r2 "\n\t" OP " %%zmm27, %%zmm30, %%zmm" #r3 "\n\t"               \
  OP " %%zmm28, %%zmm30, %%zmm" #r4 "\n\t" OP " %%zmm29, %%zmm30, %%zmm" #r5 "\n\t"
#define MOE_XPU_DOT_IF_TILE_ROW(i) MOE_XPU_DOT_IF_ROW(MOE_XPU_DOT_ROW_COUNT_AT, i)

// Accumulator r's 16 lanes summed (halves added: 8, 4, 2, 1 lanes) into sums[r].
#define MOE_XPU_DOT_SUM(r)                                   \
  "vextractf64x4 $1, %%zmm" #r ", %%ymm29\n\t"                 \
  "vaddps %%ymm29, %%ymm" #r ", %%ymm" #r "\n\t"                \
  "vextractf32x4 $1, %%ymm" #r ", %%xmm29\n\t"                 \
  "vaddps %%xmm29, %%xmm" #r ", %%xmm" #r "\n\t"                \
  "vpermilps $0x4e, %%xmm" #r ", %%xmm29\n\t"                  \
  "vaddps %%xmm29, %%xmm" #r ", %%xmm" #r "\n\t"                \
  "vpermilps $0xb1, %%xmm" #r ", %%xmm29\n\t"                  \
  "vaddss %%xmm29, %%xmm" #r ", %%xmm" #r "\n\t"                \
  "vmovss %%xmm" #r ", " #r "*4(%[sums])\n\t"

// kernel_leader_runs: how a kernel has lane 0 alone run inline assembly. The runtime vectorizes a
// kernel across the sub-group's work-items and runs each active work-item's copy of inline assembly
// in turn, behind a test of that lane's mask bit. Inside a region only lane 0 enters, every branch
// is linearized, even one on values the whole sub-group shares: each assembly body there gets its
// own 16 mask tests, run whichever body the values pick (a 6-row tile with 18 bodies by row count and
// B source spent about 1000 cycles a call on them, as long as its k loop at K = 128). So the
// branches that pick a body come first, taken by the whole sub-group, and only the call itself
// tests lane 0.
//
// The body of such a kernel (the vector kernels' parameters, moe_gemm.cpp: MOE_XPU_KERNEL_PARAMS),
// lane 0 running the assembly: tile(lead, valid, a_end, b_end, k_full, next), called by every lane
// with lead true in lane 0 alone, leaves the sums of the tile's `valid` rows over k in
// [0, k_full) (k_full a positive multiple of Step) in tile_sums[i * TN + j], work-group local memory (one sub-group per
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
            tile(w.lane == 0, valid, a_end, b_end, k_full, next);
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

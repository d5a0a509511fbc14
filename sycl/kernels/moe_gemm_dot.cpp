// moe_xpu's bf16 dot-product kernel family for CPUs with AVX512-BF16 (where no matrix engine takes
// the call).
//
// The vector kernels (moe_gemm.cpp) widen each bf16 weight to float32 and issue one FMA per
// weight and row: the runtime compiler emits no bf16 dot-product instruction from SYCL source
// (see docs/performance_targets.md). This family's k loop is written in x86 assembly instead,
// which the runtime compiler carries through SPIR-V (SPV_INTEL_inline_assembly) to the CPU
// backend: `vdpbf16ps` multiplies 32 bf16 pairs and adds them into 16 float32 lanes, twice the
// vector kernels' products per instruction, with nothing to widen.
//
// The assembly is not vectorized across work-items: the runtime runs a sub-group's work-items'
// copies of it one after another. So lane 0 of each sub-group does its worker's whole work, and
// the launch plan is the K-split kernel's. A worker owns work units exactly as the other families do
// (scheduler.hpp): one column tile of one group over up to kUnitRows rows. Its register tile is
// 4 rows x 6 columns: 24 accumulators, 6 B vectors and one A vector of the 32 zmm registers, row by
// row (so a group's short last row tile skips its missing rows). Lane l of accumulator (i, j) sums
// the products of k = 32 s + 2 l and 32 s + 2 l + 1 over the steps s;
// the 16 lanes are added by halves afterwards, and the last K % 32 elements with float FMAs:
// a fixed order, so results are bitwise reproducible. (`vdpbf16ps` treats subnormal bf16 inputs
// as zero and rounds like an FMA pair; the float kernels keep subnormals, so the two families'
// last bits differ.)
//
// The W8A8 kernel (moe_gemm_quant_dot) is the same design on AVX512-VNNI: `vpdpbusd` multiplies
// 64 unsigned-by-signed byte pairs into 16 int32 lanes, four times the products per instruction of
// the float FMA. Its integer sums are exact and scaled once, as the int8 matrix-engine kernel does
// (moe_gemm_quant_matrix), by the same formula.
//
// Only compiled where the device description says the CPU runs AVX512-BF16 code
// (DeviceDescription::bf16_dot) or AVX512-VNNI code (int8_dot); never for a GPU.
#include "assembly_tile.hpp"

namespace moe_xpu {

// (The tile, kDotRows x kDotCols, and kDotSums are in sizes.hpp, shared with the launcher.)
constexpr int64_t kDotStep = 32;  // bf16 elements of K per vdpbf16ps

// One k step of the 4 x 6 tile (32 bf16 elements, or 64 int8 ones), row by row: the 6 B columns'
// vectors into zmm24-29, then each row's A vector (zmm30) and its 6 dot products into acc[i][0..5]
// (r0..r5); rows past the tile's row count (kDotRowCount) skipped.
#define MOE_XPU_DOT_B_STEP(MOV)                                                                    \
  MOV " (%[b0],%[ko]), %%zmm24\n\t" MOV " (%[b1],%[ko]), %%zmm25\n\t" MOV " (%[b2],%[ko]), %%zmm26\n\t" \
  MOV " (%[b3],%[ko]), %%zmm27\n\t" MOV " (%[b4],%[ko]), %%zmm28\n\t" MOV " (%[b5],%[ko]), %%zmm29\n\t"
#define MOE_XPU_DOT_ROW(MOV, i, r0, r1, r2, r3, r4, r5, OP) \
  MOV " (%[a" #i "],%[ko]), %%zmm30\n\t" MOE_XPU_DOT_ROW_DOTS(OP, r0, r1, r2, r3, r4, r5)

// The sums of a 4 x 6 tile over k in [0, k_full), k_full a positive multiple of 32: sums[i * 6 + j].
// Each k step also asks for 6 lines, into L2, of the B rows from `next` on: the worker's next
// unit's rows (its next column tile), so they arrive while this unit computes. A unit of a few
// rows' tiles otherwise waited for its B at every start (16 rows an expert, K = 768: 41-42 ms
// against 21-28 with every expert sharing one B in cache; with the stream 24-28).
// a_end[i] and b_end[j] point k_full elements past the start of A row i and B column j: the loop
// runs a negative byte offset up to zero. (The 16 lanes are added in the assembly: done in SYCL
// code, the runtime vectorized that step across work-items into gathers, a fifth of the kernel's
// time.) The tile's B columns stay in L1 or L2 across the unit's row tiles: walking K in chunks,
// the accumulators parked in local memory in between, measured slower.
inline void dot_tile_sums(float* sums, const uint16_t* const (&a_end)[kDotRows],
                          const uint16_t* const (&b_end)[kDotCols], int64_t k_full, const void* next) {
  int64_t ko = -2 * k_full;
  const char* pn = static_cast<const char*>(next);
  asm volatile(
      MOE_XPU_DOT_ZERO_TILE
      "1:\n\t"
      "prefetcht1 (%[pn])\n\t" "prefetcht1 64(%[pn])\n\t" "prefetcht1 128(%[pn])\n\t"
      "prefetcht1 192(%[pn])\n\t" "prefetcht1 256(%[pn])\n\t" "prefetcht1 320(%[pn])\n\t"
      "add $384, %[pn]\n\t"
      MOE_XPU_DOT_B_STEP("vmovdqu16")
      MOE_XPU_DOT_ROW("vmovdqu16", 0, 0, 1, 2, 3, 4, 5, "vdpbf16ps") MOE_XPU_DOT_IF_TILE_ROW(1)
      MOE_XPU_DOT_ROW("vmovdqu16", 1, 6, 7, 8, 9, 10, 11, "vdpbf16ps") MOE_XPU_DOT_IF_TILE_ROW(2)
      MOE_XPU_DOT_ROW("vmovdqu16", 2, 12, 13, 14, 15, 16, 17, "vdpbf16ps") MOE_XPU_DOT_IF_TILE_ROW(3)
      MOE_XPU_DOT_ROW("vmovdqu16", 3, 18, 19, 20, 21, 22, 23, "vdpbf16ps") "2:\n\t"
      "add $64, %[ko]\n\t"
      "jnz 1b\n\t"
      MOE_XPU_DOT_TILE_SUMS(MOE_XPU_DOT_SUM)
      : [ko] "+r"(ko), [pn] "+r"(pn)
      : [a0] "r"(a_end[0]), [a1] "r"(a_end[1]), [a2] "r"(a_end[2]), [a3] "r"(a_end[3]),
        [b0] "r"(b_end[0]), [b1] "r"(b_end[1]), [b2] "r"(b_end[2]), [b3] "r"(b_end[3]),
        [b4] "r"(b_end[4]), [b5] "r"(b_end[5]), [sums] "r"(sums)
      : "memory", "cc", "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9",
        "zmm10", "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20",
        "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "zmm30");
}

// W8A8 (AVX512-VNNI): one row of the 4 x 6 tile for one 64-element k step. vpdpbusd multiplies
// unsigned bytes by signed ones, so A's bytes are flipped to A + 128 (xor 0x80, zmm31) as they are
// loaded, and 128 x the column's sum of B is subtracted afterwards (see dot_int8_column_sums).
#define MOE_XPU_DOT8_ROW(i, r0, r1, r2, r3, r4, r5)                                              \
  "vmovdqu8 (%[a" #i "],%[ko]), %%zmm30\n\t" "vpxord %%zmm31, %%zmm30, %%zmm30\n\t"               \
  MOE_XPU_DOT_ROW_DOTS("vpdpbusd", r0, r1, r2, r3, r4, r5)
#define MOE_XPU_DOT8_SUM(r)                                   \
  "vextracti64x4 $1, %%zmm" #r ", %%ymm30\n\t"                 \
  "vpaddd %%ymm30, %%ymm" #r ", %%ymm" #r "\n\t"                \
  "vextracti32x4 $1, %%ymm" #r ", %%xmm30\n\t"                 \
  "vpaddd %%xmm30, %%xmm" #r ", %%xmm" #r "\n\t"                \
  "vpshufd $0x4e, %%xmm" #r ", %%xmm30\n\t"                    \
  "vpaddd %%xmm30, %%xmm" #r ", %%xmm" #r "\n\t"                \
  "vpshufd $0xb1, %%xmm" #r ", %%xmm30\n\t"                    \
  "vpaddd %%xmm30, %%xmm" #r ", %%xmm" #r "\n\t"                \
  "vmovd %%xmm" #r ", " #r "*4(%[sums])\n\t"

// The int32 sums of (A + 128) x B of a 4 x 6 tile over k in [0, k_full), k_full a positive
// multiple of 64: sums[i * 6 + j]. Pointers as for dot_tile_sums.
inline void dot_int8_tile_sums(int32_t* sums, const int8_t* const (&a_end)[kDotRows],
                               const int8_t* const (&b_end)[kDotCols], int64_t k_full) {
  int64_t ko = -k_full;
  asm volatile(
      "vpbroadcastd %[flip], %%zmm31\n\t"
      MOE_XPU_DOT_ZERO_TILE
      "1:\n\t"
      MOE_XPU_DOT_B_STEP("vmovdqu8")
      MOE_XPU_DOT8_ROW(0, 0, 1, 2, 3, 4, 5) MOE_XPU_DOT_IF_TILE_ROW(1)
      MOE_XPU_DOT8_ROW(1, 6, 7, 8, 9, 10, 11) MOE_XPU_DOT_IF_TILE_ROW(2)
      MOE_XPU_DOT8_ROW(2, 12, 13, 14, 15, 16, 17) MOE_XPU_DOT_IF_TILE_ROW(3)
      MOE_XPU_DOT8_ROW(3, 18, 19, 20, 21, 22, 23) "2:\n\t"
      "add $64, %[ko]\n\t"
      "jnz 1b\n\t"
      MOE_XPU_DOT_TILE_SUMS(MOE_XPU_DOT8_SUM)
      : [ko] "+r"(ko)
      : [a0] "r"(a_end[0]), [a1] "r"(a_end[1]), [a2] "r"(a_end[2]), [a3] "r"(a_end[3]),
        [b0] "r"(b_end[0]), [b1] "r"(b_end[1]), [b2] "r"(b_end[2]), [b3] "r"(b_end[3]),
        [b4] "r"(b_end[4]), [b5] "r"(b_end[5]), [sums] "r"(sums), [flip] "r"(0x80808080u)
      : "memory", "cc", "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9",
        "zmm10", "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20",
        "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "zmm30", "zmm31");
}

// Column sums of the tile's 6 int8 B columns over k in [0, k_full) (vpdpbusd with bytes of one).
// The first pass over a unit's B: it also asks for the next unit's B rows, from `next` on (see
// dot_tile_sums).
inline void dot_int8_column_sums(int32_t* sums, const int8_t* const (&b_end)[kDotCols], int64_t k_full,
                                 const void* next) {
  int64_t ko = -k_full;
  const char* pn = static_cast<const char*>(next);
  asm volatile(
      "vpbroadcastd %[ones], %%zmm6\n\t"
      "vpxord %%zmm0, %%zmm0, %%zmm0\n\t" "vpxord %%zmm1, %%zmm1, %%zmm1\n\t"
      "vpxord %%zmm2, %%zmm2, %%zmm2\n\t" "vpxord %%zmm3, %%zmm3, %%zmm3\n\t"
      "vpxord %%zmm4, %%zmm4, %%zmm4\n\t" "vpxord %%zmm5, %%zmm5, %%zmm5\n\t"
      "1:\n\t"
      "prefetcht1 (%[pn])\n\t" "prefetcht1 64(%[pn])\n\t" "prefetcht1 128(%[pn])\n\t"
      "prefetcht1 192(%[pn])\n\t" "prefetcht1 256(%[pn])\n\t" "prefetcht1 320(%[pn])\n\t"
      "add $384, %[pn]\n\t"
      "vpdpbusd (%[b0],%[ko]), %%zmm6, %%zmm0\n\t"
      "vpdpbusd (%[b1],%[ko]), %%zmm6, %%zmm1\n\t"
      "vpdpbusd (%[b2],%[ko]), %%zmm6, %%zmm2\n\t"
      "vpdpbusd (%[b3],%[ko]), %%zmm6, %%zmm3\n\t"
      "vpdpbusd (%[b4],%[ko]), %%zmm6, %%zmm4\n\t"
      "vpdpbusd (%[b5],%[ko]), %%zmm6, %%zmm5\n\t"
      "add $64, %[ko]\n\t"
      "jnz 1b\n\t"
      MOE_XPU_DOT8_SUM(0) MOE_XPU_DOT8_SUM(1) MOE_XPU_DOT8_SUM(2) MOE_XPU_DOT8_SUM(3)
      MOE_XPU_DOT8_SUM(4) MOE_XPU_DOT8_SUM(5)
      : [ko] "+r"(ko), [pn] "+r"(pn)
      : [b0] "r"(b_end[0]), [b1] "r"(b_end[1]), [b2] "r"(b_end[2]), [b3] "r"(b_end[3]),
        [b4] "r"(b_end[4]), [b5] "r"(b_end[5]), [sums] "r"(sums), [ones] "r"(0x01010101u)
      : "memory", "cc", "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm30");
}

#undef MOE_XPU_DOT8_ROW
#undef MOE_XPU_DOT8_SUM
#undef MOE_XPU_DOT_B_STEP
#undef MOE_XPU_DOT_ROW

// The K-split GEMM on bf16 A and bf16 B contiguous along K (b_stride_n: B's stride between
// columns), the same parameters as moe_gemm_k_lanes so that the launcher drives both alike.
// TM x TN is the plan's tile (4 x 6: gated tiles are 3 gate columns then the matching 3 up
// columns).
template <typename TOut, int TM, int TN, bool Gated>
MOE_XPU_KERNEL
void moe_gemm_k_dot(const uint16_t* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                    int gather_is64, const uint16_t* b, int64_t b_stride_e, int64_t b_stride_n,
                    const uint16_t* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                    int64_t out_rows, const void* group_offsets, int offsets_is64, int64_t num_groups,
                    int64_t K, int64_t N, int activation, int64_t up_offset, const void* scatter_index,
                    int scatter_is64, const float* row_weight) {
  static_assert(TM == kDotRows && TN == kDotCols, "the assembly is written for one register tile");
  float* tile_sums = local_floats<kDotSums>();
  assembly_k_split<TM, TN, Gated, kDotStep>(
      a, a_row_stride, a_rows, gather_index, gather_is64, b, b_stride_e, b_stride_n, bias, bias_stride_e, out,
      out_row_stride, out_rows, group_offsets, offsets_is64, num_groups, K, N, activation, up_offset,
      scatter_index, scatter_is64, row_weight, tile_sums,
      [&](bool lead, int64_t valid, const uint16_t* const (&a_end)[TM], const uint16_t* const (&b_end)[TN],
          int64_t k_full, const uint16_t* next) {
        if (lead) {
          reinterpret_cast<int32_t*>(tile_sums)[kDotRowCount] = int32_t(valid);
          dot_tile_sums(tile_sums, a_end, b_end, k_full, next);
        }
      });
}

// W8A8 on AVX512-VNNI: int8 A with a float32 scale per row, int8 B contiguous along K with a
// float32 scale per output channel; the quantized kernels' parameters (moe_gemm_quant.cpp), of
// which it reads A, B, the per-channel scales, a_scale and the epilogue's. Integer sums exact:
// (A + 128) x B from the assembly, less 128 x each column's sum, plus the K % 64 remainder.
template <typename TOut, int TM, int TN>
MOE_XPU_KERNEL
void moe_gemm_quant_dot(const int8_t* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                        int gather_is64, const void* b, int64_t b_stride_e, int64_t b_stride_n,
                        int64_t /*b_stride_k: 1*/, const void* scale, int64_t scale_stride_e,
                        int64_t scale_stride_n, int64_t, int64_t scale_block_n, int64_t /*scale_block_k: K*/,
                        const uint8_t*, int64_t, int64_t, int64_t, const float* a_scale,
                        const float* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                        int64_t out_rows, const void* group_offsets, int offsets_is64,
                        int64_t num_groups, int64_t K, int64_t N, int, int64_t,
                        const void* scatter_index, int scatter_is64, const float* row_weight) {
  static_assert(TM == kDotRows && TN == kDotCols, "the assembly is written for one register tile");
  constexpr int outputs = TM * TN;
  const Worker w = this_worker();
  const int64_t tiles_n = (N + TN - 1) / TN;
  const int64_t k_full = K - K % 64;
  float* local = local_floats<kDotSums * 2>();
  int32_t* tile_sums = reinterpret_cast<int32_t*>(local);
  int32_t* column_sums = reinterpret_cast<int32_t*>(local + kDotSums);
  const int8_t* B = static_cast<const int8_t*>(b);
  const float* b_scale = static_cast<const float*>(scale);
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, kUnitRows / TM, tiles_n,
      UnitCost{int64_t(TM) * TN, int64_t(TN) * 7},
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        const int64_t n0 = n_tile * TN;
        const int8_t* b_col[TN];
        for (int j = 0; j < TN; ++j) b_col[j] = B + g * b_stride_e + tile_b_column<TN, false>(n0, j, N, 0) * b_stride_n;
        if (g < num_groups && k_full > 0) {
          const int8_t* b_end[TN];
          for (int j = 0; j < TN; ++j) b_end[j] = b_col[j] + k_full;
          if (w.lane == 0) dot_int8_column_sums(column_sums, b_end, k_full, b_col[0] + TN * b_stride_n);
          sycl::group_barrier(w.sg);
        }
        for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
          const int64_t m0 = row_begin + m_tile * TM;
          const int64_t valid = tile_valid_rows(rows, m_tile, TM);
          auto a_row = [&](int i) {
            return tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, i);
          };
          if (g < num_groups && k_full > 0) {
            const int8_t* a_end[TM];
            const int8_t* b_end[TN];
            for (int i = 0; i < TM; ++i) a_end[i] = a_row(i) + k_full;
            for (int j = 0; j < TN; ++j) b_end[j] = b_col[j] + k_full;
            if (w.lane == 0) {
              tile_sums[kDotRowCount] = int32_t(valid);
              dot_int8_tile_sums(tile_sums, a_end, b_end, k_full);
            }
            sycl::group_barrier(w.sg);
          }
          #pragma unroll
          for (int o0 = 0; o0 < outputs; o0 += kLanes) {
            const int o = o0 + w.lane;
            const int i = o / TN, j = o % TN;
            if (o < outputs && i < valid && n0 + j < N) {
              float r = 0.0f;
              if (g < num_groups) {
                const int64_t bn = n0 + j;
                int32_t total = k_full > 0 ? tile_sums[o] - 128 * column_sums[j] : 0;
                const int64_t src = source_row(gather_index, gather_is64, m0 + i, a_rows);  // (i < valid)
                const int8_t* ar = a + src * a_row_stride;
                for (int64_t k = k_full; k < K; ++k) total += int32_t(ar[k]) * int32_t(b_col[j][k]);
                r = float(total) * (a_scale[src] * b_scale[g * scale_stride_e + (bn / scale_block_n) * scale_stride_n]);
                if (bias != nullptr) r += bias[g * bias_stride_e + bn];
              }
              const RowTarget t = row_target(scatter_index, scatter_is64, row_weight, m0 + i, out_rows);
              out[t.row * out_row_stride + n0 + j] = FromFloat<TOut>::convert(r * t.weight);
            }
          }
          sycl::group_barrier(w.sg);
        }
      });
}

// ---------------------------------------------------------------------------------------------
// bf16 B contiguous along N ([E, K, N] weights, and nn.Linear weights read transposed: the
// backward's gradient GEMMs). vdpbf16ps multiplies pairs along the reduction dimension, which here
// lie in two B rows: `vpunpcklwd` / `vpunpckhwd` of rows k and k + 1 interleave them into
// (B[k][n], B[k + 1][n]) pairs, 16 columns a register, and A's (k, k + 1) pair is one broadcast
// dword. The unpacks work within 128-bit lanes, so the low register of 32 columns holds columns
// 8 l + 0..3 and the high one 8 l + 4..7 of lane l; the tile's store puts them back in order.
// vpermt2ps indices taking columns 0-15 and 16-31 in order from a (low, high) accumulator pair:
// element 4 l + j of the low register is column 8 l + j, of the high one (index + 16) 8 l + 4 + j.
alignas(64) constexpr int32_t kNDotUnpermute[32] = {0, 1, 2,  3,  16, 17, 18, 19, 4,  5,  6,  7,  20, 21, 22, 23,
                                                    8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

// Tile 6 rows x 64 columns: accumulator (i, v) in zmm(4 i + v), v = 0, 1 the low and high
// registers of columns 0-31, v = 2, 3 of columns 32-63; the pairs in zmm24-27, the loaded rows in
// zmm28-29, A's broadcast pair in zmm30.
#define MOE_XPU_NDOT_ROW(i, r0, r1, r2, r3)              \
  "vpbroadcastd (%[a" #i "],%[ko]), %%zmm30\n\t"        \
  "vdpbf16ps %%zmm24, %%zmm30, %%zmm" #r0 "\n\t"        \
  "vdpbf16ps %%zmm25, %%zmm30, %%zmm" #r1 "\n\t"        \
  "vdpbf16ps %%zmm26, %%zmm30, %%zmm" #r2 "\n\t"        \
  "vdpbf16ps %%zmm27, %%zmm30, %%zmm" #r3 "\n\t"
// After the loop, accumulators (a, a + 1) = (low, high) registers of 32 columns, un-permuted into
// columns in order with the two index vectors zmm30, zmm31 (kNDotUnpermute) and stored as sums
// vectors a and a + 1: sums[i * 64 + c].
#define MOE_XPU_NDOT_STORE(a, b)                          \
  "vmovaps %%zmm" #a ", %%zmm28\n\t"                     \
  "vpermt2ps %%zmm" #b ", %%zmm30, %%zmm28\n\t"          \
  "vpermt2ps %%zmm" #b ", %%zmm31, %%zmm" #a "\n\t"      \
  "vmovups %%zmm28, " #a "*64(%[sums])\n\t"              \
  "vmovups %%zmm" #a ", " #b "*64(%[sums])\n\t"
#define MOE_XPU_NDOT_STORE_TILE                                                                          \
  "vmovdqu32 (%[perm]), %%zmm30\n\t" "vmovdqu32 64(%[perm]), %%zmm31\n\t"                             \
  MOE_XPU_NDOT_STORE(0, 1) MOE_XPU_NDOT_STORE(2, 3) MOE_XPU_NDOT_STORE(4, 5) MOE_XPU_NDOT_STORE(6, 7)   \
  MOE_XPU_NDOT_STORE(8, 9) MOE_XPU_NDOT_STORE(10, 11) MOE_XPU_NDOT_STORE(12, 13)                        \
  MOE_XPU_NDOT_STORE(14, 15) MOE_XPU_NDOT_STORE(16, 17) MOE_XPU_NDOT_STORE(18, 19)                     \
  MOE_XPU_NDOT_STORE(20, 21) MOE_XPU_NDOT_STORE(22, 23)

// The B row pair kNDotPrefetchRows rows ahead (at pp) asked for, into L2 (see there). pp is a
// register of its own: a 14th register operand of the loop compiled without error and computed
// garbage in the runtime's CPU compiler.
#define MOE_XPU_NDOT_PREFETCH                             \
  "prefetcht1 (%[pp])\n\t"                                \
  "prefetcht1 64(%[pp])\n\t"                              \
  "prefetcht1 (%[pp],%[rb])\n\t"                          \
  "prefetcht1 64(%[pp],%[rb])\n\t"                        \
  "lea (%[pp],%[rb],2), %[pp]\n\t"
// The B row pair of a k step, interleaved into zmm24-27 (see above).
#define MOE_XPU_NDOT_PAIRS                                \
  "vmovdqu16 (%[bp]), %%zmm28\n\t"                       \
  "vmovdqu16 (%[bp],%[rb]), %%zmm29\n\t"                 \
  "vpunpcklwd %%zmm29, %%zmm28, %%zmm24\n\t"             \
  "vpunpckhwd %%zmm29, %%zmm28, %%zmm25\n\t"             \
  "vmovdqu16 64(%[bp]), %%zmm28\n\t"                     \
  "vmovdqu16 64(%[bp],%[rb]), %%zmm29\n\t"               \
  "vpunpcklwd %%zmm29, %%zmm28, %%zmm26\n\t"             \
  "vpunpckhwd %%zmm29, %%zmm28, %%zmm27\n\t"
// ... the same, the four interleaved registers also stored to the packed copy at pk.
#define MOE_XPU_NDOT_PAIRS_SAVE                           \
  MOE_XPU_NDOT_PAIRS                                      \
  "vmovdqu64 %%zmm24, (%[pk])\n\t"                       \
  "vmovdqu64 %%zmm25, 64(%[pk])\n\t"                     \
  "vmovdqu64 %%zmm26, 128(%[pk])\n\t"                    \
  "vmovdqu64 %%zmm27, 192(%[pk])\n\t"
// ... or read back from it (no B rows, no unpacks).
#define MOE_XPU_NDOT_PAIRS_PACKED                         \
  "vmovdqu64 (%[pk]), %%zmm24\n\t"                       \
  "vmovdqu64 64(%[pk]), %%zmm25\n\t"                     \
  "vmovdqu64 128(%[pk]), %%zmm26\n\t"                    \
  "vmovdqu64 192(%[pk]), %%zmm27\n\t"
#define MOE_XPU_NDOT_ROWS_2 MOE_XPU_NDOT_ROW(0, 0, 1, 2, 3) MOE_XPU_NDOT_ROW(1, 4, 5, 6, 7)
#define MOE_XPU_NDOT_ROWS_4 MOE_XPU_NDOT_ROWS_2 MOE_XPU_NDOT_ROW(2, 8, 9, 10, 11) MOE_XPU_NDOT_ROW(3, 12, 13, 14, 15)
#define MOE_XPU_NDOT_ROWS_6 MOE_XPU_NDOT_ROWS_4 MOE_XPU_NDOT_ROW(4, 16, 17, 18, 19) MOE_XPU_NDOT_ROW(5, 20, 21, 22, 23)
#define MOE_XPU_NDOT_LOOP(PAIRS, ROWS)                                                                         \
  asm volatile(                                                                                                 \
      MOE_XPU_DOT_ZERO_TILE "1:\n\t" PAIRS ROWS "lea (%[bp],%[rb],2), %[bp]\n\t" "add $256, %[pk]\n\t"     \
      "add $4, %[ko]\n\t" "jnz 1b\n\t" MOE_XPU_NDOT_STORE_TILE                                               \
      : [ko] "+r"(ko), [bp] "+r"(b0), [pk] "+r"(packed), [pp] "+r"(ahead)                                      \
      : [a0] "r"(a_end[0]), [a1] "r"(a_end[1]), [a2] "r"(a_end[2]), [a3] "r"(a_end[3]), [a4] "r"(a_end[4]),   \
        [a5] "r"(a_end[5]), [rb] "r"(b_row_bytes), [sums] "r"(sums), [perm] "r"(kNDotUnpermute)               \
      : "memory", "cc", "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9",         \
        "zmm10", "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20",      \
        "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "zmm30", "zmm31")

// Where a tile's interleaved B pairs come from: B's rows (read), B's rows with a packed copy
// written as they are read (save), or that copy (packed).
enum class NDotB { read, save, packed };

// Tiles that read B's rows ask for them kNDotPrefetchRows rows ahead, into L2: a strip is 128
// bytes of each row, a scattered read that the hardware prefetchers do not follow, and the out-
// of-order window covers only a few rows of a memory latency. Into L1 (prefetcht0) it measured
// no better: rows 4 KB apart share L1's sets, so lines fetched that far ahead evict the current
// ones. (E = 128, 16 rows a group, K = 1536, N = 2048: 80-96 -> 62-68 ms; 32 and 64 rows ahead
// measured the same within noise.)
constexpr int64_t kNDotPrefetchRows = 48;

// The raw accumulators of the tile's first R rows (2, 4 or 6: a group's short last row tile
// computes no padding rows beyond the next of them) over k in [0, k_pairs * 2): A rows end at
// a_end[i] (2 k_pairs elements past their start), B row 0 of the tile at b0 (its column n0), B
// rows b_row_bytes apart, the packed copy at `packed` (k_pairs * 256 bytes; unused by read);
// sums[i * 64 + c] (rows past R: zeros). k_pairs > 0.
template <int R, NDotB From = NDotB::read>
inline void n_dot_tile_sums(float* sums, const uint16_t* const (&a_end)[kNDotRows], const uint16_t* b0,
                            int64_t b_row_bytes, int64_t k_pairs, void* packed = nullptr) {
  static_assert(R == 2 || R == 4 || R == 6, "the assembly is written for 2, 4 and 6 rows");
  int64_t ko = -4 * k_pairs;
  const char* ahead = reinterpret_cast<const char*>(b0) + kNDotPrefetchRows * b_row_bytes;
  if constexpr (From == NDotB::save) {
    if constexpr (R == 2) MOE_XPU_NDOT_LOOP(MOE_XPU_NDOT_PREFETCH MOE_XPU_NDOT_PAIRS_SAVE, MOE_XPU_NDOT_ROWS_2);
    else if constexpr (R == 4) MOE_XPU_NDOT_LOOP(MOE_XPU_NDOT_PREFETCH MOE_XPU_NDOT_PAIRS_SAVE, MOE_XPU_NDOT_ROWS_4);
    else MOE_XPU_NDOT_LOOP(MOE_XPU_NDOT_PREFETCH MOE_XPU_NDOT_PAIRS_SAVE, MOE_XPU_NDOT_ROWS_6);
  } else if constexpr (From == NDotB::packed) {
    if constexpr (R == 2) MOE_XPU_NDOT_LOOP(MOE_XPU_NDOT_PAIRS_PACKED, MOE_XPU_NDOT_ROWS_2);
    else if constexpr (R == 4) MOE_XPU_NDOT_LOOP(MOE_XPU_NDOT_PAIRS_PACKED, MOE_XPU_NDOT_ROWS_4);
    else MOE_XPU_NDOT_LOOP(MOE_XPU_NDOT_PAIRS_PACKED, MOE_XPU_NDOT_ROWS_6);
  } else {
    if constexpr (R == 2) MOE_XPU_NDOT_LOOP(MOE_XPU_NDOT_PREFETCH MOE_XPU_NDOT_PAIRS, MOE_XPU_NDOT_ROWS_2);
    else if constexpr (R == 4) MOE_XPU_NDOT_LOOP(MOE_XPU_NDOT_PREFETCH MOE_XPU_NDOT_PAIRS, MOE_XPU_NDOT_ROWS_4);
    else MOE_XPU_NDOT_LOOP(MOE_XPU_NDOT_PREFETCH MOE_XPU_NDOT_PAIRS, MOE_XPU_NDOT_ROWS_6);
  }
}

// One tile's sums with B read as `From` says, R chosen by the tile's valid rows.
template <NDotB From>
inline void n_dot_tile_sums_for(bool run, int64_t valid, float* sums, const uint16_t* const (&a_end)[kNDotRows],
                                const uint16_t* b0, int64_t b_row_bytes, int64_t k_pairs, void* packed) {
  // Lane 0 (`run`) under branches the whole sub-group takes (kernel_leader_runs, assembly_tile.hpp).
  if (valid <= 2) {
    if (run) n_dot_tile_sums<2, From>(sums, a_end, b0, b_row_bytes, k_pairs, packed);
  } else if (valid <= 4) {
    if (run) n_dot_tile_sums<4, From>(sums, a_end, b0, b_row_bytes, k_pairs, packed);
  } else if (run) {
    n_dot_tile_sums<6, From>(sums, a_end, b0, b_row_bytes, k_pairs, packed);
  }
}

// The weight gradient's bf16 store, straight from the accumulators: row i's two 32-column halves
// un-permuted as MOE_XPU_NDOT_STORE does, plus (with ODD) the odd last row's product in float
// (zmm24-27: its 64 dY values, row i's A value broadcast into zmm29), rounded to bf16 by
// vcvtne2ps2bf16 (round to nearest even, NaN quiet, as FromFloat; it flushes subnormal sums to
// zero) and stored as 64 bytes of the output row, which then moves on by os bytes.
#define MOE_XPU_NDOT_ODD_NONE(i, d0, d1, h0, h1)
#define MOE_XPU_NDOT_ODD_ADD(i, d0, d1, h0, h1)              \
  "vbroadcastss 4*(64+" #i ")(%[odd]), %%zmm29\n\t"        \
  "vfmadd231ps %%zmm" #d0 ", %%zmm29, %%zmm" #h0 "\n\t"      \
  "vfmadd231ps %%zmm" #d1 ", %%zmm29, %%zmm" #h1 "\n\t"
#define MOE_XPU_NDOT_BF16_HALF(i, a, b, d0, d1, at, ODD)   \
  "vmovaps %%zmm" #a ", %%zmm28\n\t"                       \
  "vpermt2ps %%zmm" #b ", %%zmm30, %%zmm28\n\t"            \
  "vpermt2ps %%zmm" #b ", %%zmm31, %%zmm" #a "\n\t"        \
  ODD(i, d0, d1, 28, a)                                     \
  "vcvtne2ps2bf16 %%zmm28, %%zmm" #a ", %%zmm28\n\t"       \
  "vmovdqu16 %%zmm28, " #at "(%[out])\n\t"
#define MOE_XPU_NDOT_BF16_ROW(i, r0, r1, r2, r3, ODD)      \
  MOE_XPU_NDOT_BF16_HALF(i, r0, r1, 24, 25, 0, ODD)         \
  MOE_XPU_NDOT_BF16_HALF(i, r2, r3, 26, 27, 64, ODD)        \
  "add %[os], %[out]\n\t"
#define MOE_XPU_NDOT_BF16_TILE(ODD)                                                                   \
  "vmovdqu32 (%[perm]), %%zmm30\n\t" "vmovdqu32 64(%[perm]), %%zmm31\n\t"                          \
  MOE_XPU_NDOT_BF16_ROW(0, 0, 1, 2, 3, ODD) MOE_XPU_NDOT_BF16_ROW(1, 4, 5, 6, 7, ODD)                \
  MOE_XPU_NDOT_BF16_ROW(2, 8, 9, 10, 11, ODD) MOE_XPU_NDOT_BF16_ROW(3, 12, 13, 14, 15, ODD)          \
  MOE_XPU_NDOT_BF16_ROW(4, 16, 17, 18, 19, ODD) MOE_XPU_NDOT_BF16_ROW(5, 20, 21, 22, 23, ODD)
#define MOE_XPU_NDOT_BF16_LOOP(ODD_LOAD, ODD)                                                                   \
  asm volatile(                                                                                                 \
      MOE_XPU_DOT_ZERO_TILE "1:\n\t" MOE_XPU_NDOT_PAIRS MOE_XPU_NDOT_ROWS_6 "lea (%[bp],%[rb],2), %[bp]\n\t"   \
      "add $4, %[ko]\n\t" "jnz 1b\n\t" ODD_LOAD MOE_XPU_NDOT_BF16_TILE(ODD)                                  \
      : [ko] "+r"(ko), [bp] "+r"(b0), [out] "+r"(out)                                                           \
      : [a0] "r"(a_end[0]), [a1] "r"(a_end[1]), [a2] "r"(a_end[2]), [a3] "r"(a_end[3]), [a4] "r"(a_end[4]),   \
        [a5] "r"(a_end[5]), [rb] "r"(b_row_bytes), [perm] "r"(kNDotUnpermute), [os] "r"(out_row_bytes),       \
        [odd] "r"(odd)                                                                                          \
      : "memory", "cc", "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9",         \
        "zmm10", "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20",      \
        "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "zmm30", "zmm31")

// A whole 6 x 64 tile of the bf16 weight gradient: n_dot_tile_sums<6>'s sums (B read in place),
// with ODD the odd last row added (odd[c]: its dY value of column c as float, c < 64; odd[64 + i]:
// its A value of tile row i), rounded to bf16 and stored to out (row i at out + i os bytes).
template <bool Odd>
inline void n_dot_tile_store_bf16(const uint16_t* const (&a_end)[kNDotRows], const uint16_t* b0,
                                  int64_t b_row_bytes, int64_t k_pairs, uint16_t* out, int64_t out_row_bytes,
                                  const float* odd) {
  int64_t ko = -4 * k_pairs;
  if constexpr (Odd)
    MOE_XPU_NDOT_BF16_LOOP("vmovups (%[odd]), %%zmm24\n\t" "vmovups 64(%[odd]), %%zmm25\n\t"
                           "vmovups 128(%[odd]), %%zmm26\n\t" "vmovups 192(%[odd]), %%zmm27\n\t",
                           MOE_XPU_NDOT_ODD_ADD);
  else
    MOE_XPU_NDOT_BF16_LOOP("", MOE_XPU_NDOT_ODD_NONE);
}

#undef MOE_XPU_NDOT_ODD_NONE
#undef MOE_XPU_NDOT_ODD_ADD
#undef MOE_XPU_NDOT_BF16_HALF
#undef MOE_XPU_NDOT_BF16_ROW
#undef MOE_XPU_NDOT_BF16_TILE
#undef MOE_XPU_NDOT_BF16_LOOP
#undef MOE_XPU_NDOT_ROW
#undef MOE_XPU_NDOT_STORE
#undef MOE_XPU_NDOT_STORE_TILE
#undef MOE_XPU_NDOT_PAIRS
#undef MOE_XPU_NDOT_PAIRS_SAVE
#undef MOE_XPU_NDOT_PAIRS_PACKED
#undef MOE_XPU_NDOT_ROWS_2
#undef MOE_XPU_NDOT_ROWS_4
#undef MOE_XPU_NDOT_ROWS_6
#undef MOE_XPU_NDOT_LOOP

// Where column c (0..63) of tile row i sits in n_dot_tile_sums' output.
inline int n_dot_sum_index(int i, int c) { return i * kNDotCols + c; }

// The N-split GEMM on bf16 A and bf16 B contiguous along N (b_stride_k: B's stride between rows
// of K), the parameters of moe_gemm_n_lanes. N a multiple of kNDotCols (the launcher checks).
// Lane 0 runs the assembly per 6-row tile; the lanes share the epilogue (K's odd element, the
// bias, the row weight, the store), 24 outputs each.
template <typename TOut>
MOE_XPU_KERNEL
void moe_gemm_n_dot(const uint16_t* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                    int gather_is64, const uint16_t* b, int64_t b_stride_e, int64_t b_stride_k,
                    const uint16_t* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                    int64_t out_rows, const void* group_offsets, int offsets_is64, int64_t num_groups,
                    int64_t K, int64_t N, int, int64_t, const void* scatter_index, int scatter_is64,
                    const float* row_weight, void* scratch) {
  constexpr int TM = kNDotRows, TN = kNDotCols;
  const Worker w = this_worker();
  const int64_t tiles_n = N / TN;
  const int64_t k_pairs = K / 2;
  float* tile_sums = local_floats<kNDotSums>();
  const int64_t rb = b_stride_k * 2;
  void* packed = n_dot_packs(K, rb) ? static_cast<char*>(scratch) + w.id * n_dot_scratch_bytes(K, rb) : nullptr;
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, kUnitRows / TM, tiles_n,
      UnitCost{int64_t(TM) * TN / 16, int64_t(TN / 16) * 14},
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        const int64_t n0 = n_tile * TN;
        const uint16_t* b_tile = b + g * b_stride_e + n0;
        for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
          const int64_t m0 = row_begin + m_tile * TM;
          const int64_t valid = tile_valid_rows(rows, m_tile, TM);
          auto a_row = [&](int i) {
            return tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, i);
          };
          if (g < num_groups && k_pairs > 0) {
            const uint16_t* a_end[TM];
            for (int i = 0; i < TM; ++i) a_end[i] = a_row(i) + 2 * k_pairs;
            // A unit of several tiles: the first packs B, the others read that.
            const bool lead = w.lane == 0;
            if (packed == nullptr || m_last - m_first == 1)
              n_dot_tile_sums_for<NDotB::read>(lead, valid, tile_sums, a_end, b_tile, rb, k_pairs, nullptr);
            else if (m_tile == m_first)
              n_dot_tile_sums_for<NDotB::save>(lead, valid, tile_sums, a_end, b_tile, rb, k_pairs, packed);
            else
              n_dot_tile_sums_for<NDotB::packed>(lead, valid, tile_sums, a_end, b_tile, rb, k_pairs, packed);
            sycl::group_barrier(w.sg);
          }
          #pragma unroll
          for (int o0 = 0; o0 < TM * TN; o0 += kLanes) {
            const int o = o0 + w.lane;
            const int i = o / TN, c = o % TN;
            if (i < valid) {
              float s = 0.0f;
              if (g < num_groups) {
                if (k_pairs > 0) s = tile_sums[n_dot_sum_index(i, c)];
                if (K % 2 != 0) s = sycl::fma(to_float(a_row(i)[K - 1]), to_float(b_tile[(K - 1) * b_stride_k + c]), s);
                if (bias != nullptr) s += to_float(bias[g * bias_stride_e + n0 + c]);
              }
              const RowTarget t = row_target(scatter_index, scatter_is64, row_weight, m0 + i, out_rows);
              out[t.row * out_row_stride + n0 + c] = FromFloat<TOut>::convert(s * t.weight);
            }
          }
          sycl::group_barrier(w.sg);  // the sums are read before the next tile overwrites them
        }
      });
}

// The weight gradient on AVX512-BF16, dB[g] = A[rows of g]^T dY[rows of g] for bf16 operands:
// moe_gemm_n_dot's tile with the group's rows as its reduction. dY's rows are its B rows, read in
// place two at a time (rows 2r and 2r + 1 interleaved in registers); A's columns k0 .. k0 + 5 over
// the group's row pairs are its A rows, packed by the lanes into the worker's scratch as
// (A[2r][k], A[2r + 1][k]) dwords through the index table and kept while the worker's consecutive
// units share them. A unit: 6 rows of dB (columns of A) x 64 columns (N a multiple of 64), summed
// over the row pairs in order and the odd last row in float: one fixed order, bitwise
// reproducible, no atomics. The parameters are moe_gemm_wgrad's, with dB contiguous along its N
// (the lanes store along it) and dY read in place, never through the index table: the plan
// (plan_wgrad_for) launches it transposed for K-contiguous dB only without an index table.
template <typename TOut>
MOE_XPU_KERNEL
void moe_gemm_dot_wgrad(const uint16_t* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                        int gather_is64, const uint16_t* dy, int64_t dy_row_stride, int64_t dy_rows,
                        const void* group_offsets, int offsets_is64, int64_t num_groups, int64_t K,
                        int64_t N, TOut* out, int64_t out_stride_e, int64_t out_stride_k,
                        int64_t out_stride_n, int, void* scratch) {
  constexpr int TK = kNDotRows, TN = kNDotCols;
  const Worker w = this_worker();
  const int64_t tiles_n = N / TN;
  const int64_t tiles = (K + TK - 1) / TK * tiles_n;
  const int64_t cap = dot_wgrad_pair_capacity(dy_rows);
  uint32_t* at = static_cast<uint32_t*>(scratch) + w.id * TK * cap;  // [TK][cap] row pairs
  float* sums = local_floats<kNDotSums>();
  const bool dense = wgrad_dense(K, N, out_stride_e, out_stride_k, out_stride_n);
  int64_t held_group = -1, held_k0 = -1;  // the columns of A that `at` holds
  auto shape = [&](int64_t rows, int64_t& units, int64_t& cost) { units = tiles, cost = rows + 1; };
  for_each_owned_wgrad_units(w.id, w.count, group_offsets, offsets_is64, num_groups, dy_rows, shape,
                             [&](int64_t g, int64_t row_begin, int64_t rows, int64_t u_lo, int64_t u_hi, int64_t) {
    TOut* out_g = out + g * out_stride_e;
    if (rows == 0 && dense) {
      store_zero_share(out_g, K * N, u_lo, u_hi, tiles, w.lane, kLanes);
      return;
    }
    const int64_t pairs = rows / 2;
    auto a_row = [&](int64_t m) { return a + source_row(gather_index, gather_is64, row_begin + m, a_rows) * a_row_stride; };
    const bool odd = rows % 2 != 0;
    const uint16_t* odd_a = odd ? a_row(rows - 1) : nullptr;
    const uint16_t* odd_dy = odd ? dy + (row_begin + rows - 1) * dy_row_stride : nullptr;
    // Units K tile by K tile, column tiles inside: consecutive units share the packed columns.
    for (int64_t t = u_lo; t < u_hi; ++t) {
      const int64_t k0 = (t / tiles_n) * TK, n0 = (t % tiles_n) * TN;
      const int64_t valid = tile_valid_rows(K, k0 / TK, TK);
      if (pairs > 0) {
        if (g != held_group || k0 != held_k0) {
          for (int64_t r = w.lane; r < pairs; r += kLanes) {
            const uint16_t* lo = a_row(2 * r);
            const uint16_t* hi = a_row(2 * r + 1);
            #pragma unroll
            for (int i = 0; i < TK; ++i) {  // columns past K repeat the last one; not stored
              const int64_t k = k0 + (i < valid ? i : valid - 1);
              at[i * cap + r] = uint32_t(lo[k]) | (uint32_t(hi[k]) << 16);
            }
          }
          held_group = g;
          held_k0 = k0;
          sycl::group_barrier(w.sg);  // lane 0 reads every lane's pairs
        }
        const uint16_t* a_end[TK];
        for (int i = 0; i < TK; ++i) a_end[i] = reinterpret_cast<const uint16_t*>(at + i * cap + pairs);
        const uint16_t* b_tile = dy + row_begin * dy_row_stride + n0;
        if constexpr (std::is_same_v<TOut, uint16_t>) {
          if (valid == TK) {  // a whole bf16 tile: rounded and stored by the assembly
            if (odd) {  // the odd row's values as floats, where the assembly reads them
              for (int c = w.lane; c < TN; c += kLanes) sums[c] = to_float(odd_dy[n0 + c]);
              if (w.lane < TK) sums[TN + w.lane] = to_float(odd_a[k0 + w.lane]);
              sycl::group_barrier(w.sg);
            }
            TOut* row0 = out_g + k0 * out_stride_k + n0;
            const int64_t rb = dy_row_stride * 2, ob = out_stride_k * 2;
            if (odd) {
              if (w.lane == 0) n_dot_tile_store_bf16<true>(a_end, b_tile, rb, pairs, row0, ob, sums);
            } else if (w.lane == 0) {
              n_dot_tile_store_bf16<false>(a_end, b_tile, rb, pairs, row0, ob, sums);
            }
            sycl::group_barrier(w.sg);  // the sums area is read before the next unit writes it
            continue;
          }
        }
        n_dot_tile_sums_for<NDotB::read>(w.lane == 0, valid, sums, a_end, b_tile, dy_row_stride * 2, pairs,
                                         nullptr);
        sycl::group_barrier(w.sg);
      }
      for (int i = 0; i < valid; ++i) {  // consecutive lanes, consecutive columns: whole-vector stores
        TOut* row = out_g + (k0 + i) * out_stride_k + n0 + w.lane;
        #pragma unroll
        for (int c0 = 0; c0 < TN; c0 += kLanes) {
          float s = pairs > 0 ? sums[n_dot_sum_index(i, c0 + w.lane)] : 0.0f;
          if (odd_a != nullptr) s = sycl::fma(to_float(odd_a[k0 + i]), to_float(odd_dy[n0 + c0 + w.lane]), s);
          row[c0] = FromFloat<TOut>::convert(s);
        }
      }
      sycl::group_barrier(w.sg);  // the sums are read before the next unit overwrites them
    }
  });
}

// ---------------------------------------------------------------------------------------------
// 4-bit weights (symmetric int4 or one zero point for the launch, MXFP4) with bf16 activations on
// AVX512-BF16: the packed words (moe_gemm_quant.cpp's layout) decoded to exact bf16 values in
// registers and multiplied with vdpbf16ps, where the vector kernel widens every value to float32
// and issues one FMA per weight and row. A column's block of 128 k is one 64-byte line whose word
// l holds k = 16 r + l in bits 4 r .. 4 r + 3, so its byte 4 l + c holds k = 32 c + l (low
// nibble) and 32 c + 16 + l (high nibble). Two vpermw of the line (words 2 l and 2 l + 1 of it,
// each placed twice: zmm17, zmm18) put bytes 4 l + {0, 1} and 4 l + {2, 3} into the words of lanes
// l and l + 16; vpsrlvw by 0 | 4 or 8 | 12 bits (zmm19, zmm20) brings the nibble of k = 32 c + w
// into the low bits of word w; vpermw of the 16-code table (the codes' values as bf16, placed
// twice, so the bit above the nibble does not matter: zmm16) decodes them: the 32 weights of
// sub-block c in k order, ten instructions per 128 weights. A is read in place by the dot products
// (memory operands). The codes' values are exact in bf16 (int4: q - z, integers; e2m1: halves up
// to 6), their products with bf16 A exact in float32; each scale block's dot products go into a
// zeroed register, scaled once by an FMA into the accumulator: the scale is applied in float, as
// the vector kernel applies it, never rounded into bf16 weights.
//
// Tile: 4 rows x 4 columns (a half chunk of the packed layout: its columns' lines lie side by
// side, 256 bytes a block), accumulators zmm0-15 (acc[i][j] in zmm(4 i + j)), the decoded
// sub-blocks zmm23-26, each row's block sums zmm27-30, the scale zmm31. The local area (floats):
// [0, 80) the table, word indices and shift counts as loaded above, [80, 96) the tile's sums (the
// assembly's pointer, the rest addressed from it), [96, 352) the e8m0 scales as floats (MXFP4).
constexpr int64_t kNibbleSums = 80;
constexpr int64_t kNibbleE8m0 = 96;
// The tile's row count (int32, 1 .. 4; see MOE_XPU_DOT_IF_ROW): 1088 bytes from the sums.
constexpr int64_t kNibbleRowCount = 352;
#define MOE_XPU_NIB_ROW_COUNT_AT "1088"
static_assert((kNibbleRowCount - kNibbleSums) * 4 == 1088 && kNibbleRowCount < kNibbleLocal, "the row count's place");
#define MOE_XPU_NIB_IF_ROW(i) MOE_XPU_DOT_IF_ROW(MOE_XPU_NIB_ROW_COUNT_AT, i)

#define MOE_XPU_NIB_AHEAD "4096"
#define MOE_XPU_NIB_LINE_AHEAD(P, off) "prefetcht0 " MOE_XPU_NIB_AHEAD "+" #off "(%[" P "],%[ko],2)\n\t"
#define MOE_XPU_NIB_PREFETCH(P)                                                                         \
  MOE_XPU_NIB_LINE_AHEAD(P, 0) MOE_XPU_NIB_LINE_AHEAD(P, 64) MOE_XPU_NIB_LINE_AHEAD(P, 128)            \
  MOE_XPU_NIB_LINE_AHEAD(P, 192) MOE_XPU_NIB_LINE_AHEAD(P, 256) MOE_XPU_NIB_LINE_AHEAD(P, 320)         \
  MOE_XPU_NIB_LINE_AHEAD(P, 384) MOE_XPU_NIB_LINE_AHEAD(P, 448)
// Column j's line: columns 0, 1 from the pair at b, 2, 3 from the pair at bu (b + 128 bytes, or a
// gated tile's up columns).
#define MOE_XPU_NIB_LINE0 "(%[b],%[ko],2)"
#define MOE_XPU_NIB_LINE1 "64(%[b],%[ko],2)"
#define MOE_XPU_NIB_LINE2 "(%[bu],%[ko],2)"
#define MOE_XPU_NIB_LINE3 "64(%[bu],%[ko],2)"
#define MOE_XPU_NIB_DECODE(j)                               \
  "vpermw " MOE_XPU_NIB_LINE##j ", %%zmm17, %%zmm21\n\t"    \
  "vpermw " MOE_XPU_NIB_LINE##j ", %%zmm18, %%zmm22\n\t"    \
  "vpsrlvw %%zmm19, %%zmm21, %%zmm23\n\t"                   \
  "vpsrlvw %%zmm20, %%zmm21, %%zmm24\n\t"                   \
  "vpsrlvw %%zmm19, %%zmm22, %%zmm25\n\t"                   \
  "vpsrlvw %%zmm20, %%zmm22, %%zmm26\n\t"                   \
  "vpermw %%zmm16, %%zmm23, %%zmm23\n\t"                    \
  "vpermw %%zmm16, %%zmm24, %%zmm24\n\t"                    \
  "vpermw %%zmm16, %%zmm25, %%zmm25\n\t"                    \
  "vpermw %%zmm16, %%zmm26, %%zmm26\n\t"
#define MOE_XPU_NIB_DOT(i, c, d, t) "vdpbf16ps " #c "*64(%[a" #i "],%[ko]), %%zmm" #d ", %%zmm" #t "\n\t"
#define MOE_XPU_NIB_ZERO(t) "vpxord %%zmm" #t ", %%zmm" #t ", %%zmm" #t "\n\t"
#define MOE_XPU_NIB_FMA(t, r) "vfmadd231ps %%zmm31, %%zmm" #t ", %%zmm" #r "\n\t"
// Scale q of column j's block into zmm31: float32 scales (one per scale block, K contiguous), or
// MXFP4's e8m0 bytes converted through the local table (2^(s - 127); 0 and 255 as the vector
// kernel reads them).
#define MOE_XPU_NIB_SCALE_F32(j, q) "vbroadcastss " #q "*4(%[s" #j "]), %%zmm31\n\t"
#define MOE_XPU_NIB_SCALE_E8M0(j, q) \
  "movzbq " #q "(%[s" #j "]), %[tmp]\n\t" "vbroadcastss 64(%[sums],%[tmp],4), %%zmm31\n\t"
// One scale per block (int4 groups of 128), two (groups of 64), four (groups of 32, MXFP4).
#define MOE_XPU_NIB_ROW1(i, t, r)                                                                   \
  MOE_XPU_NIB_ZERO(t) MOE_XPU_NIB_DOT(i, 0, 23, t) MOE_XPU_NIB_DOT(i, 1, 24, t)                    \
  MOE_XPU_NIB_DOT(i, 2, 25, t) MOE_XPU_NIB_DOT(i, 3, 26, t) MOE_XPU_NIB_FMA(t, r)
#define MOE_XPU_NIB_ROW2(i, t, r, c0, d0, c1, d1) \
  MOE_XPU_NIB_ZERO(t) MOE_XPU_NIB_DOT(i, c0, d0, t) MOE_XPU_NIB_DOT(i, c1, d1, t) MOE_XPU_NIB_FMA(t, r)
#define MOE_XPU_NIB_ROW4(i, t, r, c, d) MOE_XPU_NIB_ZERO(t) MOE_XPU_NIB_DOT(i, c, d, t) MOE_XPU_NIB_FMA(t, r)
#define MOE_XPU_NIB_COLUMN1(SCALE, j, r0, r1, r2, r3)                                                  \
  MOE_XPU_NIB_DECODE(j) SCALE(j, 0) MOE_XPU_NIB_ROW1(0, 27, r0) MOE_XPU_NIB_IF_ROW(1) MOE_XPU_NIB_ROW1(1, 28, r1) \
  MOE_XPU_NIB_IF_ROW(2) MOE_XPU_NIB_ROW1(2, 29, r2) MOE_XPU_NIB_IF_ROW(3) MOE_XPU_NIB_ROW1(3, 30, r3) "2:\n\t"
#define MOE_XPU_NIB_HALF(SCALE, j, q, c0, d0, c1, d1, r0, r1, r2, r3)                                    \
  SCALE(j, q) MOE_XPU_NIB_ROW2(0, 27, r0, c0, d0, c1, d1) MOE_XPU_NIB_IF_ROW(1)                         \
  MOE_XPU_NIB_ROW2(1, 28, r1, c0, d0, c1, d1) MOE_XPU_NIB_IF_ROW(2) MOE_XPU_NIB_ROW2(2, 29, r2, c0, d0, c1, d1) \
  MOE_XPU_NIB_IF_ROW(3) MOE_XPU_NIB_ROW2(3, 30, r3, c0, d0, c1, d1) "2:\n\t"
#define MOE_XPU_NIB_COLUMN2(SCALE, j, r0, r1, r2, r3)                         \
  MOE_XPU_NIB_DECODE(j) MOE_XPU_NIB_HALF(SCALE, j, 0, 0, 23, 1, 24, r0, r1, r2, r3) \
  MOE_XPU_NIB_HALF(SCALE, j, 1, 2, 25, 3, 26, r0, r1, r2, r3)
#define MOE_XPU_NIB_QUARTER(SCALE, j, q, d, r0, r1, r2, r3)                                           \
  SCALE(j, q) MOE_XPU_NIB_ROW4(0, 27, r0, q, d) MOE_XPU_NIB_IF_ROW(1) MOE_XPU_NIB_ROW4(1, 28, r1, q, d) \
  MOE_XPU_NIB_IF_ROW(2) MOE_XPU_NIB_ROW4(2, 29, r2, q, d) MOE_XPU_NIB_IF_ROW(3) MOE_XPU_NIB_ROW4(3, 30, r3, q, d) "2:\n\t"
#define MOE_XPU_NIB_COLUMN4(SCALE, j, r0, r1, r2, r3)                                                \
  MOE_XPU_NIB_DECODE(j) MOE_XPU_NIB_QUARTER(SCALE, j, 0, 23, r0, r1, r2, r3)                        \
  MOE_XPU_NIB_QUARTER(SCALE, j, 1, 24, r0, r1, r2, r3) MOE_XPU_NIB_QUARTER(SCALE, j, 2, 25, r0, r1, r2, r3) \
  MOE_XPU_NIB_QUARTER(SCALE, j, 3, 26, r0, r1, r2, r3)
// The loop over whole blocks: each block also asks for the 8 lines (one block of a whole chunk)
// 4 KB ahead in each pair's chunk stream, which runs on into the next chunk, the worker's next
// units (the two streams are one where bu is b + 128: those requests find their lines in cache).
// ADV: bytes of scales a column has per block.
#define MOE_XPU_NIB_TILE(COLUMN, SCALE, ADV)                                                                     \
  asm volatile(                                                                                                 \
      MOE_XPU_DOT_ZERO_TILE                                                                                     \
      "vmovdqu16 -320(%[sums]), %%zmm16\n\t" "vmovdqu16 -256(%[sums]), %%zmm17\n\t"                         \
      "vmovdqu16 -192(%[sums]), %%zmm18\n\t" "vmovdqu16 -128(%[sums]), %%zmm19\n\t"                         \
      "vmovdqu16 -64(%[sums]), %%zmm20\n\t"                                                                  \
      "1:\n\t"                                                                                                  \
      MOE_XPU_NIB_PREFETCH("b") MOE_XPU_NIB_PREFETCH("bu")                                                      \
      COLUMN(SCALE, 0, 0, 4, 8, 12) COLUMN(SCALE, 1, 1, 5, 9, 13) COLUMN(SCALE, 2, 2, 6, 10, 14)              \
      COLUMN(SCALE, 3, 3, 7, 11, 15)                                                                            \
      "add $" ADV ", %[s0]\n\t" "add $" ADV ", %[s1]\n\t" "add $" ADV ", %[s2]\n\t" "add $" ADV ", %[s3]\n\t"  \
      "add $256, %[ko]\n\t"                                                                                     \
      "jnz 1b\n\t"                                                                                              \
      MOE_XPU_DOT_SUM(0) MOE_XPU_DOT_SUM(1) MOE_XPU_DOT_SUM(2) MOE_XPU_DOT_SUM(3) MOE_XPU_DOT_SUM(4)           \
      MOE_XPU_DOT_SUM(5) MOE_XPU_DOT_SUM(6) MOE_XPU_DOT_SUM(7) MOE_XPU_DOT_SUM(8) MOE_XPU_DOT_SUM(9)           \
      MOE_XPU_DOT_SUM(10) MOE_XPU_DOT_SUM(11) MOE_XPU_DOT_SUM(12) MOE_XPU_DOT_SUM(13) MOE_XPU_DOT_SUM(14)      \
      MOE_XPU_DOT_SUM(15)                                                                                       \
      : [ko] "+r"(ko), [s0] "+r"(s0), [s1] "+r"(s1), [s2] "+r"(s2), [s3] "+r"(s3), [tmp] "=&r"(tmp)             \
      : [a0] "r"(a_end[0]), [a1] "r"(a_end[1]), [a2] "r"(a_end[2]), [a3] "r"(a_end[3]), [b] "r"(b_end),        \
        [bu] "r"(bu_end),                                                                                       \
        [sums] "r"(local + kNibbleSums)                                                                         \
      : "memory", "cc", "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9",         \
        "zmm10", "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20",      \
        "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "zmm30", "zmm31")

// The sums of a 4 x 4 tile over `blocks` whole blocks of 128 k into local[kNibbleSums + 4 i + j]:
// A rows end at a_end[i] (128 blocks elements past their start), the packed lines of columns 0, 1
// at b_end and of columns 2, 3 at bu_end (512 blocks bytes past their first block; the second
// column of a pair 64 bytes on), column j's scales from s[j] on (float32, or e8m0 bytes with
// E8m0), ScalesPerBlock of them a block. blocks > 0.
template <int ScalesPerBlock, bool E8m0>
inline void nibble_tile_sums(float* local, const uint16_t* const (&a_end)[4], const char* b_end, const char* bu_end,
                             int64_t blocks, const char* const (&s)[4]) {
  int64_t ko = -256 * blocks;
  const char *s0 = s[0], *s1 = s[1], *s2 = s[2], *s3 = s[3];
  int64_t tmp = 0;
  if constexpr (E8m0) {
    static_assert(ScalesPerBlock == 4, "MXFP4 has a scale per 32 k");
    MOE_XPU_NIB_TILE(MOE_XPU_NIB_COLUMN4, MOE_XPU_NIB_SCALE_E8M0, "4");
  } else if constexpr (ScalesPerBlock == 1) {
    MOE_XPU_NIB_TILE(MOE_XPU_NIB_COLUMN1, MOE_XPU_NIB_SCALE_F32, "4");
  } else if constexpr (ScalesPerBlock == 2) {
    MOE_XPU_NIB_TILE(MOE_XPU_NIB_COLUMN2, MOE_XPU_NIB_SCALE_F32, "8");
  } else {
    MOE_XPU_NIB_TILE(MOE_XPU_NIB_COLUMN4, MOE_XPU_NIB_SCALE_F32, "16");
  }
}

#undef MOE_XPU_NIB_AHEAD
#undef MOE_XPU_NIB_PREFETCH
#undef MOE_XPU_NIB_LINE_AHEAD
#undef MOE_XPU_NIB_LINE0
#undef MOE_XPU_NIB_LINE1
#undef MOE_XPU_NIB_LINE2
#undef MOE_XPU_NIB_LINE3
#undef MOE_XPU_NIB_DECODE
#undef MOE_XPU_NIB_DOT
#undef MOE_XPU_NIB_ZERO
#undef MOE_XPU_NIB_FMA
#undef MOE_XPU_NIB_SCALE_F32
#undef MOE_XPU_NIB_SCALE_E8M0
#undef MOE_XPU_NIB_ROW1
#undef MOE_XPU_NIB_ROW2
#undef MOE_XPU_NIB_ROW4
#undef MOE_XPU_NIB_COLUMN1
#undef MOE_XPU_NIB_HALF
#undef MOE_XPU_NIB_COLUMN2
#undef MOE_XPU_NIB_QUARTER
#undef MOE_XPU_NIB_COLUMN4
#undef MOE_XPU_NIB_TILE

// ---------------------------------------------------------------------------------------------
// fp8 e4m3 weights (K contiguous) with bf16 activations on the same design: 32 bytes of a column
// decoded to 32 exact bf16 values, ten instructions: the magnitude m = b & 0x7f shifted into bf16's
// exponent and mantissa (m << 4, + 120 << 7: normals), codes 1-7 (subnormal m 2^-9) and 0 from an
// 8-entry table (vpermw under the mask m < 8), 0x7f as NaN, the sign moved to bit 15. Tile 4 x 4,
// any 4 columns (a pointer each, advanced 128 bytes a block). Scales: one per output channel (the
// dot products accumulate unscaled, the lanes scale each sum once) or one per 128 x 128 block
// (ScaledBlocks: each block's products in a zeroed register, scaled by an FMA; the tile's 4 columns
// share the block's scale, so one pointer, 4 bytes a block). Constants in the local area (words):
// 0x7f, 120 << 7, 8, the subnormal table, the quiet NaN, 0x8000 (16-word vectors from floats
// [0, 96)); the sums at kNibbleSums.
#define MOE_XPU_FP8_DECODE(j, c)                                         \
  "vpmovzxbw " #c "*32(%[b" #j "]), %%zmm22\n\t"                         \
  "vpandd %%zmm16, %%zmm22, %%zmm23\n\t"                                 \
  "vpcmpeqw %%zmm16, %%zmm23, %%k2\n\t"                                  \
  "vpcmpuw $1, %%zmm18, %%zmm23, %%k1\n\t"                               \
  "vpsllw $4, %%zmm23, %%zmm24\n\t"                                      \
  "vpaddw %%zmm17, %%zmm24, %%zmm24\n\t"                                 \
  "vpermw %%zmm19, %%zmm23, %%zmm24%{%%k1%}\n\t"                         \
  "vmovdqu16 %%zmm20, %%zmm24%{%%k2%}\n\t"                               \
  "vpsllw $8, %%zmm22, %%zmm25\n\t"                                      \
  "vpternlogd $0xf8, %%zmm21, %%zmm25, %%zmm24\n\t"
#define MOE_XPU_FP8_DOT(i, c, t) "vdpbf16ps " #c "*64(%[a" #i "],%[ko]), %%zmm24, %%zmm" #t "\n\t"
// Column j over one block: unscaled straight into the accumulators, or ScaledBlocks through the
// row temps zmm26-29 and the block's scale (zmm30).
#define MOE_XPU_FP8_SUB(j, c, r0, r1, r2, r3)                                                        \
  MOE_XPU_FP8_DECODE(j, c) MOE_XPU_FP8_DOT(0, c, r0) MOE_XPU_NIB_IF_ROW(1) MOE_XPU_FP8_DOT(1, c, r1)   \
  MOE_XPU_NIB_IF_ROW(2) MOE_XPU_FP8_DOT(2, c, r2) MOE_XPU_NIB_IF_ROW(3) MOE_XPU_FP8_DOT(3, c, r3) "2:\n\t"
#define MOE_XPU_FP8_COLUMN(j, s, r0, r1, r2, r3)                                                     \
  MOE_XPU_FP8_SUB(j, 0, r0, r1, r2, r3) MOE_XPU_FP8_SUB(j, 1, r0, r1, r2, r3)                       \
  MOE_XPU_FP8_SUB(j, 2, r0, r1, r2, r3) MOE_XPU_FP8_SUB(j, 3, r0, r1, r2, r3)
#define MOE_XPU_FP8_ZERO4 \
  "vpxord %%zmm26, %%zmm26, %%zmm26\n\t" "vpxord %%zmm27, %%zmm27, %%zmm27\n\t" \
  "vpxord %%zmm28, %%zmm28, %%zmm28\n\t" "vpxord %%zmm29, %%zmm29, %%zmm29\n\t"
#define MOE_XPU_FP8_SCALE4(s, r0, r1, r2, r3)                                                            \
  "vfmadd231ps %%zmm" #s ", %%zmm26, %%zmm" #r0 "\n\t" "vfmadd231ps %%zmm" #s ", %%zmm27, %%zmm" #r1 "\n\t" \
  "vfmadd231ps %%zmm" #s ", %%zmm28, %%zmm" #r2 "\n\t" "vfmadd231ps %%zmm" #s ", %%zmm29, %%zmm" #r3 "\n\t"
#define MOE_XPU_FP8_SCALED_COLUMN(j, s, r0, r1, r2, r3) \
  MOE_XPU_FP8_ZERO4 MOE_XPU_FP8_COLUMN(j, s, 26, 27, 28, 29) MOE_XPU_FP8_SCALE4(s, r0, r1, r2, r3)
#define MOE_XPU_FP8_TILE(COLUMN, SCALE_LOAD, SCALE_STEP)                                                     \
  asm volatile(                                                                                             \
      MOE_XPU_DOT_ZERO_TILE                                                                                 \
      "vmovdqu16 -320(%[sums]), %%zmm16\n\t" "vmovdqu16 -256(%[sums]), %%zmm17\n\t"                         \
      "vmovdqu16 -192(%[sums]), %%zmm18\n\t" "vmovdqu16 -128(%[sums]), %%zmm19\n\t"                         \
      "vmovdqu16 -64(%[sums]), %%zmm20\n\t" "vmovdqu16 64(%[sums]), %%zmm21\n\t"                            \
      "1:\n\t"                                                                                              \
      "prefetcht0 1024(%[b0])\n\t" "prefetcht0 1088(%[b0])\n\t" "prefetcht0 1024(%[b1])\n\t"               \
      "prefetcht0 1088(%[b1])\n\t" "prefetcht0 1024(%[b2])\n\t" "prefetcht0 1088(%[b2])\n\t"               \
      "prefetcht0 1024(%[b3])\n\t" "prefetcht0 1088(%[b3])\n\t"                                            \
      SCALE_LOAD                                                                                            \
      COLUMN(0, 30, 0, 4, 8, 12) COLUMN(1, 30, 1, 5, 9, 13) COLUMN(2, 31, 2, 6, 10, 14)                    \
      COLUMN(3, 31, 3, 7, 11, 15)                                                                           \
      "add $128, %[b0]\n\t" "add $128, %[b1]\n\t" "add $128, %[b2]\n\t" "add $128, %[b3]\n\t"             \
      SCALE_STEP                                                                                            \
      "add $256, %[ko]\n\t"                                                                                 \
      "jnz 1b\n\t"                                                                                          \
      MOE_XPU_DOT_SUM(0) MOE_XPU_DOT_SUM(1) MOE_XPU_DOT_SUM(2) MOE_XPU_DOT_SUM(3) MOE_XPU_DOT_SUM(4)       \
      MOE_XPU_DOT_SUM(5) MOE_XPU_DOT_SUM(6) MOE_XPU_DOT_SUM(7) MOE_XPU_DOT_SUM(8) MOE_XPU_DOT_SUM(9)       \
      MOE_XPU_DOT_SUM(10) MOE_XPU_DOT_SUM(11) MOE_XPU_DOT_SUM(12) MOE_XPU_DOT_SUM(13) MOE_XPU_DOT_SUM(14)  \
      MOE_XPU_DOT_SUM(15)                                                                                   \
      : [ko] "+r"(ko), [b0] "+r"(b0), [b1] "+r"(b1), [b2] "+r"(b2), [b3] "+r"(b3), [sc] "+r"(sc),            \
        [scu] "+r"(scu)                                                                                     \
      : [a0] "r"(a_end[0]), [a1] "r"(a_end[1]), [a2] "r"(a_end[2]), [a3] "r"(a_end[3]),                     \
        [sums] "r"(local + kNibbleSums)                                                                     \
      : "memory", "cc", "k1", "k2", "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8",   \
        "zmm9", "zmm10", "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19",    \
        "zmm20", "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "zmm30",   \
        "zmm31")

// The sums of a 4 x 4 fp8 tile over `blocks` whole blocks of 128 k into local[kNibbleSums + 4 i +
// j]: A rows end at a_end[i] (128 blocks elements past their start), column j's bytes from b[j] on,
// ScaledBlocks: columns 0, 1's block scales from `scale` on, columns 2, 3's from `scale_up` on (a
// gated tile's up columns; float32, one a block). blocks > 0.
template <bool ScaledBlocks>
inline void fp8_tile_sums(float* local, const uint16_t* const (&a_end)[4], const uint8_t* const (&b)[4],
                          int64_t blocks, const float* scale, const float* scale_up) {
  int64_t ko = -256 * blocks;
  const uint8_t *b0 = b[0], *b1 = b[1], *b2 = b[2], *b3 = b[3];
  const float *sc = scale, *scu = scale_up;
  if constexpr (ScaledBlocks)
    MOE_XPU_FP8_TILE(MOE_XPU_FP8_SCALED_COLUMN, "vbroadcastss (%[sc]), %%zmm30\n\t" "vbroadcastss (%[scu]), %%zmm31\n\t",
                     "add $4, %[sc]\n\t" "add $4, %[scu]\n\t");
  else
    MOE_XPU_FP8_TILE(MOE_XPU_FP8_COLUMN, "", "");
}

#undef MOE_XPU_FP8_DECODE
#undef MOE_XPU_FP8_DOT
#undef MOE_XPU_FP8_SUB
#undef MOE_XPU_FP8_COLUMN
#undef MOE_XPU_FP8_ZERO4
#undef MOE_XPU_FP8_SCALE4
#undef MOE_XPU_FP8_SCALED_COLUMN
#undef MOE_XPU_FP8_TILE
#undef MOE_XPU_NIB_IF_ROW
#undef MOE_XPU_NIB_ROW_COUNT_AT
// (The MOE_XPU_DOT_ macros of assembly_tile.hpp stay defined: that header is included once per
// bundle, and moe_gemm_fma.cpp, compiled after this file where a bundle takes both, uses them.)

// The fp8 kernel's constants (see above), written by the sub-group's lanes.
inline void fp8_constants(float* local, int lane) {
  uint16_t* words = reinterpret_cast<uint16_t*>(local);
  // m 2^-9 for the subnormal codes m = 1..7 (bf16 bits), and zero.
  constexpr uint16_t kSubnormal[8] = {0x0000, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};
  for (int h = 0; h < 2; ++h) {
    const int w = lane + 16 * h;
    words[w] = 0x7f;
    words[32 + w] = 120 << 7;
    words[64 + w] = 8;
    words[96 + w] = kSubnormal[lane % 8];
    words[128 + w] = 0x7fc0;
    words[2 * (kNibbleSums + 16) + w] = 0x8000;  // after the sums
  }
}

// The local area's constants (see kNibbleLocal), written by the sub-group's lanes: lane l's
// table entry is the bf16 bits of code l's value (exact), `e8m0` also fills the scale table.
inline void nibble_constants(float* local, int lane, float code_value, bool e8m0) {
  uint16_t* words = reinterpret_cast<uint16_t*>(local);
  const uint16_t v = uint16_t(sycl::bit_cast<uint32_t>(code_value) >> 16);
  words[lane] = v;
  words[16 + lane] = v;
  words[32 + lane] = uint16_t(2 * lane);
  words[48 + lane] = uint16_t(2 * lane);
  words[64 + lane] = uint16_t(2 * lane + 1);
  words[80 + lane] = uint16_t(2 * lane + 1);
  words[96 + lane] = 0;
  words[112 + lane] = 4;
  words[128 + lane] = 8;
  words[144 + lane] = 12;
  if (e8m0)
    for (int s = lane; s < 256; s += kLanes)
      local[kNibbleE8m0 + s] = sycl::bit_cast<float>(s == 0 ? 0x00400000u : s == 255 ? 0x7fc00000u : uint32_t(s) << 23);
}

}  // namespace moe_xpu

// The 4-bit dot-product kernel needs the quantized kernels' formats (moe_gemm_quant.cpp, before
// this file in the quantized bundles).
#ifdef MOE_XPU_QUANT_KERNEL_PARAMS
namespace moe_xpu {

// The weight-decoding kernels' 4 x 4 tile epilogue: lane l holds tile element l's finished sum s
// (row l / 4, column l % 4) and stores output (row, column) of its row tile at m0, n0; Gated: the
// activation of the gate sum of lanes with column 0, 1 times the up sum of the lane 2 on, the outputs
// 2 columns wide. Every lane calls it (the up sums cross lanes).
template <bool Gated, typename TOut>
inline void store_dot4_output(const Worker& w, float s, int activation, int64_t valid, int64_t n0, int64_t N,
                              int64_t m0, TOut* out, int64_t out_row_stride, int64_t out_rows,
                              const void* scatter_index, int scatter_is64, const float* row_weight) {
  constexpr int out_cols = Gated ? kNibbleCols / 2 : kNibbleCols;
  const int i = w.lane / kNibbleCols, c = w.lane % kNibbleCols;
  float r = s;
  if constexpr (Gated)  // the up sum of (i, c) is lane i * 4 + c + 2's
    r = activate(activation, s) * sycl::select_from_group(w.sg, s, uint32_t(w.lane + 2) % kLanes);
  if (i < valid && c < out_cols && n0 + c < N) {
    const RowTarget t = row_target(scatter_index, scatter_is64, row_weight, m0 + i, out_rows);
    out[t.row * out_row_stride + n0 + c] = FromFloat<TOut>::convert(r * t.weight);
  }
}

// int4 (one zero point for the launch: the symmetric constant or one given) or MXFP4 B in the
// packed layout, bf16 A, float32 scales contiguous along K (one per group of 32, 64 or 128 k) or
// e8m0 ones: the quantized kernels' parameters. Whole blocks of 128 k run in the assembly
// (nibble_tile_sums); a last short block is summed by the lanes, one tile column each, in float.
// Units as for every family (the scheduler's), 4 x 4 tiles: 4 adjacent columns (half a chunk), or
// Gated: 2 gate columns and their 2 up columns (up_offset on; N and up_offset even, so each pair
// lies in one chunk), whose lanes apply the activation to the gate sum times the up sum.
template <typename Fmt, typename TOut, bool Gated>
MOE_XPU_KERNEL
void moe_gemm_nibble_dot(const uint16_t* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                         int gather_is64, const void* b, int64_t b_stride_e, int64_t b_stride_n,
                         int64_t /*b_stride_k*/, const void* scale, int64_t scale_stride_e,
                         int64_t scale_stride_n, int64_t /*scale_stride_k: 1*/, int64_t /*scale_block_n: 1*/,
                         int64_t scale_block_k, const uint8_t* zero, int64_t, int64_t, int64_t,
                         const float*, const float* bias, int64_t bias_stride_e, TOut* out,
                         int64_t out_row_stride, int64_t out_rows, const void* group_offsets, int offsets_is64,
                         int64_t num_groups, int64_t K, int64_t N, int activation, int64_t up_offset,
                         const void* scatter_index, int scatter_is64, const float* row_weight) {
  constexpr int TM = kNibbleRows, TN = kNibbleCols;
  constexpr int out_cols = Gated ? TN / 2 : TN;
  constexpr bool e8m0 = Fmt::kScaleBytes == 1;
  static_assert(TM * TN == kLanes, "the tile's sums are one per lane");
  const Worker w = this_worker();
  const int64_t tiles_n = (N + out_cols - 1) / out_cols;
  const int64_t blocks = K / kPackedK;
  const int64_t k_blocks = blocks * kPackedK;
  const float z = Fmt::kZeroPoints ? float(zero[0]) : 0.0f;
  float* local = local_floats<kNibbleLocal>();
  nibble_constants(local, w.lane, Fmt::value(uint32_t(w.lane), z), e8m0);
  sycl::group_barrier(w.sg);
  const uint32_t* words = static_cast<const uint32_t*>(b);
  const char* scales = static_cast<const char*>(scale);
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, kUnitRows / TM, tiles_n,
      UnitCost{int64_t(TM) * TN, int64_t(TN) * 7 * 4 / 8},
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        const int64_t n0 = n_tile * out_cols;
        int64_t b_n[TN];  // the B column behind accumulator column j (past N: the last one)
        for (int j = 0; j < TN; ++j) b_n[j] = tile_b_column<TN, Gated>(n0, j, N, up_offset);
        // Each pair's packed words: columns past N stay in the padded chunk (n0 % 4 == 0, or even
        // gated columns), where the scales repeat the last column's.
        const uint32_t* pair_words[2] = {words + packed_column(g, n0, b_stride_e, b_stride_n),
                                         words + packed_column(g, Gated ? n0 + up_offset : n0 + 2, b_stride_e, b_stride_n)};
        const char* s_col[TN];
        for (int j = 0; j < TN; ++j) s_col[j] = scales + (g * scale_stride_e + b_n[j] * scale_stride_n) * Fmt::kScaleBytes;
        for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
          const int64_t m0 = row_begin + m_tile * TM;
          const int64_t valid = tile_valid_rows(rows, m_tile, TM);
          auto a_row = [&](int i) {
            return tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, i);
          };
          if (g < num_groups && blocks > 0) {
            const uint16_t* a_end[TM];
            for (int i = 0; i < TM; ++i) a_end[i] = a_row(i) + k_blocks;
            const char* b_end = reinterpret_cast<const char*>(pair_words[0] + blocks * kPackedBlockWords);
            const char* bu_end = reinterpret_cast<const char*>(pair_words[1] + blocks * kPackedBlockWords);
            const bool lead = w.lane == 0;  // under branches the whole sub-group takes (kernel_leader_runs)
            if (lead) reinterpret_cast<int32_t*>(local)[kNibbleRowCount] = int32_t(valid);
            if (e8m0) {
              if (lead) nibble_tile_sums<4, true>(local, a_end, b_end, bu_end, blocks, s_col);
            } else if (scale_block_k >= kPackedK) {
              if (lead) nibble_tile_sums<1, false>(local, a_end, b_end, bu_end, blocks, s_col);
            } else if (scale_block_k == 64) {
              if (lead) nibble_tile_sums<2, false>(local, a_end, b_end, bu_end, blocks, s_col);
            } else if (lead) {
              nibble_tile_sums<4, false>(local, a_end, b_end, bu_end, blocks, s_col);
            }
            sycl::group_barrier(w.sg);
          }
          // Lane l: tile element l's sum (row l / 4, column l % 4) with the short last block's
          // products and the bias; lane i * 4 + j then stores output (i, j).
          const int i = w.lane / TN, c = w.lane % TN;
          float s = 0.0f;
          if (g < num_groups) {
            if (blocks > 0) s = local[kNibbleSums + w.lane];
            const uint16_t* ar = a_row(i);
            const uint32_t* col = pair_words[c / 2] + (c % 2) * kLanes + blocks * kPackedBlockWords;
            for (int64_t k = k_blocks; k < K; ++k) {
              const uint32_t q = (col[k % kLanes] >> (4 * ((k - k_blocks) / kLanes))) & 0xfu;
              const float sc = Fmt::scale(scales, g * scale_stride_e + b_n[c] * scale_stride_n + k / scale_block_k);
              s = sycl::fma(to_float(ar[k]), Fmt::value(q, z) * sc, s);
            }
            if (bias != nullptr) s += bias[g * bias_stride_e + b_n[c]];
          }
          store_dot4_output<Gated>(w, s, activation, valid, n0, N, m0, out, out_row_stride, out_rows, scatter_index,
                                   scatter_is64, row_weight);
          sycl::group_barrier(w.sg);  // the sums are read before the next tile overwrites them
        }
      });
}

// fp8 e4m3 B contiguous along K with bf16 A (fp8_tile_sums): the quantized kernels' parameters.
// Scales one per output channel (scale_block_k >= K: each column's sum scaled once here) or per
// 128 x 128 block (scale_block_k == 128, the blocks contiguous along K; the tile's 4 columns, or a
// gated tile's gate pair and its up pair, each inside one block row). Whole blocks of 128 k in the
// assembly; the rest of K by the lanes in float. Gated: 2 gate and 2 up columns a tile, as in
// moe_gemm_nibble_dot.
template <typename TOut, bool Gated>
MOE_XPU_KERNEL
void moe_gemm_fp8_dot(const uint16_t* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                      int gather_is64, const void* b, int64_t b_stride_e, int64_t b_stride_n,
                      int64_t /*b_stride_k: 1*/, const void* scale, int64_t scale_stride_e,
                      int64_t scale_stride_n, int64_t scale_stride_k, int64_t scale_block_n,
                      int64_t scale_block_k, const uint8_t*, int64_t, int64_t, int64_t,
                      const float*, const float* bias, int64_t bias_stride_e, TOut* out,
                      int64_t out_row_stride, int64_t out_rows, const void* group_offsets, int offsets_is64,
                      int64_t num_groups, int64_t K, int64_t N, int activation, int64_t up_offset,
                      const void* scatter_index, int scatter_is64, const float* row_weight) {
  constexpr int TM = kNibbleRows, TN = kNibbleCols;
  constexpr int out_cols = Gated ? TN / 2 : TN;
  const Worker w = this_worker();
  const int64_t tiles_n = (N + out_cols - 1) / out_cols;
  const int64_t blocks = K / 128;
  const int64_t k_blocks = blocks * 128;
  const bool per_channel = scale_block_k >= K;
  float* local = local_floats<kNibbleLocal>();
  fp8_constants(local, w.lane);
  sycl::group_barrier(w.sg);
  const uint8_t* bytes = static_cast<const uint8_t*>(b);
  const float* scales = static_cast<const float*>(scale);
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, kUnitRows / TM, tiles_n,
      UnitCost{int64_t(TM) * TN, int64_t(TN) * 7},
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        const int64_t n0 = n_tile * out_cols;
        int64_t b_n[TN];
        const uint8_t* b_col[TN];
        for (int j = 0; j < TN; ++j) {
          b_n[j] = tile_b_column<TN, Gated>(n0, j, N, up_offset);
          b_col[j] = bytes + g * b_stride_e + b_n[j] * b_stride_n;
        }
        const float* scale_row = scales + g * scale_stride_e + (b_n[0] / scale_block_n) * scale_stride_n;
        const float* scale_row_up = scales + g * scale_stride_e + (b_n[2] / scale_block_n) * scale_stride_n;
        for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
          const int64_t m0 = row_begin + m_tile * TM;
          const int64_t valid = tile_valid_rows(rows, m_tile, TM);
          auto a_row = [&](int i) {
            return tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, i);
          };
          if (g < num_groups && blocks > 0) {
            const uint16_t* a_end[TM];
            for (int i = 0; i < TM; ++i) a_end[i] = a_row(i) + k_blocks;
            const bool lead = w.lane == 0;  // under branches the whole sub-group takes (kernel_leader_runs)
            if (lead) reinterpret_cast<int32_t*>(local)[kNibbleRowCount] = int32_t(valid);
            if (per_channel) {
              if (lead) fp8_tile_sums<false>(local, a_end, b_col, blocks, scale_row, scale_row_up);
            } else if (lead) {
              fp8_tile_sums<true>(local, a_end, b_col, blocks, scale_row, scale_row_up);
            }
            sycl::group_barrier(w.sg);
          }
          // Lane l: tile element l's sum (row l / 4, column l % 4), its K rest, scale and bias; lane
          // i * 4 + j then stores output (i, j) (gated: the activation of its gate sum times lane
          // i * 4 + j + 2's up sum).
          const int i = w.lane / TN, c = w.lane % TN;
          float s = 0.0f;
          if (g < num_groups) {
            const float* col_scales = scales + g * scale_stride_e + (b_n[c] / scale_block_n) * scale_stride_n;
            if (blocks > 0) s = local[kNibbleSums + w.lane];
            const uint16_t* ar = a_row(i);
            for (int64_t k = k_blocks; k < K; ++k) {
              const float v = Fp8Weights::value(b_col[c][k], 0.0f);
              s = sycl::fma(to_float(ar[k]), per_channel ? v : v * col_scales[(k / scale_block_k) * scale_stride_k], s);
            }
            if (per_channel) s *= col_scales[0];
            if (bias != nullptr) s += bias[g * bias_stride_e + b_n[c]];
          }
          store_dot4_output<Gated>(w, s, activation, valid, n0, N, m0, out, out_row_stride, out_rows, scatter_index,
                                   scatter_is64, row_weight);
          sycl::group_barrier(w.sg);  // the sums are read before the next tile overwrites them
        }
      });
}

}  // namespace moe_xpu
#endif

#ifdef MOE_XPU_DOT_PROBE
// The launcher's check, before it lets a device use this family (launcher.cpp: bf16_dot_status):
// one tile's sums over k elements of A rows a (4 x k) and B columns b (6 x k), computed as the
// kernels compute them (lane 0 runs the assembly, the lanes read the sums from local memory).
extern "C" MOE_XPU_KERNEL_WITH_LANES(moe_xpu::kLanes)
void moe_xpu_dot_probe(const uint16_t* a, const uint16_t* b, float* out, int64_t k) {
  using namespace moe_xpu;
  const Worker w = this_worker();
  float* sums = local_floats<kDotSums>();
  const uint16_t* a_end[kDotRows];
  const uint16_t* b_end[kDotCols];
  for (int i = 0; i < kDotRows; ++i) a_end[i] = a + i * k + k;
  for (int j = 0; j < kDotCols; ++j) b_end[j] = b + j * k + k;
  if (w.lane == 0) {
    reinterpret_cast<int32_t*>(sums)[kDotRowCount] = kDotRows;
    dot_tile_sums(sums, a_end, b_end, k, b);
  }
  sycl::group_barrier(w.sg);
  for (int o = w.lane; o < kDotRows * kDotCols; o += kLanes) out[o] = sums[o];
}

// ... and the N-contiguous one's: a (6 x k, rows contiguous) times b (k x 64, rows contiguous),
// k even, out[i * 64 + c] in column order (the unpacks' lane order undone as the kernel does).
extern "C" MOE_XPU_KERNEL_WITH_LANES(moe_xpu::kLanes)
void moe_xpu_n_dot_probe(const uint16_t* a, const uint16_t* b, float* out, int64_t k) {
  using namespace moe_xpu;
  const Worker w = this_worker();
  float* sums = local_floats<kNDotSums>();
  const uint16_t* a_end[kNDotRows];
  for (int i = 0; i < kNDotRows; ++i) a_end[i] = a + i * k + k;
  if (w.lane == 0) n_dot_tile_sums<kNDotRows>(sums, a_end, b, kNDotCols * 2, k / 2);
  sycl::group_barrier(w.sg);
  for (int o = w.lane; o < kNDotRows * kNDotCols; o += kLanes)
    out[o] = sums[n_dot_sum_index(o / kNDotCols, o % kNDotCols)];
}

// ... and the W8A8 kernel's: one tile's exact int32 sums over k (a multiple of 64) int8 elements,
// the tile sums less 128 x the column sums, as moe_gemm_quant_dot combines them.
extern "C" MOE_XPU_KERNEL_WITH_LANES(moe_xpu::kLanes)
void moe_xpu_int8_dot_probe(const int8_t* a, const int8_t* b, int32_t* out, int64_t k) {
  using namespace moe_xpu;
  const Worker w = this_worker();
  float* local = local_floats<kDotSums * 2>();
  int32_t* sums = reinterpret_cast<int32_t*>(local);
  int32_t* column_sums = reinterpret_cast<int32_t*>(local + kDotSums);
  const int8_t* a_end[kDotRows];
  const int8_t* b_end[kDotCols];
  for (int i = 0; i < kDotRows; ++i) a_end[i] = a + i * k + k;
  for (int j = 0; j < kDotCols; ++j) b_end[j] = b + j * k + k;
  if (w.lane == 0) {
    dot_int8_column_sums(column_sums, b_end, k, b);
    sums[kDotRowCount] = kDotRows;
    dot_int8_tile_sums(sums, a_end, b_end, k);
  }
  sycl::group_barrier(w.sg);
  for (int o = w.lane; o < kDotRows * kDotCols; o += kLanes) out[o] = sums[o] - 128 * column_sums[o % kDotCols];
}

// ... and the 4-bit kernel's: one 4 x 4 tile over k (a multiple of 128) for each scale form. b
// holds the packed lines (k / 128 blocks of 512 bytes: a chunk of 8 columns, the tile's its first
// 4), then each column's k / 32 float32 scales, then each column's k / 32 e8m0 bytes;
// out[16 v + 4 i + j] for v = 0..3: int4 (values q - 8) with one float scale a block, two, four,
// and e2m1 values with the e8m0 scales.
extern "C" MOE_XPU_KERNEL_WITH_LANES(moe_xpu::kLanes)
void moe_xpu_nibble_dot_probe(const uint16_t* a, const uint16_t* b, float* out, int64_t k) {
  using namespace moe_xpu;
  const Worker w = this_worker();
  float* local = local_floats<kNibbleLocal>();
  const int64_t blocks = k / 128;
  const uint16_t* a_end[kNibbleRows];
  for (int i = 0; i < kNibbleRows; ++i) a_end[i] = a + i * k + k;
  const char* b_end = reinterpret_cast<const char*>(b) + blocks * 512;
  const char* f32 = b_end;
  const char* e8 = f32 + kNibbleCols * (k / 32) * 4;
  constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int v = 0; v < 4; ++v) {
    const int l = w.lane;
    const float value = v < 3 ? float(l - 8) : (l & 8 ? -kE2m1[l & 7] : kE2m1[l & 7]);
    nibble_constants(local, l, value, v == 3);
    sycl::group_barrier(w.sg);
    const char* s[kNibbleCols];
    for (int j = 0; j < kNibbleCols; ++j) s[j] = v == 3 ? e8 + j * (k / 32) : f32 + j * (k / 32) * 4;
    if (w.lane == 0) {
      reinterpret_cast<int32_t*>(local)[kNibbleRowCount] = kNibbleRows;
      if (v == 0) nibble_tile_sums<1, false>(local, a_end, b_end, b_end + 128, blocks, s);
      else if (v == 1) nibble_tile_sums<2, false>(local, a_end, b_end, b_end + 128, blocks, s);
      else if (v == 2) nibble_tile_sums<4, false>(local, a_end, b_end, b_end + 128, blocks, s);
      else nibble_tile_sums<4, true>(local, a_end, b_end, b_end + 128, blocks, s);
    }
    sycl::group_barrier(w.sg);
    out[16 * v + w.lane] = local[kNibbleSums + w.lane];
    sycl::group_barrier(w.sg);
  }
  // fp8: the columns' k e4m3 bytes after the e8m0 scales, unscaled (v = 4) and with the first
  // column's float scales one a block (v = 5).
  const uint8_t* fp8 = reinterpret_cast<const uint8_t*>(e8 + kNibbleCols * (k / 32));
  const uint8_t* cols[kNibbleCols];
  for (int j = 0; j < kNibbleCols; ++j) cols[j] = fp8 + j * k;
  fp8_constants(local, w.lane);
  sycl::group_barrier(w.sg);
  for (int v = 4; v < 6; ++v) {
    if (w.lane == 0) {
      reinterpret_cast<int32_t*>(local)[kNibbleRowCount] = kNibbleRows;
      const float* scale = reinterpret_cast<const float*>(f32);
      if (v == 4) fp8_tile_sums<false>(local, a_end, cols, blocks, scale, scale);
      else fp8_tile_sums<true>(local, a_end, cols, blocks, scale, scale);
    }
    sycl::group_barrier(w.sg);
    out[16 * v + w.lane] = local[kNibbleSums + w.lane];
    sycl::group_barrier(w.sg);
  }
}
#endif

// Appended by the launcher after moe_gemm.cpp (whose MOE_XPU_KERNEL_PARAMS it uses), e.g.
// MOE_XPU_INSTANTIATE_K_DOT(uint16_t, 4, 6, false) for "moe_xpu::moe_gemm_k_dot<uint16_t, 4, 6, false>",
// or after moe_gemm_quant.cpp (MOE_XPU_QUANT_KERNEL_PARAMS), e.g. MOE_XPU_INSTANTIATE_QUANT_DOT(uint16_t, 4, 6).
#define MOE_XPU_INSTANTIATE_FP8_DOT(TOut, GATED) \
  template void moe_xpu::moe_gemm_fp8_dot<TOut, GATED>(MOE_XPU_QUANT_KERNEL_PARAMS(uint16_t, TOut));
#define MOE_XPU_INSTANTIATE_NIBBLE_DOT(FMT, TOut, GATED) \
  template void moe_xpu::moe_gemm_nibble_dot<FMT, TOut, GATED>(MOE_XPU_QUANT_KERNEL_PARAMS(uint16_t, TOut));
#define MOE_XPU_INSTANTIATE_QUANT_DOT(TOut, TM, TN) \
  template void moe_xpu::moe_gemm_quant_dot<TOut, TM, TN>(MOE_XPU_QUANT_KERNEL_PARAMS(int8_t, TOut));
#define MOE_XPU_INSTANTIATE_N_DOT(TOut) \
  template void moe_xpu::moe_gemm_n_dot<TOut>(MOE_XPU_KERNEL_PARAMS(uint16_t, uint16_t, TOut), void*);
#define MOE_XPU_INSTANTIATE_K_DOT(TOut, TM, TN, GATED) \
  template void moe_xpu::moe_gemm_k_dot<TOut, TM, TN, GATED>(MOE_XPU_KERNEL_PARAMS(uint16_t, uint16_t, TOut));
#define MOE_XPU_INSTANTIATE_DOT_WGRAD(TOut)                                                                     \
  template void moe_xpu::moe_gemm_dot_wgrad<TOut>(const uint16_t*, int64_t, int64_t, const void*, int,         \
                                                  const uint16_t*, int64_t, int64_t, const void*, int, int64_t, \
                                                  int64_t, int64_t, TOut*, int64_t, int64_t, int64_t, int, void*);

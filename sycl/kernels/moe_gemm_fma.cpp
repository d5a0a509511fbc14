// moe_xpu's FMA dot-product kernel family for CPUs without a bf16 dot-product instruction or a
// matrix engine for the call, for B contiguous along K (nn.Linear weights) with float32 A: x86
// assembly on AVX2 (16 registers of 8 floats; float32, bf16 or fp16 B) and on AVX-512 (32 of 16;
// bf16 or fp16 B); and on AVX2 for B contiguous along N ([E, K, N] weights), moe_gemm_n_fma below.
//
// On AVX2 a 16-lane sub-group vector takes two registers, so the vector K-split kernel
// (moe_gemm.cpp: k_lanes) holds at most 3 x 2 (row, column) pairs and loads five vectors for every
// six FMAs: bound by its loads. This family's k loop is x86 assembly (carried through SPIR-V as
// moe_gemm_dot.cpp's is) on whole registers: on AVX2 a 3 x 4 tile of 12 accumulators, the tile's
// three A vectors and one B vector, so a k step of 8 loads 7 vectors for 12 FMAs; on AVX-512 the
// dot-product kernels' 4 x 6 tile (assembly_tile.hpp), a k step of 16 loading 10 vectors for 24
// FMAs, each 16-bit B vector widened once for 4 rows; there the vector kernel's loop is the same
// kind of loop, and the gain is mostly the tile's fit (groups of 8 rows: two 4-row tiles where the
// vector kernel runs a 6-row and a 2-row one; docs/performance_targets.md).
//
// As in moe_gemm_dot.cpp, lane 0 of each sub-group runs its worker's assembly, the tile's sums
// pass through work-group local memory, and the 16 lanes share the epilogue (assembly_tile.hpp).
// Lane l of accumulator (i, j) sums the products of k = W s + l over the steps s (W = 8 or 16,
// the floats of a register), the lanes are added by halves afterwards, and the last K % W
// elements with float FMAs: a fixed order, so results are bitwise reproducible (the vector
// kernels' lanes sum in the same order: on the cases measured the outputs were bitwise equal).
//
// Only compiled where the device description says the CPU runs this code and the CPU target's
// vectors are 8 floats wide (AVX2, FMA and F16C) or 16 (AVX-512F) (DeviceDescription::fma_dot);
// never for a GPU.
#include "assembly_tile.hpp"

namespace moe_xpu {

// (The tiles, fma_rows x fma_cols, and their sums' floats are in sizes.hpp, shared with the launcher.)

// B's k step for column j into ymm15, per B type: offsets run in units of 2 bytes a k element,
// so float rows are addressed at scale 2 and 16-bit rows at scale 1.
#define MOE_XPU_FMA_LOAD_FLOAT(j) "vmovups (%[b" #j "],%[ko],2), %%ymm15\n\t"
#define MOE_XPU_FMA_LOAD_BF16(j) "vpmovzxwd (%[b" #j "],%[ko]), %%ymm15\n\t" "vpslld $16, %%ymm15, %%ymm15\n\t"
#define MOE_XPU_FMA_LOAD_HALF(j) "vcvtph2ps (%[b" #j "],%[ko]), %%ymm15\n\t"
#define MOE_XPU_FMA_A(i, r) "vmovups (%[a" #i "],%[ko],2), %%ymm" #r "\n\t"
#define MOE_XPU_FMA(ra, r) "vfmadd231ps %%ymm15, %%ymm" #ra ", %%ymm" #r "\n\t"
// One column's B vector against the tile's R rows (A in ymm12-14); accumulator (i, j) is ymm(4 i + j).
#define MOE_XPU_FMA_COL1(LOAD, j) LOAD(j) MOE_XPU_FMA(12, j)
#define MOE_XPU_FMA_COL2(LOAD, j, r1) MOE_XPU_FMA_COL1(LOAD, j) MOE_XPU_FMA(13, r1)
#define MOE_XPU_FMA_COL3(LOAD, j, r1, r2) MOE_XPU_FMA_COL2(LOAD, j, r1) MOE_XPU_FMA(14, r2)
#define MOE_XPU_FMA_STEP1(LOAD) \
  MOE_XPU_FMA_A(0, 12) MOE_XPU_FMA_COL1(LOAD, 0) MOE_XPU_FMA_COL1(LOAD, 1) MOE_XPU_FMA_COL1(LOAD, 2) MOE_XPU_FMA_COL1(LOAD, 3)
#define MOE_XPU_FMA_STEP2(LOAD)                                                                 \
  MOE_XPU_FMA_A(0, 12) MOE_XPU_FMA_A(1, 13) MOE_XPU_FMA_COL2(LOAD, 0, 4) MOE_XPU_FMA_COL2(LOAD, 1, 5) \
  MOE_XPU_FMA_COL2(LOAD, 2, 6) MOE_XPU_FMA_COL2(LOAD, 3, 7)
#define MOE_XPU_FMA_STEP3(LOAD)                                                                        \
  MOE_XPU_FMA_A(0, 12) MOE_XPU_FMA_A(1, 13) MOE_XPU_FMA_A(2, 14) MOE_XPU_FMA_COL3(LOAD, 0, 4, 8)                  \
  MOE_XPU_FMA_COL3(LOAD, 1, 5, 9) MOE_XPU_FMA_COL3(LOAD, 2, 6, 10) MOE_XPU_FMA_COL3(LOAD, 3, 7, 11)
#define MOE_XPU_FMA_ZERO(r) "vxorps %%ymm" #r ", %%ymm" #r ", %%ymm" #r "\n\t"
#define MOE_XPU_FMA_ZERO_ROW(i0, i1, i2, i3) MOE_XPU_FMA_ZERO(i0) MOE_XPU_FMA_ZERO(i1) MOE_XPU_FMA_ZERO(i2) MOE_XPU_FMA_ZERO(i3)
// Accumulator r's 8 lanes summed (halves added: 4, 2, 1 lanes) into sums[r].
#define MOE_XPU_FMA_SUM(r)                                                                      \
  "vextractf128 $1, %%ymm" #r ", %%xmm15\n\t" "vaddps %%xmm15, %%xmm" #r ", %%xmm" #r "\n\t"     \
  "vpermilps $0x4e, %%xmm" #r ", %%xmm15\n\t" "vaddps %%xmm15, %%xmm" #r ", %%xmm" #r "\n\t"     \
  "vpermilps $0xb1, %%xmm" #r ", %%xmm15\n\t" "vaddss %%xmm15, %%xmm" #r ", %%xmm" #r "\n\t"     \
  "vmovss %%xmm" #r ", " #r "*4(%[sums])\n\t"
#define MOE_XPU_FMA_SUM_ROW(i0, i1, i2, i3) MOE_XPU_FMA_SUM(i0) MOE_XPU_FMA_SUM(i1) MOE_XPU_FMA_SUM(i2) MOE_XPU_FMA_SUM(i3)
#define MOE_XPU_FMA_ZERO1 MOE_XPU_FMA_ZERO_ROW(0, 1, 2, 3)
#define MOE_XPU_FMA_ZERO2 MOE_XPU_FMA_ZERO1 MOE_XPU_FMA_ZERO_ROW(4, 5, 6, 7)
#define MOE_XPU_FMA_ZERO3 MOE_XPU_FMA_ZERO2 MOE_XPU_FMA_ZERO_ROW(8, 9, 10, 11)
#define MOE_XPU_FMA_SUMS1 MOE_XPU_FMA_SUM_ROW(0, 1, 2, 3)
#define MOE_XPU_FMA_SUMS2 MOE_XPU_FMA_SUMS1 MOE_XPU_FMA_SUM_ROW(4, 5, 6, 7)
#define MOE_XPU_FMA_SUMS3 MOE_XPU_FMA_SUMS2 MOE_XPU_FMA_SUM_ROW(8, 9, 10, 11)

// The tile's R rows over k in [0, k_full), k_full a positive multiple of 8: sums[i * 4 + j]. With
// 16-bit B each k step also asks for the next lines, into L2, of the B rows from `next` on (the
// worker's next unit's rows: its next column tile), one line for every line of B the step reads,
// so they arrive while this unit computes. Float B, twice the bytes a step, streams faster
// without: the hardware prefetchers keep up with it, and the extra requests compete with its
// loads. a_end[i] and b_end[j] point k_full elements past the start of A row i and B column j:
// the loop runs a negative offset up to zero.
#define MOE_XPU_FMA_TILE(R, LOAD, PREFETCH)                                                                    \
  asm volatile(MOE_XPU_FMA_ZERO##R "1:\n\t" PREFETCH MOE_XPU_FMA_STEP##R(LOAD) "add $16, %[ko]\n\t"             \
               "jnz 1b\n\t" MOE_XPU_FMA_SUMS##R                                                                 \
               : [ko] "+r"(ko), [pn] "+r"(pn)                                                                   \
               : [a0] "r"(a_end[0]), [a1] "r"(a_end[1]), [a2] "r"(a_end[2]), [b0] "r"(b_end[0]),                \
                 [b1] "r"(b_end[1]), [b2] "r"(b_end[2]), [b3] "r"(b_end[3]), [sums] "r"(sums)                   \
               : "memory", "cc", "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", \
                 "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15")
#define MOE_XPU_FMA_AHEAD1 "prefetcht1 (%[pn])\n\t" "add $64, %[pn]\n\t"
#define MOE_XPU_FMA_AHEAD2 MOE_XPU_FMA_AHEAD1 MOE_XPU_FMA_AHEAD1
// The row-count branch on the whole sub-group, `run` (lane 0) inside it: see kernel_leader_runs
// in assembly_tile.hpp.
#define MOE_XPU_FMA_TILES(LOAD, PREFETCH)                  \
  if (rows == 1) {                                         \
    if (run) MOE_XPU_FMA_TILE(1, LOAD, PREFETCH);          \
  } else if (rows == 2) {                                  \
    if (run) MOE_XPU_FMA_TILE(2, LOAD, PREFETCH);          \
  } else if (run) {                                        \
    MOE_XPU_FMA_TILE(3, LOAD, PREFETCH);                   \
  }

template <typename T>
inline void fma_tile_sums(bool run, float* sums, int64_t rows, const float* const (&a_end)[kFmaRows],
                          const T* const (&b_end)[kFmaCols], int64_t k_full, const void* next) {
  int64_t ko = -2 * k_full;
  const char* pn = static_cast<const char*>(next);
  if constexpr (std::is_same_v<T, float>) {
    MOE_XPU_FMA_TILES(MOE_XPU_FMA_LOAD_FLOAT, "")
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    MOE_XPU_FMA_TILES(MOE_XPU_FMA_LOAD_BF16, MOE_XPU_FMA_AHEAD1)
  } else {
    MOE_XPU_FMA_TILES(MOE_XPU_FMA_LOAD_HALF, MOE_XPU_FMA_AHEAD1)
  }
}

// The decode tile: one row against 8 columns (accumulators ymm0-7, A in ymm12), float B read by
// the FMAs themselves, 16-bit B widened into ymm15 first (and the next unit's lines asked for at
// the rate the step reads its own, as in the 3 x 4 tile).
#define MOE_XPU_FMA_ROW_FLOAT(j) "vfmadd231ps (%[b" #j "],%[ko],2), %%ymm12, %%ymm" #j "\n\t"
#define MOE_XPU_FMA_ROW_BF16(j) MOE_XPU_FMA_COL1(MOE_XPU_FMA_LOAD_BF16, j)
#define MOE_XPU_FMA_ROW_HALF(j) MOE_XPU_FMA_COL1(MOE_XPU_FMA_LOAD_HALF, j)
#define MOE_XPU_FMA_ROW_TILE(COL, PREFETCH)                                                                    \
  asm volatile(MOE_XPU_FMA_ZERO_ROW(0, 1, 2, 3) MOE_XPU_FMA_ZERO_ROW(4, 5, 6, 7) "1:\n\t" PREFETCH               \
               MOE_XPU_FMA_A(0, 12) COL(0) COL(1) COL(2) COL(3) COL(4) COL(5) COL(6) COL(7)                      \
               "add $16, %[ko]\n\t" "jnz 1b\n\t" MOE_XPU_FMA_SUM_ROW(0, 1, 2, 3) MOE_XPU_FMA_SUM_ROW(4, 5, 6, 7) \
               : [ko] "+r"(ko), [pn] "+r"(pn)                                                                   \
               : [a0] "r"(a_end[0]), [b0] "r"(b_end[0]), [b1] "r"(b_end[1]), [b2] "r"(b_end[2]),                \
                 [b3] "r"(b_end[3]), [b4] "r"(b_end[4]), [b5] "r"(b_end[5]), [b6] "r"(b_end[6]),                \
                 [b7] "r"(b_end[7]), [sums] "r"(sums)                                                           \
               : "memory", "cc", "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm12", "ymm15")

// One row's sums against 8 columns over k in [0, k_full), as fma_tile_sums: sums[j].
template <typename T>
inline void fma_row_sums(float* sums, const float* const (&a_end)[1], const T* const (&b_end)[kFmaRowCols],
                         int64_t k_full, const void* next) {
  int64_t ko = -2 * k_full;
  const char* pn = static_cast<const char*>(next);
  if constexpr (std::is_same_v<T, float>) {
    MOE_XPU_FMA_ROW_TILE(MOE_XPU_FMA_ROW_FLOAT, "");
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    MOE_XPU_FMA_ROW_TILE(MOE_XPU_FMA_ROW_BF16, MOE_XPU_FMA_AHEAD2);
  } else {
    MOE_XPU_FMA_ROW_TILE(MOE_XPU_FMA_ROW_HALF, MOE_XPU_FMA_AHEAD2);
  }
}

#undef MOE_XPU_FMA_ROW_TILE
#undef MOE_XPU_FMA_ROW_HALF
#undef MOE_XPU_FMA_ROW_BF16
#undef MOE_XPU_FMA_ROW_FLOAT
#undef MOE_XPU_FMA_TILES
#undef MOE_XPU_FMA_AHEAD2
#undef MOE_XPU_FMA_AHEAD1
#undef MOE_XPU_FMA_TILE
#undef MOE_XPU_FMA_SUMS3
#undef MOE_XPU_FMA_SUMS2
#undef MOE_XPU_FMA_SUMS1
#undef MOE_XPU_FMA_ZERO3
#undef MOE_XPU_FMA_ZERO2
#undef MOE_XPU_FMA_ZERO1
#undef MOE_XPU_FMA_SUM_ROW
#undef MOE_XPU_FMA_SUM
#undef MOE_XPU_FMA_ZERO_ROW
#undef MOE_XPU_FMA_ZERO
#undef MOE_XPU_FMA_STEP3
#undef MOE_XPU_FMA_STEP2
#undef MOE_XPU_FMA_STEP1
#undef MOE_XPU_FMA_COL3
#undef MOE_XPU_FMA_COL2
#undef MOE_XPU_FMA_COL1
#undef MOE_XPU_FMA
#undef MOE_XPU_FMA_A
#undef MOE_XPU_FMA_LOAD_HALF
#undef MOE_XPU_FMA_LOAD_BF16
#undef MOE_XPU_FMA_LOAD_FLOAT

// AVX-512 (16-bit B only: with float32 B the vector kernels' k loop, a 16-lane vector a register,
// is this loop already): B's k step for column j into zmm r (offsets in 2-byte units as above).
#define MOE_XPU_FMA16_BF16(j, r) "vpmovzxwd (%[b" #j "],%[ko]), %%zmm" #r "\n\t" "vpslld $16, %%zmm" #r ", %%zmm" #r "\n\t"
#define MOE_XPU_FMA16_HALF(j, r) "vcvtph2ps (%[b" #j "],%[ko]), %%zmm" #r "\n\t"
#define MOE_XPU_FMA16_B_STEP(LOAD) LOAD(0, 24) LOAD(1, 25) LOAD(2, 26) LOAD(3, 27) LOAD(4, 28) LOAD(5, 29)
#define MOE_XPU_FMA16_ROW(i, r0, r1, r2, r3, r4, r5) \
  "vmovups (%[a" #i "],%[ko],2), %%zmm30\n\t" MOE_XPU_DOT_ROW_DOTS("vfmadd231ps", r0, r1, r2, r3, r4, r5)

// The 4 x 6 tile's sums over k in [0, k_full), k_full a positive multiple of 16: sums[i * 6 + j],
// rows past the tile's row count (sums[kDotRowCount], written first) skipped. Pointers as for
// fma_tile_sums. No software prefetch: asking for the next unit's lines, as the AVX2 tile does,
// measured slower here on every bench case (the hardware prefetchers keep up).
#define MOE_XPU_FMA16_TILE(LOAD)                                                                               \
  asm volatile(MOE_XPU_DOT_ZERO_TILE "1:\n\t" MOE_XPU_FMA16_B_STEP(LOAD)                                          \
               MOE_XPU_FMA16_ROW(0, 0, 1, 2, 3, 4, 5) MOE_XPU_DOT_IF_TILE_ROW(1)                               \
               MOE_XPU_FMA16_ROW(1, 6, 7, 8, 9, 10, 11) MOE_XPU_DOT_IF_TILE_ROW(2)                             \
               MOE_XPU_FMA16_ROW(2, 12, 13, 14, 15, 16, 17) MOE_XPU_DOT_IF_TILE_ROW(3)                         \
               MOE_XPU_FMA16_ROW(3, 18, 19, 20, 21, 22, 23) "2:\n\t" "add $32, %[ko]\n\t" "jnz 1b\n\t"         \
               MOE_XPU_DOT_TILE_SUMS(MOE_XPU_DOT_SUM)                                                          \
               : [ko] "+r"(ko)                                                                                  \
               : [a0] "r"(a_end[0]), [a1] "r"(a_end[1]), [a2] "r"(a_end[2]), [a3] "r"(a_end[3]),                \
                 [b0] "r"(b_end[0]), [b1] "r"(b_end[1]), [b2] "r"(b_end[2]), [b3] "r"(b_end[3]),                \
                 [b4] "r"(b_end[4]), [b5] "r"(b_end[5]), [sums] "r"(sums)                                       \
               : "memory", "cc", "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", \
                 "zmm10", "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19",      \
                 "zmm20", "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "zmm30")

template <typename T>
inline void fma16_tile_sums(float* sums, int64_t rows, const float* const (&a_end)[kDotRows],
                            const T* const (&b_end)[kDotCols], int64_t k_full) {
  static_assert(!std::is_same_v<T, float>, "16-bit B");
  reinterpret_cast<int32_t*>(sums)[kDotRowCount] = int32_t(rows);
  int64_t ko = -2 * k_full;
  if constexpr (std::is_same_v<T, uint16_t>) {
    MOE_XPU_FMA16_TILE(MOE_XPU_FMA16_BF16);
  } else {
    MOE_XPU_FMA16_TILE(MOE_XPU_FMA16_HALF);
  }
}

// The AVX-512 decode tile: one row (A in zmm30) against 8 columns (accumulators zmm0-7), B widened
// into zmm24 first; no software prefetch either.
#define MOE_XPU_FMA16_ROW_BF16(j) MOE_XPU_FMA16_BF16(j, 24) "vfmadd231ps %%zmm24, %%zmm30, %%zmm" #j "\n\t"
#define MOE_XPU_FMA16_ROW_HALF(j) MOE_XPU_FMA16_HALF(j, 24) "vfmadd231ps %%zmm24, %%zmm30, %%zmm" #j "\n\t"
#define MOE_XPU_FMA16_ZERO(r) "vpxord %%zmm" #r ", %%zmm" #r ", %%zmm" #r "\n\t"
#define MOE_XPU_FMA16_ROW_TILE(COL)                                                                            \
  asm volatile(MOE_XPU_FMA16_ZERO(0) MOE_XPU_FMA16_ZERO(1) MOE_XPU_FMA16_ZERO(2) MOE_XPU_FMA16_ZERO(3)         \
               MOE_XPU_FMA16_ZERO(4) MOE_XPU_FMA16_ZERO(5) MOE_XPU_FMA16_ZERO(6) MOE_XPU_FMA16_ZERO(7)         \
               "1:\n\t" "vmovups (%[a0],%[ko],2), %%zmm30\n\t" COL(0) COL(1) COL(2) COL(3) COL(4)    \
               COL(5) COL(6) COL(7) "add $32, %[ko]\n\t" "jnz 1b\n\t" MOE_XPU_DOT_SUM(0) MOE_XPU_DOT_SUM(1)     \
               MOE_XPU_DOT_SUM(2) MOE_XPU_DOT_SUM(3) MOE_XPU_DOT_SUM(4) MOE_XPU_DOT_SUM(5) MOE_XPU_DOT_SUM(6)  \
               MOE_XPU_DOT_SUM(7)                                                                               \
               : [ko] "+r"(ko)                                                                                  \
               : [a0] "r"(a_end[0]), [b0] "r"(b_end[0]), [b1] "r"(b_end[1]), [b2] "r"(b_end[2]),                \
                 [b3] "r"(b_end[3]), [b4] "r"(b_end[4]), [b5] "r"(b_end[5]), [b6] "r"(b_end[6]),                \
                 [b7] "r"(b_end[7]), [sums] "r"(sums)                                                           \
               : "memory", "cc", "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm24",       \
                 "zmm29", "zmm30")

template <typename T>
inline void fma16_row_sums(float* sums, const float* const (&a_end)[1], const T* const (&b_end)[kFmaRowCols],
                           int64_t k_full) {
  static_assert(!std::is_same_v<T, float>, "16-bit B");
  int64_t ko = -2 * k_full;
  if constexpr (std::is_same_v<T, uint16_t>) {
    MOE_XPU_FMA16_ROW_TILE(MOE_XPU_FMA16_ROW_BF16);
  } else {
    MOE_XPU_FMA16_ROW_TILE(MOE_XPU_FMA16_ROW_HALF);
  }
}

#undef MOE_XPU_FMA16_ROW_TILE
#undef MOE_XPU_FMA16_ZERO
#undef MOE_XPU_FMA16_ROW_HALF
#undef MOE_XPU_FMA16_ROW_BF16
#undef MOE_XPU_FMA16_TILE
#undef MOE_XPU_FMA16_ROW
#undef MOE_XPU_FMA16_B_STEP
#undef MOE_XPU_FMA16_HALF
#undef MOE_XPU_FMA16_BF16

// The K-split GEMM on float A and B contiguous along K (float32, bf16 or fp16; b_stride_n: B's
// stride between columns), the vector kernels' parameters (moe_gemm.cpp: MOE_XPU_KERNEL_PARAMS)
// so that the launcher drives both alike: 16-bit A is widened once before the launch
// (LaunchPlan::widen_a), so the k loop converts only B. W is the floats of a register (8: AVX2,
// 16: AVX-512); TM x TN the plan's tile, fma_rows(W) x fma_cols(W) (gated tiles are the gate
// columns then the matching up columns), or for decode 1 x 8.
template <typename T, typename TOut, int TM, int TN, bool Gated, int W>
MOE_XPU_KERNEL
void moe_gemm_k_fma(const float* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                    int gather_is64, const T* b, int64_t b_stride_e, int64_t b_stride_n, const T* bias,
                    int64_t bias_stride_e, TOut* out, int64_t out_row_stride, int64_t out_rows,
                    const void* group_offsets, int offsets_is64, int64_t num_groups, int64_t K, int64_t N,
                    int activation, int64_t up_offset, const void* scatter_index, int scatter_is64,
                    const float* row_weight) {
  static_assert(W == 8 || W == 16, "AVX2 or AVX-512 registers");
  static_assert((TM == fma_rows(W) && TN == fma_cols(W)) || (TM == 1 && TN == kFmaRowCols),
                "the assembly is written for two register tiles a width");
  float* tile_sums = local_floats<fma_sums_floats(W)>();
  assembly_k_split<TM, TN, Gated, W>(
      a, a_row_stride, a_rows, gather_index, gather_is64, b, b_stride_e, b_stride_n, bias, bias_stride_e, out,
      out_row_stride, out_rows, group_offsets, offsets_is64, num_groups, K, N, activation, up_offset,
      scatter_index, scatter_is64, row_weight, tile_sums,
      [&](bool lead, int64_t valid, const float* const (&a_end)[TM], const T* const (&b_end)[TN],
          int64_t k_full, const T* next) {
        if constexpr (W == 8 && TM == 1) {
          if (lead) fma_row_sums(tile_sums, a_end, b_end, k_full, next);
        } else if constexpr (W == 8) {
          fma_tile_sums(lead, tile_sums, valid, a_end, b_end, k_full, next);
        } else if constexpr (TM == 1) {
          if (lead) fma16_row_sums(tile_sums, a_end, b_end, k_full);
        } else if (lead) {
          fma16_tile_sums(tile_sums, valid, a_end, b_end, k_full);
        }
      });
}

// ---------------------------------------------------------------------------------------------
// B contiguous along N ([E, K, N] weights, torch grouped_mm's layout) on AVX2: the outer-product
// tile of a BLIS-style kernel, 6 rows x 16 columns. A k step loads B row k's 16 columns into
// ymm12-13 (bf16 and fp16 widened there), broadcasts each row's A[i][k] into ymm14 and issues 12
// FMAs into accumulators ymm(2 i), ymm(2 i + 1): 8 loads for 12 FMAs, no horizontal sums, each
// output summed over k in a fixed order (bitwise reproducible; blocks of K, see kNFmaBlockK). The
// vector N-split kernel's tile on AVX2 is the same shape as 16-lane vectors of two registers, and
// ran at half of torch's grouped_mm on these weights (the runtime's vectorized loop around it).
#define MOE_XPU_NFMA_B_FLOAT "vmovups (%[bp]), %%ymm12\n\t" "vmovups 32(%[bp]), %%ymm13\n\t"
#define MOE_XPU_NFMA_B_BF16                                                    \
  "vpmovzxwd (%[bp]), %%ymm12\n\t" "vpslld $16, %%ymm12, %%ymm12\n\t"           \
  "vpmovzxwd 16(%[bp]), %%ymm13\n\t" "vpslld $16, %%ymm13, %%ymm13\n\t"
#define MOE_XPU_NFMA_B_HALF "vcvtph2ps (%[bp]), %%ymm12\n\t" "vcvtph2ps 16(%[bp]), %%ymm13\n\t"
// A k step's B from B's rows (the row kNFmaPrefetchRows ahead asked for first), optionally also
// stored, widened, to the packed strip at pk; or from that strip.
#define MOE_XPU_NFMA_READ(LOAD) "prefetcht0 (%[pp])\n\t" LOAD "add %[rb], %[bp]\n\t" "add %[rb], %[pp]\n\t"
#define MOE_XPU_NFMA_SAVE(LOAD) \
  MOE_XPU_NFMA_READ(LOAD) "vmovups %%ymm12, (%[pk])\n\t" "vmovups %%ymm13, 32(%[pk])\n\t" "add $64, %[pk]\n\t"
#define MOE_XPU_NFMA_PACKED "vmovups (%[pk]), %%ymm12\n\t" "vmovups 32(%[pk]), %%ymm13\n\t" "add $64, %[pk]\n\t"
// Row i's A[i][k] broadcast into ymm14 (float; bf16 and fp16 widened there) and its 2 FMAs.
#define MOE_XPU_NFMA_FMAS(r0, r1) "vfmadd231ps %%ymm12, %%ymm14, %%ymm" #r0 "\n\t" "vfmadd231ps %%ymm13, %%ymm14, %%ymm" #r1 "\n\t"
#define MOE_XPU_NFMA_ROW_FLOAT(i, r0, r1) "vbroadcastss (%[a" #i "],%[ko],4), %%ymm14\n\t" MOE_XPU_NFMA_FMAS(r0, r1)
#define MOE_XPU_NFMA_ROW_BF16(i, r0, r1) \
  "vpbroadcastw (%[a" #i "],%[ko],2), %%ymm14\n\t" "vpslld $16, %%ymm14, %%ymm14\n\t" MOE_XPU_NFMA_FMAS(r0, r1)
#define MOE_XPU_NFMA_ROW_HALF(i, r0, r1) \
  "vpbroadcastw (%[a" #i "],%[ko],2), %%xmm14\n\t" "vcvtph2ps %%xmm14, %%ymm14\n\t" MOE_XPU_NFMA_FMAS(r0, r1)
#define MOE_XPU_NFMA_ZERO(r0, r1) MOE_XPU_FMA_NZERO(r0) MOE_XPU_FMA_NZERO(r1)
#define MOE_XPU_FMA_NZERO(r) "vxorps %%ymm" #r ", %%ymm" #r ", %%ymm" #r "\n\t"
// Row i's accumulators added to its sums (a block of K's, see kNFmaBlockK).
#define MOE_XPU_NFMA_ADD(at, r)                                                               \
  "vaddps " at "(%[sums]), %%ymm" #r ", %%ymm" #r "\n\t" "vmovups %%ymm" #r ", " at "(%[sums])\n\t"
#define MOE_XPU_NFMA_STORE(i, r0, r1) MOE_XPU_NFMA_ADD(#i "*64", r0) MOE_XPU_NFMA_ADD(#i "*64+32", r1)
#define MOE_XPU_NFMA_CLEAR(i, r0, r1) "vmovups %%ymm0, " #i "*64(%[sums])\n\t" "vmovups %%ymm0, " #i "*64+32(%[sums])\n\t"
// Rows 0 .. R - 1 of the tile: ROWS##R(M) applies M(i, r0, r1) to each.
#define MOE_XPU_NFMA_ROWS1(M) M(0, 0, 1)
#define MOE_XPU_NFMA_ROWS2(M) MOE_XPU_NFMA_ROWS1(M) M(1, 2, 3)
#define MOE_XPU_NFMA_ROWS3(M) MOE_XPU_NFMA_ROWS2(M) M(2, 4, 5)
#define MOE_XPU_NFMA_ROWS4(M) MOE_XPU_NFMA_ROWS3(M) M(3, 6, 7)
#define MOE_XPU_NFMA_ROWS5(M) MOE_XPU_NFMA_ROWS4(M) M(4, 8, 9)
#define MOE_XPU_NFMA_ROWS6(M) MOE_XPU_NFMA_ROWS5(M) M(5, 10, 11)
#define MOE_XPU_NFMA_ZERO_ROW(i, r0, r1) MOE_XPU_NFMA_ZERO(r0, r1)
// The tile's loop: sums cleared, then per block of k steps up to the next multiple of kNFmaBlockK
// (ko, running from -K up to zero, a multiple of it) the accumulators zeroed, the block's steps,
// and the accumulators added to the sums. (A block counter in a register of its own, a 13th
// operand, made the whole kernel about 20% slower at K = 128.)
#define MOE_XPU_NFMA_LOOP(R, STEP, ROW)                                                                         \
  asm volatile("vxorps %%ymm0, %%ymm0, %%ymm0\n\t" MOE_XPU_NFMA_ROWS6(MOE_XPU_NFMA_CLEAR) "1:\n\t"            \
               MOE_XPU_NFMA_ROWS##R(MOE_XPU_NFMA_ZERO_ROW) "2:\n\t" STEP MOE_XPU_NFMA_ROWS##R(ROW)              \
               "add $1, %[ko]\n\t" "test %[mask], %[ko]\n\t" "jnz 2b\n\t" MOE_XPU_NFMA_ROWS##R(MOE_XPU_NFMA_STORE) \
               "test %[ko], %[ko]\n\t" "jnz 1b\n\t"                                                          \
               : [ko] "+r"(ko), [bp] "+r"(bp), [pk] "+r"(pk), [pp] "+r"(pp)                                     \
               : [a0] "r"(a_end[0]), [a1] "r"(a_end[1]), [a2] "r"(a_end[2]), [a3] "r"(a_end[3]),                \
                 [a4] "r"(a_end[4]), [a5] "r"(a_end[5]), [rb] "r"(b_row_bytes), [sums] "r"(sums),               \
                 [mask] "i"(kNFmaBlockK - 1)                                                                    \
               : "memory", "cc", "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", \
                 "ymm10", "ymm11", "ymm12", "ymm13", "ymm14")
#define MOE_XPU_NFMA_LOOPS(STEP, ROW)                                                             \
  if constexpr (R == 1) MOE_XPU_NFMA_LOOP(1, STEP, ROW);                                           \
  else if constexpr (R == 2) MOE_XPU_NFMA_LOOP(2, STEP, ROW);                                      \
  else if constexpr (R == 3) MOE_XPU_NFMA_LOOP(3, STEP, ROW);                                      \
  else if constexpr (R == 4) MOE_XPU_NFMA_LOOP(4, STEP, ROW);                                      \
  else if constexpr (R == 5) MOE_XPU_NFMA_LOOP(5, STEP, ROW);                                      \
  else MOE_XPU_NFMA_LOOP(6, STEP, ROW);
#define MOE_XPU_NFMA_FROM(LOAD, ROW)                                            \
  if constexpr (From == NFmaB::read) {                                          \
    MOE_XPU_NFMA_LOOPS(MOE_XPU_NFMA_READ(LOAD), ROW)                             \
  } else if constexpr (From == NFmaB::save) {                                   \
    MOE_XPU_NFMA_LOOPS(MOE_XPU_NFMA_SAVE(LOAD), ROW)                             \
  } else {                                                                      \
    MOE_XPU_NFMA_LOOPS(MOE_XPU_NFMA_PACKED, ROW)                                 \
  }
#define MOE_XPU_NFMA_FOR_A(LOAD)                                                \
  if constexpr (std::is_same_v<TA, float>) {                                    \
    MOE_XPU_NFMA_FROM(LOAD, MOE_XPU_NFMA_ROW_FLOAT)                              \
  } else if constexpr (std::is_same_v<TA, uint16_t>) {                          \
    MOE_XPU_NFMA_FROM(LOAD, MOE_XPU_NFMA_ROW_BF16)                               \
  } else {                                                                      \
    MOE_XPU_NFMA_FROM(LOAD, MOE_XPU_NFMA_ROW_HALF)                               \
  }

// Where a tile's B comes from: B's rows (read), B's rows with the strip also stored to a packed
// copy, K x 16 floats (save), or that copy (packed). A B strip is 64 bytes (float) or 32 (16-bit)
// of each of K rows N elements apart: at N = 1024 floats the rows are 4 KB apart, so a strip
// falls into 16 of the L2's sets and into one of the L1's, and the unit's later row tiles would
// re-read it from L3; the packed copy is one contiguous run the prefetchers follow.
enum class NFmaB { read, save, packed };
// The k loop runs in blocks of kNFmaBlockK, each block's sums added to the tile's: one running sum
// over all of K loses accuracy as K grows (K = 1031: 4x the error of torch's float32 GEMM, which
// blocks its sums), and the blocks cost one add and store per accumulator each.
constexpr int64_t kNFmaBlockK = 256;
static_assert((kNFmaBlockK & (kNFmaBlockK - 1)) == 0, "a power of two: the loop tests ko's low bits");
// Rows of B ahead that a tile reading B's rows asks for (each row is a page of its own from
// N = 1024 floats on, where the hardware prefetchers stop).
constexpr int64_t kNFmaPrefetchRows = 24;

// The tile's first R rows (1..6) over k in [0, K), K > 0: A rows (float, or B's 16-bit type) end
// at a_end[i] (K elements past their start), B row 0 of the tile at b0 (its column n0), rows
// b_row_bytes apart, the packed strip at `packed` (K x 64 bytes; unused by read); sums[i * 16 + c].
template <int R, NFmaB From, typename TA, typename T>
inline void n_fma_tile_sums(float* sums, const TA* const (&a_end)[kNFmaRows], const T* b0, int64_t b_row_bytes,
                            int64_t K, float* packed) {
  static_assert(R >= 1 && R <= kNFmaRows, "the assembly is written for 1 to 6 rows");
  int64_t ko = -K;
  const char* bp = reinterpret_cast<const char*>(b0);
  const char* pp = bp + kNFmaPrefetchRows * b_row_bytes;
  float* pk = packed;
  if constexpr (std::is_same_v<T, float>) {
    MOE_XPU_NFMA_FOR_A(MOE_XPU_NFMA_B_FLOAT)
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    MOE_XPU_NFMA_FOR_A(MOE_XPU_NFMA_B_BF16)
  } else {
    MOE_XPU_NFMA_FOR_A(MOE_XPU_NFMA_B_HALF)
  }
}

// ... with R the tile's valid rows (a group's short last tile computes only its own rows), run by
// lane 0 (`run`) under branches the whole sub-group takes (kernel_leader_runs, assembly_tile.hpp).
template <NFmaB From, typename TA, typename T>
inline void n_fma_tile_sums_for(bool run, int64_t valid, float* sums, const TA* const (&a_end)[kNFmaRows],
                                const T* b0, int64_t b_row_bytes, int64_t K, float* packed) {
  if (valid <= 1) {
    if (run) n_fma_tile_sums<1, From>(sums, a_end, b0, b_row_bytes, K, packed);
  } else if (valid == 2) {
    if (run) n_fma_tile_sums<2, From>(sums, a_end, b0, b_row_bytes, K, packed);
  } else if (valid == 3) {
    if (run) n_fma_tile_sums<3, From>(sums, a_end, b0, b_row_bytes, K, packed);
  } else if (valid == 4) {
    if (run) n_fma_tile_sums<4, From>(sums, a_end, b0, b_row_bytes, K, packed);
  } else if (valid == 5) {
    if (run) n_fma_tile_sums<5, From>(sums, a_end, b0, b_row_bytes, K, packed);
  } else if (run) {
    n_fma_tile_sums<6, From>(sums, a_end, b0, b_row_bytes, K, packed);
  }
}

#undef MOE_XPU_NFMA_FOR_A
#undef MOE_XPU_NFMA_FROM
#undef MOE_XPU_NFMA_LOOPS
#undef MOE_XPU_NFMA_LOOP
#undef MOE_XPU_NFMA_ZERO_ROW
#undef MOE_XPU_NFMA_ROWS6
#undef MOE_XPU_NFMA_ROWS5
#undef MOE_XPU_NFMA_ROWS4
#undef MOE_XPU_NFMA_ROWS3
#undef MOE_XPU_NFMA_ROWS2
#undef MOE_XPU_NFMA_ROWS1
#undef MOE_XPU_NFMA_CLEAR
#undef MOE_XPU_NFMA_STORE
#undef MOE_XPU_NFMA_ADD
#undef MOE_XPU_FMA_NZERO
#undef MOE_XPU_NFMA_ZERO
#undef MOE_XPU_NFMA_ROW_HALF
#undef MOE_XPU_NFMA_ROW_BF16
#undef MOE_XPU_NFMA_ROW_FLOAT
#undef MOE_XPU_NFMA_FMAS
#undef MOE_XPU_NFMA_PACKED
#undef MOE_XPU_NFMA_SAVE
#undef MOE_XPU_NFMA_READ
#undef MOE_XPU_NFMA_B_HALF
#undef MOE_XPU_NFMA_B_BF16
#undef MOE_XPU_NFMA_B_FLOAT

// The N-split GEMM on B contiguous along N (float32, bf16 or fp16; b_stride_k: B's stride between
// rows of K) and A of B's dtype or float32, the parameters of moe_gemm_n_lanes (not gated). N a
// multiple of kNFmaCols (the launcher checks). 16-bit A is widened in the k loop, one extra
// instruction a row (widening it before the launch, as the K-contiguous kernels do, cost more
// than the kernel at small shapes: a torch op and a pass over A). Lane 0 runs the assembly per
// 6-row tile; lane l then finishes column l of the tile's rows (the bias, the row weight, the store).
template <typename TA, typename T, typename TOut>
MOE_XPU_KERNEL
void moe_gemm_n_fma(const TA* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                    int gather_is64, const T* b, int64_t b_stride_e, int64_t b_stride_k, const T* bias,
                    int64_t bias_stride_e, TOut* out, int64_t out_row_stride, int64_t out_rows,
                    const void* group_offsets, int offsets_is64, int64_t num_groups, int64_t K, int64_t N, int,
                    int64_t, const void* scatter_index, int scatter_is64, const float* row_weight, void* scratch) {
  constexpr int TM = kNFmaRows, TN = kNFmaCols;
  static_assert(TN == kLanes, "lane l finishes column l");
  const Worker w = this_worker();
  float* tile_sums = local_floats<kNFmaSums>();
  const int64_t rb = b_stride_k * int64_t(sizeof(T));
  float* packed = reinterpret_cast<float*>(static_cast<char*>(scratch) + w.id * n_fma_scratch_bytes(K));
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, kUnitRows / TM, N / TN,
      unit_cost<T, TM, TN / kLanes>(),
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        const int64_t n0 = n_tile * TN;
        const T* b_tile = b + g * b_stride_e + n0;
        for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
          const int64_t m0 = row_begin + m_tile * TM;
          const int64_t valid = tile_valid_rows(rows, m_tile, TM);
          auto a_row = [&](int i) {
            return tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, i);
          };
          if (g < num_groups && K > 0) {
            const TA* a_end[TM];
            for (int i = 0; i < TM; ++i) a_end[i] = a_row(i) + K;
            // A unit of several tiles: the first packs its B strip, the others read that.
            const bool lead = w.lane == 0;
            if (m_last - m_first == 1)
              n_fma_tile_sums_for<NFmaB::read>(lead, valid, tile_sums, a_end, b_tile, rb, K, packed);
            else if (m_tile == m_first)
              n_fma_tile_sums_for<NFmaB::save>(lead, valid, tile_sums, a_end, b_tile, rb, K, packed);
            else
              n_fma_tile_sums_for<NFmaB::packed>(lead, valid, tile_sums, a_end, b_tile, rb, K, packed);
            sycl::group_barrier(w.sg);
          }
          float add = 0.0f;
          if (bias != nullptr && g < num_groups) add = to_float(bias[g * bias_stride_e + n0 + w.lane]);
          for (int i = 0; i < TM; ++i)
            if (i < valid) {
              const float s = g < num_groups ? (K > 0 ? tile_sums[i * TN + w.lane] : 0.0f) + add : 0.0f;
              const RowTarget t = row_target(scatter_index, scatter_is64, row_weight, m0 + i, out_rows);
              out[t.row * out_row_stride + n0 + w.lane] = FromFloat<TOut>::convert(s * t.weight);
            }
          sycl::group_barrier(w.sg);  // the sums are read before the next tile overwrites them
        }
      });
}

}  // namespace moe_xpu

#ifdef MOE_XPU_FMA_PROBE
// The launcher's checks, before it lets a device use this family (launcher.cpp: dot_probes), for
// the register width W = MOE_XPU_FMA_PROBE (8 or 16): over k elements (a multiple of 16) of float
// A rows a (R x k) and B columns b of each B type t (8 x k floats, then 8 x k bf16, then 8 x k
// fp16). moe_xpu_fma_probe: the tile R x C = fma_rows(W) x fma_cols(W) for 1 .. R rows,
// out[t R R C + (r - 1) R C + C i + j] (at 16 floats float B, the vector kernels', is skipped: its
// sums are zero). moe_xpu_fma_row_probe: the decode tile, row 0 against the 8 columns,
// out[8 t + j].
//
// Written as the first of these was for AVX2 alone (kept in two kernels, B's pointer arrays as
// initializer lists in lane 0's branch, A's filled by every lane): variants that built the arrays
// in a helper or ran both tiles in one loop read wrong pointers on the 8-float target.
#define MOE_XPU_FMA_PROBE_ENDS(b) {b + k, b + 2 * k, b + 3 * k, b + 4 * k, b + 5 * k, b + 6 * k, b + 7 * k, b + 8 * k}
#if MOE_XPU_FMA_PROBE == 8
#define MOE_XPU_FMA_PROBE_TILE(T, bt)                                                                     \
  const T* b_end[kFmaCols] = {bt + k, bt + 2 * k, bt + 3 * k, bt + 4 * k};                                \
  fma_tile_sums(true, sums, r, a_end, b_end, k, bt);
#define MOE_XPU_FMA_PROBE_ROW(T, bt)                                                                      \
  const T* b_end[kFmaRowCols] = MOE_XPU_FMA_PROBE_ENDS(bt);                                             \
  fma_row_sums(sums, a_end, b_end, k, bt);
#else
#define MOE_XPU_FMA_PROBE_TILE(T, bt)                                                                     \
  const T* b_end[kDotCols] = {bt + k, bt + 2 * k, bt + 3 * k, bt + 4 * k, bt + 5 * k, bt + 6 * k};        \
  fma16_tile_sums(sums, r, a_end, b_end, k);
#define MOE_XPU_FMA_PROBE_ROW(T, bt)                                                                      \
  const T* b_end[kFmaRowCols] = MOE_XPU_FMA_PROBE_ENDS(bt);                                             \
  fma16_row_sums(sums, a_end, b_end, k);
#endif

extern "C" MOE_XPU_KERNEL_WITH_LANES(moe_xpu::kLanes)
void moe_xpu_fma_probe(const float* a, const float* b, float* out, int64_t k) {
  using namespace moe_xpu;
  constexpr int W = MOE_XPU_FMA_PROBE, R = fma_rows(W), C = fma_cols(W);
  const Worker w = this_worker();
  float* sums = local_floats<fma_sums_floats(W)>();
  const float* a_end[R];
  for (int i = 0; i < R; ++i) a_end[i] = a + i * k + k;
  const uint16_t* bb = reinterpret_cast<const uint16_t*>(b + kFmaRowCols * k);
  const sycl::half* bh = reinterpret_cast<const sycl::half*>(bb + kFmaRowCols * k);
  for (int t = 0; t < 3; ++t)
    for (int r = 1; r <= R; ++r) {
      if (w.lane == 0) {
        for (int o = 0; o < R * C; ++o) sums[o] = 0.0f;
        if (t == 0) {
#if MOE_XPU_FMA_PROBE == 8
          MOE_XPU_FMA_PROBE_TILE(float, b)
#endif
        } else if (t == 1) {
          MOE_XPU_FMA_PROBE_TILE(uint16_t, bb)
        } else {
          MOE_XPU_FMA_PROBE_TILE(sycl::half, bh)
        }
      }
      sycl::group_barrier(w.sg);
      if (w.lane < R * C) out[t * R * R * C + (r - 1) * R * C + w.lane] = sums[w.lane];
      if (R * C > kLanes && w.lane < R * C - kLanes)
        out[t * R * R * C + (r - 1) * R * C + kLanes + w.lane] = sums[kLanes + w.lane];
      sycl::group_barrier(w.sg);
    }
}

extern "C" MOE_XPU_KERNEL_WITH_LANES(moe_xpu::kLanes)
void moe_xpu_fma_row_probe(const float* a, const float* b, float* out, int64_t k) {
  using namespace moe_xpu;
  const Worker w = this_worker();
  float* sums = local_floats<kFmaRowCols>();
  const float* a_end[1] = {a + k};
  const uint16_t* bb = reinterpret_cast<const uint16_t*>(b + kFmaRowCols * k);
  const sycl::half* bh = reinterpret_cast<const sycl::half*>(bb + kFmaRowCols * k);
  for (int t = 0; t < 3; ++t) {
    if (w.lane == 0) {
      for (int o = 0; o < kFmaRowCols; ++o) sums[o] = 0.0f;
      if (t == 0) {
#if MOE_XPU_FMA_PROBE == 8
        MOE_XPU_FMA_PROBE_ROW(float, b)
#endif
      } else if (t == 1) {
        MOE_XPU_FMA_PROBE_ROW(uint16_t, bb)
      } else {
        MOE_XPU_FMA_PROBE_ROW(sycl::half, bh)
      }
    }
    sycl::group_barrier(w.sg);
    if (w.lane < kFmaRowCols) out[t * kFmaRowCols + w.lane] = sums[w.lane];
    sycl::group_barrier(w.sg);
  }
}

#if MOE_XPU_FMA_PROBE == 8
// The N-contiguous tile (AVX2 only) for 1 .. 6 rows of A (6 x k floats) against B rows of 16
// columns of each B type (k x 16 floats, then k x 16 bf16, then k x 16 fp16):
// out[t 6 96 + (r - 1) 96 + 16 i + c]. (16-bit A: the next probe kernel; one kernel for both read
// zeros where the tile's sums should have been, on this runtime's 8-float target.)
extern "C" MOE_XPU_KERNEL_WITH_LANES(moe_xpu::kLanes)
void moe_xpu_n_fma_probe(const float* a, const float* b, float* out, int64_t k) {
  using namespace moe_xpu;
  const Worker w = this_worker();
  float* sums = local_floats<kNFmaSums>();
  const float* a_end[kNFmaRows];
  for (int i = 0; i < kNFmaRows; ++i) a_end[i] = a + i * k + k;
  const uint16_t* bb = reinterpret_cast<const uint16_t*>(b + kNFmaCols * k);
  const sycl::half* bh = reinterpret_cast<const sycl::half*>(bb + kNFmaCols * k);
  for (int t = 0; t < 3; ++t)
    for (int r = 1; r <= kNFmaRows; ++r) {
      if (w.lane == 0) {
        for (int o = 0; o < kNFmaSums; ++o) sums[o] = 0.0f;
        if (t == 0) n_fma_tile_sums_for<NFmaB::read>(true, r, sums, a_end, b, kNFmaCols * 4, k, nullptr);
        else if (t == 1) n_fma_tile_sums_for<NFmaB::read>(true, r, sums, a_end, bb, kNFmaCols * 2, k, nullptr);
        else n_fma_tile_sums_for<NFmaB::read>(true, r, sums, a_end, bh, kNFmaCols * 2, k, nullptr);
      }
      sycl::group_barrier(w.sg);
      for (int i = 0; i < kNFmaRows; ++i)
        out[(t * kNFmaRows + r - 1) * kNFmaSums + i * kNFmaCols + w.lane] = sums[i * kNFmaCols + w.lane];
      sycl::group_barrier(w.sg);
    }
}

// ... for 16-bit A: a holds the 6 x k A rows in bf16, then in fp16; bf16 A against bf16 B, fp16 A
// against fp16 B (B as above), out[t 6 96 + (r - 1) 96 + 16 i + c] for t = 0, 1.
extern "C" MOE_XPU_KERNEL_WITH_LANES(moe_xpu::kLanes)
void moe_xpu_n_fma_a16_probe(const float* a, const float* b, float* out, int64_t k) {
  using namespace moe_xpu;
  const Worker w = this_worker();
  float* sums = local_floats<kNFmaSums>();
  const uint16_t* ab = reinterpret_cast<const uint16_t*>(a);
  const sycl::half* ah = reinterpret_cast<const sycl::half*>(ab + kNFmaRows * k);
  const uint16_t* bb = reinterpret_cast<const uint16_t*>(b + kNFmaCols * k);
  const sycl::half* bh = reinterpret_cast<const sycl::half*>(bb + kNFmaCols * k);
  for (int t = 0; t < 2; ++t)
    for (int r = 1; r <= kNFmaRows; ++r) {
      if (w.lane == 0) {
        for (int o = 0; o < kNFmaSums; ++o) sums[o] = 0.0f;
        if (t == 0) {
          const uint16_t* a_end[kNFmaRows] = {ab + k, ab + 2 * k, ab + 3 * k, ab + 4 * k, ab + 5 * k, ab + 6 * k};
          n_fma_tile_sums_for<NFmaB::read>(true, r, sums, a_end, bb, kNFmaCols * 2, k, nullptr);
        } else {
          const sycl::half* a_end[kNFmaRows] = {ah + k, ah + 2 * k, ah + 3 * k, ah + 4 * k, ah + 5 * k, ah + 6 * k};
          n_fma_tile_sums_for<NFmaB::read>(true, r, sums, a_end, bh, kNFmaCols * 2, k, nullptr);
        }
      }
      sycl::group_barrier(w.sg);
      for (int i = 0; i < kNFmaRows; ++i)
        out[(t * kNFmaRows + r - 1) * kNFmaSums + i * kNFmaCols + w.lane] = sums[i * kNFmaCols + w.lane];
      sycl::group_barrier(w.sg);
    }
}
#endif

#undef MOE_XPU_FMA_PROBE_ROW
#undef MOE_XPU_FMA_PROBE_TILE
#undef MOE_XPU_FMA_PROBE_ENDS
#endif

// Appended by the launcher after moe_gemm.cpp (whose MOE_XPU_KERNEL_PARAMS it uses), e.g.
// MOE_XPU_INSTANTIATE_K_FMA(float, float, 3, 4, false, 8) for "moe_xpu::moe_gemm_k_fma<float, float, 3, 4, false, 8>".
#define MOE_XPU_INSTANTIATE_K_FMA(T, TOut, TM, TN, GATED, W) \
  template void moe_xpu::moe_gemm_k_fma<T, TOut, TM, TN, GATED, W>(MOE_XPU_KERNEL_PARAMS(float, T, TOut));
#define MOE_XPU_INSTANTIATE_N_FMA(TA, T, TOut) \
  template void moe_xpu::moe_gemm_n_fma<TA, T, TOut>(MOE_XPU_KERNEL_PARAMS(TA, T, TOut), void*);

// moe_xpu's FMA dot-product kernel family for CPUs whose vector class is AVX2 (16 registers of 8
// floats), for B contiguous along K (nn.Linear weights) in float32, bf16 or fp16, with float32 A.
//
// There a 16-lane sub-group vector takes two registers, so the vector K-split kernel
// (moe_gemm.cpp: k_lanes) holds at most 3 x 2 (row, column) pairs and loads five vectors for every
// six FMAs: bound by its loads. This family's k loop is x86 assembly (carried through SPIR-V as
// moe_gemm_dot.cpp's is) on 8-float registers: a 3 x 4 tile of 12 accumulators, the tile's three
// A vectors and one B vector, so a k step of 8 loads 7 vectors for 12 FMAs.
//
// As in moe_gemm_dot.cpp, lane 0 of each sub-group runs its worker's assembly, the tile's sums
// pass through work-group local memory, and the 16 lanes share the epilogue (assembly_tile.hpp).
// Lane l of accumulator (i, j) sums the products of k = 8 s + l over the steps s, the 8 lanes are
// added by halves afterwards, and the last K % 8 elements with float FMAs: a fixed order, so
// results are bitwise reproducible (and differ in the last bits from the vector kernels').
//
// Only compiled where the device description says the CPU runs AVX2 and FMA code and the CPU
// target's vectors are 8 floats wide (DeviceDescription::fma_dot); never for a GPU.
#include "assembly_tile.hpp"

namespace moe_xpu {

// (The tile, kFmaRows x kFmaCols, and kFmaSums are in sizes.hpp, shared with the launcher.)
constexpr int64_t kFmaStep = 8;  // floats of K per register

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
#define MOE_XPU_FMA_TILES(LOAD, PREFETCH) \
  if (rows == 1) MOE_XPU_FMA_TILE(1, LOAD, PREFETCH); \
  else if (rows == 2) MOE_XPU_FMA_TILE(2, LOAD, PREFETCH); \
  else MOE_XPU_FMA_TILE(3, LOAD, PREFETCH);

template <typename T>
inline void fma_tile_sums(float* sums, int64_t rows, const float* const (&a_end)[kFmaRows],
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

// The K-split GEMM on float A and B contiguous along K (float32, bf16 or fp16; b_stride_n: B's
// stride between columns), the vector kernels' parameters (moe_gemm.cpp: MOE_XPU_KERNEL_PARAMS)
// so that the launcher drives both alike: 16-bit A is widened once before the launch
// (LaunchPlan::widen_a), so the k loop converts only B. TM x TN is the plan's tile (3 x 4: gated
// tiles are 2 gate columns then the matching 2 up columns), or for decode 1 x 8.
template <typename T, typename TOut, int TM, int TN, bool Gated>
MOE_XPU_KERNEL
void moe_gemm_k_fma(const float* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                    int gather_is64, const T* b, int64_t b_stride_e, int64_t b_stride_n, const T* bias,
                    int64_t bias_stride_e, TOut* out, int64_t out_row_stride, int64_t out_rows,
                    const void* group_offsets, int offsets_is64, int64_t num_groups, int64_t K, int64_t N,
                    int activation, int64_t up_offset, const void* scatter_index, int scatter_is64,
                    const float* row_weight) {
  static_assert((TM == kFmaRows && TN == kFmaCols) || (TM == 1 && TN == kFmaRowCols),
                "the assembly is written for two register tiles");
  float* tile_sums = local_floats<kFmaSums>();
  assembly_k_split<TM, TN, Gated, kFmaStep>(
      a, a_row_stride, a_rows, gather_index, gather_is64, b, b_stride_e, b_stride_n, bias, bias_stride_e, out,
      out_row_stride, out_rows, group_offsets, offsets_is64, num_groups, K, N, activation, up_offset,
      scatter_index, scatter_is64, row_weight, tile_sums,
      [&](int64_t valid, const float* const (&a_end)[TM], const T* const (&b_end)[TN], int64_t k_full,
          const T* next) {
        if constexpr (TM == 1) fma_row_sums(tile_sums, a_end, b_end, k_full, next);
        else fma_tile_sums(tile_sums, valid, a_end, b_end, k_full, next);
      });
}

}  // namespace moe_xpu

#ifdef MOE_XPU_FMA_PROBE
// The launcher's check, before it lets a device use this family (launcher.cpp: dot_probes): one
// tile's sums over k elements (a multiple of 8) of float A rows a (3 x k) and B columns b (4 x k)
// of each B type (float, bf16 and fp16 columns one after another: 4 x k floats, then 4 x k bf16,
// then 4 x k fp16), for 1, 2 and 3 rows: out[36 t + 12 (r - 1) + 4 i + j] for B type t.
extern "C" MOE_XPU_KERNEL_WITH_LANES(moe_xpu::kLanes)
void moe_xpu_fma_probe(const float* a, const float* b, float* out, int64_t k) {
  using namespace moe_xpu;
  const Worker w = this_worker();
  float* sums = local_floats<kFmaSums>();
  const float* a_end[kFmaRows];
  for (int i = 0; i < kFmaRows; ++i) a_end[i] = a + i * k + k;
  const float* bf = b;
  const uint16_t* bb = reinterpret_cast<const uint16_t*>(b + kFmaCols * k);
  const sycl::half* bh = reinterpret_cast<const sycl::half*>(bb + kFmaCols * k);
  for (int t = 0; t < 3; ++t)
    for (int r = 1; r <= kFmaRows; ++r) {
      if (w.lane == 0) {
        for (int o = 0; o < kFmaRows * kFmaCols; ++o) sums[o] = 0.0f;
        if (t == 0) {
          const float* b_end[kFmaCols] = {bf + k, bf + 2 * k, bf + 3 * k, bf + 4 * k};
          fma_tile_sums(sums, r, a_end, b_end, k, bf);
        } else if (t == 1) {
          const uint16_t* b_end[kFmaCols] = {bb + k, bb + 2 * k, bb + 3 * k, bb + 4 * k};
          fma_tile_sums(sums, r, a_end, b_end, k, bb);
        } else {
          const sycl::half* b_end[kFmaCols] = {bh + k, bh + 2 * k, bh + 3 * k, bh + 4 * k};
          fma_tile_sums(sums, r, a_end, b_end, k, bh);
        }
      }
      sycl::group_barrier(w.sg);
      if (w.lane < kFmaRows * kFmaCols) out[36 * t + 12 * (r - 1) + w.lane] = sums[w.lane];
      sycl::group_barrier(w.sg);
    }
}
#endif

// Appended by the launcher after moe_gemm.cpp (whose MOE_XPU_KERNEL_PARAMS it uses), e.g.
// MOE_XPU_INSTANTIATE_K_FMA(float, float, 3, 4, false) for "moe_xpu::moe_gemm_k_fma<float, float, 3, 4, false>".
#define MOE_XPU_INSTANTIATE_K_FMA(T, TOut, TM, TN, GATED) \
  template void moe_xpu::moe_gemm_k_fma<T, TOut, TM, TN, GATED>(MOE_XPU_KERNEL_PARAMS(float, T, TOut));

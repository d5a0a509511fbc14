// moe_xpu quantized grouped GEMM kernels: out[m] = A[row(m)] @ dequant(B[g]) for the rows m of
// group g, with B stored quantized and dequantized in the k loop (never into a float copy).
//
// Compiled at run time like moe_gemm.cpp, in bundles of their own (one per weight format and
// output dtype); the scheduler (scheduler.hpp) and the epilogue (epilogue.hpp) are the forward
// kernels' own, so the index-table gather, the gated activation, the row weight and the scatter
// behave exactly as there.
//
// Weight formats (the launcher's DType of B; the Python container moe_xpu.quant.QuantizedExperts
// lays them out):
//  - Int8Weights: int8 values, any strides (K contiguous reads fastest); float32 scales.
//  - Fp8Weights: float8 e4m3fn values, any strides; float32 scales.
//  - Int4Weights: unsigned 4-bit values q with a zero point z (uint8 per scale block; 8 when none
//    is given), value (q - z) * scale.
//  - Mxfp4Weights: e2m1 values with an e8m0 scale (a power of two, uint8) per block of 32 along K.
// 4-bit values are packed along K in words of eight, in the lane order of the kernel: for each
// block of 128 k, word l (l = 0..15) holds the values of k = 16 r + l, r = 0..7, value r in bits
// 4r..4r+3. A lane then reads one 32-bit word per 128 k and column, and a sub-group's 16 words
// are one contiguous 64-byte load.
// Scales (and zero points) are indexed by (n / scale_block_n, k / scale_block_k) through their
// own strides: per output channel (block_n 1, block_k >= K), group-wise along K (block_n 1,
// block_k 32, 64 or 128), DeepSeek-V3's 128 x 128 blocks, MXFP4's blocks of 32. scale_block_k is
// a multiple of 16, so a 16-k step of the sub-group reads one scale per column.
//
// W8A8 (int8 A with a float32 scale per row of A, int8 B): products summed in int32 per lane, the
// lanes' sums converted to float and scaled by a_scale[row] * b_scale[n] before the cross-lane sum.
// Weight-only formats (float, half or bf16 A): each B value is dequantized to float and the
// products summed in float, in ascending k per lane: the naive float computation on the
// dequantized weights, with the same rounding behaviour. Bitwise reproducible, as elsewhere.
#include "epilogue.hpp"
#include "scheduler.hpp"

namespace moe_xpu {

inline float fp8_e4m3_to_float(uint32_t x) {
  const uint32_t mag = x & 0x7fu;
  // Normal numbers rebias the exponent (7 -> 127); subnormals are m * 2^-9; 0x7f is NaN.
  float v = mag >= 8u ? sycl::bit_cast<float>((mag << 20) + (120u << 23)) : float(mag) * 0.001953125f;
  v = mag == 0x7fu ? sycl::bit_cast<float>(0x7fc00000u) : v;
  return (x & 0x80u) != 0u ? -v : v;
}

inline float e2m1_to_float(uint32_t x) {  // 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
  const uint32_t mag = x & 7u;
  const float v = mag >= 2u ? sycl::bit_cast<float>((((mag >> 1) + 126u) << 23) | ((mag & 1u) << 22))
                            : float(mag) * 0.5f;
  return (x & 8u) != 0u ? -v : v;
}

inline float e8m0_to_float(uint32_t s) {  // 2^(s - 127); 255 is NaN
  const uint32_t bits = s == 0u ? 0x00400000u : s == 255u ? 0x7fc00000u : s << 23;
  return sycl::bit_cast<float>(bits);
}

struct Int8Weights {
  static constexpr int kBits = 8;
  static float value(uint32_t byte, float) { return float(static_cast<int8_t>(byte)); }
  static float scale(const void* s, int64_t i) { return static_cast<const float*>(s)[i]; }
};
struct Fp8Weights {
  static constexpr int kBits = 8;
  static float value(uint32_t byte, float) { return fp8_e4m3_to_float(byte); }
  static float scale(const void* s, int64_t i) { return static_cast<const float*>(s)[i]; }
};
struct Int4Weights {
  static constexpr int kBits = 4;
  static float value(uint32_t nibble, float zero) { return float(nibble) - zero; }
  static float scale(const void* s, int64_t i) { return static_cast<const float*>(s)[i]; }
};
struct Mxfp4Weights {
  static constexpr int kBits = 4;
  static float value(uint32_t nibble, float) { return e2m1_to_float(nibble); }
  static float scale(const void* s, int64_t i) { return e8m0_to_float(static_cast<const uint8_t*>(s)[i]); }
};

// k per packed 4-bit block: 16 lanes x 8 values.
constexpr int64_t kPackedK = 128;

// A quantized kernel's arguments, in its parameter order.
template <typename TA, typename TOut>
struct QuantArgs {
  const TA* a; int64_t a_row_stride; int64_t a_rows; const void* gather_index; int gather_is64;
  const void* b; int64_t b_stride_e; int64_t b_stride_n; int64_t b_stride_k;
  const void* scale; int64_t scale_stride_e; int64_t scale_stride_n; int64_t scale_stride_k;
  int64_t scale_block_n; int64_t scale_block_k; const uint8_t* zero; const float* a_scale;
  const float* bias; int64_t bias_stride_e;
  TOut* out; int64_t out_row_stride; int64_t out_rows; const void* group_offsets; int offsets_is64;
  int64_t num_groups; int64_t K; int64_t N; int activation; int64_t up_offset;
  const void* scatter_index; int scatter_is64; const float* row_weight;
};

// Accumulator of one tile element: int32 for W8A8, float otherwise.
template <typename TA>
using QuantAcc = std::conditional_t<std::is_same_v<TA, int8_t>, int32_t, float>;

// acc[i][j] += A[row i][k] * bv[j] for one k of every row (rows past the tile repeat its last).
template <int R, int TN, typename TA, typename TB>
__attribute__((always_inline)) inline void quant_step(QuantAcc<TA> (&acc)[R][TN], const TA* const (&a_row)[R],
                                                      int64_t k, float keep, const TB (&bv)[TN]) {
  #pragma unroll
  for (int i = 0; i < R; ++i) {
    if constexpr (std::is_same_v<TA, int8_t>) {
      const int32_t av = a_row[i][k];
      #pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] += av * bv[j];
    } else {
      const float av = keep * to_float(a_row[i][k]);
      #pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = sycl::fma(av, bv[j], acc[i][j]);
    }
  }
}

// One R x TN tile at rows m0 .. m0 + valid_rows - 1 of group g, column tile n_tile.
template <int R, int TN, bool Gated, typename TA, typename Fmt, typename TOut>
inline void quant_tile(const QuantArgs<TA, TOut>& p, const Worker& w, int64_t g, int64_t m0,
                       int64_t valid_rows, int64_t n_tile) {
  constexpr bool w8a8 = std::is_same_v<TA, int8_t>;
  constexpr int out_cols = Gated ? TN / 2 : TN;
  const int64_t n0 = n_tile * out_cols, K = p.K;
  int64_t b_n[TN];  // the B column behind accumulator column j (gated: gate, then up columns)
  #pragma unroll
  for (int j = 0; j < TN; ++j) {
    const int64_t n = n0 + (Gated ? j % out_cols : j);
    b_n[j] = (n < p.N ? n : p.N - 1) + (Gated && j >= out_cols ? p.up_offset : 0);
  }
  QuantAcc<TA> acc[R][TN];
  #pragma unroll
  for (int i = 0; i < R; ++i)
    #pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0;
  float sums[R][TN];
  if (g < p.num_groups) {
    const TA* a_row[R];
    #pragma unroll
    for (int i = 0; i < R; ++i) {  // rows past the group repeat its last row; not stored
      const int64_t m = m0 + (i < valid_rows ? i : valid_rows - 1);
      a_row[i] = p.a + source_row(p.gather_index, p.gather_is64, m, p.a_rows) * p.a_row_stride;
    }
    // Each column's scales (and zero points) along K: element (k / scale_block_k) * scale_stride_k.
    int64_t scale_at[TN];
    #pragma unroll
    for (int j = 0; j < TN; ++j)
      scale_at[j] = g * p.scale_stride_e + (b_n[j] / p.scale_block_n) * p.scale_stride_n;
    auto scale_of = [&](int j, int64_t k0) {  // k0: the sub-group's first k of a 16-k step
      return Fmt::scale(p.scale, scale_at[j] + (k0 / p.scale_block_k) * p.scale_stride_k);
    };
    auto zero_of = [&](int j, int64_t k0) {
      return p.zero == nullptr ? 8.0f : float(p.zero[scale_at[j] + (k0 / p.scale_block_k) * p.scale_stride_k]);
    };
    if constexpr (Fmt::kBits == 8) {
      const uint8_t* b_col[TN];
      #pragma unroll
      for (int j = 0; j < TN; ++j)
        b_col[j] = static_cast<const uint8_t*>(p.b) + g * p.b_stride_e + b_n[j] * p.b_stride_n;
      // Whole 16-k steps unmasked; the K remainder as one masked step (lanes past K read k = K - 1
      // and count zero).
      for (int64_t k0 = 0; k0 < K; k0 += kLanes) {
        const bool whole = k0 + kLanes <= K;
        const int64_t k = whole || k0 + w.lane < K ? k0 + w.lane : K - 1;
        const float keep = whole || k0 + w.lane < K ? 1.0f : 0.0f;
        if constexpr (w8a8) {
          int32_t bv[TN];
          #pragma unroll
          for (int j = 0; j < TN; ++j) bv[j] = keep != 0.0f ? int32_t(static_cast<int8_t>(b_col[j][k * p.b_stride_k])) : 0;
          quant_step<R, TN, TA>(acc, a_row, k, keep, bv);
        } else {
          float bv[TN];
          #pragma unroll
          for (int j = 0; j < TN; ++j) bv[j] = Fmt::value(b_col[j][k * p.b_stride_k], 0.0f) * scale_of(j, k0);
          quant_step<R, TN, TA>(acc, a_row, k, keep, bv);
        }
      }
    } else {
      // 4-bit: K is a multiple of the scale block (>= 32), so every 16-k step is whole.
      const uint32_t* w_col[TN];
      #pragma unroll
      for (int j = 0; j < TN; ++j)
        w_col[j] = static_cast<const uint32_t*>(p.b) + g * p.b_stride_e + b_n[j] * p.b_stride_n + w.lane;
      for (int64_t kb = 0; kb < K; kb += kPackedK) {
        uint32_t word[TN];
        #pragma unroll
        for (int j = 0; j < TN; ++j) word[j] = w_col[j][(kb / kPackedK) * kLanes];
        const int steps = K - kb >= kPackedK ? 8 : int((K - kb) / kLanes);
        #pragma unroll
        for (int r = 0; r < 8; ++r) {
          if (r >= steps) break;
          const int64_t k0 = kb + int64_t(kLanes) * r;
          float bv[TN];
          #pragma unroll
          for (int j = 0; j < TN; ++j)
            bv[j] = Fmt::value((word[j] >> (4 * r)) & 0xfu, zero_of(j, k0)) * scale_of(j, k0);
          quant_step<R, TN, TA>(acc, a_row, k0 + w.lane, 1.0f, bv);
        }
      }
    }
    #pragma unroll
    for (int i = 0; i < R; ++i) {
      float row_scale = 1.0f;
      if constexpr (w8a8) {
        const int64_t m = m0 + (i < valid_rows ? i : valid_rows - 1);
        row_scale = p.a_scale[source_row(p.gather_index, p.gather_is64, m, p.a_rows)];
      }
      #pragma unroll
      for (int j = 0; j < TN; ++j)
        sums[i][j] = w8a8 ? float(acc[i][j]) * (row_scale * scale_of(j, 0)) : float(acc[i][j]);
    }
    if (p.bias != nullptr)  // added once, to lane 0's partial sums
      #pragma unroll
      for (int j = 0; j < TN; ++j) {
        const float bj = w.lane == 0 ? p.bias[g * p.bias_stride_e + b_n[j]] : 0.0f;
        #pragma unroll
        for (int i = 0; i < R; ++i) sums[i][j] += bj;
      }
  } else {  // the tail group: zeros
    #pragma unroll
    for (int i = 0; i < R; ++i)
      #pragma unroll
      for (int j = 0; j < TN; ++j) sums[i][j] = 0.0f;
  }
  k_split_epilogue<R, TN, Gated>(w, sums, p.activation, m0, valid_rows, n0, p.N, p.out, p.out_row_stride,
                                 p.out_rows, p.scatter_index, p.scatter_is64, p.row_weight);
}

// The 16 lanes split K (as moe_gemm_k_lanes does); each lane keeps TM x TN partial sums of a row
// tile, reduced across the sub-group once per tile. Units are one column tile of one group over
// up to kUnitRows rows, owned by the persistent workers through the shared scheduler. A group's
// short last row tile runs with a 1- or 4-row tile.
template <typename TA, typename Fmt, typename TOut, int TM, int TN, bool Gated>
MOE_XPU_KERNEL
void moe_gemm_quant(const TA* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                    int gather_is64, const void* b, int64_t b_stride_e, int64_t b_stride_n,
                    int64_t b_stride_k, const void* scale, int64_t scale_stride_e,
                    int64_t scale_stride_n, int64_t scale_stride_k, int64_t scale_block_n,
                    int64_t scale_block_k, const uint8_t* zero, const float* a_scale,
                    const float* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                    int64_t out_rows, const void* group_offsets, int offsets_is64,
                    int64_t num_groups, int64_t K, int64_t N, int activation, int64_t up_offset,
                    const void* scatter_index, int scatter_is64, const float* row_weight) {
  static_assert(!Gated || TN % 2 == 0, "gated tiles pair gate and up columns");
  const Worker w = this_worker();
  const QuantArgs<TA, TOut> p{a, a_row_stride, a_rows, gather_index, gather_is64, b, b_stride_e, b_stride_n,
                              b_stride_k, scale, scale_stride_e, scale_stride_n, scale_stride_k, scale_block_n,
                              scale_block_k, zero, a_scale, bias, bias_stride_e, out, out_row_stride, out_rows,
                              group_offsets, offsets_is64, num_groups, K, N, activation, up_offset,
                              scatter_index, scatter_is64, row_weight};
  constexpr int out_cols = Gated ? TN / 2 : TN;
  const int64_t tiles_n = (N + out_cols - 1) / out_cols;
  // A k step reads TN columns of 16 values of Fmt::kBits bits (see unit_cost in scheduler.hpp).
  const UnitCost cost{int64_t(TM) * TN, int64_t(TN) * 7 * Fmt::kBits / 8};
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, kUnitRows / TM, tiles_n, cost,
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
          const int64_t m0 = row_begin + m_tile * TM;
          const int64_t valid = rows - m_tile * TM < TM ? rows - m_tile * TM : TM;
          if (TM > 4 && valid == 1)
            quant_tile<1, TN, Gated, TA, Fmt>(p, w, g, m0, valid, n_tile);
          else if (TM > 4 && valid <= 4)
            quant_tile<(TM > 4 ? 4 : TM), TN, Gated, TA, Fmt>(p, w, g, m0, valid, n_tile);
          else
            quant_tile<TM, TN, Gated, TA, Fmt>(p, w, g, m0, valid, n_tile);
        }
      });
}

}  // namespace moe_xpu

// Instantiations are appended by the launcher, one line per compiled variant, e.g.
// MOE_XPU_INSTANTIATE_QUANT(float, moe_xpu::Int4Weights, float, 1, 8, false).
#define MOE_XPU_QUANT_KERNEL_PARAMS(TA, TOut)                                                          \
  const TA*, int64_t, int64_t, const void*, int, const void*, int64_t, int64_t, int64_t, const void*, \
      int64_t, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const float*, const float*, int64_t, \
      TOut*, int64_t, int64_t, const void*, int, int64_t, int64_t, int64_t, int, int64_t, const void*,  \
      int, const float*
#define MOE_XPU_INSTANTIATE_QUANT(TA, FMT, TOut, TM, TN, GATED) \
  template void moe_xpu::moe_gemm_quant<TA, FMT, TOut, TM, TN, GATED>(MOE_XPU_QUANT_KERNEL_PARAMS(TA, TOut));

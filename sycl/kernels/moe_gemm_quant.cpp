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
// are one contiguous 64-byte load. Columns are stored in chunks of kPackedCols: chunk c holds,
// block by block, the 16 words of each of its columns (words [E][N / 8][K / 128][8][16]; the
// launcher's b_stride_n is the chunk's stride), so a tile of adjacent columns reads its weights as
// one sequential stream, which the hardware prefetchers follow, where a column's words apart were
// as many short streams as the tile has columns.
// Scales (and zero points) are indexed by (n / scale_block_n, k / scale_block_k) through their
// own strides: per output channel (block_n 1, block_k >= K), group-wise along K (block_n 1,
// block_k 32, 64 or 128), DeepSeek-V3's 128 x 128 blocks, MXFP4's blocks of 32. scale_block_k is
// a multiple of 16, so a 16-k step of the sub-group reads one scale per column.
//
// W8A8 (int8 A with a float32 scale per row of A, int8 B): products summed in int32 per lane, the
// lanes' sums converted to float and scaled by a_scale[row] * b_scale[n] before the cross-lane sum;
// on a matrix engine with int8 tiles, moe_gemm_quant_matrix (at the end of this file) instead.
// Weight-only formats (float, half or bf16 A): each B value is dequantized to float and the
// products summed in float, in ascending k per lane: the naive float computation on the
// dequantized weights, with the same rounding behaviour; int8 B (one scale per output channel)
// sums A times the integer values and scales the sums once. 4-bit values are dequantized by a
// table lookup across the sub-group or arithmetically, per device class, with the same bits (see
// packed_step). Bitwise reproducible, as elsewhere.
#include "epilogue.hpp"
#include "matrix_engine.hpp"
#include "scheduler.hpp"

namespace moe_xpu {

inline float fp8_e4m3_to_float(uint32_t x) {
  const uint32_t mag = x & 0x7fu;
  // Normal numbers rebias the exponent (7 -> 127); subnormals are m * 2^-9; 0x7f is NaN.
  float v = mag >= 8u ? sycl::bit_cast<float>((mag << 20) + (120u << 23)) : float(mag) * 0.001953125f;
  v = mag == 0x7fu ? sycl::bit_cast<float>(0x7fc00000u) : v;
  return (x & 0x80u) != 0u ? -v : v;
}

// e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Twice the magnitude of code x & 7 is
// nibble x & 7 of 0xC8643210 (0, 1, 2, 3, 4, 6, 8, 12), bit 3 the sign: integer shifts, no
// comparisons or selects (the arithmetic 4-bit decode of packed_step runs it per weight).
inline float e2m1_to_float(uint32_t x) {
  const float v = float((0xC8643210u >> ((x & 7u) * 4u)) & 0xfu) * 0.5f;
  return sycl::bit_cast<float>(sycl::bit_cast<uint32_t>(v) ^ ((x & 8u) << 28));
}

// Byte-indexed constant tables for the scales and zero points read once per column and block: a
// uniform byte's conversion is then one load, where the CPU compiler computed it in vector
// registers after a broadcast (zero points) or in per-column branches (e8m0's special codes).
struct ByteTable {
  uint32_t bits[256];
};
constexpr ByteTable e8m0_table() {  // 2^(s - 127); 255 is NaN
  ByteTable t{};
  for (uint32_t s = 0; s < 256; ++s) t.bits[s] = s == 0u ? 0x00400000u : s == 255u ? 0x7fc00000u : s << 23;
  return t;
}
constexpr ByteTable byte_float_table() {  // float(s), its bits: s = m * 2^e, m in [1, 2)
  ByteTable t{};
  for (uint32_t s = 1; s < 256; ++s) {
    uint32_t e = 0;
    while ((s >> (e + 1)) != 0u) ++e;
    t.bits[s] = ((127u + e) << 23) | ((s << (23 - e)) & 0x7fffffu);
  }
  return t;
}
inline constexpr ByteTable kE8m0Bits = e8m0_table();
inline constexpr ByteTable kByteFloatBits = byte_float_table();
inline float e8m0_to_float(uint32_t s) { return sycl::bit_cast<float>(kE8m0Bits.bits[s & 0xffu]); }
inline float byte_to_float(uint32_t s) { return sycl::bit_cast<float>(kByteFloatBits.bits[s & 0xffu]); }

struct Int8Weights {
  static constexpr int kScaleBytes = 4;  // float32
  static constexpr int kBits = 8;
  static float value(uint32_t byte, float) { return float(static_cast<int8_t>(byte)); }
  static float scale(const void* s, int64_t i) { return static_cast<const float*>(s)[i]; }
};
struct Fp8Weights {
  static constexpr int kScaleBytes = 4;  // float32
  static constexpr int kBits = 8;
  static float value(uint32_t byte, float) { return fp8_e4m3_to_float(byte); }
  static float scale(const void* s, int64_t i) { return static_cast<const float*>(s)[i]; }
};
struct Int4Weights {
  static constexpr int kScaleBytes = 4;  // float32
  static constexpr int kBits = 4;
  static constexpr bool kZeroPoints = true;
  static float value(uint32_t nibble, float zero) { return float(nibble) - zero; }
  static float scale(const void* s, int64_t i) { return static_cast<const float*>(s)[i]; }
};
struct Mxfp4Weights {
  static constexpr int kScaleBytes = 1;  // e8m0
  static constexpr int kBits = 4;
  static constexpr bool kZeroPoints = false;
  static float value(uint32_t nibble, float) { return e2m1_to_float(nibble); }
  static float scale(const void* s, int64_t i) { return e8m0_to_float(static_cast<const uint8_t*>(s)[i]); }
};

// k per packed 4-bit block: 16 lanes x 8 values.
constexpr int64_t kPackedK = 128;
constexpr int64_t kPackedCols = 8;
constexpr int64_t kPackedBlockWords = kPackedCols * kLanes;  // a chunk's words per block of 128 k

// Word offset of 4-bit column n's first block in expert g (see the file's head); its block kb
// follows at + (kb / kPackedK) * kPackedBlockWords.
inline int64_t packed_column(int64_t g, int64_t n, int64_t b_stride_e, int64_t b_stride_chunk) {
  return g * b_stride_e + (n / kPackedCols) * b_stride_chunk + (n % kPackedCols) * kLanes;
}

// The scale block of column n: one column per block (int4, MXFP4, per-channel scales) skips the
// 64-bit division.
inline int64_t scale_block_of(int64_t n, int64_t block_n) { return block_n == 1 ? n : n / block_n; }

// A quantized kernel's arguments, in its parameter order.
template <typename TA, typename TOut>
struct QuantArgs {
  const TA* a; int64_t a_row_stride; int64_t a_rows; const void* gather_index; int gather_is64;
  const void* b; int64_t b_stride_e; int64_t b_stride_n; int64_t b_stride_k;
  const void* scale; int64_t scale_stride_e; int64_t scale_stride_n; int64_t scale_stride_k;
  int64_t scale_block_n; int64_t scale_block_k; const uint8_t* zero; int64_t zero_stride_e;
  int64_t zero_stride_n; int64_t zero_stride_k; const float* a_scale;
  const float* bias; int64_t bias_stride_e;
  TOut* out; int64_t out_row_stride; int64_t out_rows; const void* group_offsets; int offsets_is64;
  int64_t num_groups; int64_t K; int64_t N; int activation; int64_t up_offset;
  const void* scatter_index; int scatter_is64; const float* row_weight;
};

// Accumulator of one tile element: int32 for W8A8, float otherwise.
template <typename TA>
using QuantAcc = std::conditional_t<std::is_same_v<TA, int8_t>, int32_t, float>;

// B value as the accumulation takes it: the int8 itself for W8A8, else dequantized (times the
// scale of its block).
template <typename TA, typename Fmt>
__attribute__((always_inline)) inline QuantAcc<TA> quant_b_value(uint8_t byte, float scale) {
  if constexpr (std::is_same_v<TA, int8_t>) return int32_t(static_cast<int8_t>(byte));
  else return Fmt::value(byte, 0.0f) * scale;
}

// acc[i][j] += A[row i][k] * bv[j] for one k of every row (rows past the tile repeat its last).
template <int R, int TN, typename TA>
__attribute__((always_inline)) inline void quant_step(QuantAcc<TA> (&acc)[R][TN], const TA* const (&a_row)[R],
                                                      int64_t k, const QuantAcc<TA> (&bv)[TN]) {
  #pragma unroll
  for (int i = 0; i < R; ++i) {
    if constexpr (std::is_same_v<TA, int8_t>) {
      const int32_t av = a_row[i][k];
      #pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] += av * bv[j];
    } else {
      const float av = to_float(a_row[i][k]);
      #pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = sycl::fma(av, bv[j], acc[i][j]);
    }
  }
}

// Asks the memory for the cache line at `at` with x86 `prefetcht0` in inline assembly, which the
// runtime compiler carries through SPIR-V to the CPU backend and runs once per lane (see
// moe_gemm_dot.cpp). syclexp::prefetch is a library call on the CPU device, which inside a k loop
// spills the accumulators. CPU devices only (the kernels' Prefetch parameter); prefetches never
// fault, so a request past the end of B is harmless.
__attribute__((always_inline)) inline void request_line(const void* at) { asm volatile("prefetcht0 (%0)" ::"r"(at)); }

// How far ahead of its k loop an 8-bit tile asks for each column's bytes (with K contiguous).
constexpr int64_t kBytesAhead = 256;

// The whole 16-k steps of 8-bit B read with unit stride along K, from k_begin to k_whole; values
// times their block's scale when Scaled. Prefetch: every 1024 / TN k, lane l asks for line l / TN
// of column l % TN's next 16 / TN lines kBytesAhead ahead, so the memory streams the tile's TN
// columns while it computes (a request for the whole next tile at each unit's start, a burst that
// held the line fill buffers, was slower; see docs/performance_targets.md).
template <bool Scaled, bool Prefetch, int R, int TN, typename TA, typename Fmt>
__attribute__((always_inline)) inline void byte_steps(QuantAcc<TA> (&acc)[R][TN], const TA* const (&a_row)[R],
                                                      const uint8_t* const (&b_col)[TN], int64_t k_begin,
                                                      int64_t k_whole, int lane, const float (&sc)[TN]) {
  constexpr int64_t period = 1024 / TN;  // k a request covers: 16 / TN lines of each column
  const uint8_t* mine = nullptr;         // this lane's line of its column, kBytesAhead on
  if constexpr (Prefetch) {
    mine = b_col[0];
    #pragma unroll
    for (int j = 1; j < TN; ++j) mine = lane % TN == j ? b_col[j] : mine;
    mine += kBytesAhead + (lane / TN) * 64;
  }
  for (int64_t k0 = k_begin; k0 < k_whole; k0 += kLanes) {
    if constexpr (Prefetch)
      if (((k0 - k_begin) & (period - 1)) == 0) request_line(mine + k0);
    const int64_t k = k0 + lane;
    QuantAcc<TA> bv[TN];
    #pragma unroll
    for (int j = 0; j < TN; ++j) bv[j] = quant_b_value<TA, Fmt>(b_col[j][k], Scaled ? sc[j] : 1.0f);
    quant_step<R, TN, TA>(acc, a_row, k, bv);
  }
}

// One 16-k step of a 4-bit kernel: the low values of the lanes' words (k = k0 + lane), which are
// then shifted down for the next step (steps run r = 0..7 in order: a shift by a constant is one
// instruction on AVX-512 where a shift by 4 r, a run-time count, was two), dequantized
// either by a 16-entry table lookup across the sub-group (Lookup: lane l holds the dequantized
// value of code l for each column, its scale and zero point applied, and select_from_group fetches
// entry q: one permute per value where arithmetic decoding took five to eight instructions), or
// arithmetically. The lookup is for devices whose sub-group permute is one instruction (AVX-512's
// 16-lane vpermps, GPU shuffles); on narrower CPUs a 16-lane permute spans registers and the CPU
// compiler spilled the table and read it back lane by lane (AVX2: 10x slower than arithmetic).
// Both give the same bits: (value(q) - z) * scale.
template <bool Lookup, int R, int TN, typename TA, typename Fmt>
__attribute__((always_inline)) inline void packed_step(float (&acc)[R][TN], const TA* const (&a_row)[R],
                                                       uint32_t (&word)[TN], int64_t k,
                                                       const sycl::sub_group& sg, const float (&table)[TN],
                                                       const float (&zero)[TN]) {
  float bv[TN];
  #pragma unroll
  for (int j = 0; j < TN; ++j) {
    const uint32_t q = word[j] & 0xfu;
    word[j] >>= 4;
    if constexpr (Lookup) bv[j] = sycl::select_from_group(sg, table[j], q);
    else bv[j] = Fmt::value(q, zero[j]) * table[j];
  }
  quant_step<R, TN, TA>(acc, a_row, k, bv);
}

// Each column's decode state for the scale block of k. Lookup: table[j] is lane l's entry, code l
// dequantized (code_value: Fmt::value of code l without zero point, computed once); otherwise
// table[j] is the block's scale and zero[j] its zero point. OneZero: every zero point of the
// launch is one_zero (symmetric int4's constant 8): not read per column and block, and
// code_value - one_zero is the same vector for every column, kept out of the k loop.
template <bool Lookup, int TN, typename Fmt, bool OneZero>
__attribute__((always_inline)) inline void packed_tables(float (&table)[TN], float (&zero_of)[TN], int64_t k,
                                                         float code_value, int block_shift, const void* scale,
                                                         const int64_t (&scale_at)[TN], int64_t scale_stride_k,
                                                         const uint8_t* zero, const int64_t (&zero_at)[TN],
                                                         int64_t zero_stride_k, float one_zero) {
  const int64_t block = k >> block_shift;
  #pragma unroll
  for (int j = 0; j < TN; ++j) {
    const float z = !Fmt::kZeroPoints ? 0.0f
                    : OneZero         ? one_zero
                                      : byte_to_float(zero[zero_at[j] + block * zero_stride_k]);
    const float s = Fmt::scale(scale, scale_at[j] + block * scale_stride_k);
    if constexpr (Lookup) {
      table[j] = (code_value - z) * s;
    } else {
      table[j] = s;
      zero_of[j] = z;
    }
  }
}

// How far ahead of its k loop a 4-bit tile asks for its words: 8 blocks of a chunk (4 KB). Two to
// sixteen measured alike; one page ahead keeps the request inside the stream's next page, where
// the hardware prefetchers, which stop at each 4 KB boundary, start late.
constexpr int64_t kWordsAheadBlocks = 8;

// The 8 steps of each whole block of 128 k, the tables rebuilt every S steps (S * 16 k: the
// scale block, or 128 k for blocks of 128 and more). Streams (CPU devices): the tile's word
// streams (gated tiles read two chunks, the gate's and the up columns') requested
// kWordsAheadBlocks ahead, block by block: a one-row tile computes a block about as fast as the
// memory delivers it, and the hardware prefetchers alone did not keep ahead.
template <bool Lookup, int S, int Streams, int R, int TN, typename TA, typename Fmt, bool OneZero>
__attribute__((always_inline)) inline void packed_blocks(float (&acc)[R][TN], const TA* const (&a_row)[R],
                                                         const uint32_t* const (&w_col)[TN], int64_t k_blocks_end,
                                                         const sycl::sub_group& sg, int lane, float code_value,
                                                         int block_shift, const void* scale,
                                                         const int64_t (&scale_at)[TN], int64_t scale_stride_k,
                                                         const uint8_t* zero, const int64_t (&zero_at)[TN],
                                                         int64_t zero_stride_k, float one_zero) {
  for (int64_t kb = 0; kb < k_blocks_end; kb += kPackedK) {
    #pragma unroll
    for (int s = 0; s < Streams; ++s)
      // Lane l the 32 bytes at 32 l: the sub-group the block's 512 bytes, each line twice.
      request_line(reinterpret_cast<const char*>(w_col[s * (TN / 2)] + (kb / kPackedK + kWordsAheadBlocks) * kPackedBlockWords) +
                   32 * lane);
    uint32_t word[TN];
    #pragma unroll
    for (int j = 0; j < TN; ++j) word[j] = w_col[j][(kb / kPackedK) * kPackedBlockWords + lane];
    float table[TN], zero_of[TN];
    // (The table step written as a loop of its own rather than `if (r % S == 0)` in the step loop,
    // which the CPU compiler treated as divergent.)
    for (int r0 = 0; r0 < 8; r0 += S) {
      packed_tables<Lookup, TN, Fmt, OneZero>(table, zero_of, kb + int64_t(kLanes) * r0, code_value, block_shift, scale,
                                              scale_at, scale_stride_k, zero, zero_at, zero_stride_k, one_zero);
      #pragma unroll 2
      for (int r = r0; r < r0 + S; ++r)
        packed_step<Lookup, R, TN, TA, Fmt>(acc, a_row, word, kb + int64_t(kLanes) * r + lane, sg, table, zero_of);
    }
  }
}

// packed_blocks with its table step chosen by the scale block: every 8 steps (128 k) for blocks
// of 128 and more, else every 2; and for formats with zero points, whether the launch has one.
template <bool Lookup, int Streams, int R, int TN, typename TA, typename Fmt, typename... Args>
__attribute__((always_inline)) inline void packed_blocks_for(int64_t scale_block_k, bool one_zero_point, Args&&... args) {
  if (Fmt::kZeroPoints && one_zero_point) {
    if (scale_block_k >= kPackedK) packed_blocks<Lookup, 8, Streams, R, TN, TA, Fmt, true>(args...);
    else packed_blocks<Lookup, 2, Streams, R, TN, TA, Fmt, true>(args...);
  } else {
    if (scale_block_k >= kPackedK) packed_blocks<Lookup, 8, Streams, R, TN, TA, Fmt, false>(args...);
    else packed_blocks<Lookup, 2, Streams, R, TN, TA, Fmt, false>(args...);
  }
}

// One R x TN tile at rows m0 .. m0 + valid_rows - 1 of group g, column tile n_tile.
// (Written like k_lanes_tile: the arguments read into scalars first, loops without lambdas. Read
// through the struct or captured by lambdas, the CPU compiler kept the accumulators and scales in
// per-lane memory and gathered every access: 30x slower.)
template <int R, int TN, bool Gated, bool Lookup, bool Prefetch, typename TA, typename Fmt, typename TOut>
__attribute__((always_inline)) inline void quant_tile(const QuantArgs<TA, TOut>& p, const Worker& w, int64_t g, int64_t m0,
                       int64_t valid_rows, int64_t n_tile) {
  constexpr bool w8a8 = std::is_same_v<TA, int8_t>;
  constexpr int out_cols = Gated ? TN / 2 : TN;
  const TA* a = p.a; const int64_t a_row_stride = p.a_row_stride, a_rows = p.a_rows;
  const void* gather_index = p.gather_index; const int gather_is64 = p.gather_is64;
  const void* b = p.b; const int64_t b_stride_e = p.b_stride_e, b_stride_n = p.b_stride_n, b_stride_k = p.b_stride_k;
  const void* scale = p.scale;
  const int64_t scale_stride_e = p.scale_stride_e, scale_stride_n = p.scale_stride_n, scale_stride_k = p.scale_stride_k;
  const int64_t scale_block_n = p.scale_block_n, scale_block_k = p.scale_block_k;
  const uint8_t* zero = p.zero;
  const int64_t zero_stride_e = p.zero_stride_e, zero_stride_n = p.zero_stride_n, zero_stride_k = p.zero_stride_k;
  const float* a_scale = p.a_scale; const float* bias = p.bias; const int64_t bias_stride_e = p.bias_stride_e;
  const int64_t K = p.K, N = p.N, up_offset = p.up_offset, num_groups = p.num_groups;
  // (Broadcast from lane 0: the CPU compiler then treats the columns' scale addresses as uniform,
  // scalar loads, instead of gathering them per lane.)
  const int64_t n0 = sycl::group_broadcast(w.sg, n_tile * out_cols, 0);
  int64_t b_n[TN];  // the B column behind accumulator column j (gated: gate, then up columns)
  #pragma unroll
  for (int j = 0; j < TN; ++j) b_n[j] = tile_b_column<TN, Gated>(n0, j, N, up_offset);
  QuantAcc<TA> acc[R][TN];
  #pragma unroll
  for (int i = 0; i < R; ++i)
    #pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0;
  float sums[R][TN];
  #pragma unroll
  for (int i = 0; i < R; ++i)
    #pragma unroll
    for (int j = 0; j < TN; ++j) sums[i][j] = 0.0f;
  if (g < num_groups) {
    const TA* a_row[R];
    #pragma unroll
    for (int i = 0; i < R; ++i) {  // rows past the group repeat its last row; not stored
      const int64_t m = m0 + (i < valid_rows ? i : valid_rows - 1);
      a_row[i] = a + source_row(gather_index, gather_is64, m, a_rows) * a_row_stride;
    }
    // Each column's scales along K: element (k / scale_block_k) * scale_stride_k from scale_at[j];
    // its zero points likewise (4-bit formats: the launcher points formats without them at one
    // constant, strides 0).
    // int8 B has one scale per output channel (and W8A8 sums integers): the scale multiplies the
    // sums once at the end instead of every value in the k loop. (Decided per format: with both
    // loops in one kernel, the CPU compiler masked fp8's.)
    constexpr bool end_scale = std::is_same_v<Fmt, Int8Weights>;
    int64_t scale_at[TN], zero_at[TN];
    #pragma unroll
    for (int j = 0; j < TN; ++j) {
      scale_at[j] = sycl::group_broadcast(w.sg, g * scale_stride_e + scale_block_of(b_n[j], scale_block_n) * scale_stride_n, 0);
      zero_at[j] = sycl::group_broadcast(w.sg, g * zero_stride_e + scale_block_of(b_n[j], scale_block_n) * zero_stride_n, 0);
    }
    if constexpr (Fmt::kBits == 8) {
      const uint8_t* b_col[TN];
      #pragma unroll
      for (int j = 0; j < TN; ++j) b_col[j] = static_cast<const uint8_t*>(b) + g * b_stride_e + b_n[j] * b_stride_n;
      // K in scale blocks (one, per channel), each column's scale read once a block. Whole 16-k
      // steps unmasked; the K remainder (only ever at the end of K: blocks shorter than K are
      // multiples of 16) as one masked step, lanes past K reading k = K - 1 and counting zero.
      // B read with unit stride along K (the nn.Linear and checkpoint layout) has a loop of its
      // own: with the stride a run-time value every read is a 16-lane gather.
      const int64_t block_k = scale_block_k < K ? scale_block_k : K;
      const bool unit = b_stride_k == 1;
      for (int64_t kb = 0; kb < K; kb += block_k) {
        const int64_t k_end = kb + block_k < K ? kb + block_k : K;
        const int64_t k_whole = k_end - (k_end - kb) % kLanes;
        float sc[TN];
        #pragma unroll
        for (int j = 0; j < TN; ++j)
          sc[j] = end_scale ? 1.0f : Fmt::scale(scale, scale_at[j] + (kb / scale_block_k) * scale_stride_k);
        if (unit) {
          byte_steps<!end_scale, Prefetch, R, TN, TA, Fmt>(acc, a_row, b_col, kb, k_whole, w.lane, sc);
        } else {
          for (int64_t k0 = kb; k0 < k_whole; k0 += kLanes) {
            const int64_t k = k0 + w.lane;
            QuantAcc<TA> bv[TN];
            #pragma unroll
            for (int j = 0; j < TN; ++j) bv[j] = quant_b_value<TA, Fmt>(b_col[j][k * b_stride_k], sc[j]);
            quant_step<R, TN, TA>(acc, a_row, k, bv);
          }
        }
        if (k_whole < k_end) {
          const bool inside = k_whole + w.lane < K;
          const int64_t k = inside ? k_whole + w.lane : K - 1;
          QuantAcc<TA> bv[TN];  // zero past K (exactly, for the int32 sums)
          #pragma unroll
          for (int j = 0; j < TN; ++j) bv[j] = inside ? quant_b_value<TA, Fmt>(b_col[j][k * b_stride_k], sc[j]) : 0;
          quant_step<R, TN, TA>(acc, a_row, k, bv);
        }
      }
    } else {
      // 4-bit: K is a multiple of the scale block (a power of two of at least 16), so every 16-k
      // step is whole and a step's block is k0 >> block_shift. Column pointers stay uniform and
      // the lane indexes the word, so each column's 16 words are one contiguous load.
      // (A loop, not sycl::clz: the CPU compiler treats the builtin's result as varying per lane,
      // and every scale address after it became a gather.)
      int block_shift = 0;
      while ((int64_t(1) << block_shift) < scale_block_k) ++block_shift;
      const uint32_t* w_col[TN];
      #pragma unroll
      for (int j = 0; j < TN; ++j)
        w_col[j] = static_cast<const uint32_t*>(b) + sycl::group_broadcast(w.sg, packed_column(g, b_n[j], b_stride_e, b_stride_n), 0);
      // Whole blocks of 128 k run their 8 steps unconditionally; a last short block (K a multiple
      // of a smaller scale block) runs its steps in a loop of its own. (An `if (r < steps)` in the
      // unrolled loop was compiled as divergent: every step masked, its values parked on the stack.)
      const int64_t k_blocks_end = K - K % kPackedK;
      const float code_value = Fmt::value(uint32_t(w.lane), 0.0f);
      // Zero points of stride 0 everywhere: one for the launch (the launcher's symmetric constant).
      const bool one_zero_point = Fmt::kZeroPoints && zero_stride_e == 0 && zero_stride_n == 0 && zero_stride_k == 0;
      const float one_zero = one_zero_point ? byte_to_float(zero[0]) : 0.0f;
      constexpr int streams = Prefetch ? (Gated ? 2 : 1) : 0;
      packed_blocks_for<Lookup, streams, R, TN, TA, Fmt>(scale_block_k, one_zero_point, acc, a_row, w_col, k_blocks_end, w.sg,
                                                         w.lane, code_value, block_shift, scale, scale_at, scale_stride_k,
                                                         zero, zero_at, zero_stride_k, one_zero);
      if (k_blocks_end < K) {
        uint32_t word[TN];
        #pragma unroll
        for (int j = 0; j < TN; ++j) word[j] = w_col[j][(k_blocks_end / kPackedK) * kPackedBlockWords + w.lane];
        const int steps = int((K - k_blocks_end) / kLanes);
        for (int r = 0; r < steps; ++r) {
          const int64_t k0 = k_blocks_end + int64_t(kLanes) * r;
          float table[TN], zero_of[TN];
          packed_tables<Lookup, TN, Fmt, false>(table, zero_of, k0, code_value, block_shift, scale, scale_at, scale_stride_k,
                                                zero, zero_at, zero_stride_k, 0.0f);
          packed_step<Lookup, R, TN, TA, Fmt>(acc, a_row, word, k0 + w.lane, w.sg, table, zero_of);
        }
      }
    }
    #pragma unroll
    for (int i = 0; i < R; ++i) {
      float row_scale = 1.0f;
      if constexpr (w8a8) {
        const int64_t m = m0 + (i < valid_rows ? i : valid_rows - 1);
        row_scale = a_scale[source_row(gather_index, gather_is64, m, a_rows)];
      }
      #pragma unroll
      for (int j = 0; j < TN; ++j)
        sums[i][j] = end_scale ? float(acc[i][j]) * (row_scale * Fmt::scale(scale, scale_at[j])) : float(acc[i][j]);
    }
    if (bias != nullptr)  // added once, to lane 0's partial sums
      #pragma unroll
      for (int j = 0; j < TN; ++j) {
        const float bj = w.lane == 0 ? bias[g * bias_stride_e + b_n[j]] : 0.0f;
        #pragma unroll
        for (int i = 0; i < R; ++i) sums[i][j] += bj;
      }
  }
  k_split_epilogue<R, TN, Gated>(w, sums, p.activation, m0, valid_rows, n0, N, p.out, p.out_row_stride,
                                 p.out_rows, p.scatter_index, p.scatter_is64, p.row_weight);
}

// Asks the memory for `runs` runs of `len` bytes, `stride` bytes apart: one request where they
// are adjacent.
inline void prefetch_runs(const char* at, int64_t runs, int64_t stride, int64_t len) {
  if (runs <= 1 || stride == len) {
    syclexp::prefetch(at, std::size_t((runs - 1) * stride + len));
    return;
  }
  for (int64_t r = 0; r < runs; ++r) syclexp::prefetch(at + r * stride, std::size_t(len));
}

// While a unit computes, lane 0 asks the memory for the scales and zero points of the next column
// tile of its group, the worker's next unit but at the end of a row block (the scheduler walks a
// row block's column tiles in order): a column has a few dozen bytes of them, too short a stream
// for the hardware prefetchers. (The weights themselves are requested inside the k loops, a few
// lines at a time: see byte_steps and packed_blocks. Asked for here, a whole next tile at once,
// the burst held the line fill buffers and the core waited on them.) Called before the tile's
// accumulators are live (the CPU device implements prefetch as a library call; see
// prefetch_next_chunk in moe_gemm.cpp). A tile's scale and zero-point rows lie one after another
// in the checkpoint layouts, so each run (gated: the gate and the up run) is one request: the CPU
// compiler turns every request site in lane 0's branch into a call per lane of a 16-lane mask.
// Prefetches never fault, so a tile past N is harmless.
template <int TM, int TN, bool Gated, typename Fmt, typename TA, typename TOut>
inline void prefetch_column_tile(const QuantArgs<TA, TOut>& p, int64_t g, int64_t n_tile, int lane) {
  constexpr int out_cols = Gated ? TN / 2 : TN;
  const int64_t n0 = n_tile * out_cols;
  if (lane == 0 && g < p.num_groups && n0 < p.N && (Fmt::kBits == 4 || p.b_stride_k == 1)) {
    const int64_t blocks = (p.K + p.scale_block_k - 1) / p.scale_block_k;
    const int64_t cols = p.N - n0 < out_cols ? p.N - n0 : out_cols;  // the run's columns inside N
    #pragma unroll
    for (int run = 0; run < (Gated ? 2 : 1); ++run) {
      const int64_t col = n0 + (run == 1 ? p.up_offset : 0);
      // Only where a column's run along K is contiguous (their layouts).
      const int64_t first = scale_block_of(col, p.scale_block_n);
      const int64_t rows = scale_block_of(col + cols - 1, p.scale_block_n) - first + 1;
      if (p.scale_stride_k <= 1)
        prefetch_runs(static_cast<const char*>(p.scale) + (g * p.scale_stride_e + first * p.scale_stride_n) * Fmt::kScaleBytes,
                      rows, p.scale_stride_n * Fmt::kScaleBytes, blocks * Fmt::kScaleBytes);
      if (Fmt::kBits == 4 && p.zero_stride_k == 1)
        prefetch_runs(reinterpret_cast<const char*>(p.zero) + g * p.zero_stride_e + first * p.zero_stride_n, rows,
                      p.zero_stride_n, blocks);
    }
  }
}

// Lookup: the device's 16 lanes are one vector register (GPUs, AVX-512 CPUs; nibble_lookup in
// variants.cpp): 4-bit values are decoded by a sub-group table lookup (packed_step), which gives
// the same bits as arithmetic decoding. Prefetch (CPU devices): the k loops ask for their weights
// ahead (byte_steps, packed_blocks) and each unit for the next one's scales (prefetch_column_tile).
// The 16 lanes split K (as moe_gemm_k_lanes does); each lane keeps TM x TN partial sums of a row
// tile, reduced across the sub-group once per tile. Units are one column tile of one group over
// up to kUnitRows rows, owned by the persistent workers through the shared scheduler. A group's
// short last row tile runs the full tile (rows past the group repeat its last row, not stored):
// with 1- and 4-row tiles beside the 6-row one in the same kernel, as k_lanes does, the CPU
// compiler masked the whole 4-bit loop and gathered its bytes lane by lane (10-15x slower).
template <typename TA, typename Fmt, typename TOut, int TM, int TN, bool Gated, bool Lookup, bool Prefetch>
MOE_XPU_KERNEL
void moe_gemm_quant(const TA* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                    int gather_is64, const void* b, int64_t b_stride_e, int64_t b_stride_n,
                    int64_t b_stride_k, const void* scale, int64_t scale_stride_e,
                    int64_t scale_stride_n, int64_t scale_stride_k, int64_t scale_block_n,
                    int64_t scale_block_k, const uint8_t* zero, int64_t zero_stride_e,
                    int64_t zero_stride_n, int64_t zero_stride_k, const float* a_scale,
                    const float* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                    int64_t out_rows, const void* group_offsets, int offsets_is64,
                    int64_t num_groups, int64_t K, int64_t N, int activation, int64_t up_offset,
                    const void* scatter_index, int scatter_is64, const float* row_weight) {
  static_assert(!Gated || TN % 2 == 0, "gated tiles pair gate and up columns");
  const Worker w = this_worker();
  const QuantArgs<TA, TOut> p{a, a_row_stride, a_rows, gather_index, gather_is64, b, b_stride_e, b_stride_n,
                              b_stride_k, scale, scale_stride_e, scale_stride_n, scale_stride_k, scale_block_n,
                              scale_block_k, zero, zero_stride_e, zero_stride_n, zero_stride_k, a_scale,
                              bias, bias_stride_e, out, out_row_stride, out_rows,
                              group_offsets, offsets_is64, num_groups, K, N, activation, up_offset,
                              scatter_index, scatter_is64, row_weight};
  constexpr int out_cols = Gated ? TN / 2 : TN;
  const int64_t tiles_n = (N + out_cols - 1) / out_cols;
  // A k step reads TN columns of 16 values of Fmt::kBits bits (see unit_cost in scheduler.hpp).
  const UnitCost cost{int64_t(TM) * TN, int64_t(TN) * 7 * Fmt::kBits / 8};
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, kUnitRows / TM, tiles_n, cost,
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        if constexpr (Prefetch) prefetch_column_tile<TM, TN, Gated, Fmt>(p, g, n_tile + 1, w.lane);
        for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
          const int64_t m0 = row_begin + m_tile * TM;
          const int64_t valid = tile_valid_rows(rows, m_tile, TM);
          quant_tile<TM, TN, Gated, Lookup, Prefetch, TA, Fmt>(p, w, g, m0, valid, n_tile);
        }
      });
}

// W8A8 on the matrix engine (AMX-INT8 on Xeon CPUs, XMX int8 on Intel GPUs), for int8 B stored
// with K contiguous (nn.Linear weights) and one scale per output channel: the float matrix
// kernel's transposed product out^T = B^T A^T (matrix_engine.hpp) with int8 tiles and int32
// sums. Each worker packs its row block's int8 token rows four k to a word (the engine's packed
// form for int8) once into its scratch area; the weight rows are the engine's row-major left
// operand, read in place. The epilogue scales each tile's exact int32 sums once:
// (sum * (a_scale[row] * b_scale[n]) + bias[n]) * row weight, as the vector W8A8 kernel does per
// lane before its cross-lane sum (so the two agree to float rounding, not bit for bit). Needs
// K % (the engine tile's k) == 0 and N % Rows == 0 (checked by the launcher).
template <typename TOut, int Rows, int Toks, int KStep, int Lanes>
MOE_XPU_KERNEL_WITH_LANES(Lanes)
void moe_gemm_quant_matrix(const int8_t* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                           int gather_is64, const void* b, int64_t b_stride_e, int64_t b_stride_n,
                           int64_t /*b_stride_k: 1*/, const void* scale, int64_t scale_stride_e,
                           int64_t scale_stride_n, int64_t /*scale_stride_k*/, int64_t scale_block_n,
                           int64_t /*scale_block_k: K*/, const uint8_t* /*zero*/, int64_t, int64_t, int64_t,
                           const float* a_scale, const float* bias, int64_t bias_stride_e, TOut* out,
                           int64_t out_row_stride, int64_t out_rows, const void* group_offsets,
                           int offsets_is64, int64_t num_groups, int64_t K, int64_t N, int /*activation*/,
                           int64_t /*up_offset*/, const void* scatter_index, int scatter_is64,
                           const float* row_weight, void* scratch) {
  using Tile = EngineTile<Rows, Toks, KStep, Lanes>;
  const Worker w = this_worker();
  unsigned char* mine = static_cast<unsigned char*>(scratch) + w.id * matrix_scratch_bytes(K, false);
  uint32_t* packed = reinterpret_cast<uint32_t*>(mine);                  // [tok_tiles][K / 4][Toks]
  int32_t* stored = reinterpret_cast<int32_t*>(mine + matrix_a_bytes(K));  // [4][Rows][Toks]
  constexpr int out_cols = 2 * Rows;  // a unit: two weight tiles
  constexpr int kColumnSteps = (out_cols + Lanes - 1) / Lanes;  // epilogue column c = lane + Lanes * s
  const float* b_scale = static_cast<const float*>(scale);
  for_each_engine_unit<Tile>(
      w, group_offsets, offsets_is64, num_groups, out_rows, N, out_cols, UnitCost{1, 7}, out,
      out_row_stride, scatter_index, scatter_is64, row_weight,
      [&](int64_t j, int64_t m0, int64_t valid) {
        // Lane t packs token t: word r holds its k = 4r .. 4r + 3, low byte first (rows past
        // valid repeat the last one; their outputs are not stored).
        const uint8_t* row = reinterpret_cast<const uint8_t*>(
            tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, w.lane));
        uint32_t* dst = packed + j * (K / 4) * Toks;
        for (int64_t r = 0; r < K / 4; ++r)
          dst[r * Toks + w.lane] = uint32_t(row[4 * r]) | (uint32_t(row[4 * r + 1]) << 8) |
                                   (uint32_t(row[4 * r + 2]) << 16) | (uint32_t(row[4 * r + 3]) << 24);
      },
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n0) {
        int64_t first_row[2];
        const bool second_stored = unit_weight_tiles<false, Rows>(n0, N, 0, first_row);
        const int8_t* w_rows[2];
        for (int i = 0; i < 2; ++i) w_rows[i] = static_cast<const int8_t*>(b) + g * b_stride_e + first_row[i] * b_stride_n;
        int64_t col[kColumnSteps];  // this lane's output column per step, and its scale and bias
        bool stores[kColumnSteps];
        float col_scale[kColumnSteps], bias_v[kColumnSteps];
        #pragma unroll
        for (int s = 0; s < kColumnSteps; ++s) {
          const int c = w.lane + Lanes * s;
          stores[s] = c < out_cols && (c < Rows || second_stored);
          col[s] = n0 + (stores[s] ? c : 0);
          col_scale[s] = b_scale[g * scale_stride_e + scale_block_of(col[s], scale_block_n) * scale_stride_n];
          bias_v[s] = bias != nullptr ? bias[g * bias_stride_e + col[s]] : 0.0f;
        }
        for (int64_t t = m_first; t < m_last; t += 2) {
          const int pair = t + 1 < m_last ? 2 : 1;
          const uint32_t* x = packed + (t - m_first) * (K / 4) * Toks;
          if (pair == 2) matrix_k_loop<Tile, 2, int8_t, int32_t>(w.sg, w_rows, b_stride_n, x, K, stored);
          else matrix_k_loop<Tile, 1, int8_t, int32_t>(w.sg, w_rows, b_stride_n, x, K, stored);
          for (int j = 0; j < pair; ++j) {
            const int32_t* tile = stored + j * 2 * Rows * Toks;  // [weight tile][weight row][token]
            const int64_t m0 = row_begin + (t + j) * Toks;
            const int64_t valid = tile_valid_rows(rows, t + j, Toks);
            for (int64_t m = 0; m < valid; ++m) {
              const float row_scale = a_scale[source_row(gather_index, gather_is64, m0 + m, a_rows)];
              const RowTarget target = row_target(scatter_index, scatter_is64, row_weight, m0 + m, out_rows);
              TOut* dst = out + target.row * out_row_stride;
              #pragma unroll
              for (int s = 0; s < kColumnSteps; ++s) {
                if (!stores[s]) continue;
                const int c = int(col[s] - n0);
                const float v = float(tile[c * Toks + m]) * (row_scale * col_scale[s]) + bias_v[s];
                dst[col[s]] = FromFloat<TOut>::convert(v * target.weight);
              }
            }
          }
        }
      });
}

// Weight-only formats on the matrix engine, bf16 activations: each unit dequantizes its two
// weight tiles' rows into the worker's scratch area as bf16, exactly: the unscaled values of
// int8 (integers up to 128), fp8 e4m3 (a 3-bit mantissa and an exponent range inside bf16's) and
// int4 (q - z, integers up to 15); MXFP4's e2m1 values times their power-of-two block scale (exact
// unless it falls below bf16's normal range, under 2^-126, where the engine reads zero). The float
// matrix kernel's k loop and epilogue then run on them, so products are exact and summed in
// float32. Scales: one per output channel (block_k >= K, and MXFP4's folded ones) multiply the
// float sums in the epilogue; scales per K block (int4 groups, fp8's 128 x 128 blocks) multiply
// each block's engine sums, which are added up in float in ascending k. The dequantized rows
// serve every token tile of the unit's row block. Needs K % (the engine tile's k) == 0 and
// N % Rows == 0, and K-blocked scales blocks of whole engine steps (checked by the launcher).
template <typename Fmt>
constexpr bool kFoldedScales = std::is_same_v<Fmt, Mxfp4Weights>;

// One weight row (K values at b + row: bytes for 8-bit formats; for 4-bit, the words of its first
// block, packed_column) dequantized to bf16 bits in dst, exactly: the values without their scale (int8, fp8 and int4's integers less the
// zero point zero_at(k) are exact in bf16), MXFP4's power-of-two scale folded_scale(k) folded in
// (exact above 2^-126). Uniform loops over whole sub-group steps (K is whole engine steps): per-lane
// bounds made every load and store masked.
template <typename Fmt, int Lanes, typename FoldedScale, typename ZeroAt>
__attribute__((always_inline)) inline void dequantize_row_bf16(uint16_t* dst, const void* b, int64_t row, int64_t K,
                                                                int lane, FoldedScale folded_scale, ZeroAt zero_at) {
  auto bf16_bits = [](float v) { return uint16_t(sycl::bit_cast<uint32_t>(v) >> 16); };
  if constexpr (Fmt::kBits == 8) {
    const uint8_t* bytes = static_cast<const uint8_t*>(b) + row;
    for (int64_t k0 = 0; k0 < K; k0 += Lanes) dst[k0 + lane] = bf16_bits(Fmt::value(bytes[k0 + lane], 0.0f));
  } else {
    // Word l of each 128-k block holds k = 16 s + l, s = 0..7 (see the file's head).
    const uint32_t* words = static_cast<const uint32_t*>(b) + row;
    for (int64_t kb = 0; kb < K; kb += kPackedK) {
      const uint32_t word = words[(kb / kPackedK) * kPackedBlockWords + lane];
      const int steps = K - kb < kPackedK ? int((K - kb) / kLanes) : 8;
      for (int step = 0; step < steps; ++step) {
        const int64_t k0 = kb + int64_t(kLanes) * step;
        const uint32_t q = (word >> (4 * step)) & 0xfu;
        if constexpr (kFoldedScales<Fmt>) dst[k0 + lane] = bf16_bits(Fmt::value(q, 0.0f) * folded_scale(k0));
        else dst[k0 + lane] = bf16_bits(Fmt::value(q, zero_at(k0)));
      }
    }
  }
}

template <typename Fmt, typename TOut, bool Gated, int Rows, int Toks, int KStep, int Lanes>
MOE_XPU_KERNEL_WITH_LANES(Lanes)
void moe_gemm_dequant_matrix(const uint16_t* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                             int gather_is64, const void* b, int64_t b_stride_e, int64_t b_stride_n,
                             int64_t /*b_stride_k: 1*/, const void* scale, int64_t scale_stride_e,
                             int64_t scale_stride_n, int64_t scale_stride_k, int64_t scale_block_n,
                             int64_t scale_block_k, const uint8_t* zero, int64_t zero_stride_e,
                             int64_t zero_stride_n, int64_t zero_stride_k, const float* /*a_scale*/,
                             const float* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                             int64_t out_rows, const void* group_offsets, int offsets_is64, int64_t num_groups,
                             int64_t K, int64_t N, int activation, int64_t up_offset, const void* scatter_index,
                             int scatter_is64, const float* row_weight, void* scratch) {
  using Tile = EngineTile<Rows, Toks, KStep, Lanes>;
  const Worker w = this_worker();
  unsigned char* mine = static_cast<unsigned char*>(scratch) + w.id * dequant_matrix_scratch_bytes(K);
  uint32_t* packed = reinterpret_cast<uint32_t*>(mine);                   // [tok_tiles][K / 2][Toks]
  float* stored = reinterpret_cast<float*>(mine + matrix_a_bytes(K));     // [4][Rows][Toks]
  uint16_t* values = reinterpret_cast<uint16_t*>(mine + matrix_scratch_bytes(K, false));  // [2][Rows][K]
  float* block_sums = reinterpret_cast<float*>(values + 2 * kMatRows * K);  // [4][Rows][Toks]
  constexpr int out_cols = Gated ? Rows : 2 * Rows;
  const bool blocked = !kFoldedScales<Fmt> && scale_block_k < K;
  // (A loop, not sycl::clz, as in quant_tile.)
  int block_shift = 0;
  while ((int64_t(1) << block_shift) < scale_block_k) ++block_shift;
  auto scale_of = [&](int64_t g, int64_t n, int64_t k) {
    return Fmt::scale(scale, g * scale_stride_e + scale_block_of(n, scale_block_n) * scale_stride_n + (k >> block_shift) * scale_stride_k);
  };
  for_each_engine_unit<Tile>(
      w, group_offsets, offsets_is64, num_groups, out_rows, N, out_cols, UnitCost{1, 7}, out,
      out_row_stride, scatter_index, scatter_is64, row_weight,
      pair_packer<Toks, uint16_t>(a, a_row_stride, a_rows, gather_index, gather_is64, K, w.lane, packed),
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n0) {
        // The two weight tiles' rows dequantized into `values`.
        int64_t n_tile[2];
        const bool second_stored = unit_weight_tiles<Gated, Rows>(n0, N, up_offset, n_tile);
        for (int i = 0; i < 2; ++i)
          for (int r = 0; r < Rows; ++r) {
            const int64_t n = n_tile[i] + r;
            dequantize_row_bf16<Fmt, Lanes>(
                values + (i * Rows + r) * K, b,
                Fmt::kBits == 4 ? packed_column(g, n, b_stride_e, b_stride_n) : g * b_stride_e + n * b_stride_n, K, w.lane,
                [&](int64_t k) { return scale_of(g, n, k); },
                [&](int64_t k) {
                  return float(zero[g * zero_stride_e + scale_block_of(n, scale_block_n) * zero_stride_n +
                                    (k >> block_shift) * zero_stride_k]);
                });
          }
        const bf16* w_rows[2] = {reinterpret_cast<const bf16*>(values),
                                 reinterpret_cast<const bf16*>(values + Rows * K)};
        auto whole_k = [&](auto tiles, const uint32_t* x) {
          matrix_k_loop<Tile, decltype(tiles)::value>(w.sg, w_rows, K, x, K, stored);
        };
        // Scales per K block: each block's sums (token tile j, weight tile i, row r) times the
        // scale of row n_tile[i] + r, added up in float in ascending k.
        auto k_blocks = [&](auto tiles, const uint32_t* x) {
          constexpr int Tiles = decltype(tiles)::value;
          for (int t = 0; t < Tiles * 2 * Rows; ++t) stored[t * Toks + w.lane] = 0.0f;
          for (int64_t kb = 0; kb < K; kb += scale_block_k) {
            const bf16* block_rows[2] = {w_rows[0] + kb, w_rows[1] + kb};
            const int64_t len = K - kb < scale_block_k ? K - kb : scale_block_k;  // whole engine steps
            matrix_k_loop<Tile, Tiles>(w.sg, block_rows, K, x + (kb / 2) * Toks, K, block_sums, len);
            for (int j = 0; j < Tiles; ++j)
              for (int i = 0; i < 2; ++i) {
                #pragma unroll 1
                for (int r = 0; r < Rows; ++r) {
                  const int64_t at = ((2 * j + i) * Rows + r) * Toks + w.lane;
                  stored[at] = sycl::fma(block_sums[at], scale_of(g, n_tile[i] + r, kb), stored[at]);
                }
              }
          }
        };
        auto column = [&](int64_t n, float& col_scale, float& bias_n) {
          col_scale = blocked || kFoldedScales<Fmt> ? 1.0f : scale_of(g, n, 0);
          bias_n = bias != nullptr ? bias[g * bias_stride_e + n] : 0.0f;
        };
        if (blocked)
          matrix_unit_tiles<Tile, Gated>(w, k_blocks, packed, K, stored, n0, second_stored, up_offset, row_begin,
                                         rows, m_first, m_last, activation, out, out_row_stride, out_rows,
                                         scatter_index, scatter_is64, row_weight, column);
        else
          matrix_unit_tiles<Tile, Gated>(w, whole_k, packed, K, stored, n0, second_stored, up_offset, row_begin,
                                         rows, m_first, m_last, activation, out, out_row_stride, out_rows,
                                         scatter_index, scatter_is64, row_weight, column);
      });
}

}  // namespace moe_xpu

// Instantiations are appended by the launcher, one line per compiled variant, e.g.
// MOE_XPU_INSTANTIATE_QUANT(float, moe_xpu::Int4Weights, float, 1, 8, false, true, true).
#define MOE_XPU_QUANT_KERNEL_PARAMS(TA, TOut)                                                          \
  const TA*, int64_t, int64_t, const void*, int, const void*, int64_t, int64_t, int64_t, const void*, \
      int64_t, int64_t, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t,          \
      const float*, const float*, int64_t,                                                           \
      TOut*, int64_t, int64_t, const void*, int, int64_t, int64_t, int64_t, int, int64_t, const void*,  \
      int, const float*
#define MOE_XPU_INSTANTIATE_QUANT(TA, FMT, TOut, TM, TN, GATED, LOOKUP, PREFETCH) \
  template void moe_xpu::moe_gemm_quant<TA, FMT, TOut, TM, TN, GATED, LOOKUP, PREFETCH>(MOE_XPU_QUANT_KERNEL_PARAMS(TA, TOut));
#define MOE_XPU_INSTANTIATE_QUANT_MATRIX(TOut, ROWS, TOKS, KSTEP, LANES) \
  template void moe_xpu::moe_gemm_quant_matrix<TOut, ROWS, TOKS, KSTEP, LANES>(MOE_XPU_QUANT_KERNEL_PARAMS(int8_t, TOut), void*);
#define MOE_XPU_INSTANTIATE_DEQUANT_MATRIX(FMT, TOut, GATED, ROWS, TOKS, KSTEP, LANES)               \
  template void moe_xpu::moe_gemm_dequant_matrix<FMT, TOut, GATED, ROWS, TOKS, KSTEP, LANES>(       \
      MOE_XPU_QUANT_KERNEL_PARAMS(uint16_t, TOut), void*);

// moe_xpu grouped GEMM kernels.
//
// This file is SYCL device source compiled at run time by the SYCL runtime compiler
// (sycl_ext_oneapi_kernel_compiler) for the device at hand; the launcher
// (sycl/launcher.cpp) embeds it and instantiates the names listed there.
//
// One launch computes every group's GEMM: out[m] = A[row(m)] @ B[g] (+ bias[g]) for the rows
// m of group g, where group g owns rows [group_offsets[g-1], group_offsets[g]) and
// row(m) = gather_index[m] when an index table is given, else m.
//
// Scheduling: a fixed set of workers (one sub-group each) loops over the work units of all
// groups. A unit is one column tile of one group over several row tiles, so its slice of B is
// read from memory once and reused from cache. Each worker derives every group's units from the
// cumulative row offsets in device memory and takes those centred in its equal share of the
// total cost (row tiles plus B streaming), so skewed routing stays balanced. Empty groups cost
// one offset read. Rows at or past group_offsets[E-1] form a last "tail" group whose tiles are
// written with zeros, so no separate memset is needed.
//
// All addresses are 64-bit offsets from the base pointers; no per-group pointer arrays.
// Each output element is produced by exactly one work-item with a fixed k order, so results
// are bitwise reproducible.
#include "epilogue.hpp"
#include "matrix_engine.hpp"
#include "scheduler.hpp"

namespace moe_xpu {

// Row tiles from which a K-split unit walks K in long chunks (see moe_gemm_k_lanes).
constexpr int64_t kLongChunkTiles = 6;
// B rows up to this long are read one after another by the K-split kernel's one-row tiles.
constexpr int64_t kShortRowBytes = 2048;


// One k step of a vector kernel's tile: acc[i][j] += A[row i][k] * bv[j], rows in order, so every
// accumulator sees its k values in ascending order whatever the tile or chunking.
template <int R, int TN, typename TA>
__attribute__((always_inline)) inline void fma_step(float (&acc)[R][TN], const TA* const (&a_row)[R], int64_t k, const float (&bv)[TN]) {
  #pragma unroll
  for (int i = 0; i < R; ++i) {
    const float av = to_float(a_row[i][k]);
    #pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = sycl::fma(av, bv[j], acc[i][j]);
  }
}

// The vector kernels' K chunks (KChunk > 0, CPU): a unit's row tiles run each chunk in turn and
// park their partial sums in work-group local memory in between: [Tiles][TM][TN][16 lanes].
// nullptr without chunks.
template <int64_t Tiles, int TM, int TN, int KChunk>
inline float* partial_sums_area() {
  if constexpr (KChunk > 0)
    return local_floats<Tiles * TM * TN * kLanes>();
  else
    return nullptr;
}

// bf16 B whose rows start 4-byte aligned can be read as 32-bit words of two adjacent columns,
// each widened with one integer op.
inline bool bf16_words_readable(const void* b, int64_t b_stride_e, int64_t b_stride_k) {
  return (reinterpret_cast<uintptr_t>(b) & 3) == 0 && (b_stride_e | b_stride_k) % 2 == 0;
}
inline void widen_bf16_word(uint32_t word, float& lo, float& hi) {
  lo = sycl::bit_cast<float>(word << 16);
  hi = sycl::bit_cast<float>(word & 0xffff0000u);
}

// A tile's parked partial sums: element (i, j) at lane_saved[(i * TN + j) * 16], where lane_saved
// points at this lane's slot of the tile. Resuming with from_saved false starts at zero. (The
// flag is uniform across the sub-group; testing the per-lane pointer instead made the one-row
// decode tile about 30% slower on the CPU device.)
template <int R, int TN>
inline void park_partial_sums(float* lane_saved, const float (&acc)[R][TN]) {
  #pragma unroll
  for (int i = 0; i < R; ++i)
    #pragma unroll
    for (int j = 0; j < TN; ++j) lane_saved[(i * TN + j) * kLanes] = acc[i][j];
}
template <int R, int TN>
inline void resume_partial_sums(float (&acc)[R][TN], bool from_saved, const float* lane_saved) {
  #pragma unroll
  for (int i = 0; i < R; ++i)
    #pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = from_saved ? lane_saved[(i * TN + j) * kLanes] : 0.0f;
}

// The share of the next K chunk a K-chunked unit's row tile asks the memory for (CPU only):
// row tile `part` of `parts` (parts == 0: none).
struct PrefetchShare {
  int part;
  int parts;
};

// While a K-chunked unit's row tiles compute one chunk from cache, they ask the memory for the
// next chunk of the unit's B rows (after the last chunk: the first chunk of the next column
// tile's rows, the worker's next unit, b_next_unit elements further on), each row tile its
// share. The hardware prefetchers do not run ahead of a unit's short strips of B rows, so
// without this the memory idles while the unit computes. Lane 0 makes one call per B row, before
// the tile's accumulators are live: the CPU device implements prefetch as a library call, and a
// call inside the k loop spills every accumulator (prefetching there made the loop 2.5x slower).
// Prefetches never fault, so a share past the end of B (last column tile) is harmless.
template <int TN, typename T>
inline void prefetch_next_chunk(const T* b_group, const int64_t (&b_n)[TN], int64_t b_stride_n,
                                int64_t b_next_unit, int64_t k_begin, int64_t k_end, int64_t K,
                                PrefetchShare share, int lane) {
  if (share.parts == 0) return;
  const int64_t len = k_end - k_begin;
  const int64_t step = k_end < K ? len : b_next_unit - k_begin;  // from this chunk to the next
  const int64_t part_len = (len + share.parts - 1) / share.parts;
  const int64_t from = k_begin + share.part * part_len;
  const int64_t count = from + part_len < k_end ? part_len : k_end - from;
  // (Written as one guarded block: an early return for the other lanes measured 5-10% slower.)
  if (lane == 0 && count > 0) {
    #pragma unroll
    for (int j = 0; j < TN; ++j)
      syclexp::prefetch(b_group + b_n[j] * b_stride_n + from + step, std::size_t(count));
  }
}

// A vector kernel's arguments, in its parameter order, handed to its bodies in one piece.
// b_stride_other is B's stride along the dimension the lanes do not split (N for the K-split
// kernel, K for the N-split one). A may be wider than B (float A with 16-bit B: the launcher's
// caller widened A once, so the k loop converts only B).
template <typename TA, typename T, typename TOut>
struct VectorArgs {
  const TA* a; int64_t a_row_stride; int64_t a_rows; const void* gather_index; int gather_is64;
  const T* b; int64_t b_stride_e; int64_t b_stride_other; const T* bias; int64_t bias_stride_e;
  TOut* out; int64_t out_row_stride; int64_t out_rows; const void* group_offsets; int offsets_is64;
  int64_t num_groups; int64_t K; int64_t N; int activation; int64_t up_offset;
  const void* scatter_index; int scatter_is64; const float* row_weight;
};

// One R x TN tile of the K-split kernel at rows m0 .. m0 + valid_rows - 1 of group g.
template <int R, int TN, bool Gated, typename TA, typename T, typename TOut>
inline void k_lanes_tile(const VectorArgs<TA, T, TOut>& p, const Worker& w, int64_t g,
                         int64_t num_groups, int64_t m0, int64_t valid_rows, int64_t n_tile,
                         int64_t k_begin, int64_t k_end, float* saved, PrefetchShare prefetch) {
  const TA* a = p.a; const int64_t a_row_stride = p.a_row_stride, a_rows = p.a_rows;
  const void* gather_index = p.gather_index; const int gather_is64 = p.gather_is64;
  const T* b = p.b; const int64_t b_stride_e = p.b_stride_e, b_stride_n = p.b_stride_other;
  const T* bias = p.bias; const int64_t bias_stride_e = p.bias_stride_e;
  TOut* out = p.out; const int64_t out_row_stride = p.out_row_stride, out_rows = p.out_rows;
  const int64_t K = p.K, N = p.N, up_offset = p.up_offset;
  const int activation = p.activation;
  const void* scatter_index = p.scatter_index; const int scatter_is64 = p.scatter_is64;
  const float* row_weight = p.row_weight;
  // Gated activation: output column n is act(B column n) * (B column n + up_offset), so a tile's
  // TN accumulator columns are TN/2 gate columns followed by the matching TN/2 up columns.
  constexpr bool gated = Gated;
  constexpr int out_cols = gated ? TN / 2 : TN;
  const int64_t n0 = n_tile * out_cols;
  int64_t b_n[TN];  // the B column behind accumulator column j
  #pragma unroll
  for (int j = 0; j < TN; ++j) b_n[j] = tile_b_column<TN, Gated>(n0, j, N, up_offset);
  // K chunks: partial sums of [k_begin, k_end) are added to those saved by earlier chunks; a
  // chunk that does not end K saves them (lane-major, at saved) instead of finishing the tile.
  const bool first = k_begin == 0, last = k_end == K;
  if (g < num_groups)
    prefetch_next_chunk(b + g * b_stride_e, b_n, b_stride_n, int64_t(out_cols) * b_stride_n, k_begin,
                        k_end, K, prefetch, w.lane);
  float acc[R][TN];
  resume_partial_sums(acc, !first, saved);
  if (g < num_groups) {
    const TA* a_row[R];
    #pragma unroll
    for (int i = 0; i < R; ++i)
      a_row[i] = tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid_rows, i);
    const T* b_col[TN];
    #pragma unroll
    for (int j = 0; j < TN; ++j) b_col[j] = b + g * b_stride_e + b_n[j] * b_stride_n;
    // Uniform trip count (every lane runs the same iterations), so the vectorizer emits
    // plain unmasked vector loads; the K remainder is one masked step.
    const int64_t k_full = last ? K - K % kLanes : k_end;  // chunks end at multiples of 16
    if (R == 1 && K * int64_t(sizeof(T)) <= kShortRowBytes) {
      // One-row tiles over short B rows (the fused MoE's second GEMM in decode) read their TN
      // weight rows one after another, a single sequential stream, instead of side by side:
      // TN streams of a few dozen cache lines each are too short for the hardware prefetchers
      // to pay off. 32 one-row experts, cold cache: bf16 K = 768 8.4 -> 5.3 ms; with 4 KB rows
      // (bf16 K = 2048) side by side stays faster, 9.7 vs 10.5 ms. Same k order per sum.
      #pragma unroll
      for (int j = 0; j < TN; ++j)
        for (int64_t k0 = k_begin; k0 < k_full; k0 += kLanes) {
          const int64_t k = k0 + w.lane;
          acc[0][j] = sycl::fma(to_float(a_row[0][k]), to_float(b_col[j][k]), acc[0][j]);
        }
    } else {
      for (int64_t k0 = k_begin; k0 < k_full; k0 += kLanes) {
        const int64_t k = k0 + w.lane;
        float bv[TN];
        #pragma unroll
        for (int j = 0; j < TN; ++j) bv[j] = to_float(b_col[j][k]);
        fma_step(acc, a_row, k, bv);
      }
    }
    if (k_full < k_end) {
      const int64_t k = k_full + w.lane < K ? k_full + w.lane : K - 1;
      const float keep = k_full + w.lane < K ? 1.0f : 0.0f;
      float bv[TN];
      #pragma unroll
      for (int j = 0; j < TN; ++j) bv[j] = keep * to_float(b_col[j][k]);
      fma_step(acc, a_row, k, bv);
    }
    if (!last) {
      park_partial_sums(saved, acc);
      return;
    }
    if (bias != nullptr)  // added once, to lane 0's partial sums
      #pragma unroll
      for (int j = 0; j < TN; ++j) {
        const float bj = w.lane == 0 ? to_float(bias[g * bias_stride_e + b_n[j]]) : 0.0f;
        #pragma unroll
        for (int i = 0; i < R; ++i) acc[i][j] += bj;
      }
  }
  k_split_epilogue<R, TN, Gated>(w, acc, activation, m0, valid_rows, n0, N, out, out_row_stride, out_rows,
                                 scatter_index, scatter_is64, row_weight);
}

// Variant for B stored with K contiguous (b_stride_k == 1), e.g. nn.Linear weights [E, N, K]
// seen through .transpose(1, 2). The 16 lanes split K; each lane keeps TM x TN partial sums,
// reduced across the sub-group once per tile. Both A and B are read as contiguous vectors.
// Gated kernels (activation != kNone, even TN) are separate instantiations: each kernel holds one
// epilogue, so every loop over the accumulators has a fixed trip count and they stay in
// registers (a kernel holding both grew large enough that the CPU compiler outlined and
// de-vectorized it). TA, the type of A, is T or (for 16-bit T) float: A is re-read for every
// column tile while each B value serves a whole row tile, so for tall tiles a float copy of A
// made once per call leaves only B to widen in the k loop. KChunk > 0 (CPU, tall tiles): units
// of several row tiles walk K in chunks of KChunk, the row tiles' partial sums parked in
// work-group local memory (one sub-group per work-group) between chunks.
template <typename TA, typename T, typename TOut, int TM, int TN, bool Gated, int KChunk>
MOE_XPU_KERNEL
void moe_gemm_k_lanes(const TA* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                      int gather_is64, const T* b, int64_t b_stride_e, int64_t b_stride_n,
                      const T* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                      int64_t out_rows, const void* group_offsets, int offsets_is64,
                      int64_t num_groups, int64_t K, int64_t N, int activation, int64_t up_offset,
                      const void* scatter_index, int scatter_is64, const float* row_weight) {
  static_assert(!Gated || TN % 2 == 0, "gated tiles pair gate and up columns");
  constexpr int kTileElems = TM * TN * kLanes;  // one row tile's partial sums, lane-major
  float* partial = partial_sums_area<kUnitRows / TM, TM, TN, KChunk>();
  const Worker w = this_worker();
  const VectorArgs<TA, T, TOut> p{a, a_row_stride, a_rows, gather_index, gather_is64, b, b_stride_e,
                                  b_stride_n, bias, bias_stride_e, out, out_row_stride, out_rows,
                                  group_offsets, offsets_is64, num_groups, K, N, activation, up_offset,
                                  scatter_index, scatter_is64, row_weight};
  constexpr int out_cols = Gated ? TN / 2 : TN;
  const int64_t tiles_n = (N + out_cols - 1) / out_cols;
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, kUnitRows / TM, tiles_n,
      unit_cost<T, TM, TN>(),
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        // Units of several row tiles walk K in chunks (KChunk > 0, CPU): all of a unit's row
        // tiles run one chunk, its B rows in cache, while they prefetch the next chunk (see
        // prefetch_next_chunk), so the memory streams while the unit computes. Chunk length
        // follows the unit's height: two row tiles compute a chunk briefly, so short chunks
        // keep the prefetch bursts small; kLongChunkTiles or more compute long enough that
        // parking their partial sums between chunks costs more than shorter chunks gain (bench
        // cases, float32, cold cache, same process, medians of 7: chunks of 256 for every height
        // -> 128 / 256 / 512: 64tok-E64 53.9 -> 49.9 ms, fused 64tok second GEMM 28.7 -> 25.3 ms;
        // prefill (3 row tiles a unit) unchanged). One-row-tile units read their B slice
        // once, from memory: no chunks (chunked and prefetched, they measured the same).
        const int64_t tiles = m_last - m_first;
        const bool chunked = KChunk > 0 && tiles > 1 && g < num_groups;
        const int64_t chunk = !chunked ? (K > 0 ? K : 1)
                              : tiles >= kLongChunkTiles ? 2 * KChunk
                              : tiles == 2               ? KChunk / 2
                                                         : KChunk;
        for (int64_t k_begin = 0; k_begin < (K > 0 ? K : 1); k_begin += chunk) {
          const int64_t k_end = k_begin + chunk < K ? k_begin + chunk : K;
          for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
            const int64_t m0 = row_begin + m_tile * TM;
            const int64_t valid = tile_valid_rows(rows, m_tile, TM);
            float* saved = KChunk > 0 ? partial + (m_tile - m_first) * kTileElems + w.lane : nullptr;
            const PrefetchShare prefetch{int(m_tile - m_first), chunked ? int(tiles) : 0};
            // A group's last row tile is often short (always, for experts with a row or two under
            // skewed routing): run it with a shorter compiled tile instead of computing padding.
            // (Only for tiles taller than 4: pairing a 1-row variant with the 4-row tile measured
            // several times slower on the CPU device.)
            if (TM > 4 && valid == 1)
              k_lanes_tile<1, TN, Gated>(p, w, g, num_groups, m0, valid, n_tile, k_begin, k_end, saved, prefetch);
            else if (TM > 4 && valid <= 4)
              k_lanes_tile<(TM > 4 ? 4 : TM), TN, Gated>(p, w, g, num_groups, m0, valid, n_tile, k_begin, k_end, saved,
                                                        prefetch);
            else
              k_lanes_tile<TM, TN, Gated>(p, w, g, num_groups, m0, valid, n_tile, k_begin, k_end, saved, prefetch);
          }
        }
      });
}

// One pass of a one-row streaming unit over RK consecutive k rows: every sum vector u of the
// block gets a[k] * B[k][u] + ... + a[k + RK - 1] * B[k + RK - 1][u], in k order. A read unit
// yields P adjacent columns per lane (P = 2: a word of two bf16 columns); b_values(k, offset, bv)
// reads them. last_offset is the clamped offset of the last, possibly partial, read unit.
template <int P, int RK, typename TA, typename BValues>
inline void row_stream_pass(float* lane_sums, const TA* a_row, int64_t k, int64_t read_units,
                            int64_t last_offset, BValues&& b_values) {
  float av[RK];
  #pragma unroll
  for (int r = 0; r < RK; ++r) av[r] = to_float(a_row[k + r]);
  auto step = [&](int64_t u, int64_t offset) {
    float s[P];
    #pragma unroll
    for (int p = 0; p < P; ++p) s[p] = lane_sums[(P * u + p) * kLanes];
    #pragma unroll
    for (int r = 0; r < RK; ++r) {
      float bv[P];
      b_values(k + r, offset, bv);
      #pragma unroll
      for (int p = 0; p < P; ++p) s[p] = sycl::fma(av[r], bv[p], s[p]);
    }
    #pragma unroll
    for (int p = 0; p < P; ++p) lane_sums[(P * u + p) * kLanes] = s[p];
  };
  for (int64_t u = 0; u + 1 < read_units; ++u) step(u, u * kLanes);
  step(read_units - 1, last_offset);
}

// Runs the passes of a whole K: 4 k rows a pass (each sum is loaded and stored once per 4 FMAs,
// and B is read as 4 sequential streams), then the remainder one row at a time.
template <int P, typename TA, typename BValues>
inline void row_stream_k(float* lane_sums, const TA* a_row, int64_t K, int64_t read_units,
                         int64_t last_offset, BValues&& b_values) {
  constexpr int kRowsPerPass = 4;
  const int64_t k_full = K - K % kRowsPerPass;
  for (int64_t k = 0; k < k_full; k += kRowsPerPass)
    row_stream_pass<P, kRowsPerPass>(lane_sums, a_row, k, read_units, last_offset, b_values);
  for (int64_t k = k_full; k < K; ++k)
    row_stream_pass<P, 1>(lane_sums, a_row, k, read_units, last_offset, b_values);
}

// The N-split kernel's one-row tiles on the CPU (TN > kRegisterTileVectors): a unit is one row
// of a group across a block of 16 * TN columns, and every k step reads that block's stretch of a
// B row (8 KB of float), four k rows a pass: long sequential streams the hardware prefetchers
// follow. A register tile's narrow strip (1.5 KB of each 6 KB row at {1, 24}) moves to a new 4 KB
// page at every k step, which they do not follow. The row's sums live in work-group local memory
// (one sub-group per work-group): lane l holds column n0 + 16 v + l in sum vector v, or, for bf16
// B read as words of two columns (4-byte aligned rows, even N), columns n0 + 32 v + 2 l + {0, 1}
// in sum vectors 2 v and 2 v + 1. [E, K, N] decode, weights not in cache: float32 19.5 -> 14.4
// ms (grouped_mm 15.8), bfloat16 12.9 -> 9.3 ms (matrix engine 13.2).
template <int TN, typename TA, typename T, typename TOut>
inline void n_lanes_row_stream(const VectorArgs<TA, T, TOut>& p) {
  float* sums = local_floats<TN * kLanes>();
  const Worker w = this_worker();
  const int64_t b_stride_k = p.b_stride_other;
  float* lane_sums = sums + w.lane;
  const int64_t tile_n = int64_t(kLanes) * TN;
  const int64_t tiles_n = (p.N + tile_n - 1) / tile_n;
  const bool pairs = std::is_same_v<T, uint16_t> && bf16_words_readable(p.b, p.b_stride_e, b_stride_k) &&
                     p.N % 2 == 0;
  for_each_owned_unit(
      w.id, w.count, p.group_offsets, p.offsets_is64, p.num_groups, p.out_rows, 1, kUnitRows, tiles_n,
      unit_cost<T, 1, TN>(),
      [&](int64_t g, int64_t row_begin, int64_t, int64_t m_first, int64_t m_last, int64_t n_tile) {
        const int64_t n0 = n_tile * tile_n;
        const int64_t cols = p.N - n0 < tile_n ? p.N - n0 : tile_n;
        const int64_t sum_vectors = pairs ? 2 * ((cols + 31) / 32) : (cols + kLanes - 1) / kLanes;
        auto column = [&](int64_t v) {
          return pairs ? n0 + 32 * (v / 2) + 2 * w.lane + v % 2 : n0 + kLanes * v + w.lane;
        };
        for (int64_t m = row_begin + m_first; m < row_begin + m_last; ++m) {
          for (int64_t v = 0; v < sum_vectors; ++v) lane_sums[v * kLanes] = 0.0f;
          if (g < p.num_groups) {
            const TA* a_row = p.a + source_row(p.gather_index, p.gather_is64, m, p.a_rows) * p.a_row_stride;
            const T* b_block = p.b + g * p.b_stride_e + n0;
            // Lanes past the block in the last read unit read its first one instead (not stored).
            // A block of whole read units (cols a multiple of their width) passes the same last
            // offset on every lane, so its last unit's reads stay vector loads; the lane-dependent
            // offset of a partial last unit turns them into per-lane loads on the CPU device
            // (T8 E8 K128 N64: 4 sum vectors, the last one's loads took most of the kernel).
            if (pairs) {
              const uint32_t* words = reinterpret_cast<const uint32_t*>(b_block) + w.lane;
              const int64_t word_stride = b_stride_k / 2, units = sum_vectors / 2;
              auto b_words = [&](int64_t k, int64_t offset, float (&bv)[2]) {
                widen_bf16_word(words[k * word_stride + offset], bv[0], bv[1]);
              };
              if ((cols / 2) % kLanes == 0) {
                row_stream_k<2>(lane_sums, a_row, p.K, units, (units - 1) * kLanes, b_words);
              } else {
                const int64_t last = (units - 1) * kLanes + w.lane < cols / 2 ? (units - 1) * kLanes : 0;
                row_stream_k<2>(lane_sums, a_row, p.K, units, last, b_words);
              }
            } else {
              const T* b_lane = b_block + w.lane;
              auto b_values = [&](int64_t k, int64_t offset, float (&bv)[1]) {
                bv[0] = to_float(b_lane[k * b_stride_k + offset]);
              };
              if (cols % kLanes == 0) {
                row_stream_k<1>(lane_sums, a_row, p.K, sum_vectors, (sum_vectors - 1) * kLanes, b_values);
              } else {
                const int64_t last = (sum_vectors - 1) * kLanes + w.lane < cols ? (sum_vectors - 1) * kLanes : 0;
                row_stream_k<1>(lane_sums, a_row, p.K, sum_vectors, last, b_values);
              }
            }
          }
          const RowTarget t = row_target(p.scatter_index, p.scatter_is64, p.row_weight, m, p.out_rows);
          for (int64_t v = 0; v < sum_vectors; ++v) {
            const int64_t col = column(v);
            if (col < n0 + cols) {
              float s = lane_sums[v * kLanes];
              if (g < p.num_groups && p.bias != nullptr) s += to_float(p.bias[g * p.bias_stride_e + col]);
              p.out[t.row * p.out_row_stride + col] = FromFloat<TOut>::convert(s * t.weight);
            }
          }
        }
      });
}

// The N-split kernel's work unit on the CPU (KChunk > 0): a row block of row_tiles row tiles
// across col_tiles consecutive column tiles, K walked in chunks with the column tiles inside the
// chunk loop, so that a chunk's B rows are read as long stretches across the column block
// (sequential, followed by the hardware prefetchers) instead of one tile-wide strip per B row at
// a time, which jumps to a new 4 KB page at every k. The partial sums of all the unit's tiles
// live in work-group local memory, room for kNLanesPartialTiles tiles: the row block covers
// about 1.5x the average group's rows (16, 32 or 64 rows, so most groups stream their B once) and
// the column block is as wide as the rest of that room allows, split evenly over N. [E, K, N]
// float32 with the cache cold: prefill 155 -> 122 ms, 64 tokens 86 -> 49 ms, 16 tokens x top-2
// 37 -> 27 ms. Elsewhere (GPU, KChunk = 0) a unit is one column tile over kUnitRows rows,
// registers only. kNLanesPartialTiles is in sizes.hpp, which the host shares.
// Units of the N-split kernel whose B slice is larger than this prefetch their next K chunk.
constexpr int64_t kPrefetchSliceBytes = 256 * 1024;
struct NLanesUnitShape {
  int64_t row_tiles, col_tiles;
};
template <int TM, int KChunk>
inline NLanesUnitShape n_lanes_unit_shape(int64_t out_rows, int64_t num_groups, int64_t tiles_n,
                                          int64_t num_workers) {
  if constexpr (KChunk == 0) {
    return {kUnitRows / TM, 1};
  } else {
    const int64_t wanted = 3 * out_rows / (2 * (num_groups > 0 ? num_groups : 1));
    int64_t rows = wanted <= 16 ? 16 : wanted <= 32 ? 32 : 64;
    // A problem too small to give every worker a unit gets shorter row blocks (one expert of 64
    // rows, K = 128, N = 64: one unit on one core otherwise).
    if (rows > 16 && (out_rows + rows - 1) / rows * tiles_n < num_workers) rows = 16;
    const int64_t row_tiles = rows / TM;
    const int64_t most = kNLanesPartialTiles / row_tiles;
    const int64_t blocks = (tiles_n + most - 1) / most;
    return {row_tiles, blocks > 0 ? (tiles_n + blocks - 1) / blocks : 1};
  }
}

// Variant for B stored with N contiguous (b_stride_n == 1), e.g. a contiguous [E, K, N]
// tensor. The 16 lanes split N: lane l owns columns n0 + l + 16 * j; A values are uniform
// across the sub-group. A row tile streams K rows of a B slice 16 * TN columns wide (1 MB for
// float, K = 2048, TN = 8): too large to stay in L1 between the row tiles of a unit. With
// KChunk > 0 (CPU) a unit spans several column tiles and walks K in chunks of KChunk (see
// n_lanes_unit_shape): every row tile of every column tile runs the chunk while the chunk's B
// rows stay in cache, its partial sums kept in work-group local memory in between (one sub-group
// per work-group). KChunk = 0: one column tile, the whole K per row tile, registers only.
// One-row tiles wider than kRegisterTileVectors stream B rows instead (n_lanes_row_stream).
// bf16 B with 4-byte aligned rows is read as 32-bit words holding two adjacent columns, each
// widened with one integer op (lane l then owns columns n0 + 32 * v + 2 * l + {0, 1}). TA is
// A's type (the launcher compiles TA = T only; see has_float_a_variant).
template <typename TA, typename T, typename TOut, int TM, int TN, int KChunk>
MOE_XPU_KERNEL
void moe_gemm_n_lanes(const TA* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                      int gather_is64, const T* b, int64_t b_stride_e, int64_t b_stride_k,
                      const T* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                      int64_t out_rows, const void* group_offsets, int offsets_is64,
                      int64_t num_groups, int64_t K, int64_t N, int /*activation: k_lanes only*/,
                      int64_t /*up_offset*/, const void* scatter_index, int scatter_is64,
                      const float* row_weight) {
  static_assert(TN <= kRegisterTileVectors || TM == 1, "wide N-split tiles have one row");
  if constexpr (TN > kRegisterTileVectors) {
    n_lanes_row_stream<TN>(VectorArgs<TA, T, TOut>{
        a, a_row_stride, a_rows, gather_index, gather_is64, b, b_stride_e, b_stride_k, bias,
        bias_stride_e, out, out_row_stride, out_rows, group_offsets, offsets_is64, num_groups, K, N,
        kNone, 0, scatter_index, scatter_is64, row_weight});
  } else {
    constexpr int kTileElems = TM * TN * kLanes;  // one row tile's partial sums, lane-major
    float* partial = partial_sums_area<kNLanesPartialTiles, TM, TN, KChunk>();
    const Worker w = this_worker();
    const int64_t tile_n = int64_t(kLanes) * TN;
    const int64_t tiles_n = (N + tile_n - 1) / tile_n;
    const NLanesUnitShape unit = n_lanes_unit_shape<TM, KChunk>(out_rows, num_groups, tiles_n, w.count);
    const int64_t chunk = KChunk > 0 ? KChunk : (K > 0 ? K : 1);
    // Word reads of bf16 pairs: B rows 4-byte aligned (tile starts are even columns).
    constexpr bool kPairType = std::is_same_v<T, uint16_t> && TN % 2 == 0;
    const bool pairs = kPairType && bf16_words_readable(b, b_stride_e, b_stride_k);
    const UnitCost tile_cost = unit_cost<T, TM, TN>();
    // A unit whose B slice stays in the core's cache after its first column block (K = N = 128:
    // 64 KB) gains nothing from prefetching and pays the library call per row tile and chunk:
    // 256 tokens top-2 of 8 experts, K = N = 128, one core: 506 -> 452 us.
    const bool prefetch_b = K * unit.col_tiles * tile_n * int64_t(sizeof(T)) > kPrefetchSliceBytes;
    for_each_owned_unit(
        w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, unit.row_tiles,
        (tiles_n + unit.col_tiles - 1) / unit.col_tiles,
        UnitCost{tile_cost.row_tile * unit.col_tiles, tile_cost.stream * unit.col_tiles},
        [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_block) {
          const T* b_g = b + g * b_stride_e;
          const int64_t k_steps = g < num_groups ? K : 0;  // the tail group only stores zeros
          const int64_t t_first = n_block * unit.col_tiles;
          const int64_t t_last = t_first + unit.col_tiles < tiles_n ? t_first + unit.col_tiles : tiles_n;
          for (int64_t k_begin = 0; k_begin < (k_steps > 0 ? k_steps : 1); k_begin += chunk) {
            const int64_t k_end = k_begin + chunk < k_steps ? k_begin + chunk : k_steps;
            const bool last_chunk = k_end == k_steps;
            for (int64_t n_tile = t_first; n_tile < t_last; ++n_tile) {
              const bool full_tile = n_tile * tile_n + tile_n <= N;
              const bool pair_tile = pairs && full_tile;
              int64_t col[TN];  // the output column behind accumulator column j
              #pragma unroll
              for (int j = 0; j < TN; ++j)
                col[j] = n_tile * tile_n + (pair_tile ? 2 * (kLanes * (j / 2) + w.lane) + j % 2
                                                      : w.lane + int64_t(kLanes) * j);
              for (int64_t m_tile = m_first; m_tile < m_last; ++m_tile) {
                const int64_t m0 = row_begin + m_tile * TM;
                float* saved = KChunk > 0 ? partial + ((n_tile - t_first) * unit.row_tiles + m_tile - m_first) * kTileElems + w.lane
                                        : nullptr;
                // Each row tile asks the memory for one B row of the next chunk across this column
                // tile (lane 0, one call, before the accumulators are live; see
                // prefetch_next_chunk). [E, K, N] float32, cold cache, same process: prefill 112
                // -> 100 ms; 64tok and 16tok unchanged. Prefetching the whole next chunk over the
                // row tiles made 64tok 6% slower.
                const int64_t next_row = k_end + (m_tile - m_first);
                if (KChunk > 0 && prefetch_b && g < num_groups && next_row < k_steps && next_row < k_end + chunk &&
                    w.lane == 0)
                  syclexp::prefetch(b_g + next_row * b_stride_k + n_tile * tile_n,
                                    std::size_t(full_tile ? tile_n : N - n_tile * tile_n));
                float acc[TM][TN];
                resume_partial_sums(acc, KChunk > 0 && k_begin > 0, saved);
                const int64_t valid = tile_valid_rows(rows, m_tile, TM);
                const TA* a_row[TM];
                #pragma unroll
                for (int i = 0; i < TM; ++i)
                  a_row[i] = tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, i);
                if constexpr (kPairType) {
                  if (pair_tile) {
                    const uint32_t* b_words =
                        reinterpret_cast<const uint32_t*>(b_g + n_tile * tile_n) + w.lane;
                    for (int64_t k = k_begin; k < k_end; ++k) {
                      const uint32_t* b_k = b_words + k * (b_stride_k / 2);
                      float bv[TN];
                      #pragma unroll
                      for (int v = 0; v < TN / 2; ++v) {
                        widen_bf16_word(b_k[kLanes * v], bv[2 * v], bv[2 * v + 1]);
                      }
                      fma_step(acc, a_row, k, bv);
                    }
                  }
                }
                // (The pair loop stands in its own `if constexpr` block above: folded into this chain
                // it measured about 10% slower on the CPU device.)
                if (pair_tile) {
                  // done above
                } else if (full_tile) {  // unclamped, consecutive addresses
                  const T* b_lane = b_g + n_tile * tile_n + w.lane;
                  for (int64_t k = k_begin; k < k_end; ++k) {
                    const T* b_k = b_lane + k * b_stride_k;
                    float bv[TN];
                    #pragma unroll
                    for (int j = 0; j < TN; ++j) bv[j] = to_float(b_k[kLanes * j]);
                    fma_step(acc, a_row, k, bv);
                  }
                } else if ((N - n_tile * tile_n) % kLanes == 0) {
                  // The last tile in whole vectors (N a multiple of 16): each vector past N reads
                  // the tile's first one instead (never stored), so every read stays a consecutive
                  // vector load. Clamping each lane's column turns them into gathers: N = 64 in
                  // the 32-column-wide {2, 8} tile measured 3-5x slower.
                  const T* b_lane = b_g + n_tile * tile_n + w.lane;
                  const int64_t cols = N - n_tile * tile_n;
                  int64_t offset[TN];
                  #pragma unroll
                  for (int j = 0; j < TN; ++j) offset[j] = int64_t(kLanes) * j < cols ? int64_t(kLanes) * j : 0;
                  for (int64_t k = k_begin; k < k_end; ++k) {
                    const T* b_k = b_lane + k * b_stride_k;
                    float bv[TN];
                    #pragma unroll
                    for (int j = 0; j < TN; ++j) bv[j] = to_float(b_k[offset[j]]);
                    fma_step(acc, a_row, k, bv);
                  }
                } else {
                  const T* b_col[TN];
                  #pragma unroll
                  for (int j = 0; j < TN; ++j) b_col[j] = b_g + (col[j] < N ? col[j] : N - 1);
                  for (int64_t k = k_begin; k < k_end; ++k) {
                    float bv[TN];
                    #pragma unroll
                    for (int j = 0; j < TN; ++j) bv[j] = to_float(b_col[j][k * b_stride_k]);
                    fma_step(acc, a_row, k, bv);
                  }
                }
                if (!last_chunk) {
                  park_partial_sums(saved, acc);
                  continue;
                }
                if (g < num_groups && bias != nullptr) {
                  #pragma unroll
                  for (int j = 0; j < TN; ++j) {
                    const float bj = to_float(bias[g * bias_stride_e + (col[j] < N ? col[j] : N - 1)]);
                    #pragma unroll
                    for (int i = 0; i < TM; ++i) acc[i][j] += bj;
                  }
                }
                #pragma unroll
                for (int i = 0; i < TM; ++i)
                  #pragma unroll
                  for (int j = 0; j < TN; ++j)
                    if (m_tile * TM + i < rows && col[j] < N) {
                      const RowTarget t = row_target(scatter_index, scatter_is64, row_weight, m0 + i, out_rows);
                      out[t.row * out_row_stride + col[j]] = FromFloat<TOut>::convert(acc[i][j] * t.weight);
                    }
              }
            }
          }
        });
  }
}


// Matrix-engine variant (joint_matrix: AMX on Intel Xeon CPUs, XMX on Intel GPUs) for bf16 (and, on
// XMX, fp16) B
// stored with K contiguous (nn.Linear weights seen through .transpose(1, 2)). It computes the
// transposed product out^T = B^T A^T one engine tile (EngineTile below) at a time: the weights are the matrix
// engine's row-major left operand, read straight from memory, and the unit's tokens are its right
// operand, which the engine wants in "packed" (VNNI) form: for each pair of k, the two values of
// a token side by side, tokens along a row. Each worker packs the A rows of its row block once
// (gathered through the index table, widened or narrowed to bf16) into its own scratch area and
// keeps them while it walks consecutive column tiles of the same rows. Accumulators are stored to
// the scratch area once per tile and the usual epilogue (bias, gated activation, row weight,
// scatter) runs on them. Needs K % 32 == 0 and N % 16 == 0 (checked by the launcher).
template <typename TA, typename T, typename TOut, bool Gated, int Rows, int Toks, int KStep, int Lanes>
MOE_XPU_KERNEL_WITH_LANES(Lanes)
void moe_gemm_matrix(const TA* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                     int gather_is64, const T* b, int64_t b_stride_e, int64_t b_stride_n,
                     const T* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                     int64_t out_rows, const void* group_offsets, int offsets_is64,
                     int64_t num_groups, int64_t K, int64_t N, int activation, int64_t up_offset,
                     const void* scatter_index, int scatter_is64, const float* row_weight,
                     void* scratch) {
  using Tile = EngineTile<Rows, Toks, KStep, Lanes>;
  using E = EngineElem<T>;
  const Worker w = this_worker();
  unsigned char* mine = static_cast<unsigned char*>(scratch) + w.id * matrix_scratch_bytes(K, false);
  uint32_t* packed = reinterpret_cast<uint32_t*>(mine);  // [tok_tiles][K / 2][Toks]
  float* stored = reinterpret_cast<float*>(mine + matrix_a_bytes(K));  // [4][Rows][Toks]
  // Plain units are two weight tiles (2 * Rows output columns) wide; gated units one output tile
  // of Rows columns, whose gate and up weight rows make the two weight tiles.
  constexpr int out_cols = Gated ? Rows : 2 * Rows;
  for_each_engine_unit<Tile>(
      w, group_offsets, offsets_is64, num_groups, out_rows, N, out_cols, UnitCost{1, 14}, out,
      out_row_stride, scatter_index, scatter_is64, row_weight,
      pair_packer<Toks, T>(a, a_row_stride, a_rows, gather_index, gather_is64, K, w.lane, packed),
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n0) {
        int64_t first_row[2];
        const bool second_stored = unit_weight_tiles<Gated, Rows>(n0, N, up_offset, first_row);
        const E* w_rows[2];
        for (int i = 0; i < 2; ++i) w_rows[i] = reinterpret_cast<const E*>(b + g * b_stride_e + first_row[i] * b_stride_n);
        matrix_unit_tiles<Tile, Gated>(
            w,
            [&](auto tiles, const uint32_t* x) {
              matrix_k_loop<Tile, decltype(tiles)::value>(w.sg, w_rows, b_stride_n, x, K, stored);
            },
            packed, K, stored, n0, second_stored, up_offset, row_begin, rows, m_first,
            m_last, activation, out, out_row_stride, out_rows, scatter_index, scatter_is64, row_weight,
            [&](int64_t n, float& scale, float& bias_n) {
              scale = 1.0f;
              bias_n = bias != nullptr ? to_float(bias[g * bias_stride_e + n]) : 0.0f;
            });
      });
}

// Matrix-engine variant for bf16 B stored with N contiguous (a contiguous [E, K, N] tensor):
// out = A B directly. The unit's tokens are the engine's row-major left operand (their gathered
// rows copied once per row block into the worker's scratch area, as bf16). A unit is kKnCols
// columns wide and walks K in chunks: each chunk of its B slice is packed once into the engine's
// pair-interleaved form (rows 2r and 2r + 1 of B side by side; about one pass over the slice, the
// read the unit makes anyway), then every token tile x column-tile pair runs the chunk, its
// partial sums kept in the scratch area between chunks.
template <typename TA, typename TOut>
MOE_XPU_KERNEL
void moe_gemm_matrix_kn(const TA* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                        int gather_is64, const uint16_t* b, int64_t b_stride_e, int64_t b_stride_k,
                        const uint16_t* bias, int64_t bias_stride_e, TOut* out,
                        int64_t out_row_stride, int64_t out_rows, const void* group_offsets,
                        int offsets_is64, int64_t num_groups, int64_t K, int64_t N,
                        int /*activation: K-contiguous B only*/, int64_t /*up_offset*/,
                        const void* scatter_index, int scatter_is64, const float* row_weight,
                        void* scratch) {
  const Worker w = this_worker();
  unsigned char* mine = static_cast<unsigned char*>(scratch) + w.id * matrix_scratch_bytes(K, true);
  uint16_t* rows_a = reinterpret_cast<uint16_t*>(mine);                          // [4][16][K]
  uint32_t* pairs_b = reinterpret_cast<uint32_t*>(mine + matrix_a_bytes(K));      // [chunk / 2][kKnCols]
  float* partial = reinterpret_cast<float*>(mine + matrix_a_bytes(K) + kKnPackedBytes);  // [4][kKnTiles][16][16]
  float* stored = partial + kKnPartialBytes / 4;                                  // [2][16][16]
  const int64_t tiles_n = (N + kKnCols - 1) / kKnCols;
  HeldRowBlock held;  // what rows_a holds
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, kMatToks, kMatTokTiles,
      tiles_n, UnitCost{kKnTiles / 2, 7 * kKnTiles},
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        const int64_t n0 = n_tile * kKnCols;
        const int64_t cols = N - n0 < kKnCols ? N - n0 : kKnCols;  // a multiple of 16
        if (g == num_groups) {
          matrix_zero_rows(out, out_row_stride, out_rows, scatter_index, scatter_is64, row_weight,
                           row_begin + m_first * kMatToks, row_begin + rows, m_last - m_first, n0,
                           kKnCols, N, w.lane);
          return;
        }
        held.hold(g, row_begin, rows, m_first, m_last, [&](int64_t j, int64_t m0, int64_t valid) {
          for (int64_t i = 0; i < kMatToks; ++i) {
            const TA* src = tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, i);
            uint16_t* dst = rows_a + (j * kMatToks + i) * K;
            for (int64_t k = w.lane; k < K; k += kLanes) dst[k] = FromFloat<uint16_t>::convert(to_float(src[k]));
          }
        });
        const int tiles = int(cols / kMatRows);
        const uint16_t* b_g = b + g * b_stride_e + n0;
        for (int64_t k0 = 0; k0 < K; k0 += kKnChunk) {
          const int64_t k_len = K - k0 < kKnChunk ? K - k0 : kKnChunk;  // a multiple of 32
          const bool first = k0 == 0, last = k0 + k_len == K;
          for (int64_t r = 0; r < k_len / 2; ++r) {
            const uint16_t* even = b_g + (k0 + 2 * r) * b_stride_k;
            const uint16_t* odd = even + b_stride_k;
            for (int c = w.lane; c < tiles * kMatRows; c += kLanes)
              pairs_b[r * kKnCols + c] = bf16_pair(even[c], odd[c]);
          }
          const bf16* xb = reinterpret_cast<const bf16*>(pairs_b);
          for (int64_t t = m_first; t < m_last; ++t) {
            const bf16* x = reinterpret_cast<const bf16*>(rows_a + (t - m_first) * kMatToks * K);
            for (int p = 0; p < tiles; p += 2) {
              // Column tiles p and p + 1 (an odd last tile runs twice; its copy is not stored).
              const int tile_of[2] = {p, p + 1 < tiles ? p + 1 : p};
              float* saved[2];
              jm::joint_matrix<sycl::sub_group, float, jm::use::accumulator, kMatToks, kMatRows> acc[2];
              for (int i = 0; i < 2; ++i) {
                saved[i] = partial + ((t - m_first) * kKnTiles + tile_of[i]) * (kTileBytes / 4);
                if (first) jm::joint_matrix_fill(w.sg, acc[i], 0.0f);
                else jm::joint_matrix_load(w.sg, acc[i], global_ptr(saved[i]), kMatRows, jm::layout::row_major);
              }
              for (int64_t k = 0; k < k_len; k += kMatK) {
                jm::joint_matrix<sycl::sub_group, bf16, jm::use::a, kMatToks, kMatK, jm::layout::row_major> xa;
                jm::joint_matrix_load(w.sg, xa, global_ptr(x + k0 + k), K);
                for (int i = 0; i < 2; ++i) {
                  jm::joint_matrix<sycl::sub_group, bf16, jm::use::b, kMatK, kMatRows, jm::layout::ext_intel_packed> bb;
                  jm::joint_matrix_load(w.sg, bb, global_ptr(xb + k * kKnCols + tile_of[i] * 2 * kMatRows), 2 * kKnCols);
                  jm::joint_matrix_mad(w.sg, acc[i], xa, bb, acc[i]);
                }
              }
              if (!last) {
                for (int i = 0; i < 2; ++i)
                  jm::joint_matrix_store(w.sg, acc[i], global_ptr(saved[i]), kMatRows, jm::layout::row_major);
                continue;
              }
              for (int i = 0; i < 2; ++i)
                jm::joint_matrix_store(w.sg, acc[i], global_ptr(stored + i * kMatToks * kMatRows), kMatRows,
                                       jm::layout::row_major);
              const int64_t m0 = row_begin + t * kMatToks;
              const int64_t valid = tile_valid_rows(rows, t, kMatToks);
              const int stores = tile_of[1] != tile_of[0] ? 2 : 1;
              for (int i = 0; i < stores; ++i) {
                const int64_t n = n0 + tile_of[i] * kMatRows + w.lane;
                const float bias_v = bias != nullptr ? to_float(bias[g * bias_stride_e + n]) : 0.0f;
                for (int64_t m = 0; m < valid; ++m) {
                  const RowTarget target = row_target(scatter_index, scatter_is64, row_weight, m0 + m, out_rows);
                  out[target.row * out_row_stride + n] = FromFloat<TOut>::convert(
                      (stored[(i * kMatToks + m) * kMatRows + w.lane] + bias_v) * target.weight);
                }
              }
            }
          }
        }
      });
}

}  // namespace moe_xpu

// Instantiations are appended by the launcher, one line per compiled variant, e.g.
// MOE_XPU_INSTANTIATE_K_LANES(float, uint16_t, float, 6, 4, false, 128), and registered under the
// matching name "moe_xpu::moe_gemm_k_lanes<float, uint16_t, float, 6, 4, false, 128>".
#define MOE_XPU_KERNEL_PARAMS(TA, T, TOut)                                                      \
  const TA*, int64_t, int64_t, const void*, int, const T*, int64_t, int64_t, const T*, int64_t, \
      TOut*, int64_t, int64_t, const void*, int, int64_t, int64_t, int64_t, int, int64_t,         \
      const void*, int, const float*
#define MOE_XPU_INSTANTIATE_K_LANES(TA, T, TOut, TM, TN, GATED, KCHUNK) \
  template void moe_xpu::moe_gemm_k_lanes<TA, T, TOut, TM, TN, GATED, KCHUNK>(MOE_XPU_KERNEL_PARAMS(TA, T, TOut));
#define MOE_XPU_INSTANTIATE_MATRIX(TA, T, TOut, GATED, ROWS, TOKS, KSTEP, LANES) \
  template void moe_xpu::moe_gemm_matrix<TA, T, TOut, GATED, ROWS, TOKS, KSTEP, LANES>(MOE_XPU_KERNEL_PARAMS(TA, T, TOut), void*);
#define MOE_XPU_INSTANTIATE_MATRIX_KN(TA, TOut) \
  template void moe_xpu::moe_gemm_matrix_kn<TA, TOut>(MOE_XPU_KERNEL_PARAMS(TA, uint16_t, TOut), void*);
#define MOE_XPU_INSTANTIATE_N_LANES(TA, T, TOut, TM, TN, KCHUNK) \
  template void moe_xpu::moe_gemm_n_lanes<TA, T, TOut, TM, TN, KCHUNK>(MOE_XPU_KERNEL_PARAMS(TA, T, TOut));

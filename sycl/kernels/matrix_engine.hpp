// Device code shared by the matrix-engine kernels (joint_matrix: AMX on Intel Xeon CPUs, XMX on
// Intel GPUs): the engine tile, each worker's scratch area, token packing into the engine's
// pair-interleaved form, the k loop over weight tiles and the zeroed tail. Used by the float
// kernels (moe_gemm.cpp) and the W8A8 kernel (moe_gemm_quant.cpp); handed to the runtime
// compiler as an include file.
#pragma once

#include "epilogue.hpp"
#include "scheduler.hpp"

namespace moe_xpu {

namespace jm = sycl::ext::oneapi::experimental::matrix;
using bf16 = sycl::ext::oneapi::bfloat16;
// AMX's engine tile (kMatRows x kMatToks x kMatK), the N-contiguous kernel's unit and the
// scratch areas are in sizes.hpp, which the host shares.

// The K-contiguous matrix kernel's engine tile: Rows weight rows (output columns) x Toks tokens,
// KStep k per engine step, run by sub-groups of Lanes (one token per lane when packing). The
// shapes the device's matrix engine takes: AMX 16 x 16 x 32 on 16 lanes; Xe-HPC, Xe2 and Xe3 XMX
// 8 x 16 x 16 on 16 lanes; Xe-HPG XMX 8 x 8 x 16 on 8 lanes. Everything else is shared.
template <int Rows, int Toks, int KStep, int Lanes>
struct EngineTile {
  static_assert(Toks == Lanes, "token packing puts one token on each lane");
  static constexpr int rows = Rows, toks = Toks, k_step = KStep, lanes = Lanes;
  static constexpr int tok_tiles = int(kUnitRows) / Toks;
  static constexpr int64_t tile_bytes = int64_t(Rows) * Toks * 4;
};


// The four zero tiles after a kernel's four stored accumulator tiles (tile_elems elements each),
// zeroed by the worker's lanes. Accumulators start from a load of one of them each: on AMX
// joint_matrix_fill (like loads of one tile, which the compiler merges) becomes one zeroed tile
// copied to the others through a tile store and a reload of the same address, which waits for
// the store to complete. (The weight gradient zeroes its accumulators once per 32 x 32 block of
// dB; the forward kernels once per k loop over all of K, where loading zero tiles measured no
// difference within this VM's noise.)
template <typename Acc>
inline const Acc* zeroed_tiles(Acc* stored, int64_t tile_elems, int lane, int lanes) {
  Acc* zeros = stored + 4 * tile_elems;
  for (int64_t e = lane; e < 4 * tile_elems; e += lanes) zeros[e] = Acc(0);
  return zeros;
}
// (Engine tiles smaller than AMX's fit the same area: the launcher sizes it with the formula
// above for every K-contiguous matrix variant.)

template <typename T>
inline auto global_ptr(T* p) {
  return sycl::address_space_cast<sycl::access::address_space::global_space,
                                  sycl::access::decorated::no>(p);
}

// The token rows a matrix-kernel worker holds in its scratch, packed once per (group, row block):
// a worker's consecutive units share them (see for_each_owned_unit).
struct HeldRowBlock {
  int64_t group = -1, block = -1;
  // Unless already held, calls pack_tile(j, m0, valid) for token tile j of row block
  // [m_first, m_last) of group g (rows from row_begin, `rows` in all): its first output row m0
  // and its real rows.
  template <typename PackTileFn>
  void hold(int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last,
            PackTileFn&& pack_tile, int64_t toks = kMatToks) {
    if (g == group && m_first == block) return;
    for (int64_t t = m_first; t < m_last; ++t)
      pack_tile(t - m_first, row_begin + t * toks, tile_valid_rows(rows, t, toks));
    group = g;
    block = m_first;
  }
};

inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }
inline uint32_t bf16_pair(float lo, float hi) {
  return bf16_pair(FromFloat<uint16_t>::convert(lo), FromFloat<uint16_t>::convert(hi));
}

// The matrix engine's element type for B of type T (bf16 travels as uint16_t bits), and two A
// values as one 32-bit word of it, low first (the engine's pair-interleaved form).
template <typename T>
using EngineElem = std::conditional_t<std::is_same_v<T, sycl::half>, sycl::half, bf16>;
template <typename T, typename TA>
inline uint32_t engine_pair(TA lo, TA hi) {
  if constexpr (std::is_same_v<T, sycl::half>) {
    return uint32_t(sycl::bit_cast<uint16_t>(sycl::half(to_float(lo)))) |
           (uint32_t(sycl::bit_cast<uint16_t>(sycl::half(to_float(hi)))) << 16);
  } else {
    return bf16_pair(lo, hi);
  }
}

// Packs row tile `tile` of a row block (rows m0 .. m0 + valid - 1 of A's gathered rows) as
// packed[r][t] = (a[t][2r], a[t][2r + 1]): lane t handles token t (rows past valid repeat the
// last one; their outputs are not stored).
template <int Toks, typename T, typename TA>
inline void matrix_pack_rows(const TA* a, int64_t a_row_stride, int64_t a_rows,
                             const void* gather_index, int gather_is64, int64_t m0, int64_t valid,
                             int64_t K, int lane, uint32_t* packed) {
  const TA* row = tile_a_row(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, lane);
  for (int64_t r = 0; r < K / 2; ++r)
    packed[r * Toks + lane] = engine_pair<T>(row[2 * r], row[2 * r + 1]);
}

// for_each_engine_unit's pack_tile for the 16-bit engine kernels: token tile j of the row block
// into packed + j * (K / 2) * Toks, pair-interleaved (matrix_pack_rows).
template <int Toks, typename T, typename TA>
inline auto pair_packer(const TA* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                        int gather_is64, int64_t K, int lane, uint32_t* packed) {
  return [=](int64_t j, int64_t m0, int64_t valid) {
    matrix_pack_rows<Toks, T>(a, a_row_stride, a_rows, gather_index, gather_is64, m0, valid, K, lane,
                              packed + j * (K / 2) * Toks);
  };
}

// The k loop of `Tiles` consecutive packed token tiles (x: the first; the next follows
// K x Toks elements later) against the unit's two weight tiles, over the first k_len k (all of K
// unless given); stores accumulator (token tile j, weight tile i) to stored + (2 j + i) * Rows *
// Toks as [weight row][token]. E: the engine's element type (bf16, fp16: two k a packed word,
// float sums; int8: four k a word, int32 sums).
template <typename Tile, int Tiles, typename E, typename Acc = float>
inline void matrix_k_loop(const sycl::sub_group& sg, const E* const (&w_rows)[2], int64_t b_stride_n,
                          const uint32_t* x, int64_t K, Acc* stored, int64_t k_len = -1) {
  if (k_len < 0) k_len = K;
  constexpr int R = Tile::rows, Tk = Tile::toks, KS = Tile::k_step;
  constexpr int per_word = 4 / int(sizeof(E));
  jm::joint_matrix<sycl::sub_group, Acc, jm::use::accumulator, R, Tk> acc[Tiles][2];
  for (int j = 0; j < Tiles; ++j)
    for (int i = 0; i < 2; ++i) jm::joint_matrix_fill(sg, acc[j][i], Acc(0));
  const E* xe = reinterpret_cast<const E*>(x);
  for (int64_t k = 0; k < k_len; k += KS) {
    jm::joint_matrix<sycl::sub_group, E, jm::use::b, KS, Tk, jm::layout::ext_intel_packed> xb[Tiles];
    for (int j = 0; j < Tiles; ++j)
      jm::joint_matrix_load(sg, xb[j], global_ptr(xe + (j * K + k) * Tk), per_word * Tk);
    for (int i = 0; i < 2; ++i) {
      jm::joint_matrix<sycl::sub_group, E, jm::use::a, R, KS, jm::layout::row_major> wa;
      jm::joint_matrix_load(sg, wa, global_ptr(w_rows[i] + k), b_stride_n);
      for (int j = 0; j < Tiles; ++j) jm::joint_matrix_mad(sg, acc[j][i], wa, xb[j], acc[j][i]);
    }
  }
  for (int j = 0; j < Tiles; ++j)
    for (int i = 0; i < 2; ++i)
      jm::joint_matrix_store(sg, acc[j][i], global_ptr(stored + (2 * j + i) * R * Tk), Tk,
                             jm::layout::row_major);
}

// Writes zeros to the tail group's rows [m_begin, min(m_end, m_begin + tiles * 16)) at output
// columns [n0, n0 + cols) below N.
template <typename TOut>
inline void matrix_zero_rows(TOut* out, int64_t out_row_stride, int64_t out_rows,
                             const void* scatter_index, int scatter_is64, const float* row_weight,
                             int64_t m_begin, int64_t m_end, int64_t tiles, int64_t n0, int cols,
                             int64_t N, int lane, int64_t toks = kMatToks, int lanes = kLanes) {
  for (int64_t m = m_begin; m < m_end && m < m_begin + tiles * toks; ++m)
    for (int64_t j = lane; j < cols; j += lanes)
      if (n0 + j < N) {
        const RowTarget t = row_target(scatter_index, scatter_is64, row_weight, m, out_rows);
        out[t.row * out_row_stride + n0 + j] = FromFloat<TOut>::convert(0.0f);
      }
}

// The unit walk of the K-contiguous matrix kernels: each unit of this worker (one column tile of
// out_cols columns of one group over up to kUnitRows rows, in token tiles of Toks) has its row
// block packed into the worker's scratch (pack_tile(j, m0, valid); once for consecutive units of
// the same rows), then runs compute(g, row_begin, rows, m_first, m_last, n0); the tail group's
// rows are zeroed instead.
template <typename Tile, typename TOut, typename PackTileFn, typename ComputeFn>
inline void for_each_engine_unit(const Worker& w, const void* group_offsets, int offsets_is64,
                                 int64_t num_groups, int64_t out_rows, int64_t N, int out_cols, UnitCost cost,
                                 TOut* out, int64_t out_row_stride, const void* scatter_index, int scatter_is64,
                                 const float* row_weight, PackTileFn&& pack_tile, ComputeFn&& compute) {
  constexpr int Toks = Tile::toks;
  const int64_t tiles_n = (N + out_cols - 1) / out_cols;
  HeldRowBlock held;  // what the scratch holds
  for_each_owned_unit(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, Toks, Tile::tok_tiles, tiles_n, cost,
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_first, int64_t m_last, int64_t n_tile) {
        const int64_t n0 = n_tile * out_cols;
        if (g == num_groups) {  // tail rows: zeros
          matrix_zero_rows(out, out_row_stride, out_rows, scatter_index, scatter_is64, row_weight,
                           row_begin + m_first * Toks, row_begin + rows, m_last - m_first, n0,
                           out_cols, N, w.lane, Toks, Tile::lanes);
          return;
        }
        held.hold(g, row_begin, rows, m_first, m_last, pack_tile, Toks);
        compute(g, row_begin, rows, m_first, m_last, n0);
      });
}

// The first weight rows (output columns) of a K-contiguous unit's two weight tiles at output
// column n0: n0 and n0 + Rows (gated: the gate rows n0 and the up rows n0 + up_offset). A plain
// unit at the last Rows columns repeats its first tile and stores only that one: returns whether
// the second tile is stored.
template <bool Gated, int Rows>
inline bool unit_weight_tiles(int64_t n0, int64_t N, int64_t up_offset, int64_t (&first_row)[2]) {
  const bool second_stored = Gated || n0 + Rows < N;
  first_row[0] = n0;
  first_row[1] = Gated ? n0 + up_offset : n0 + (second_stored ? Rows : 0);
  return second_stored;
}

// A K-contiguous engine unit's token tiles and epilogue, shared by the float and the dequantizing
// kernels: k_loop(tiles, x) leaves the sums of the unit's two weight tiles against `tiles` (1 or 2,
// a std::integral_constant) consecutive token tiles of its packed row block (x: the first) in
// `stored`, as matrix_k_loop does; token tiles go in pairs where there are two (each weight tile
// then serves both from one load). Then per stored output column (sum * scale + bias), the gated
// activation, the row weight and the scatter. column(n, scale, bias) gives weight row n's scale
// and bias. Plain units are two weight tiles (2 * Rows output columns) wide, their second tile
// stored only when second_stored; gated units one output tile of Rows columns, whose gate and up
// weight rows (n and n + up_offset) make the two tiles.
template <typename Tile, bool Gated, typename TOut, typename KLoopFn, typename ColumnFn>
inline void matrix_unit_tiles(const Worker& w, KLoopFn&& k_loop,
                              const uint32_t* packed, int64_t K, const float* stored, int64_t n0,
                              bool second_stored, int64_t up_offset, int64_t row_begin, int64_t rows,
                              int64_t m_first, int64_t m_last, int activation, TOut* out,
                              int64_t out_row_stride, int64_t out_rows, const void* scatter_index,
                              int scatter_is64, const float* row_weight, ColumnFn&& column) {
  constexpr int Rows = Tile::rows, Toks = Tile::toks, Lanes = Tile::lanes;
  constexpr int out_cols = Gated ? Rows : 2 * Rows;
  // The epilogue's lanes walk the unit's output columns: column c = lane + Lanes * s.
  constexpr int kColumnSteps = (out_cols + Lanes - 1) / Lanes;
  // Per column step: the weight tile and row behind this lane's output column, its scale and
  // bias (gated: gate and up), and whether the column is stored.
  int tile_of[kColumnSteps], row_of[kColumnSteps];
  bool stores[kColumnSteps];
  float scale_v[kColumnSteps][2], bias_v[kColumnSteps][2];
  #pragma unroll
  for (int s = 0; s < kColumnSteps; ++s) {
    const int c = w.lane + Lanes * s;
    tile_of[s] = Gated ? 0 : c / Rows;
    row_of[s] = Gated ? c : c % Rows;
    stores[s] = c < out_cols && (Gated || tile_of[s] == 0 || second_stored);
    scale_v[s][0] = scale_v[s][1] = 1.0f;
    bias_v[s][0] = bias_v[s][1] = 0.0f;
    if (stores[s]) {
      const int64_t n = Gated ? n0 + c : n0 + (second_stored ? c : row_of[s]);
      column(n, scale_v[s][0], bias_v[s][0]);
      if (Gated) column(n + up_offset, scale_v[s][1], bias_v[s][1]);
    }
  }
  for (int64_t t = m_first; t < m_last; t += 2) {
    const int pair = t + 1 < m_last ? 2 : 1;
    const uint32_t* x = packed + (t - m_first) * (K / 2) * Toks;
    if (pair == 2) k_loop(std::integral_constant<int, 2>{}, x);
    else k_loop(std::integral_constant<int, 1>{}, x);
    for (int j = 0; j < pair; ++j) {
      const float* tile = stored + j * 2 * Rows * Toks;  // [weight tile][weight row][token]
      const int64_t m0 = row_begin + (t + j) * Toks;
      const int64_t valid = tile_valid_rows(rows, t + j, Toks);
      for (int64_t m = 0; m < valid; ++m) {
        const RowTarget target = row_target(scatter_index, scatter_is64, row_weight, m0 + m, out_rows);
        TOut* dst = out + target.row * out_row_stride + n0;
        #pragma unroll
        for (int s = 0; s < kColumnSteps; ++s) {
          if (!stores[s]) continue;
          const float v0 = tile[(tile_of[s] * Rows + row_of[s]) * Toks + m] * scale_v[s][0] + bias_v[s][0];
          if constexpr (Gated) {
            const float v1 = tile[(Rows + row_of[s]) * Toks + m] * scale_v[s][1] + bias_v[s][1];
            dst[row_of[s]] = FromFloat<TOut>::convert(activate(activation, v0) * v1 * target.weight);
          } else {
            dst[second_stored ? w.lane + Lanes * s : row_of[s]] = FromFloat<TOut>::convert(v0 * target.weight);
          }
        }
      }
    }
  }
}

}  // namespace moe_xpu

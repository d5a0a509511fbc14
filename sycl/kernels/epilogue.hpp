// The epilogue shared by the forward kernel families: cross-lane sums of K-split tiles, the
// fused-MoE activations, the row weight and the scatter to destination rows. Handed to the
// runtime compiler as an include file.
#pragma once

#include "common.hpp"

namespace moe_xpu {

// Reduces 16 per-lane vectors at once: afterwards lane l holds the sub-group sum of v[l].
// The working set is a sycl::vec, not an array: selecting between two array elements by a
// per-lane condition lets the compiler turn the pair of loads into one load through a per-lane
// pointer, which forces the array (and the accumulators feeding it) out of registers into
// scatter/gather traffic; on the CPU device that cost more than the whole k loop of a tile.
inline float transpose_reduce16(const sycl::sub_group& sg, int lane, const float (&in)[16]) {
  sycl::vec<float, 16> v;
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = in[i];
#pragma unroll
  for (int h = 8; h >= 1; h >>= 1) {
    const bool upper = (lane & h) != 0;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const float lo = v[i], hi = v[i + h];
      v[i] = (upper ? hi : lo) + sycl::permute_group_by_xor(sg, upper ? lo : hi, h);
    }
  }
  return v[0];
}

// What happens to a finished tile element before it is stored (the fused-MoE epilogues).
enum Activation : int { kNone = 0, kSilu = 1, kGeluTanh = 2 };

inline float activate(int activation, float x) {
  if (activation == kSilu) return x / (1.0f + sycl::exp(-x));
  // gelu with the tanh approximation (torch's approximate="tanh")
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + sycl::tanh(inner));
}

// Output row m goes to row scatter_index[m] (when given), scaled by row_weight[that row].
struct RowTarget {
  int64_t row;
  float weight;
};

inline RowTarget row_target(const void* scatter_index, int scatter_is64, const float* row_weight,
                            int64_t m, int64_t out_rows) {
  const int64_t row =
      scatter_index == nullptr ? m : clamp64(load_index(scatter_index, scatter_is64, m), 0, out_rows - 1);
  return RowTarget{row, row_weight == nullptr ? 1.0f : row_weight[row]};
}


// The end of a K-split tile (every lane holds partial sums over its k of an R x TN tile, bias
// already added): sums across the 16 lanes, the gated activation (TN/2 gate columns followed by
// the matching TN/2 up columns), the row weight and the store to the destination rows, converted
// to TOut. Rows from valid_rows on and columns from N on are not stored.
// Always inlined: where the CPU compiler kept it a call (the 16-bit outputs' larger body), the
// caller's accumulators went through memory by scatter and gather at every K chunk, and the
// K-split kernel with bf16 output took 2.6x the time of the same kernel with float32 output.
template <int R, int TN, bool Gated, typename TOut>
__attribute__((always_inline)) inline void k_split_epilogue(const Worker& w, const float (&acc)[R][TN], int activation, int64_t m0,
                             int64_t valid_rows, int64_t n0, int64_t N, TOut* out, int64_t out_row_stride,
                             int64_t out_rows, const void* scatter_index, int scatter_is64,
                             const float* row_weight) {
  constexpr bool gated = Gated;
  constexpr int out_cols = gated ? TN / 2 : TN;
  // Cross-lane sums, 16 tile elements at a time (all lanes take part: uniform control flow).
  // Element order: plain tiles row-major (i, j); gated tiles all gate elements (i, j <
  // out_cols) row-major, then the matching up elements. After the butterfly, element e sits
  // on lane e % 16 of sums[e / 16].
  constexpr int kElems = R * TN;
  constexpr int kSets = (kElems + 15) / 16;
  float sums[kSets];
  #pragma unroll
  for (int set = 0; set < kSets; ++set) {
    float v[16];
    #pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int idx = set * 16 + e;
      if (idx >= kElems) {
        v[e] = 0.0f;
      } else if (gated) {
        constexpr int half = R * (TN / 2);
        const int r = idx < half ? idx : idx - half;
        v[e] = acc[r / (TN / 2)][r % (TN / 2) + (idx < half ? 0 : TN / 2)];
      } else {
        v[e] = acc[idx / TN][idx % TN];
      }
    }
    sums[set] = transpose_reduce16(w.sg, w.lane, v);
  }
  constexpr int outputs = R * out_cols;
  #pragma unroll
  for (int set = 0; set * 16 < outputs; ++set) {
    const int o = set * 16 + w.lane;  // this lane's output element
    float v = sums[set];
    if (gated) {  // fetch the up element o + outputs from its lane
      const int partner = o + outputs;
      float up = 0.0f;
      #pragma unroll
      for (int q = 0; q < kSets; ++q) {
        const float candidate = sycl::select_from_group(w.sg, sums[q], partner % 16);
        up = q == partner / 16 ? candidate : up;
      }
      v = activate(activation, v) * up;
    }
    const int i = o / out_cols, j = o % out_cols;
    if (o < outputs && i < valid_rows && n0 + j < N) {
      const RowTarget t = row_target(scatter_index, scatter_is64, row_weight, m0 + i, out_rows);
      out[t.row * out_row_stride + n0 + j] = FromFloat<TOut>::convert(v * t.weight);
    }
  }
}

// Weight gradients (moe_gemm_wgrad.cpp, moe_gemm_dot.cpp): dB dense per group in either layout,
// so an empty group's zeros can be stored as one flat run.
inline bool wgrad_dense(int64_t K, int64_t N, int64_t stride_e, int64_t stride_k, int64_t stride_n) {
  return stride_e == K * N && ((stride_k == N && stride_n == 1) || (stride_k == 1 && stride_n == K));
}

// An empty group's zeros in dense dB: the worker's share of its units [u_lo, u_hi) of `units`, as
// the same share of its elements, stored consecutively across the lanes. Unit by unit, the empty
// tiles' bookkeeping cost twice the stores (decode float32, dB of 128 experts into touched memory:
// 323 ms).
template <typename TOut>
inline void store_zero_share(TOut* out_g, int64_t elems, int64_t u_lo, int64_t u_hi, int64_t units,
                             int lane, int lanes) {
  const TOut zero = FromFloat<TOut>::convert(0.0f);
  for (int64_t e = u_lo * elems / units + lane; e < u_hi * elems / units; e += lanes) out_g[e] = zero;
}

}  // namespace moe_xpu

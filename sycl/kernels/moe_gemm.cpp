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
// Scheduling: a fixed set of workers (one sub-group each) loops over the output tiles of all
// groups. Each worker walks the groups once, derives each group's tile range from the
// cumulative row offsets in device memory, and takes every num_workers-th tile. Empty groups
// cost one offset read. Rows at or past group_offsets[E-1] form a last "tail" group whose
// tiles are written with zeros, so no separate memset is needed.
//
// All addresses are 64-bit offsets from the base pointers; no per-group pointer arrays.
// Each output element is produced by exactly one work-item with a fixed k order, so results
// are bitwise reproducible.
#include <sycl/sycl.hpp>
#include <cstdint>

namespace syclexp = sycl::ext::oneapi::experimental;

namespace moe_xpu {

// bf16 travels as its bit pattern (uint16_t): the device bf16 library is not available to the
// runtime compiler, and the conversion is a shift anyway.
inline float to_float(float x) { return x; }
inline float to_float(sycl::half x) { return static_cast<float>(x); }
inline float to_float(uint16_t bf16_bits) {
  return sycl::bit_cast<float>(static_cast<uint32_t>(bf16_bits) << 16);
}

template <typename T> struct FromFloat;
template <> struct FromFloat<float> {
  static float convert(float x) { return x; }
};
template <> struct FromFloat<sycl::half> {
  static sycl::half convert(float x) { return sycl::half(x); }
};
template <> struct FromFloat<uint16_t> {  // float -> bf16, round to nearest even, NaN kept quiet
  static uint16_t convert(float x) {
    uint32_t u = sycl::bit_cast<uint32_t>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

inline int64_t load_index(const void* p, int is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i]
              : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Calls tile(g, row_begin, rows, m_tile, n_tile) for every tile this worker owns.
// g == num_groups is the tail group (rows past the last offset). Offsets are clamped into
// [previous offset, out_rows] so that malformed offsets can never address memory out of range
// (the host validates them where it can do so without a synchronisation).
template <typename TileFn>
inline void for_each_owned_tile(int64_t worker, int64_t num_workers, const void* group_offsets,
                                int offsets_is64, int64_t num_groups, int64_t out_rows,
                                int64_t tile_m, int64_t tiles_n, TileFn&& tile) {
  int64_t tile_base = 0;
  int64_t row_begin = 0;
  for (int64_t g = 0; g <= num_groups; ++g) {
    const int64_t row_end =
        g < num_groups ? clamp64(load_index(group_offsets, offsets_is64, g), row_begin, out_rows)
                       : out_rows;
    const int64_t rows = row_end - row_begin;
    const int64_t tiles_m = (rows + tile_m - 1) / tile_m;
    const int64_t count = tiles_m * tiles_n;
    // Column tile outermost inside a group: workers running side by side share a B panel.
    int64_t t = tile_base + ((worker - tile_base % num_workers) + num_workers) % num_workers;
    for (; t < tile_base + count; t += num_workers) {
      const int64_t local = t - tile_base;
      tile(g, row_begin, rows, local % tiles_m, local / tiles_m);
    }
    tile_base += count;
    row_begin = row_end;
  }
}

struct Worker {
  sycl::sub_group sg;
  int64_t id;     // this sub-group's index among all workers
  int64_t count;  // number of workers in the launch
  int lane;
  int lanes;      // sub-group size: 16 is requested, but the code does not depend on it
};

inline Worker this_worker() {
  auto it = sycl::ext::oneapi::this_work_item::get_nd_item<1>();
  sycl::sub_group sg = it.get_sub_group();
  const int64_t per_group = sg.get_group_linear_range();
  return Worker{sg, static_cast<int64_t>(it.get_group_linear_id()) * per_group + sg.get_group_linear_id(),
                static_cast<int64_t>(it.get_group_range(0)) * per_group,
                static_cast<int>(sg.get_local_linear_id()),
                static_cast<int>(sg.get_local_linear_range())};
}

// Source row of output row m: through the index table when there is one. Clamped so that a bad
// index cannot read out of bounds (validated on the host where possible).
inline int64_t source_row(const void* gather_index, int gather_is64, int64_t m, int64_t a_rows) {
  if (gather_index == nullptr) return m;
  return clamp64(load_index(gather_index, gather_is64, m), 0, a_rows - 1);
}

// Variant for B stored with K contiguous (b_stride_k == 1), e.g. nn.Linear weights [E, N, K]
// seen through .transpose(1, 2). The 16 lanes split K; each lane keeps TM x TN partial sums,
// reduced across the sub-group once per tile. Both A and B stream contiguously along K.
template <typename T, typename TOut, int TM, int TN>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::sub_group_size<16>))
void moe_gemm_k_lanes(const T* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                      int gather_is64, const T* b, int64_t b_stride_e, int64_t b_stride_n,
                      const T* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                      int64_t out_rows, const void* group_offsets, int offsets_is64,
                      int64_t num_groups, int64_t K, int64_t N) {
  const Worker w = this_worker();
  const int64_t tiles_n = (N + TN - 1) / TN;
  for_each_owned_tile(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, tiles_n,
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_tile, int64_t n_tile) {
        const int64_t m0 = row_begin + m_tile * TM;
        const int64_t n0 = n_tile * TN;
        float acc[TM][TN];
        for (int i = 0; i < TM; ++i)
          for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
        if (g < num_groups) {
          const T* a_row[TM];
          for (int i = 0; i < TM; ++i) {  // rows past the group repeat its last row; not stored
            const int64_t m = m0 + (i < rows - m_tile * TM ? i : rows - 1 - m_tile * TM);
            a_row[i] = a + source_row(gather_index, gather_is64, m, a_rows) * a_row_stride;
          }
          const T* b_col[TN];
          for (int j = 0; j < TN; ++j)
            b_col[j] = b + g * b_stride_e + (n0 + j < N ? n0 + j : N - 1) * b_stride_n;
          const int64_t k_full = K - K % w.lanes;
          for (int64_t k = w.lane; k < k_full; k += w.lanes) {
            float av[TM];
            for (int i = 0; i < TM; ++i) av[i] = to_float(a_row[i][k]);
            for (int j = 0; j < TN; ++j) {
              const float bv = to_float(b_col[j][k]);
              for (int i = 0; i < TM; ++i) acc[i][j] = sycl::fma(av[i], bv, acc[i][j]);
            }
          }
          const int64_t k = k_full + w.lane;
          if (k < K) {
            for (int j = 0; j < TN; ++j) {
              const float bv = to_float(b_col[j][k]);
              for (int i = 0; i < TM; ++i) acc[i][j] = sycl::fma(to_float(a_row[i][k]), bv, acc[i][j]);
            }
          }
          for (int i = 0; i < TM; ++i)
            for (int j = 0; j < TN; ++j)
              acc[i][j] = sycl::reduce_over_group(w.sg, acc[i][j], sycl::plus<float>());
          if (bias != nullptr)
            for (int j = 0; j < TN; ++j) {
              const float bj = to_float(bias[g * bias_stride_e + (n0 + j < N ? n0 + j : N - 1)]);
              for (int i = 0; i < TM; ++i) acc[i][j] += bj;
            }
        }
        // Every lane holds every sum now; lane (i * TN + j) % lanes stores element (i, j).
        for (int i = 0; i < TM; ++i)
          for (int j = 0; j < TN; ++j)
            if ((i * TN + j) % w.lanes == w.lane && m_tile * TM + i < rows && n0 + j < N)
              out[(m0 + i) * out_row_stride + n0 + j] = FromFloat<TOut>::convert(acc[i][j]);
      });
}

// Variant for B stored with N contiguous (b_stride_n == 1), e.g. a contiguous [E, K, N]
// tensor. The 16 lanes split N: lane l owns columns n0 + l + 16 * j; A values are uniform
// across the sub-group.
template <typename T, typename TOut, int TM, int TN>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::sub_group_size<16>))
void moe_gemm_n_lanes(const T* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                      int gather_is64, const T* b, int64_t b_stride_e, int64_t b_stride_k,
                      const T* bias, int64_t bias_stride_e, TOut* out, int64_t out_row_stride,
                      int64_t out_rows, const void* group_offsets, int offsets_is64,
                      int64_t num_groups, int64_t K, int64_t N) {
  const Worker w = this_worker();
  const int64_t tile_n = static_cast<int64_t>(w.lanes) * TN;
  const int64_t tiles_n = (N + tile_n - 1) / tile_n;
  for_each_owned_tile(
      w.id, w.count, group_offsets, offsets_is64, num_groups, out_rows, TM, tiles_n,
      [&](int64_t g, int64_t row_begin, int64_t rows, int64_t m_tile, int64_t n_tile) {
        const int64_t m0 = row_begin + m_tile * TM;
        int64_t col[TN];
        for (int j = 0; j < TN; ++j) col[j] = n_tile * tile_n + w.lane + static_cast<int64_t>(w.lanes) * j;
        float acc[TM][TN];
        for (int i = 0; i < TM; ++i)
          for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
        if (g < num_groups) {
          const T* a_row[TM];
          for (int i = 0; i < TM; ++i) {
            const int64_t m = m0 + (i < rows - m_tile * TM ? i : rows - 1 - m_tile * TM);
            a_row[i] = a + source_row(gather_index, gather_is64, m, a_rows) * a_row_stride;
          }
          const T* b_col[TN];
          for (int j = 0; j < TN; ++j) b_col[j] = b + g * b_stride_e + (col[j] < N ? col[j] : N - 1);
          for (int64_t k = 0; k < K; ++k) {
            float bv[TN];
            for (int j = 0; j < TN; ++j) bv[j] = to_float(b_col[j][k * b_stride_k]);
            for (int i = 0; i < TM; ++i) {
              const float av = to_float(a_row[i][k]);
              for (int j = 0; j < TN; ++j) acc[i][j] = sycl::fma(av, bv[j], acc[i][j]);
            }
          }
          if (bias != nullptr)
            for (int j = 0; j < TN; ++j) {
              const float bj = to_float(bias[g * bias_stride_e + (col[j] < N ? col[j] : N - 1)]);
              for (int i = 0; i < TM; ++i) acc[i][j] += bj;
            }
        }
        for (int i = 0; i < TM; ++i)
          for (int j = 0; j < TN; ++j)
            if (m_tile * TM + i < rows && col[j] < N)
              out[(m0 + i) * out_row_stride + col[j]] = FromFloat<TOut>::convert(acc[i][j]);
      });
}

}  // namespace moe_xpu

// Instantiations are appended by the launcher, one line per compiled variant, e.g.
// MOE_XPU_INSTANTIATE_K_LANES(float, float, 4, 4), and registered under the matching name
// "moe_xpu::moe_gemm_k_lanes<float, float, 4, 4>".
#define MOE_XPU_KERNEL_PARAMS(T, TOut)                                                         \
  const T*, int64_t, int64_t, const void*, int, const T*, int64_t, int64_t, const T*, int64_t, \
      TOut*, int64_t, int64_t, const void*, int, int64_t, int64_t, int64_t
#define MOE_XPU_INSTANTIATE_K_LANES(T, TOut, TM, TN) \
  template void moe_xpu::moe_gemm_k_lanes<T, TOut, TM, TN>(MOE_XPU_KERNEL_PARAMS(T, TOut));
#define MOE_XPU_INSTANTIATE_N_LANES(T, TOut, TM, TN) \
  template void moe_xpu::moe_gemm_n_lanes<T, TOut, TM, TN>(MOE_XPU_KERNEL_PARAMS(T, TOut));

// moe_xpu weight-gradient kernel: for every group g, dB[g] = A[rows of g]^T @ dY[rows of g], a
// grouped GEMM whose reduction runs over each group's rows (the backward of moe_gemm for its
// weights). Compiled at run time like moe_gemm.cpp, in the same bundle.
//
// Row m of group g (rows [group_offsets[g-1], group_offsets[g]) of dY) pairs with A row
// gather_index[m] when an index table is given, else A row m. A work unit is one TK x (16 * TN)
// tile of one group's dB; the 16 lanes split its columns (lane l owns columns n0 + l + 16 j) and
// it walks the group's rows in ascending order, so every dB element is one work-item's sum in a
// fixed order: bitwise reproducible, no atomics. An empty group's units store zeros (as a flat
// run of elements when dB is dense).
//
// Scheduling: a fixed set of workers; every group contributes tiles_k * tiles_n units costing
// (rows + 1) each (the rows' FMAs plus the tile's store), and each worker runs the units
// centred in its equal share of the total, so one group holding every row still spreads over all
// workers. Offsets are read on the device and clamped like the forward kernels'.
//
// The lanes store along dB's N. For dB contiguous along K (nn.Linear weights seen through
// .transpose(1, 2)) the launcher computes dB^T = dY^T A instead, the operands swapped, so the
// stores stay consecutive; the index table then applies to the second operand (gather_dy).
#include "matrix_engine.hpp"

namespace moe_xpu {

template <typename T, typename TOut, int TK, int TN>
MOE_XPU_KERNEL
void moe_gemm_wgrad(const T* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                    int gather_is64, const T* dy, int64_t dy_row_stride, int64_t dy_rows,
                    const void* group_offsets, int offsets_is64, int64_t num_groups, int64_t K,
                    int64_t N, TOut* out, int64_t out_stride_e, int64_t out_stride_k,
                    int64_t out_stride_n, int gather_dy) {
  const Worker w = this_worker();
  const int64_t tile_n = int64_t(kLanes) * TN;
  const int64_t tiles_n = (N + tile_n - 1) / tile_n;
  const int64_t tiles_k = (K + TK - 1) / TK;
  const int64_t tiles = tiles_k * tiles_n;
  const int64_t walked_rows = gather_dy ? a_rows : dy_rows;  // the operand read row by row
  const bool dense = wgrad_dense(K, N, out_stride_e, out_stride_k, out_stride_n);
  // Every tile of a group costs its rows' FMAs plus its store.
  auto shape = [&](int64_t rows, int64_t& units, int64_t& cost) { units = tiles, cost = rows + 1; };
  for_each_owned_wgrad_units(w.id, w.count, group_offsets, offsets_is64, num_groups, walked_rows, shape,
                             [&](int64_t g, int64_t row_begin, int64_t rows, int64_t u_lo, int64_t u_hi, int64_t) {
    const int64_t row_end = row_begin + rows;
    if (rows == 0 && dense) {
      store_zero_share(out + g * out_stride_e, K * N, u_lo, u_hi, tiles, w.lane, kLanes);
      return;
    }
    // Units ordered K tile by K tile, column tiles inside: a worker's consecutive units store
    // along the same TK rows of dB, long runs of consecutive memory (column tiles outside
    // measured 134 vs 85-100 ms on the fused 64tok gate_up gradient, float32). The group's rows
    // of A and dY they read stay in cache either way.
    for (int64_t t = u_lo; t < u_hi; ++t) {
      const int64_t n0 = (t % tiles_n) * tile_n;
      const int64_t k0 = (t / tiles_n) * TK;
      const bool full = n0 + tile_n <= N;
      // A last tile in whole 16-column vectors reads the tile's first vector in place of those
      // past N (never stored): consecutive loads instead of per-lane clamped gathers.
      const bool whole_vectors = (N - n0) % kLanes == 0;
      int64_t col[TN], offset[TN];
      #pragma unroll
      for (int j = 0; j < TN; ++j) {
        col[j] = n0 + w.lane + int64_t(kLanes) * j;
        offset[j] = full || int64_t(kLanes) * j < N - n0 ? int64_t(kLanes) * j : 0;
      }
      int64_t kk[TK];  // A columns of the tile's rows, clamped (rows past K are never stored)
      #pragma unroll
      for (int i = 0; i < TK; ++i) kk[i] = k0 + i < K ? k0 + i : K - 1;
      float acc[TK][TN];
      #pragma unroll
      for (int i = 0; i < TK; ++i)
        #pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
      // The rows' walk, with the dY strip's load as a parameter: the consecutive and the clamped
      // loads each get a loop of their own. Chosen per row inside one loop, the compiler merged
      // them into one load from a selected address, and every dY vector became a gather.
      auto walk_rows = [&](auto load_dy) {
        for (int64_t m = row_begin; m < row_end; ++m) {
          const int64_t source = gather_dy ? source_row(gather_index, gather_is64, m, dy_rows) : 0;
          const T* a_row = a + (gather_dy ? m : source_row(gather_index, gather_is64, m, a_rows)) * a_row_stride;
          float dv[TN];
          load_dy(dy + (gather_dy ? source : m) * dy_row_stride, dv);
          #pragma unroll
          for (int i = 0; i < TK; ++i) {
            const float av = to_float(a_row[kk[i]]);
            #pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] = sycl::fma(av, dv[j], acc[i][j]);
          }
        }
      };
      if (full || whole_vectors) {
        walk_rows([&](const T* dy_row, float (&dv)[TN]) {
          const T* dy_lane = dy_row + n0 + w.lane;
          #pragma unroll
          for (int j = 0; j < TN; ++j) dv[j] = to_float(dy_lane[offset[j]]);
        });
      } else {
        walk_rows([&](const T* dy_row, float (&dv)[TN]) {
          #pragma unroll
          for (int j = 0; j < TN; ++j) dv[j] = to_float(dy_row[col[j] < N ? col[j] : N - 1]);
        });
      }
      TOut* out_g = out + g * out_stride_e;
      // Lane-consecutive stores (dB N-contiguous, as the launcher always arranges for dense dB),
      // with the bounds test as a parameter: a whole tile gets plain vector stores. (Tested per
      // store, each store is masked and its mask built from two 64-bit compares: as many
      // instructions as the conversion, which is what a tile of few rows spends its time on.)
      auto store_rows = [&](auto in_bounds) {
        #pragma unroll
        for (int i = 0; i < TK; ++i) {
          TOut* out_lane = out_g + (k0 + i) * out_stride_k + n0 + w.lane;
          #pragma unroll
          for (int j = 0; j < TN; ++j)
            if (in_bounds(i, j)) out_lane[kLanes * j] = FromFloat<TOut>::convert(acc[i][j]);
        }
      };
      if (out_stride_n == 1 && full && k0 + TK <= K) {
        store_rows([](int, int) { return true; });
      } else if (out_stride_n == 1) {
        store_rows([&](int i, int j) { return k0 + i < K && col[j] < N; });
      } else {
        #pragma unroll
        for (int i = 0; i < TK; ++i)
          #pragma unroll
          for (int j = 0; j < TN; ++j)
            if (k0 + i < K && col[j] < N)
              out_g[(k0 + i) * out_stride_k + col[j] * out_stride_n] = FromFloat<TOut>::convert(acc[i][j]);
      }
    }
  });
}

// Matrix-engine weight gradient (joint_matrix: AMX on Intel Xeon CPUs, XMX on Intel GPUs) for bf16
// (and, where the engine takes it, fp16) operands. The reduction runs over a group's rows, which
// are the outer dimension of both A and dY, so each operand is rearranged into a worker's scratch
// area first: dY's rows into the engine's pair-interleaved right operand (rows 2r and 2r + 1 side
// by side, a block of up to kWgradPackedBudget bytes, kept while the worker's consecutive units
// use it), and the unit's 2 x Rows columns of A into the row-major left operand A^T, read through
// the index table (rows past the group's end are zeros in both). Both are laid out tile by tile,
// so an engine tile load reads one contiguous run of memory. A unit is those 2 x Rows rows of
// dB across the block's columns, every tile summed over all the group's rows in ascending order,
// so every element is one engine accumulator in a fixed order: bitwise reproducible for any
// worker count. Empty groups store zeros as the vector kernel does.
// Columns of a group's dY blocks: as many whole column-tile pairs as the budget holds at its
// padded row count (at least one pair).
inline int64_t wgrad_block_cols(int64_t padded_rows, int64_t N, int64_t pair_cols) {
  const int64_t fit = kWgradPackedBudget / (padded_rows * 2) / pair_cols * pair_cols;
  const int64_t all = (N + pair_cols - 1) / pair_cols * pair_cols;
  const int64_t cols = fit > pair_cols ? fit : pair_cols;
  return cols < all ? cols : all;
}
template <typename T, typename TOut, int Rows, int Toks, int KStep, int Lanes>
MOE_XPU_KERNEL_WITH_LANES(Lanes)
void moe_gemm_matrix_wgrad(const T* a, int64_t a_row_stride, int64_t a_rows, const void* gather_index,
                           int gather_is64, const T* dy, int64_t dy_row_stride, int64_t dy_rows,
                           const void* group_offsets, int offsets_is64, int64_t num_groups, int64_t K,
                           int64_t N, TOut* out, int64_t out_stride_e, int64_t out_stride_k,
                           int64_t out_stride_n, int gather_dy, void* scratch) {
  static_assert(Toks == Lanes, "the epilogue puts one column on each lane");
  using E = EngineElem<T>;
  constexpr int KB = 2 * Rows;        // dB rows (columns of A) of a unit: two engine tiles
  constexpr int PairCols = 2 * Toks;  // dB columns of a column-tile pair
  static_assert(KB <= 32, "the scratch layout holds at most 32 columns of A");
  const Worker w = this_worker();
  const int64_t walked_rows = gather_dy ? a_rows : dy_rows;  // the operand read row by row
  const int64_t cap = wgrad_padded_rows(walked_rows);
  unsigned char* mine = static_cast<unsigned char*>(scratch) + w.id * wgrad_matrix_scratch_bytes(walked_rows);
  uint32_t* at = reinterpret_cast<uint32_t*>(mine);                        // [KB][padded / 2] row pairs
  uint32_t* yp = reinterpret_cast<uint32_t*>(mine + 32 * cap * 2);  // [block cols / Toks][padded / 2][Toks]
  float* stored = reinterpret_cast<float*>(mine + 32 * cap * 2 + wgrad_packed_bytes(cap));  // [2][2][Rows][Toks]
  const float* zeros = zeroed_tiles(stored, Rows * Toks, w.lane, Lanes);
  const int64_t tiles_k = (K + KB - 1) / KB;
  const int64_t pairs_n = (N + PairCols - 1) / PairCols;
  // A group's units and what each costs: engine steps over its padded rows per column-tile pair,
  // plus one for the pair's stores. An empty group: every pair costs 1 (its zeros).
  auto block_cols_of = [&](int64_t rows) {
    return rows == 0 ? int64_t(PairCols) : wgrad_block_cols(wgrad_padded_rows(rows), N, PairCols);
  };
  auto shape = [&](int64_t rows, int64_t& units, int64_t& cost) {
    const int64_t block_cols = block_cols_of(rows);
    units = tiles_k * ((pairs_n * PairCols + block_cols - 1) / block_cols);
    cost = rows == 0 ? 1 : (wgrad_padded_rows(rows) / KStep + 1) * (block_cols / PairCols);
  };
  const bool dense = wgrad_dense(K, N, out_stride_e, out_stride_k, out_stride_n);
  const TOut zero = FromFloat<TOut>::convert(0.0f);
  int64_t held_group = -1, held_block = -1;  // the dY block yp holds
  for_each_owned_wgrad_units(w.id, w.count, group_offsets, offsets_is64, num_groups, walked_rows, shape,
                             [&](int64_t g, int64_t row_begin, int64_t rows, int64_t u_lo, int64_t u_hi, int64_t units) {
    TOut* out_g = out + g * out_stride_e;
    if (rows == 0) {
      if (dense) {
        store_zero_share(out_g, K * N, u_lo, u_hi, units, w.lane, Lanes);
      } else {
        for (int64_t u = u_lo; u < u_hi; ++u)
          for (int64_t k = (u / pairs_n) * KB; k < (u / pairs_n + 1) * KB && k < K; ++k)
            for (int64_t n = (u % pairs_n) * PairCols + w.lane; n < (u % pairs_n + 1) * PairCols && n < N; n += Lanes)
              out_g[k * out_stride_k + n * out_stride_n] = zero;
      }
      return;
    }
    const int64_t block_cols = block_cols_of(rows);
    const int64_t padded = wgrad_padded_rows(rows);
    const E* at_e = reinterpret_cast<const E*>(at);
    const E* yp_e = reinterpret_cast<const E*>(yp);
    // Row m of the group in either operand (zeros past the group's end are written by the packing).
    auto a_row = [&](int64_t m) {
      return a + (gather_dy ? row_begin + m : source_row(gather_index, gather_is64, row_begin + m, a_rows)) * a_row_stride;
    };
    auto dy_row = [&](int64_t m) {
      return dy + (gather_dy ? source_row(gather_index, gather_is64, row_begin + m, dy_rows) : row_begin + m) * dy_row_stride;
    };
    for (int64_t u = u_lo; u < u_hi; ++u) {
      const int64_t block = u / tiles_k, k0 = (u % tiles_k) * KB;
      const int64_t n0 = block * block_cols;
      const int64_t cols = pairs_n * PairCols - n0 < block_cols ? pairs_n * PairCols - n0 : block_cols;
      if (g != held_group || block != held_block) {
        // yp[c / Toks][r][c % Toks] = (dY[2r][n0 + c], dY[2r + 1][n0 + c]), zeros past the rows and N.
        for (int64_t r = 0; r < padded / 2; ++r) {
          const bool lo_real = 2 * r < rows, hi_real = 2 * r + 1 < rows;
          const T* lo_row = dy_row(lo_real ? 2 * r : 0);
          const T* hi_row = dy_row(hi_real ? 2 * r + 1 : 0);
          for (int64_t c = w.lane; c < cols; c += Lanes) {
            const int64_t n = n0 + c;
            const float lo = lo_real && n < N ? to_float(lo_row[n]) : 0.0f;
            const float hi = hi_real && n < N ? to_float(hi_row[n]) : 0.0f;
            yp[((c / Toks) * (padded / 2) + r) * Toks + c % Toks] = engine_pair<T>(lo, hi);
          }
        }
        held_group = g;
        held_block = block;
      }
      // at[i][r] = (A[2r][k0 + i], A[2r + 1][k0 + i]): each lane a pair of rows.
      for (int64_t r = w.lane; r < padded / 2; r += Lanes) {
        const bool lo_real = 2 * r < rows, hi_real = 2 * r + 1 < rows;
        const T* lo_row = a_row(lo_real ? 2 * r : 0);
        const T* hi_row = a_row(hi_real ? 2 * r + 1 : 0);
        for (int i = 0; i < KB; ++i) {
          const bool real_k = k0 + i < K;
          const float lo = lo_real && real_k ? to_float(lo_row[k0 + i]) : 0.0f;
          const float hi = hi_real && real_k ? to_float(hi_row[k0 + i]) : 0.0f;
          at[i * (padded / 2) + r] = engine_pair<T>(lo, hi);
        }
      }
      for (int64_t p = 0; p < cols; p += PairCols) {
        jm::joint_matrix<sycl::sub_group, float, jm::use::accumulator, Rows, Toks> acc[2][2];
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < 2; ++j)
            jm::joint_matrix_load(w.sg, acc[i][j], global_ptr(zeros + (2 * i + j) * Rows * Toks), Toks,
                                  jm::layout::row_major);
        for (int64_t r = 0; r < padded; r += KStep) {
          jm::joint_matrix<sycl::sub_group, E, jm::use::b, KStep, Toks, jm::layout::ext_intel_packed> yb[2];
          for (int j = 0; j < 2; ++j)
            jm::joint_matrix_load(w.sg, yb[j], global_ptr(yp_e + ((p / Toks + j) * padded + r) * Toks), 2 * Toks);
          for (int i = 0; i < 2; ++i) {
            jm::joint_matrix<sycl::sub_group, E, jm::use::a, Rows, KStep, jm::layout::row_major> xa;
            jm::joint_matrix_load(w.sg, xa, global_ptr(at_e + i * Rows * padded + r), padded);
            for (int j = 0; j < 2; ++j) jm::joint_matrix_mad(w.sg, acc[i][j], xa, yb[j], acc[i][j]);
          }
        }
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < 2; ++j)
            jm::joint_matrix_store(w.sg, acc[i][j], global_ptr(stored + (2 * i + j) * Rows * Toks), Toks,
                                   jm::layout::row_major);
        // Lane-consecutive stores where dB is N-contiguous (the launcher arranges it for dense dB),
        // unmasked where the pair's columns are all below N (a per-lane condition made every store a
        // scatter), a dB row's two tiles one after the other (whole 64-byte lines of bf16); through
        // the general strides every store is a scatter.
        const int64_t np = n0 + p;  // the pair's first column
        const int rows_k = K - k0 < KB ? int(K - k0) : KB;
        if (out_stride_n == 1 && np + PairCols <= N) {
          for (int row = 0; row < rows_k; ++row) {
            TOut* dst = out_g + (k0 + row) * out_stride_k + np + w.lane;
            const float* src = stored + (2 * (row / Rows)) * Rows * Toks + (row % Rows) * Toks + w.lane;
            dst[0] = FromFloat<TOut>::convert(src[0]);
            dst[Toks] = FromFloat<TOut>::convert(src[Rows * Toks]);
          }
        } else {
          for (int row = 0; row < rows_k; ++row)
            for (int j = 0; j < 2; ++j) {
              const int64_t n = np + j * Toks + w.lane;
              if (n < N)
                out_g[(k0 + row) * out_stride_k + n * out_stride_n] = FromFloat<TOut>::convert(
                    stored[((2 * (row / Rows) + j) * Rows + row % Rows) * Toks + w.lane]);
            }
        }
      }
    }
  });
}

}  // namespace moe_xpu

#define MOE_XPU_INSTANTIATE_WGRAD(T, TOut, TK, TN)                                                     \
  template void moe_xpu::moe_gemm_wgrad<T, TOut, TK, TN>(                                             \
      const T*, int64_t, int64_t, const void*, int, const T*, int64_t, int64_t, const void*, int, int64_t, \
      int64_t, int64_t, TOut*, int64_t, int64_t, int64_t, int);
#define MOE_XPU_INSTANTIATE_MATRIX_WGRAD(T, TOut, ROWS, TOKS, KSTEP, LANES)                                 \
  template void moe_xpu::moe_gemm_matrix_wgrad<T, TOut, ROWS, TOKS, KSTEP, LANES>(                          \
      const T*, int64_t, int64_t, const void*, int, const T*, int64_t, int64_t, const void*, int, int64_t, \
      int64_t, int64_t, TOut*, int64_t, int64_t, int64_t, int, void*);

// Sizes that the kernels and the host launcher must agree on: work-unit rows, the vector kernels'
// local-memory tiles, the matrix-engine tile and every worker's scratch area. Plain C++ with no
// SYCL, so the host (g++, sycl/variants.cpp) includes the same file the runtime compiler gets.
#pragma once

#include <cstdint>

namespace moe_xpu {

// Rows a work unit covers at most: enough to read B once in prefill, few enough that one
// expert taking every row still spreads over many units.
constexpr std::int64_t kUnitRows = 64;

// N-split tiles at most this many vectors wide keep their sums in registers; wider one-row tiles
// (the CPU's decode tile) stream B rows with their sums in work-group local memory.
constexpr int kRegisterTileVectors = 32;
// Room for the N-split kernel's partial sums in work-group local memory, in tiles (see
// n_lanes_unit_shape in moe_gemm.cpp).
constexpr std::int64_t kNLanesPartialTiles = 192;

// The dot-product kernels' register tile, bf16 and W8A8 alike (moe_gemm_dot.cpp: their assembly
// is written for it), and the floats of work-group local memory that hold one tile's sums.
constexpr int kDotRows = 4;
constexpr int kDotCols = 6;
constexpr std::int64_t kDotSums = 32;
// The FMA dot-product kernels' register tiles (moe_gemm_fma.cpp), by the floats a register holds:
// on AVX2 (8) 3 x 4 (12 accumulators, 3 A vectors and 1 B vector of the 16 ymm registers), on
// AVX-512 (16) the dot-product kernels' 4 x 6 of the 32 zmm registers; for decode 1 x kFmaRowCols
// on both; and the floats of local memory for one tile's sums.
constexpr int kFmaRows = 3;
constexpr int kFmaCols = 4;
constexpr int kFmaRowCols = 8;
constexpr std::int64_t kFmaSums = 16;
constexpr int fma_rows(int width) { return width == 16 ? kDotRows : kFmaRows; }
constexpr int fma_cols(int width) { return width == 16 ? kDotCols : kFmaCols; }
constexpr std::int64_t fma_sums_floats(int width) { return width == 16 ? kDotSums : kFmaSums; }
// The N-contiguous FMA kernel's tile (moe_gemm_n_fma, AVX2): 6 rows x 16 columns, 12 accumulators of
// the 16 ymm registers, its sums stored for the epilogue.
constexpr int kNFmaRows = 6;
constexpr int kNFmaCols = 16;
constexpr std::int64_t kNFmaSums = kNFmaRows * kNFmaCols;
// A worker's scratch there: the packed copy of a unit's B strip, K rows of 16 floats.
inline std::int64_t n_fma_scratch_bytes(std::int64_t K) { return (K > 0 ? K : 1) * kNFmaCols * 4; }
// The 4-bit dot-product kernel's tile (moe_gemm_nibble_dot): 4 rows x 4 columns, half a chunk of
// the packed layout; kNibbleLocal floats of work-group local memory (its constants, sums and row
// count). The fp8 kernel's tile is the same.
constexpr int kNibbleRows = 4;
constexpr int kNibbleCols = 4;
constexpr std::int64_t kNibbleLocal = 368;
// The N-contiguous bf16 dot-product kernel's tile (moe_gemm_n_dot): 6 rows x 64 columns, its
// 24 accumulators' 16 lanes each stored for the epilogue.
constexpr int kNDotRows = 6;
constexpr int kNDotCols = 64;
constexpr std::int64_t kNDotSums = kNDotRows * kNDotCols;
// The N-contiguous dot kernel's scratch (moe_gemm_n_dot): a worker's unit of several row tiles
// keeps its 64 columns of B as the first tile interleaved them, K / 2 row pairs of 256 bytes, and
// the later tiles read that copy. Only where B's rows fall into too few cache sets to stay in L2
// for the second tile: rows a multiple of 64 bytes apart cover kNDotL2Sets / gcd(stride / 64,
// kNDotL2Sets) sets (N = 2048 bf16, 4 KB apart: 32 of a 1 MB 8-way L2's 2048), which must hold
// the tile's 2 K lines in kNDotL2Ways ways with room to spare; and K at most kNDotPackMaxK (the
// copy stays within L2). Elsewhere every tile reads B itself: a copy there measured slower
// (E = 64, K = 2048, rows 4160 bytes apart, 16 rows a group: 38-41 ms without, 45-61 ms with;
// 4096 bytes apart: 58-62 without, 49-50 with).
constexpr std::int64_t kNDotPackMaxK = 4096;
constexpr std::int64_t kNDotL2Sets = 2048, kNDotL2Ways = 8;
inline bool n_dot_packs(std::int64_t K, std::int64_t b_row_bytes) {
  if (K > kNDotPackMaxK || b_row_bytes % 64 != 0) return false;
  std::int64_t x = b_row_bytes / 64 % kNDotL2Sets, y = kNDotL2Sets;  // gcd(x, y)
  while (x != 0) {
    const std::int64_t r = y % x;
    y = x;
    x = r;
  }
  return kNDotL2Sets / y * kNDotL2Ways < 2 * K;
}
inline std::int64_t n_dot_scratch_bytes(std::int64_t K, std::int64_t b_row_bytes) {
  return n_dot_packs(K, b_row_bytes) ? K / 2 * kNDotCols * 4 : 64;
}

// AMX's engine tile, which the N-contiguous matrix kernel is written for:
constexpr int kMatRows = 16;  // weight rows (output columns) per engine tile
constexpr int kMatToks = 16;  // tokens per engine tile
constexpr int kMatK = 32;     // k per engine step (bf16)
constexpr int kMatTokTiles = int(kUnitRows) / kMatToks;

// The N-contiguous matrix kernel's unit: up to kKnCols columns, so that for N <= kKnCols a chunk
// of B rows is one contiguous block of memory, read as one sequential stream (the hardware
// prefetchers follow it; units of 256 or 1024 columns read B rows in short pieces and measured
// 1.7-2x slower on the bench's [E, K, N] cases), K walked one engine step (kKnChunk) at a time
// (chunks of 64 measured 1.2-1.4x slower).
constexpr int kKnCols = 4096;
constexpr int kKnChunk = 32;
constexpr int kKnTiles = kKnCols / kMatRows;

// One worker's scratch area in the forward matrix kernels: the packed A of a row block
// (kUnitRows x K bf16); for the N-contiguous kernel its packed B chunk and the partial sums of its
// unit; then the stored accumulator tiles of the epilogue.
inline std::int64_t matrix_a_bytes(std::int64_t K) { return kUnitRows * K * 2; }
constexpr std::int64_t kTileBytes = kMatRows * kMatToks * 4;
constexpr std::int64_t kKnPackedBytes = std::int64_t(kKnChunk) * kKnCols * 2;
constexpr std::int64_t kKnPartialBytes = std::int64_t(kMatTokTiles) * kKnTiles * kTileBytes;
inline std::int64_t matrix_scratch_bytes(std::int64_t K, bool kn) {
  return matrix_a_bytes(K) + (kn ? kKnPackedBytes + kKnPartialBytes : 0) + 4 * kTileBytes;
}

// ... and in the dequantizing one (moe_gemm_quant.cpp): the same, then the unit's two weight
// tiles' rows dequantized to bf16 (at most 2 x 16 rows of K) and four tiles of K-block sums.
inline std::int64_t dequant_matrix_scratch_bytes(std::int64_t K) {
  return matrix_scratch_bytes(K, false) + 2 * kMatRows * K * 2 + 4 * kTileBytes;
}

// The matrix weight gradient (moe_gemm_wgrad.cpp): a group's rows are padded to whole steps of
// kWgradRowStep, and a worker holds a packed block of dY of up to kWgradPackedBudget bytes (one
// column-tile pair's worth, 64 bytes a row, when a group has more rows than that budget holds).
constexpr std::int64_t kWgradRowStep = 32;
constexpr std::int64_t kWgradPackedBudget = 512 * 1024;
inline std::int64_t wgrad_padded_rows(std::int64_t rows) {
  return (rows + kWgradRowStep - 1) / kWgradRowStep * kWgradRowStep;
}
inline std::int64_t wgrad_packed_bytes(std::int64_t padded_rows) {
  return padded_rows * 64 > kWgradPackedBudget ? padded_rows * 64 : kWgradPackedBudget;
}
// One worker's scratch: A^T of a unit (at most 32 columns of A over the padded rows), the packed dY
// block, the four accumulator tiles of the epilogue and four zero tiles. `rows` is every row the
// launch walks.
inline std::int64_t wgrad_matrix_scratch_bytes(std::int64_t rows) {
  const std::int64_t padded = wgrad_padded_rows(rows);
  return 32 * padded * 2 + wgrad_packed_bytes(padded) + 8 * kTileBytes;
}

// The bf16 dot weight gradient (moe_gemm_dot_wgrad): the fewest rows a group averages for it to
// run, and a worker's scratch: kNDotRows columns of A as dwords of row pairs, room for a group
// with every row the launch walks.
constexpr std::int64_t kDotWgradMinRows = 2;
inline std::int64_t dot_wgrad_pair_capacity(std::int64_t rows) { return (rows + 1) / 2; }
inline std::int64_t dot_wgrad_scratch_bytes(std::int64_t rows) {
  return kNDotRows * dot_wgrad_pair_capacity(rows) * 4;
}

}  // namespace moe_xpu

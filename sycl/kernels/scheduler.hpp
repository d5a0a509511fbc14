// The persistent work-group scheduler shared by the kernel families (moe_gemm.cpp, the quantized
// moe_gemm_quant.cpp, the weight gradient in moe_gemm_wgrad.cpp): a fixed set of workers walks the cumulative group offsets on the
// device and each takes the work units that start in its equal share of the total cost. Handed to
// the runtime compiler as an include file.
#pragma once

#include "common.hpp"
#include "sizes.hpp"

namespace moe_xpu {

// What a work unit costs, in vector-FMA issue slots per k step: each of its row tiles issues
// row_tile FMAs, and reading its B slice from memory takes `stream` (see unit_cost).
struct UnitCost {
  int64_t row_tile;
  int64_t stream;
};

// Unit costs of a kernel whose row tiles are TM x TN vectors of B elements of type T. A k step
// reads TN vectors of 16 B elements (16 * sizeof(T) bytes each) and issues TM * TN FMAs. A CPU
// core streams about 4.5 bytes per cycle from memory and issues 2 vector FMAs per cycle, so a
// column's read costs 16 * sizeof(T) / 4.5 * 2 ~ 7 * sizeof(T) FMA slots: a decode unit (1 x 8,
// float: 8 vs 224) is almost all streaming; a float prefill unit of three 6 x 4 row tiles (72)
// costs about two thirds of its B read (112).
// Weighing both keeps workers balanced when experts hold very different numbers of rows.
template <typename T, int TM, int TN>
constexpr UnitCost unit_cost() {
  return UnitCost{int64_t(TM) * TN, int64_t(TN) * 7 * int64_t(sizeof(T))};
}

// How many of `units` units of `cost` each, the first starting at `base`, have their middle
// before `limit`.
inline int64_t units_centred_before(int64_t limit, int64_t base, int64_t cost, int64_t units) {
  const int64_t before = limit - base - cost / 2;  // unit u's middle is base + u * cost + cost / 2
  if (before <= 0) return 0;
  const int64_t n = (before + cost - 1) / cost;
  return n < units ? n : units;
}

// Calls unit(g, row_begin, rows, m_first, m_last, n_tile) for every work unit this worker owns:
// row tiles [m_first, m_last) of group g (rows [row_begin, row_begin + rows)) at column tile
// n_tile. A work unit is one column tile of one group over up to `tiles_per_unit` consecutive row
// tiles: its B slice is read from memory once and reused from cache by its row tiles. Units are
// ordered group by group, row block by row block, column tile by column tile, and each worker
// owns the units whose middle lies in its equal share of the total cost (row tiles plus B
// streaming, see UnitCost): balanced however skewed the routing, each worker within half a unit
// of its share (owning those that start in it could put a whole unit more on one worker, which
// with a few large units is a large imbalance). A worker's consecutive units share their rows of
// A and read adjacent B rows as one long stream. g == num_groups is the tail group (rows past the last
// offset, written with zeros). Offsets are clamped into [previous offset, out_rows] so malformed
// offsets can never address memory out of range (the host validates them where it can do so
// without a synchronisation).
template <typename UnitFn>
inline void for_each_owned_unit(int64_t worker, int64_t num_workers, const void* group_offsets,
                                int offsets_is64, int64_t num_groups, int64_t out_rows,
                                int64_t tile_m, int64_t tiles_per_unit, int64_t tiles_n,
                                UnitCost cost_of, UnitFn&& unit) {
  // The tail group only stores zeros: a row tile costs one slot and there is no B to stream.
  auto row_tile_cost = [&](int64_t g) { return g < num_groups ? cost_of.row_tile : int64_t(1); };
  auto stream_cost = [&](int64_t g) { return g < num_groups ? cost_of.stream : int64_t(0); };
  int64_t total = 0;
  for_each_group(group_offsets, offsets_is64, num_groups, out_rows, tile_m, tiles_per_unit,
                 [&](int64_t g, int64_t, int64_t, int64_t tiles_m, int64_t blocks_m) {
                   total += tiles_n * (tiles_m * row_tile_cost(g) + blocks_m * stream_cost(g));
                   return true;
                 });
  const int64_t first = total * worker / num_workers;
  const int64_t last = total * (worker + 1) / num_workers;
  int64_t group_cost_base = 0;
  for_each_group(
      group_offsets, offsets_is64, num_groups, out_rows, tile_m, tiles_per_unit,
      [&](int64_t g, int64_t row_begin, int64_t row_end, int64_t tiles_m, int64_t blocks_m) {
        const int64_t base = group_cost_base;
        group_cost_base += tiles_n * (tiles_m * row_tile_cost(g) + blocks_m * stream_cost(g));
        if (group_cost_base <= first) return true;
        // Row block by row block, each across all column tiles: a worker's consecutive units
        // share their rows of A (kept in cache) and read adjacent slices of B.
        int64_t block_base = base;
        for (int64_t block = 0; block < blocks_m; ++block) {
          const int64_t m_first = block * tiles_per_unit;
          const int64_t m_last = m_first + tiles_per_unit < tiles_m ? m_first + tiles_per_unit : tiles_m;
          const int64_t unit_cost = (m_last - m_first) * row_tile_cost(g) + stream_cost(g);
          const int64_t n_lo = units_centred_before(first, block_base, unit_cost, tiles_n);
          const int64_t n_hi = units_centred_before(last, block_base, unit_cost, tiles_n);
          for (int64_t n_tile = n_lo; n_tile < n_hi; ++n_tile)
            unit(g, row_begin, row_end - row_begin, m_first, m_last, n_tile);
          if (n_hi < tiles_n) return false;  // the rest are the next workers'
          block_base += tiles_n * unit_cost;
        }
        return group_cost_base < last;
      });
}

// The weight-gradient kernels' scheduling (moe_gemm_wgrad.cpp): each group's dB is `units` work
// units of equal `cost`, shape(rows, units, cost) saying how many for a group of `rows` rows, and
// each worker runs the units whose middle lies in its equal share of the total cost (as
// for_each_owned_unit), so one group holding every row still spreads over all workers. Calls
// group(g, row_begin, rows, u_lo, u_hi, units) for every group of which the worker owns units
// [u_lo, u_hi), in group order.
template <typename ShapeFn, typename GroupFn>
inline void for_each_owned_wgrad_units(int64_t worker, int64_t num_workers, const void* group_offsets,
                                       int offsets_is64, int64_t num_groups, int64_t rows,
                                       ShapeFn&& shape, GroupFn&& group) {
  int64_t total = 0;
  for_each_group(group_offsets, offsets_is64, num_groups, rows, 1, 1,
                 [&](int64_t g, int64_t row_begin, int64_t row_end, int64_t, int64_t) {
                   if (g == num_groups) return true;
                   int64_t units, cost;
                   shape(row_end - row_begin, units, cost);
                   total += units * cost;
                   return true;
                 });
  const int64_t first = total * worker / num_workers;
  const int64_t last = total * (worker + 1) / num_workers;
  int64_t base = 0;
  for_each_group(group_offsets, offsets_is64, num_groups, rows, 1, 1,
                 [&](int64_t g, int64_t row_begin, int64_t row_end, int64_t, int64_t) {
                   if (g == num_groups || base >= last) return false;
                   int64_t units, cost;
                   shape(row_end - row_begin, units, cost);
                   const int64_t u_lo = units_centred_before(first, base, cost, units);
                   const int64_t u_hi = units_centred_before(last, base, cost, units);
                   if (u_lo < u_hi) group(g, row_begin, row_end - row_begin, u_lo, u_hi, units);
                   base += units * cost;
                   return base < last;
                 });
}

}  // namespace moe_xpu

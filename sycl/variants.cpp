#include "variants.hpp"

#include "kernels/sizes.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <iterator>
#include <sstream>
#include <stdexcept>

namespace moe_xpu {
namespace {

const char* type_name(DType t) {
  switch (t) {
    case DType::float32: return "float";
    case DType::float16: return "sycl::half";
    case DType::bfloat16: return "uint16_t";
    case DType::int8: return "int8_t";
    case DType::int4:
    case DType::fp8_e4m3:
    case DType::mxfp4: break;
  }
  throw std::invalid_argument("moe_xpu: unknown dtype");
}

// The format tag of quantized B in moe_gemm_quant.cpp.
const char* format_name(DType t) {
  switch (t) {
    case DType::int8: return "moe_xpu::Int8Weights";
    case DType::int4: return "moe_xpu::Int4Weights";
    case DType::fp8_e4m3: return "moe_xpu::Fp8Weights";
    case DType::mxfp4: return "moe_xpu::Mxfp4Weights";
    default: break;
  }
  throw std::invalid_argument("moe_xpu: not a quantized weight format");
}

// The tile shapes compiled into every bundle, per kernel. K-split (k_lanes, plain and gated
// alike; the gated epilogue needs an even TN: gate and up columns in pairs): {1, 8} decode,
// {6, 4} otherwise (on the AMX Xeon, with the kernel of that time, 3-7% faster than {8, 3} and
// {4, 6} in float32 at 16 and 64 rows per expert, equal in bfloat16; AVX-512 CPUs now take
// {4, 6}, see kCpuTileTables); its short last row tiles run 1- and 4-row variants compiled into
// the same kernel, which measured faster than a separate 4-row tile shape. N-split (n_lanes): wide tiles
// so each k-step reads a long contiguous piece of a B row: {2, 8} beyond decode ({4, 6} spilled
// three accumulators; {2, 8} measured 1.27x faster in bfloat16 at 16 rows per expert, equal in
// float32); for decode on the CPU {1, 128}, a row streaming whole 2048-column blocks of B rows
// with its sums in work-group local memory (see n_lanes_row_stream; [E, K, N] decode, weights not
// in cache: float32 19.5 -> 14.4 ms, bfloat16 12.9 -> 9.3 ms; before it the register tile
// {1, 24}, 10-15% faster than {1, 12} on the CPU). GPUs get {1, 8} and {2, 4}: wider N-split
// tiles keep too many 64-bit column addresses live and spill (python -m moe_xpu.gpu_check: {1, 24} spilled 6-9 KB per thread on
// pvc, dg2 and mtl; bf16 {2, 8} 1.2-1.3 KB on dg2 and mtl, which emulate 64-bit integer math).
// The first shape of each list is the decode shape.
// Those are the AVX-512 CPU's tiles. With narrower vectors a 16-lane sub-group vector takes two
// (AVX2) or four (SSE) of the 16 registers, so the register tiles shrink with the class (see
// kCpuTileTables). AVX2 (CL_CONFIG_CPU_TARGET_ARCH=core-avx2 on an AMD EPYC, bench cases, cold
// cache, median of 3): K-split {3, 2} beyond decode, float32 prefill 238 -> 125-131 ms, 64tok
// 98 -> 59-65 ms, bfloat16 prefill 187 -> 148 ms (of {3, 4}, {4, 2}, {2, 4}, {2, 2}, {5, 2}, {6, 2}
// the fastest or within 5%); decode stays {1, 8} (bf16 8.6 ms, {1, 4} 10.5 ms). N-split {2, 2}:
// {3, 2} had taken [E, K, N] float32 prefill 280 -> 251 ms, 64tok 100 -> 83 ms, 16tok 52 -> 34 ms
// ({2, 4}: 237, 111, 43 ms); {2, 2} against {3, 2} (2-core Zen 3, two alternating runs each,
// warm): kernel alone 64 rows an expert at K = N = 128 through an index table 327-332 vs 444-449
// us, T64 E8 K128 N128 54-57 vs 74-76 us; 2048 rows over 32 experts K 2048 N 1536 float32 168-208
// vs 216-222 ms, bfloat16 156 vs 220-232 ms; 64tok equal in float32, 72-75 vs 81-88 ms in
// bfloat16; 16tok (memory bound) within the noise. float32 B has no word pairs to read, and there
// {6, 1} (12 accumulator registers, one B vector a k step; the classic 6 x 16 AVX2 register
// tile) beat {2, 2} on the [E, K, N] bench cases (Zen 3, two alternating runs, cold cache):
// prefill 219-220 vs 241-309 ms, 64tok 104-118 vs 147-199 ms, 16tok 43-55 vs 57-58 ms; in
// bfloat16 it lost the word pairs (prefill 277-314 vs 224-231 ms), so 16-bit B keeps {2, 2}. The
// SSE table is sized by the same register count, not measured (no target CPU).
constexpr TileShape kKLanesTiles[] = {{1, 8}, {6, 4}};
constexpr TileShape kNLanesTilesCpu[] = {{1, 128}, {2, 8}};
constexpr TileShape kNLanesTiles[] = {{1, 8}, {2, 4}};

// The CPU tile tables per vector class, widest first: decode and prefill shape of each family
// (N-split: for 16-bit B, read as word pairs, and for float32 B), and the quantized vector
// kernels' tile of several rows (their decode tile is the K-split one).
// AVX-512 K-split {4, 6}: a row tile's A is read from L2 again for every column tile (a third of
// the loop's time on an Ice Lake Xeon), and {4, 6} reads it once per 6 columns where {6, 4} does
// per 4; groups of 8 rows also run as two whole tiles. Zen 5 (2 cores of a VM, AVX-512), float32,
// cold cache, both tiles in one process by tile override, two rounds, ms, {6, 4} -> {4, 6}: bench
// gemm 64tok-E64 58.4 / 63.2 -> 45.3 / 50.5, prefill 88.8 / 83.1 -> 75.2 / 77.8, 16tok-E8 18.4 /
// 17.6 -> 16.4 / 17.9; fused_moe 64tok-E64 82.4 / 73.0 -> 66.9 / 74.2, prefill 121.9 / 121.5 ->
// 109.3 / 113.3, 16tok-E8 49.9 / 55.3 -> 47.0 / 50.0; bitwise the same outputs. (On the Ice Lake
// Xeon, {4, 6} had measured within that VM's 20% spread of {6, 4}.) The quantized kernels keep
// {6, 4}: with their per-column decode, weight-only int8 at 64tok-E64 measured 28.6-32.8 ms on
// {6, 4}, 37.1-37.5 on {4, 6} (26.9 on the 4-row tile they add for groups of 3-4 rows).
struct CpuTileTable {
  const char* name;
  int vector_width;  // the narrowest width the table is for
  TileShape k_lanes[2], n_lanes[2], n_lanes_float[2];
  TileShape quant_tall;
};
constexpr CpuTileTable kCpuTileTables[] = {
    {"avx512", 16, {kKLanesTiles[0], {4, 6}}, {kNLanesTilesCpu[0], kNLanesTilesCpu[1]},
     {kNLanesTilesCpu[0], kNLanesTilesCpu[1]}, kKLanesTiles[1]},
    {"avx2", 8, {{1, 8}, {3, 2}}, {{1, 128}, {2, 2}}, {{1, 128}, {6, 1}}, {3, 2}},
    {"sse", 1, {{1, 4}, {2, 2}}, {{1, 128}, {2, 2}}, {{1, 128}, {2, 2}}, {2, 2}},
};

// MOE_XPU_CPU_TILES="k=1x4,3x4;n=1x128,2x4" replaces the CPU table (tuning on a new CPU class;
// the description's name carries it, so its bundles are built apart); "f=..." sets float32 B's
// N-split tiles apart (default: the n tiles). The quantized kernels' tall tile is the k part's.
const CpuTileTable* cpu_tiles_from_environment() {
  static const CpuTileTable* table = []() -> const CpuTileTable* {
    const char* v = std::getenv("MOE_XPU_CPU_TILES");
    if (v == nullptr || *v == '\0') return nullptr;
    auto* t = new CpuTileTable{"custom", 1, {}, {}, {}, {}};
    int k = 0, n = 0, f = 0;
    std::string spec(v);
    for (std::size_t pos = 0; pos < spec.size();) {
      const std::size_t end = std::min(spec.find(';', pos), spec.size());
      const std::string part = spec.substr(pos, end - pos);
      pos = end + 1;
      if (part.size() < 2 || part[1] != '=') throw std::invalid_argument("moe_xpu: MOE_XPU_CPU_TILES: bad part " + part);
      int* count = part[0] == 'k' ? &k : part[0] == 'f' ? &f : &n;
      TileShape* into = part[0] == 'k' ? t->k_lanes : part[0] == 'f' ? t->n_lanes_float : t->n_lanes;
      std::istringstream in(part.substr(2));
      int m = 0, c = 0;
      char x = 0, comma = 0;
      while (*count < 2 && in >> m >> x >> c) {
        into[(*count)++] = TileShape{m, c};
        in >> comma;
      }
    }
    if (k != 2 || n != 2 || (f != 0 && f != 2))
      throw std::invalid_argument("moe_xpu: MOE_XPU_CPU_TILES needs two k and two n shapes (and two f shapes, if any)");
    if (f == 0) std::copy(std::begin(t->n_lanes), std::end(t->n_lanes), t->n_lanes_float);
    t->quant_tall = t->k_lanes[1];
    return t;
  }();
  return table;
}

const CpuTileTable& cpu_tile_table(const DeviceDescription& d) {
  if (const CpuTileTable* custom = cpu_tiles_from_environment()) return *custom;
  for (const CpuTileTable& t : kCpuTileTables)
    if (d.vector_width >= t.vector_width) return t;
  return kCpuTileTables[std::size(kCpuTileTables) - 1];
}

// The matrix-engine tiles the K-contiguous matrix kernel is instantiated for, in order of
// preference: AMX, then XMX on 16 lanes (Xe-HPC, Xe2, Xe3), then XMX on 8 lanes (Xe-HPG); int8:
// whether the W8A8 kernel is built at the tile's int8 shape (not on 8 lanes: see device_model.cpp).
constexpr MatrixShape kEngineTiles[] = {{16, 16, 32, 16, false, true}, {8, 16, 16, 16, true, true}, {8, 8, 16, 8, true, false}};

// AMX's tile, for which the N-contiguous matrix kernel is written.
bool has_amx_tile(const DeviceDescription& d) { return d.has_matrix_shape(16, 16, 32); }

}  // namespace

Family family_of(bool k_lanes, bool gated) {
  if (gated && !k_lanes)
    throw std::invalid_argument("moe_xpu: the gated-activation epilogue needs B contiguous along K");
  return !k_lanes ? Family::n_lanes : gated ? Family::k_lanes_gated : Family::k_lanes;
}

std::string cpu_vector_class(const DeviceDescription& d) { return d.is_cpu ? cpu_tile_table(d).name : "gpu"; }

// A small launch costs the CPU runtime more to hand to its thread pool (waking the workers,
// waiting for them; longer still while torch's OpenMP threads spin after a torch op) than its
// work-groups take on one thread: those launches go to a queue whose commands the calling thread
// executes itself (cl_intel_exec_by_local_thread). The limit is where one thread stops beating the
// pool: F / r = F / (n r) + o gives F = o r n / (n - 1) for n cores, a thread's rate r (about 35
// GFLOP/s, float32, AVX2) and the pool's cost o (about 100 us right after a torch op, torch's
// OpenMP threads parked): 3.5 MFLOP of the vector kernels on one core, scaled by n / (n - 1).
// 2-core AMD EPYC, AVX2, each launch right after a grouped_mm, median of 200: calling thread vs
// pool 2.1 MFLOP 134 vs 153 us, 4.2 MFLOP 210 vs 232 and 214 vs 237 us, 6.3 MFLOP 270 vs 312 us,
// 8.4 MFLOP 616 vs 472 us. MOE_XPU_INLINE_FLOPS overrides it (0: never), and then alone decides.
namespace {
double forced_inline_flops() {
  static const double forced = []() {
    const char* v = std::getenv("MOE_XPU_INLINE_FLOPS");
    return v != nullptr && *v != '\0' ? std::max(0.0, std::atof(v)) : -1.0;
  }();
  return forced;
}
}  // namespace

double inline_flops_limit(const DeviceDescription& d) {
  if (!d.is_cpu) return 0.0;
  if (forced_inline_flops() >= 0.0) return forced_inline_flops();
  const double n = double(std::max<std::int64_t>(d.compute_units, 1));
  return n > 1.0 ? 3.5e6 * n / (n - 1.0) : 1.0e12;
}

// The same balance for the weights a launch streams: B / w = B / (n w) + o gives B = o w n / (n - 1)
// for one core's streaming rate w (about 15 GB/s: a memory-bound launch is bound by the reads one
// core can keep in flight) and o as above: 1.5 MB on one core, scaled by n / (n - 1). The FLOP limit
// alone kept launches of few FLOPs but many weight bytes (decode: a row or two per expert) on one
// core, and right after torch ops, whose OpenMP threads then spin, the pool ran them faster (2-core
// Xeon, a torch linear before each launch, medians of 280: 4 rows over 32 experts, K 512, N 512,
// 4 MB of weights: pool 115-187 vs calling thread 148-263 us; N 256, 2 MB: 100-130 vs 89-118 us).
double inline_bytes_limit(const DeviceDescription& d) {
  if (!d.is_cpu) return 0.0;
  if (forced_inline_flops() >= 0.0) return 1.0e18;
  const double n = double(std::max<std::int64_t>(d.compute_units, 1));
  return n > 1.0 ? 1.5e6 * n / (n - 1.0) : 1.0e18;
}

// 4-bit weights are decoded by a table lookup across the sub-group where a 16-lane permute is one
// instruction (GPUs, AVX-512 CPUs), arithmetically elsewhere (see packed_step in moe_gemm_quant.cpp).
// MOE_XPU_NIBBLE_DECODE=lookup|arithmetic overrides it (tests run both on any host: same bits).
bool nibble_lookup(const DeviceDescription& d) {
  static const int forced = []() {
    const char* v = std::getenv("MOE_XPU_NIBBLE_DECODE");
    if (v == nullptr || *v == '\0') return -1;
    const std::string s(v);
    if (s == "lookup") return 1;
    if (s == "arithmetic") return 0;
    throw std::invalid_argument("moe_xpu: MOE_XPU_NIBBLE_DECODE must be lookup or arithmetic, not " + s);
  }();
  return forced >= 0 ? forced == 1 : (!d.is_cpu || d.vector_width >= 16);
}

// The quantized kernels' tallest CPU tile for 4-bit formats decoded by lookup (see family_tiles):
// 4 x 4 measured faster than 8 x 2 on every multi-row bench case (docs/performance_targets.md).
constexpr TileShape kLookupTallTile{4, 4};

std::vector<TileShape> family_tiles(Family f, const DeviceDescription& d, DType t) {
  switch (f) {
    case Family::k_lanes:
    case Family::k_lanes_gated:
      if (d.is_cpu) return {std::begin(cpu_tile_table(d).k_lanes), std::end(cpu_tile_table(d).k_lanes)};
      return {std::begin(kKLanesTiles), std::end(kKLanesTiles)};
    // The quantized kernels split K like k_lanes and take its CPU decode tile and the table's
    // quant_tall (AVX-512: {6, 4} where k_lanes takes {4, 6}). On GPUs their
    // dequantization keeps more values live per column: k_lanes' {6, 4} spilled 0.9-2.2 KB per
    // thread on dg2 and mtl for the 4-bit formats (python -m moe_xpu.gpu_check), {2, 4} does not;
    // with a lookup table per column the decode tile {1, 8} spilled 192-544 B there, {1, 4} not.
    case Family::quant:
    case Family::quant_gated:
      if (d.is_cpu) {
        // A third tile of 4 rows for groups of 3-4 rows, where the tall tile's padding rows cost
        // a third of its FMAs (16tok-E8 on AMX, whose engine tiles take 5+ rows).
        // 4-bit formats decoded by lookup keep a word and a table register per column beside the
        // accumulators; with more than 16 accumulators (k_lanes' {6, 4}, and {12, 2}) the CPU
        // compiler ran out of registers and compiled the whole tile masked, A read by gathers
        // (Ice Lake class: int4 groups of 5 rows took 15x the time of groups of 4). Their tallest
        // tile is kLookupTallTile.
        const CpuTileTable& table = cpu_tile_table(d);
        std::vector<TileShape> tiles{table.k_lanes[0], table.quant_tall};
        const TileShape tall = tiles.back();
        if ((t == DType::int4 || t == DType::mxfp4) && nibble_lookup(d) &&
            tall.tile_m * tall.tile_n > kLookupTallTile.tile_m * kLookupTallTile.tile_n)
          tiles.back() = kLookupTallTile;
        if (tiles.back().tile_m > 4) tiles.push_back(TileShape{4, tall.tile_n});
        return tiles;
      }
      return {TileShape{1, 4}, TileShape{2, 4}};
    case Family::n_lanes:
      if (d.is_cpu) {
        const CpuTileTable& table = cpu_tile_table(d);
        const TileShape* tiles = t == DType::float32 ? table.n_lanes_float : table.n_lanes;
        return {tiles, tiles + 2};
      }
      return {std::begin(kNLanesTiles), std::end(kNLanesTiles)};
    // 16 tokens x 2 engine tiles of 16 weight rows (gated: one gate and one up tile).
    // Engine-tile tokens x 2 weight tiles (gated: one gate and one up tile).
    case Family::matrix:
    case Family::matrix_gated: return {TileShape{engine_tile(d).n, 2}};
    case Family::matrix_kn: return {TileShape{16, 2}};
    case Family::quant_matrix:
    case Family::dequant_matrix:
    case Family::dequant_matrix_gated: return {TileShape{engine_tile(d).n, 2}};
    case Family::matrix_wgrad: return {TileShape{2 * engine_tile(d).m, 2}};
    // The register tile its assembly is written for: 24 accumulators, 6 B and 1 A vector.
    case Family::dot:
    case Family::dot_gated:
    case Family::quant_dot: return {TileShape{kDotRows, kDotCols}};
    case Family::fma_dot:
    case Family::fma_dot_gated:
      return {TileShape{1, kFmaRowCols}, TileShape{fma_rows(d.vector_width), fma_cols(d.vector_width)}};
    case Family::fma_kn: return {TileShape{kNFmaRows, kNFmaCols / int(kSubGroupSize)}};
    case Family::nibble_dot:
    case Family::nibble_dot_gated:
    case Family::fp8_dot:
    case Family::fp8_dot_gated: return {TileShape{kNibbleRows, kNibbleCols}};
    case Family::dot_kn:
    case Family::dot_wgrad: return {TileShape{kNDotRows, kNDotCols / int(kSubGroupSize)}};
    // TK rows of K x TN vectors of 16 columns: 16 accumulators where AVX-512 holds a vector in one
    // register; on AVX2 one column vector down 8 rows of K (dB of the prefill case into touched
    // memory, AMD EPYC Zen 3: float32 553 -> 393 ms, bfloat16 602 -> 454 ms against {4, 2}; of
    // {2, 2}, {3, 2}, {4, 1}, {2, 4}, {6, 1}, {6, 2}, {10, 1}, {12, 1}, {16, 1} none more than 3%
    // faster); {4, 2} on narrower CPUs (not measured) and on GPUs, whose register file the forward
    // tiles size.
    case Family::wgrad:
      if (d.is_cpu && d.vector_width >= 16) return {TileShape{4, 4}};
      if (d.is_cpu && d.vector_width >= 8) return {TileShape{8, 1}};
      return {TileShape{4, 2}};
  }
  throw std::invalid_argument("moe_xpu: unknown kernel family");
}

namespace {

// Few rows per expert (decode): one row per tile so no work is spent on padding rows; many rows
// (prefill): taller tiles reuse each loaded B value across more rows. The decode tile up to 2 rows
// a group. The CPU's streaming decode tile (N-split, wider than a
// register tile) pays off on long B rows only: where N fits the other tile's columns, that tile
// runs instead (T=8 E=8 K=128 N=64: 17-19 -> 14.5 us).
TileShape choose_tile(Family f, const DeviceDescription& d, DType t, double rows_per_group, std::int64_t N) {
  const std::vector<TileShape> tiles = family_tiles(f, d, t);
  if (tiles.size() == 1) return tiles[0];
  const bool short_rows = f == Family::n_lanes && tiles[0].tile_n > kRegisterTileVectors &&
                          N <= std::int64_t(tiles[1].tile_n) * kSubGroupSize;
  if (rows_per_group <= 2.0 && !short_rows) return tiles[0];
  return tiles.size() > 2 && rows_per_group <= 4.0 ? tiles[2] : tiles[1];
}

// The vector kernels' K chunk: on the CPU device, tiles of several rows walk K in chunks, their
// partial sums in work-group local memory. N-split (moe_gemm_n_lanes): chunks of 16 B rows, read
// across a block of column tiles (see n_lanes_unit_shape; chunks of 8 and 32 measured 2-10%
// slower on the [E, K, N] bench cases). K-split (moe_gemm_k_lanes): chunks
// of 256 (128 for units of two row tiles, 512 for six or more) whose row tiles prefetch the
// next chunk while they compute this one, so a unit's weight rows stream from memory while it
// computes (without chunks: bench prefill float32 113 -> 98 ms, 64tok 55 -> 52 ms; with the
// prefetch, cold cache, same process, best of 7: prefill 98 -> 91 ms, fused MoE prefill first /
// second GEMM 96 / 59 -> 84 / 48 ms).
// Elsewhere (and for the decode tile, where a B slice serves one row tile) no chunking, which
// also keeps work-group local memory free on GPUs.
int k_chunk(Family f, const DeviceDescription& d, TileShape s) {
  if (!d.is_cpu || s.tile_m <= 1) return 0;
  return f == Family::n_lanes ? 16 : 256;
}

// Bytes of work-group local memory a vector kernel variant declares (group_local_memory in
// moe_gemm.cpp: partial_sums_area for K chunks, n_lanes_row_stream's row sums); the matrix
// kernels use a global scratch area instead.
std::int64_t family_local_memory_bytes(Family f, TileShape s, const DeviceDescription& d) {
  const std::int64_t floats_per_tile = std::int64_t(s.tile_m) * s.tile_n * kSubGroupSize;
  switch (f) {
    case Family::k_lanes:
    case Family::k_lanes_gated:
      return k_chunk(f, d, s) > 0 ? (kUnitRows / s.tile_m) * floats_per_tile * 4 : 0;
    case Family::n_lanes:
      if (s.tile_n > kRegisterTileVectors) return std::int64_t(s.tile_n) * kSubGroupSize * 4;
      return k_chunk(f, d, s) > 0 ? kNLanesPartialTiles * floats_per_tile * 4 : 0;
    case Family::matrix:
    case Family::matrix_gated:
    case Family::matrix_kn:
    case Family::wgrad:
    case Family::quant:
    case Family::quant_gated:
    case Family::quant_matrix:
    case Family::dequant_matrix:
    case Family::dequant_matrix_gated:
    case Family::matrix_wgrad: return 0;
    case Family::dot:
    case Family::dot_gated: return kDotSums * 4;  // a tile's sums
    case Family::fma_dot:
    case Family::fma_dot_gated: return fma_sums_floats(d.vector_width) * 4;
    case Family::fma_kn: return kNFmaSums * 4;  // a tile's sums
    case Family::quant_dot: return 2 * kDotSums * 4;  // a tile's int32 sums and its column sums
    case Family::nibble_dot:
    case Family::nibble_dot_gated:
    case Family::fp8_dot:
    case Family::fp8_dot_gated: return kNibbleLocal * 4;  // its constants and a tile's sums
    case Family::dot_kn:
    case Family::dot_wgrad: return kNDotSums * 4;  // a tile's accumulators
  }
  throw std::invalid_argument("moe_xpu: unknown kernel family");
}

// The template arguments of one kernel variant, as written in its name and its instantiation.
std::string template_args(Family f, DType a, DType t, DType out, TileShape s, const DeviceDescription& d) {
  std::ostringstream args;
  if (f == Family::matrix_kn) {
    args << type_name(a) << ", " << type_name(out);
    return args.str();
  }
  if (f == Family::wgrad) {
    args << type_name(t) << ", " << type_name(out) << ", " << s.tile_m << ", " << s.tile_n;
    return args.str();
  }
  if (f == Family::quant || f == Family::quant_gated) {
    args << type_name(a) << ", " << format_name(t) << ", " << type_name(out) << ", " << s.tile_m << ", "
         << s.tile_n << ", " << (f == Family::quant_gated ? "true" : "false") << ", "
         << (nibble_lookup(d) ? "true" : "false") << ", " << (d.is_cpu ? "true" : "false");
    return args.str();
  }
  if (f == Family::matrix_wgrad) {
    const MatrixShape e = engine_tile(d);
    args << type_name(t) << ", " << type_name(out) << ", " << e.m << ", " << e.n << ", " << e.k << ", "
         << e.sub_group_size;
    return args.str();
  }
  if (f == Family::quant_matrix) {  // the engine's int8 tile: twice its bf16 k
    const MatrixShape e = engine_tile(d);
    args << type_name(out) << ", " << e.m << ", " << e.n << ", " << 2 * e.k << ", " << e.sub_group_size;
    return args.str();
  }
  if (f == Family::dequant_matrix || f == Family::dequant_matrix_gated) {
    const MatrixShape e = engine_tile(d);
    args << format_name(t) << ", " << type_name(out) << ", " << (f == Family::dequant_matrix_gated ? "true" : "false")
         << ", " << e.m << ", " << e.n << ", " << e.k << ", " << e.sub_group_size;
    return args.str();
  }
  if (f == Family::quant_dot) {
    args << type_name(out) << ", " << s.tile_m << ", " << s.tile_n;
    return args.str();
  }
  if (f == Family::fp8_dot || f == Family::fp8_dot_gated) {
    args << type_name(out) << ", " << (f == Family::fp8_dot_gated ? "true" : "false");
    return args.str();
  }
  if (f == Family::nibble_dot || f == Family::nibble_dot_gated) {
    args << format_name(t) << ", " << type_name(out) << ", " << (f == Family::nibble_dot_gated ? "true" : "false");
    return args.str();
  }
  if (f == Family::dot_kn || f == Family::dot_wgrad) {
    args << type_name(out);
    return args.str();
  }
  if (f == Family::fma_kn) {
    args << type_name(a) << ", " << type_name(t) << ", " << type_name(out);
    return args.str();
  }
  if (f == Family::fma_dot || f == Family::fma_dot_gated) {  // A is float32
    args << type_name(t) << ", " << type_name(out) << ", " << s.tile_m << ", " << s.tile_n << ", "
         << (f == Family::fma_dot_gated ? "true" : "false") << ", " << d.vector_width;
    return args.str();
  }
  if (f == Family::dot || f == Family::dot_gated) {
    args << type_name(out) << ", " << s.tile_m << ", " << s.tile_n << ", " << (f == Family::dot_gated ? "true" : "false");
    return args.str();
  }
  if (f == Family::matrix || f == Family::matrix_gated) {
    const MatrixShape e = engine_tile(d);
    args << type_name(a) << ", " << type_name(t) << ", " << type_name(out) << ", "
         << (f == Family::matrix_gated ? "true" : "false")
         << ", " << e.m << ", " << e.n << ", " << e.k << ", " << e.sub_group_size;
    return args.str();
  }
  args << type_name(a) << ", " << type_name(t) << ", " << type_name(out) << ", " << s.tile_m << ", " << s.tile_n;
  if (f != Family::n_lanes) args << ", " << (f == Family::k_lanes_gated ? "true" : "false");
  args << ", " << k_chunk(f, d, s);
  return args.str();
}

// The kernel template a family instantiates: moe_gemm_<base> in moe_gemm.cpp, instantiated there
// by the macro MOE_XPU_INSTANTIATE_<BASE>(template arguments).
std::string kernel_base(Family f) {
  switch (f) {
    case Family::k_lanes:
    case Family::k_lanes_gated: return "k_lanes";
    case Family::n_lanes: return "n_lanes";
    case Family::matrix:
    case Family::matrix_gated: return "matrix";
    case Family::matrix_kn: return "matrix_kn";
    case Family::wgrad: return "wgrad";
    case Family::quant:
    case Family::quant_gated: return "quant";
    case Family::quant_matrix: return "quant_matrix";
    case Family::dequant_matrix:
    case Family::dequant_matrix_gated: return "dequant_matrix";
    case Family::matrix_wgrad: return "matrix_wgrad";
    case Family::dot:
    case Family::dot_gated: return "k_dot";
    case Family::fma_dot:
    case Family::fma_dot_gated: return "k_fma";
    case Family::fma_kn: return "n_fma";
    case Family::quant_dot: return "quant_dot";
    case Family::nibble_dot:
    case Family::nibble_dot_gated: return "nibble_dot";
    case Family::fp8_dot:
    case Family::fp8_dot_gated: return "fp8_dot";
    case Family::dot_kn: return "n_dot";
    case Family::dot_wgrad: return "dot_wgrad";
  }
  throw std::invalid_argument("moe_xpu: unknown kernel family");
}

std::string family_kernel_name(Family f, DType a, DType t, DType out, TileShape s, const DeviceDescription& d) {
  return "moe_xpu::moe_gemm_" + kernel_base(f) + "<" + template_args(f, a, t, out, s, d) + ">";
}

std::string family_kernel_instantiation(Family f, DType a, DType t, DType out, TileShape s, const DeviceDescription& d) {
  std::string macro = kernel_base(f);
  std::transform(macro.begin(), macro.end(), macro.begin(), [](unsigned char c) { return std::toupper(c); });
  return "MOE_XPU_INSTANTIATE_" + macro + "(" + template_args(f, a, t, out, s, d) + ")\n";
}

// K-split kernels of 16-bit B are also compiled with float A (see LaunchPlan::widen_a), at every
// tile: the fused MoE's second GEMM reads its float32 h at any tile. (The N-split kernel reads A
// as one broadcast scalar per row and k step; float A measured no faster there.)
// The K-contiguous matrix kernels pack A to bf16 as they read it, from bf16 or float A.
bool has_float_a_variant(Family f, DType t) {
  return t != DType::float32 && f != Family::n_lanes && f != Family::matrix_kn && f != Family::wgrad &&
         f != Family::matrix_wgrad && f != Family::dot && f != Family::dot_gated && f != Family::dot_kn &&
         f != Family::dot_wgrad && f != Family::quant_dot && f != Family::nibble_dot &&
         f != Family::nibble_dot_gated && f != Family::fp8_dot && f != Family::fp8_dot_gated;
}

// MOE_XPU_NUM_WORKERS=n fixes the persistent scheduler's worker count (tests run with odd counts,
// so every share boundary falls somewhere new); unset or 0: chosen per launch.
std::int64_t workers_from_environment() {
  static const std::int64_t forced = [] {
    const char* v = std::getenv("MOE_XPU_NUM_WORKERS");
    return v != nullptr ? std::max<std::int64_t>(0, std::atoll(v)) : std::int64_t{0};
  }();
  return forced;
}

// The persistent scheduler's worker count: `per_cu` a compute unit, except that on the CPU, where
// starting a work-group costs the runtime a few microseconds, a tiny problem (a small model's
// decode step) gets one worker per ~4 MFLOP of work, at least one per core (a 1 MFLOP launch:
// 173 us with 32 workers, 75 us with 2). A requested count (the launch's, else
// MOE_XPU_NUM_WORKERS) replaces the choice; never more than `max_units` work units, and a whole
// number of work-groups of `subgroups_per_wg` workers.
std::int64_t worker_count(const DeviceDescription& d, std::int64_t per_cu, double flops, std::int64_t requested,
                          std::int64_t max_units, std::int64_t subgroups_per_wg) {
  const std::int64_t compute_units = d.compute_units;
  std::int64_t workers = compute_units * per_cu;
  if (d.is_cpu)
    workers = std::min(workers, std::max(compute_units, static_cast<std::int64_t>(flops / 4.0e6) + 1));
  if (requested > 0) workers = requested;
  else if (const std::int64_t forced = workers_from_environment(); forced > 0) workers = forced;
  workers = std::max<std::int64_t>(1, std::min(workers, max_units));
  return (workers + subgroups_per_wg - 1) / subgroups_per_wg * subgroups_per_wg;
}

}  // namespace

std::vector<MatrixShape> engine_tiles() { return {std::begin(kEngineTiles), std::end(kEngineTiles)}; }

MatrixShape engine_tile(const DeviceDescription& d) {
  for (const MatrixShape& s : kEngineTiles)
    for (const MatrixShape& own : d.matrix_shapes)
      if (own.m == s.m && own.n == s.n && own.k == s.k && own.sub_group_size == s.sub_group_size) return own;
  return MatrixShape{};
}

bool engine_takes(const DeviceDescription& d, DType t) {
  const MatrixShape e = engine_tile(d);
  return e.m != 0 && (t == DType::bfloat16 || (t == DType::float16 && e.fp16) || (t == DType::int8 && e.int8));
}

bool has_matrix_engine(const DeviceDescription& d) { return engine_tile(d).m != 0; }

int sub_group_size(const Variant& v, const DeviceDescription& d) {
  const bool engine = v.family == Family::matrix || v.family == Family::matrix_gated ||
                      v.family == Family::quant_matrix || v.family == Family::dequant_matrix ||
                      v.family == Family::dequant_matrix_gated || v.family == Family::matrix_wgrad;
  return engine ? engine_tile(d).sub_group_size : int(kSubGroupSize);
}

namespace {

// The A dtypes a quantized bundle (B format t, output out) compiles: activations of the output's
// dtype (and, for float32 output, bf16 and fp16 ones), and int8 (W8A8) for int8 B.
std::vector<DType> quant_a_dtypes(DType t, DType out) {
  std::vector<DType> a{out};
  if (out == DType::float32) a.insert(a.end(), {DType::bfloat16, DType::float16});
  if (t == DType::int8) a.push_back(DType::int8);
  return a;
}

// Whether a quantized bundle (B format t, output out) compiles the dequantizing matrix kernels
// (weight-only B into bf16 tiles; bf16 activations): on an engine with bf16 tiles on 16 lanes (on
// Xe-HPG's 8 lanes they spilled 160-1344 bytes, as W8A8 did).
bool dequantizes_to_engine(const DeviceDescription& d, DType t, DType out) {
  const std::vector<DType> a = quant_a_dtypes(t, out);
  return is_quantized(t) && engine_takes(d, DType::bfloat16) && engine_tile(d).sub_group_size == 16 &&
         std::find(a.begin(), a.end(), DType::bfloat16) != a.end();
}

// Whether a quantized bundle compiles the weight-decoding dot-product kernels (4-bit and fp8 B):
// bf16 activations among the bundle's (bf16 or float32 output), on a CPU where they passed their
// self-check.
bool nibble_dot_compiles(const DeviceDescription& d, DType t, DType out) {
  const std::vector<DType> a = quant_a_dtypes(t, out);
  return d.nibble_dot && (t == DType::int4 || t == DType::mxfp4 || t == DType::fp8_e4m3) &&
         std::find(a.begin(), a.end(), DType::bfloat16) != a.end();
}

}  // namespace

// The FMA dot-product kernels take B of dtype t on d: on AVX2 float32, bf16 and fp16; on AVX-512
// only 16-bit B, which they widen in registers once per tile row. (With float32 B the vector
// kernels' k loop, where a 16-lane vector is one register, is already theirs, and their taller
// tile and K chunks stream it faster: prefill 108 vs 124 ms, Intel Xeon, Ice Lake.)
bool fma_takes(const DeviceDescription& d, DType t) {
  return d.fma_dot && (d.vector_width == 8 || t == DType::bfloat16 || t == DType::float16);
}

// The N-contiguous FMA kernel: AVX2 only (on AVX-512 a 16-lane vector is one register and the
// vector N-split kernel's loop is this kernel's already).
bool fma_kn_takes(const DeviceDescription& d, DType t) { return d.fma_dot && d.vector_width == 8 && fma_takes(d, t); }

std::vector<Variant> bundle_variants(const DeviceDescription& d, DType t, DType out) {
  if (is_quantized(out) || out == DType::int8) throw std::invalid_argument("moe_xpu: the output dtype must be a float type");
  if (is_quantized(t)) {
    std::vector<Variant> variants;
    for (DType a : quant_a_dtypes(t, out))
      for (Family f : {Family::quant, Family::quant_gated}) {
        if (f == Family::quant_gated && a == DType::int8) continue;  // the fused MoE runs weight-only
        for (TileShape s : family_tiles(f, d, t)) variants.push_back(Variant{f, a, t, out, s});
      }
    if (d.int8_dot && t == DType::int8)
      variants.push_back(Variant{Family::quant_dot, DType::int8, t, out, family_tiles(Family::quant_dot, d, t)[0]});
    if (nibble_dot_compiles(d, t, out))
      for (Family f : t == DType::fp8_e4m3 ? std::vector<Family>{Family::fp8_dot, Family::fp8_dot_gated}
                                            : std::vector<Family>{Family::nibble_dot, Family::nibble_dot_gated})
        variants.push_back(Variant{f, DType::bfloat16, t, out, family_tiles(f, d, t)[0]});
    if (engine_takes(d, t) && t == DType::int8)
      variants.push_back(Variant{Family::quant_matrix, DType::int8, t, out, family_tiles(Family::quant_matrix, d, t)[0]});
    if (dequantizes_to_engine(d, t, out))
      for (Family f : {Family::dequant_matrix, Family::dequant_matrix_gated})
        variants.push_back(Variant{f, DType::bfloat16, t, out, family_tiles(f, d, t)[0]});
    return variants;
  }
  std::vector<Family> families{Family::k_lanes, Family::k_lanes_gated, Family::n_lanes, Family::wgrad};
  if (engine_takes(d, t)) families.insert(families.end(), {Family::matrix, Family::matrix_gated, Family::matrix_wgrad});
  if (t == DType::bfloat16 && has_amx_tile(d)) families.push_back(Family::matrix_kn);
  if (t == DType::bfloat16 && d.bf16_dot) families.insert(families.end(), {Family::dot, Family::dot_gated, Family::dot_kn, Family::dot_wgrad});
  std::vector<Variant> variants;
  for (Family f : families)
    for (TileShape s : family_tiles(f, d, t)) {
      variants.push_back(Variant{f, t, t, out, s});
      if (has_float_a_variant(f, t)) variants.push_back(Variant{f, DType::float32, t, out, s});
    }
  if (fma_takes(d, t))  // float A only (16-bit A is widened before the launch)
    for (Family f : {Family::fma_dot, Family::fma_dot_gated})
      for (TileShape s : family_tiles(f, d, t)) variants.push_back(Variant{f, DType::float32, t, out, s});
  if (fma_kn_takes(d, t))  // A of B's dtype, and float32 A for 16-bit B
    for (DType a : t == DType::float32 ? std::vector<DType>{t} : std::vector<DType>{t, DType::float32})
      variants.push_back(Variant{Family::fma_kn, a, t, out, family_tiles(Family::fma_kn, d, t)[0]});
  return variants;
}

std::string kernel_name(const Variant& v, const DeviceDescription& d) {
  return family_kernel_name(v.family, v.a, v.b, v.out, v.shape, d);
}

std::string kernel_instantiation(const Variant& v, const DeviceDescription& d) {
  return family_kernel_instantiation(v.family, v.a, v.b, v.out, v.shape, d);
}

std::int64_t local_memory_bytes(const Variant& v, const DeviceDescription& d) {
  return family_local_memory_bytes(v.family, v.shape, d);
}

namespace {

// The tile a forward launch runs: the device's choice for its rows per group and N, or the
// caller's override (GemmArgs tile_m / tile_n), which must be one the family compiles.
TileShape forward_tile(Family family, const GemmArgs& args, const DeviceDescription& d, double rows_per_group,
                       bool overridable) {
  TileShape shape = choose_tile(family, d, args.dtype, rows_per_group, args.N);
  if (!overridable || (args.tile_m == 0 && args.tile_n == 0)) return shape;
  for (TileShape s : family_tiles(family, d, args.dtype))
    if (s.tile_m == args.tile_m && s.tile_n == args.tile_n) return s;
  throw std::invalid_argument("moe_xpu: tile shape override is not compiled in");
}

// Workers of a forward launch whose plan has its tile: never more than there can be work units
// (see for_each_owned_unit in the kernels: a unit covers up to kUnitRows rows of one group; every
// group may add one partial unit).
std::int64_t forward_workers(const GemmArgs& args, const LaunchPlan& plan, const DeviceDescription& d,
                             std::int64_t workers_per_cu, std::int64_t subgroups_per_wg) {
  const std::int64_t tiles_n = (args.N + plan.tile_n - 1) / plan.tile_n;
  const std::int64_t unit_rows = (kUnitRows / plan.tile_m) * plan.tile_m;
  const std::int64_t max_units = (args.out_rows / unit_rows + args.num_groups + 1) * tiles_n;
  const double flops = 2.0 * double(args.out_rows) * double(args.K) * double(args.N);
  return worker_count(d, workers_per_cu, flops, args.num_workers, max_units, subgroups_per_wg);
}

// Whether a launch runs on the calling thread (CPU device; see inline_flops_limit and
// inline_bytes_limit), or as the launch asks (`asked`: 0 by size, 1 never, 2 always).
bool runs_on_calling_thread(const DeviceDescription& d, int asked, double flops, double bytes) {
  if (!d.is_cpu || asked == 1) return false;
  if (asked == 2) return true;
  return flops <= inline_flops_limit(d) && bytes <= inline_bytes_limit(d);
}

// A forward launch: the bytes bound counts the weights it may stream.
bool runs_on_calling_thread(const GemmArgs& args, const DeviceDescription& d) {
  const double columns = double(args.N) * (args.activation != 0 ? 2.0 : 1.0);  // gated: gate and up columns
  const double flops = 2.0 * double(args.out_rows) * double(args.K) * columns;
  // Every row in a group of its own at most (no routing counts on the host).
  const double groups = double(std::min(args.num_groups, args.out_rows));
  const double weight_bytes = groups * double(args.K) * columns * double(stored_bits(args.dtype)) / 8.0;
  return runs_on_calling_thread(d, args.calling_thread, flops, weight_bytes);
}

// The plan of a launch with quantized B: the quantized family (gated with an activation), the
// k_lanes tile choice and worker count.
LaunchPlan plan_quant(const GemmArgs& args, const DeviceDescription& d) {
  const std::vector<DType> a_types = quant_a_dtypes(args.dtype, args.out_dtype);
  if (std::find(a_types.begin(), a_types.end(), args.a_dtype) == a_types.end())
    throw std::invalid_argument("moe_xpu: quantized B takes A of the output dtype, bf16 or fp16 A with float32 output, "
                                "or int8 A with int8 B");
  const bool gated = args.activation != 0;
  if (gated && args.a_dtype == DType::int8)
    throw std::invalid_argument("moe_xpu: the gated epilogue with quantized B takes float activations");
  const double rows_per_group =
      args.num_groups > 0 ? double(args.out_rows) / double(args.num_groups) : double(args.out_rows);
  // W8A8 on the matrix engine's int8 tile: int8 weights contiguous along K with one scale per
  // output channel, whole engine steps of K and whole tiles of N, at any rows per group. Unlike
  // bf16, a mostly-padding token tile did not lose at decode (AMX, 2-core Xeon, median of 21, one
  // to eight rows over 8-128 experts, K 512-2048, N 256-1536: cold cache 0.48-1.93 ms against the
  // vector kernel's 0.47-3.15, warm 0.14-1.09 against 0.14-1.29; the bench decode case 4.8
  // against 9.2 ms).
  // Weight-only formats with bf16 activations dequantize into the engine's bf16 tiles (exact
  // values, the scales on the float sums) where groups average more than four rows: the
  // dequantization is vector work per weight, which the vector kernel does anyway, so the engine
  // pays off only where it serves several token rows (AMX, bench shapes, warm, int8 / fp8, vector
  // -> engine: 16 rows a group 102 -> 51 / 160 -> 88 ms, 8 rows 42 -> 31 / 68 -> 56 ms; 4 rows
  // 11 -> 16 / 24 -> 32 ms, 0.25 rows 12 -> 15 / 10 -> 17 ms).
  const MatrixShape e = engine_tile(d);
  const bool w8a8 = args.a_dtype == DType::int8;
  // (e is all zeros on a device without an engine: every test of its sizes comes after e.m != 0.)
  const bool k_contiguous = e.m != 0 && args.b_stride_k == 1 && args.N % e.m == 0;
  // Scales per K block (not MXFP4's, folded into its values) in blocks of whole engine steps.
  const bool k_blocks_fit = args.scale_block_k >= args.K || args.dtype == DType::mxfp4 ||
                            (e.k != 0 && args.scale_block_k % e.k == 0);
  const bool matrix_shape =
      k_contiguous && (w8a8 ? engine_takes(d, args.dtype) && args.scale_block_k >= args.K && args.K % (2 * e.k) == 0
                            : args.a_dtype == DType::bfloat16 && dequantizes_to_engine(d, args.dtype, args.out_dtype) &&
                                  args.K % e.k == 0 && k_blocks_fit);
  if (args.engine == 2 && !matrix_shape)
    throw std::invalid_argument(
        "moe_xpu: the matrix engine takes quantized B as W8A8 on an engine with int8 tiles (per-channel "
        "scales), or weight-only with bf16 activations on one with bf16 tiles; B contiguous along K, K a "
        "multiple of the engine's k (and of its int8 k for W8A8), scale blocks along K of whole engine "
        "steps and N a multiple of its tile");
  const bool use_matrix = args.engine == 2 || (args.engine == 0 && matrix_shape && (w8a8 || rows_per_group > 4.0) &&
                                               args.tile_m == 0 && args.tile_n == 0);
  const bool use_dot = !use_matrix && w8a8 && d.int8_dot && args.engine == 0 && args.b_stride_k == 1 &&
                       args.scale_block_k >= args.K && rows_per_group > 2.0 && args.tile_m == 0 && args.tile_n == 0;
  // Quantized B with bf16 activations on AVX512-BF16 (no matrix engine taking it): the
  // weight-decoding dot-product kernels, K of at least one 128-k block, gated with an even output
  // width and up offset (each gate and up column pair in one packed chunk or block row). Decode too:
  // their tiles run only the rows a group holds, and one row's decode in registers beats the vector
  // kernel's one-row tile (Zen 5, bench decode, cold: fp8 7.2-7.4 -> 4.1-5.1 ms; int4, MXFP4 within
  // 5%). Tile overrides address the vector kernels.
  const bool decodes_to_bf16 = !use_matrix && !use_dot && args.engine == 0 &&
                               (!gated || (args.N % 2 == 0 && args.up_offset % 2 == 0)) &&
                               nibble_dot_compiles(d, args.dtype, args.out_dtype) &&
                               args.a_dtype == DType::bfloat16 && args.K >= 128 && args.tile_m == 0 &&
                               args.tile_n == 0;
  // 4-bit B: one zero point for the launch (int4's symmetric constant or one given), scales
  // contiguous along K in groups of 32, 64 or 128 (MXFP4: 32).
  const bool one_zero_point = args.zero_stride_e == 0 && args.zero_stride_n == 0 && args.zero_stride_k == 0;
  const bool use_nibble = decodes_to_bf16 && args.dtype != DType::fp8_e4m3 &&
                          (args.dtype == DType::mxfp4 || one_zero_point) && args.scale_block_n == 1 &&
                          args.scale_stride_k == 1 &&
                          (args.scale_block_k == 32 || args.scale_block_k == 64 || args.scale_block_k == 128);
  // fp8: B contiguous along K, scales per output channel or per 128 x 128 block contiguous along K
  // (a tile's 4 columns inside one block row; gated: each of its column pairs).
  const bool use_fp8_dot = decodes_to_bf16 && args.dtype == DType::fp8_e4m3 && args.b_stride_k == 1 &&
                           (args.scale_block_k >= args.K ||
                            (args.scale_block_k == 128 && args.scale_block_n % (gated ? 2 : 4) == 0 &&
                             args.scale_stride_k == 1));
  const Family family = use_dot      ? Family::quant_dot
                        : use_fp8_dot ? (gated ? Family::fp8_dot_gated : Family::fp8_dot)
                        : use_nibble ? (gated ? Family::nibble_dot_gated : Family::nibble_dot)
                        : !use_matrix ? (gated ? Family::quant_gated : Family::quant)
                        : w8a8      ? Family::quant_matrix
                        : gated     ? Family::dequant_matrix_gated
                                    : Family::dequant_matrix;
  const bool dot_family = use_dot || use_nibble || use_fp8_dot;
  const TileShape shape = forward_tile(family, args, d, rows_per_group, !use_matrix && !dot_family);
  LaunchPlan plan;
  plan.kernel_name = family_kernel_name(family, args.a_dtype, args.dtype, args.out_dtype, shape, d);
  plan.matrix_engine = use_matrix;
  // As for the float kernels: a tile of several rows re-reads A for every column tile, and 16-bit A
  // is widened at each read (CPU, 16tok-E8 on the 4-row tile, cold, median of 7, bf16 -> float32
  // A: int8 14.5 -> 12.3 ms, int4 12.5 -> 11.1, MXFP4 12.0 -> 10.8, fp8 22.9 -> 21.6). Not measured
  // on a GPU, where it would cost two more launches (the copy of A, the output's rounding).
  plan.widen_a = d.is_cpu && !use_matrix && !dot_family && shape.tile_m > 1 &&
                 (args.a_dtype == DType::bfloat16 || args.a_dtype == DType::float16);
  plan.tile_m = shape.tile_m;
  plan.tile_n = use_matrix ? (gated ? 1 : 2) * e.m : gated ? shape.tile_n / 2 : shape.tile_n;
  plan.scratch_bytes = !use_matrix ? 0 : w8a8 ? matrix_scratch_bytes(args.K, false) : dequant_matrix_scratch_bytes(args.K);
  const std::int64_t lanes = use_matrix ? e.sub_group_size : kSubGroupSize;
  plan.sub_group_size = int(lanes);
  // As the float kernels: one sub-group per work-group and 16 workers per core on the CPU, 4
  // sub-groups per work-group and 32 workers per compute unit on GPUs (matrix engine: 8, each
  // with its scratch area).
  const std::int64_t subgroups_per_wg = d.is_cpu ? 1 : 4;
  plan.work_group_size = subgroups_per_wg * lanes;
  plan.num_workers = forward_workers(args, plan, d, d.is_cpu ? 16 : use_matrix ? 8 : 32, subgroups_per_wg);
  plan.calling_thread = runs_on_calling_thread(args, d);
  return plan;
}

}  // namespace

LaunchPlan plan_for(const GemmArgs& args, const DeviceDescription& d) {
  if (is_quantized(args.dtype)) return plan_quant(args, d);
  if (args.b_stride_k != 1 && args.b_stride_n != 1)
    throw std::invalid_argument("moe_xpu: b must be contiguous along K or along N");
  const bool k_lanes = args.b_stride_k == 1;
  const bool cpu = d.is_cpu;
  const double rows_per_group =
      args.num_groups > 0 ? double(args.out_rows) / double(args.num_groups) : double(args.out_rows);

  const bool gated = args.activation != 0;
  // The matrix engine, for bf16 B in whole engine tiles (either layout; gated epilogue and float A
  // with K-contiguous B only), when a group holds more than a couple of rows on average, or when
  // an expert's weights (4 MB or more) stream from beyond the core's L2. With one or two rows a
  // group, a 16-token engine tile does mostly padding work: on small cache-resident experts the
  // vector kernels' one-row tile was faster (1 token top-8, E=64, K=2048, N=768: 0.61 vs 0.80 ms),
  // while streaming larger experts from memory the engine's tile loads were (bench decode case,
  // weights not in cache: 8.1 vs 10.4 ms). The vector kernels stay selectable (engine = 1) and are
  // what tile overrides address.
  // GPUs: the XMX tile through the same K-contiguous kernel; [E, K, N] weights stay on the
  // vector kernels there (the N-contiguous matrix kernel is written for AMX's tile).
  const bool matrix_shape = engine_takes(d, args.dtype) && args.K % 32 == 0 &&
                            args.N % 16 == 0 && (k_lanes || !gated) &&
                            (k_lanes || (args.a_dtype == DType::bfloat16 && has_amx_tile(d)));
  if (args.engine == 2 && !matrix_shape)
    throw std::invalid_argument(
        "moe_xpu: the matrix engine needs a device with one, bf16 B (or fp16 where the engine takes it), "
        "K % 32 == 0 and N % 16 == 0");
  // With [E, K, N] weights on the CPU the vector kernels' streaming decode tile is the faster
  // one for large experts too (9.3 vs 13.2 ms on the bench decode case), and their column-block
  // units up to 4 rows a group (bench 16tok-E8: 16.0-16.7 vs 17.0-18.9 ms in three runs).
  const double expert_weights = double(args.K) * double(args.N) * (gated ? 2.0 : 1.0);
  const bool kn_cpu = !k_lanes && cpu;
  const bool streamed = expert_weights * 2.0 >= double(4 << 20) && !kn_cpu;
  const bool use_matrix = args.engine == 2 || (args.engine == 0 && matrix_shape &&
                                               (rows_per_group > (kn_cpu ? 4.0 : 2.0) || streamed) &&
                                               args.tile_m == 0 && args.tile_n == 0);
  // bf16 A and B on a CPU with AVX512-BF16 where the matrix engine does not run: the dot-product
  // kernels, where tiles of several rows reuse each B vector (the decode tile, one row a group, is
  // bound by streaming the weights and stays on the vector kernel). K-contiguous weights take the
  // k-lanes dot kernels (gated too); N-contiguous ones the n_dot tile, which is not gated and
  // needs whole 64-column tiles. Tile overrides address the vector kernels.
  const bool use_dot = !use_matrix && args.engine == 0 && d.bf16_dot && args.dtype == DType::bfloat16 &&
                       args.a_dtype == DType::bfloat16 && rows_per_group > 2.0 && args.tile_m == 0 &&
                       args.tile_n == 0 && (k_lanes || (!gated && args.N % kNDotCols == 0));
  // B contiguous along K on an AVX2 or AVX-512 CPU: the FMA dot-product kernels, on float A (16-bit
  // A gets there widened: the plan for it widens A, and the float A plan lands here). B contiguous
  // along N on AVX2: their N-contiguous tile (on A of B's dtype as well, widened in its k loop),
  // not gated, in whole 16-column tiles, where groups average more than 2 rows (with fewer the
  // vector kernel's streaming decode tile reads B rows whole). Tile overrides address the vector
  // kernels.
  const bool fma_kn = !k_lanes && !gated && args.N % kNFmaCols == 0 && rows_per_group > 2.0 &&
                      fma_kn_takes(d, args.dtype);
  const bool fma_candidate = !use_matrix && !use_dot && args.engine == 0 && fma_takes(d, args.dtype) &&
                             (k_lanes || fma_kn) && args.tile_m == 0 && args.tile_n == 0;
  const bool use_fma = fma_candidate && (args.a_dtype == DType::float32 || (fma_kn && args.a_dtype == args.dtype));
  const Family family = use_fma && !k_lanes ? Family::fma_kn
                        : use_fma           ? (gated ? Family::fma_dot_gated : Family::fma_dot)
                        : use_dot && !k_lanes ? Family::dot_kn
                        : use_dot           ? (gated ? Family::dot_gated : Family::dot)
                        : !use_matrix ? family_of(k_lanes, gated)
                        : !k_lanes ? Family::matrix_kn
                        : gated    ? Family::matrix_gated
                                   : Family::matrix;
  const TileShape shape = forward_tile(family, args, d, rows_per_group, !use_matrix);

  const std::int64_t lanes = use_matrix && k_lanes ? engine_tile(d).sub_group_size : kSubGroupSize;
  LaunchPlan plan;
  plan.sub_group_size = int(lanes);
  const bool float_a_compiled = fma_candidate || has_float_a_variant(family, args.dtype);
  if (args.a_dtype != args.dtype && (args.a_dtype != DType::float32 || !float_a_compiled))
    throw std::invalid_argument(
        "moe_xpu: A must have B's dtype, or be float32 with 16-bit B contiguous along K");
  plan.kernel_name = family_kernel_name(family, args.a_dtype, args.dtype, args.out_dtype, shape, d);
  plan.matrix_engine = use_matrix;
  plan.widen_a = !use_matrix && !(use_fma && !k_lanes) && args.a_dtype != DType::float32 && float_a_compiled &&
                 (shape.tile_m > 1 || fma_candidate);
  plan.tile_m = shape.tile_m;
  if (use_matrix) plan.tile_n = !k_lanes ? int(kKnCols) : engine_tile(d).m * (gated ? 1 : 2);
  else plan.tile_n = k_lanes ? (gated ? shape.tile_n / 2 : shape.tile_n) : shape.tile_n * int(lanes);
  plan.scratch_bytes = use_matrix                ? matrix_scratch_bytes(args.K, !k_lanes)
                       : family == Family::dot_kn ? n_dot_scratch_bytes(args.K, args.b_stride_k * 2)
                       : family == Family::fma_kn ? n_fma_scratch_bytes(args.K)
                                                  : 0;
  // CPU: one sub-group per work-group, 16 per core so the runtime's thread pool can balance (on
  // the decode case with its weights not in cache: 17.1 ms at 4 per core, 15.8 ms at 8-32 per
  // core; other cases unchanged within 2%);
  // GPU: 4 sub-groups per work-group and enough of them to fill every Xe core's threads.
  // (One sub-group per work-group on the CPU is also what the N-split kernel's K chunks assume:
  // they keep one sub-group's partial sums in the work-group's local memory.)
  // (GPU matrix-engine workers: 8 per Xe core, each with its scratch area in global memory.)
  const std::int64_t subgroups_per_wg = cpu ? 1 : 4;
  const std::int64_t workers_per_cu = cpu ? 16 : use_matrix ? 8 : 32;
  plan.work_group_size = subgroups_per_wg * lanes;
  plan.num_workers = forward_workers(args, plan, d, workers_per_cu, subgroups_per_wg);
  plan.calling_thread = runs_on_calling_thread(args, d);
  return plan;
}

LaunchPlan plan_wgrad_for(const WgradArgs& args, const DeviceDescription& d) {
  // The matrix engine for 16-bit operands it takes, where dB is at least two engine tiles each way
  // (not the bias gradient's single column of ones) and the groups average more than 4 rows. With
  // fewer, dB's stores are the time and the vector kernel stores from registers, the engine through
  // its tiles in scratch (AMX, dB of bf16 [E, K, N], warm, the bench's cases: 16 rows a group
  // 110 -> 55-64 ms, 8 rows 47 -> 35 ms, 128 rows 370 -> 76 ms; 4 rows 19 vs 20 ms, 0.25 rows 56 vs
  // 58 ms).
  const double rows_per_group = args.num_groups > 0 ? double(args.dy_rows) / double(args.num_groups) : 0.0;
  const bool matrix_shape = engine_takes(d, args.dtype) && args.dtype != DType::int8 &&
                            args.K >= 2 * engine_tile(d).m && args.N >= 2 * engine_tile(d).n;
  if (args.engine == 2 && !matrix_shape)
    throw std::invalid_argument(
        "moe_xpu: the matrix-engine weight gradient needs a device with one, operands of a dtype it takes "
        "(bf16; fp16 where the engine takes it) and K, N of at least two engine tiles");
  const bool use_matrix = args.engine == 2 || (args.engine == 0 && matrix_shape && rows_per_group > 4.0);
  // The kernels store along their N: a dB contiguous along K is computed as dB^T = dY^T A.
  const bool transposed = args.out_stride_n != 1 && args.out_stride_k == 1;
  // bf16 on a CPU with AVX512-BF16 where the engine does not run: the dot kernel, for its N in
  // whole 64-column tiles, dY read in place (so transposed only without an index table, which
  // would then apply to it), and groups of at least kDotWgradMinRows rows on average (the
  // assembly rounds and stores whole bf16 tiles itself: dB of 64 groups, K = N = 2048, measured
  // 28-32 ms against the vector kernel's 48-60 at 8 rows a group, 20-23 against 35 at 4; with one
  // row a group even).
  const bool use_dot = !use_matrix && args.engine == 0 && d.bf16_dot && args.dtype == DType::bfloat16 &&
                       (transposed ? args.K : args.N) % kNDotCols == 0 && (transposed || args.out_stride_n == 1) &&
                       !(transposed && args.gather_index != 0) && rows_per_group >= double(kDotWgradMinRows);
  const Family family = use_matrix ? Family::matrix_wgrad : use_dot ? Family::dot_wgrad : Family::wgrad;
  const TileShape shape = family_tiles(family, d, args.dtype)[0];
  const std::int64_t lanes = use_matrix ? engine_tile(d).sub_group_size : kSubGroupSize;
  LaunchPlan plan;
  plan.kernel_name = family_kernel_name(family, args.dtype, args.dtype, args.out_dtype, shape, d);
  plan.matrix_engine = use_matrix;
  plan.wgrad_transposed = transposed;
  // (The kernel walks dY's rows in either orientation: see moe_gemm_wgrad in launcher.cpp.)
  plan.scratch_bytes = use_matrix ? wgrad_matrix_scratch_bytes(args.dy_rows)
                       : use_dot  ? dot_wgrad_scratch_bytes(args.dy_rows)
                                  : 0;
  plan.tile_m = shape.tile_m;
  plan.tile_n = shape.tile_n * int(use_matrix ? engine_tile(d).n : kSubGroupSize);
  plan.sub_group_size = int(lanes);
  // As the forward kernels: one sub-group per work-group and 16 workers per core on the CPU,
  // 4 sub-groups per work-group and 32 workers per compute unit on GPUs (8 with the matrix
  // engine, each with its scratch area).
  const std::int64_t subgroups_per_wg = d.is_cpu ? 1 : 4;
  const std::int64_t units = args.num_groups * ((args.K + plan.tile_m - 1) / plan.tile_m) *
                             ((args.N + plan.tile_n - 1) / plan.tile_n);
  const double flops = 2.0 * double(args.dy_rows) * double(args.K) * double(args.N);
  const std::int64_t per_cu = d.is_cpu ? 16 : use_matrix ? 8 : 32;
  plan.num_workers = worker_count(d, per_cu, flops, args.num_workers, units, subgroups_per_wg);
  plan.work_group_size = subgroups_per_wg * lanes;
  // As a forward launch, a small dB runs on the calling thread; the bytes bound counts dB, which
  // the launch writes whole.
  const double db_bytes = double(args.num_groups) * double(args.K) * double(args.N) * double(stored_bits(args.out_dtype)) / 8.0;
  plan.calling_thread = runs_on_calling_thread(d, args.calling_thread, flops, db_bytes);
  return plan;
}

}  // namespace moe_xpu

// The choice of kernel variants, tiles and launch shape: a function of the problem (GemmArgs)
// and of a DeviceDescription only, so it can be evaluated for a GPU that is not present
// (gpu_check compiles exactly what this returns for each Intel GPU generation; the tests run the
// GPU variants on the CPU device).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device_model.hpp"
#include "launcher.hpp"

namespace moe_xpu {

// The sub-group size every kernel is written for (kLanes in moe_gemm.cpp).
constexpr std::uint32_t kSubGroupSize = 16;

// Which kernel family a launch uses: the B layout picks the lane split, the epilogue whether it
// is gated (wgrad: the weight gradient, moe_gemm_wgrad.cpp); bf16 runs on the matrix engine where there is one (see has_matrix_engine and
// plan_for), with one matrix kernel per B layout.
// quant / quant_gated: quantized B (moe_gemm_quant.cpp), K-split like k_lanes; quant_matrix: W8A8
// on the matrix engine's int8 tile; dequant_matrix / dequant_matrix_gated: weight-only 8-bit B
// dequantized into the engine's bf16 tiles; matrix_wgrad: the weight gradient on the matrix engine;
// dot / dot_gated: bf16 K-split with AVX512-BF16 dot products; dot_kn: bf16 N-split (B
// contiguous along N) with the same; dot_wgrad: the bf16 weight gradient with the same; quant_dot:
// W8A8 with AVX512-VNNI; nibble_dot / nibble_dot_gated: 4-bit B (int4, MXFP4) with bf16 A on
// AVX512-BF16 dot products; fp8_dot / fp8_dot_gated: fp8 e4m3 B with the same (CPU only, all in moe_gemm_dot.cpp);
// fma_dot / fma_dot_gated: float32, bf16 or fp16 B contiguous along K with float A, on AVX2 or
// AVX-512 FMA assembly; fma_kn: the same B types contiguous along N, on AVX2 (CPU only, both in
// moe_gemm_fma.cpp).
enum class Family { k_lanes, k_lanes_gated, n_lanes, matrix, matrix_gated, matrix_kn, wgrad, quant, quant_gated,
                    quant_matrix, dequant_matrix, dequant_matrix_gated, matrix_wgrad, dot, dot_gated, dot_kn,
                    dot_wgrad, quant_dot, nibble_dot, nibble_dot_gated, fp8_dot, fp8_dot_gated, fma_dot,
                    fma_dot_gated, fma_kn };

// (tile_m, tile_n) of one kernel variant. tile_n is in units of columns per lane group (see
// moe_gemm.cpp: k_lanes tiles are TN columns wide, n_lanes tiles are 16 * TN columns wide).
struct TileShape {
  int tile_m, tile_n;
};

// One kernel variant a bundle compiles: family, A, B and output dtypes, tile shape.
struct Variant {
  Family family;
  DType a, b, out;
  TileShape shape;
};

// The CPU vector class the vector kernels' tiles are tuned per ("avx512", "avx2", "sse"), from
// the description's vector width; "gpu" for a GPU.
std::string cpu_vector_class(const DeviceDescription& d);

// 4-bit weights decoded by a table lookup across the sub-group (else arithmetically).
bool nibble_lookup(const DeviceDescription& d);
// FLOPs up to which a CPU launch runs on the calling thread (0 on GPUs; see variants.cpp).
double inline_flops_limit(const DeviceDescription& d);
// Weight bytes a CPU launch may stream and still run on the calling thread (see variants.cpp).
double inline_bytes_limit(const DeviceDescription& d);
Family family_of(bool k_lanes, bool gated);
// The tile shapes compiled for family f on device d with B elements of type t (the CPU's N-split
// tiles differ between float32 and 16-bit B).
std::vector<TileShape> family_tiles(Family f, const DeviceDescription& d, DType t);
// The engine tiles the K-contiguous matrix kernel is written for (AMX, XMX on 16 and on 8 lanes).
std::vector<MatrixShape> engine_tiles();
// The engine tile the K-contiguous matrix kernel uses on device d (m == 0: none).
MatrixShape engine_tile(const DeviceDescription& d);
// The device has a matrix engine whose tile the matrix kernels are written for.
bool has_matrix_engine(const DeviceDescription& d);
// ... and it takes inputs of dtype t (bf16 everywhere; fp16 on XMX; int8 with int8 A: AMX-INT8, XMX).
bool engine_takes(const DeviceDescription& d, DType t);
// Whether the FMA dot-product kernels (moe_gemm_fma.cpp) take B of dtype t on d, and whether
// their N-contiguous kernel does.
bool fma_takes(const DeviceDescription& d, DType t);
bool fma_kn_takes(const DeviceDescription& d, DType t);
// The sub-group size a variant is written for (and required to compile with).
int sub_group_size(const Variant& v, const DeviceDescription& d);
// Every variant the launcher can pick on device d for one (B dtype, output dtype) pair: one
// bundle, one compiler run. Quantized B dtypes have bundles of their own (the quantized family).
std::vector<Variant> bundle_variants(const DeviceDescription& d, DType b, DType out);
std::string kernel_name(const Variant& v, const DeviceDescription& d);
std::string kernel_instantiation(const Variant& v, const DeviceDescription& d);
// Work-group local memory a variant declares, in bytes.
std::int64_t local_memory_bytes(const Variant& v, const DeviceDescription& d);
LaunchPlan plan_for(const GemmArgs& args, const DeviceDescription& d);
LaunchPlan plan_wgrad_for(const WgradArgs& args, const DeviceDescription& d);

}  // namespace moe_xpu

// Host side of moe_xpu: builds the runtime-compiled kernels, caches them, and launches them on
// a SYCL queue (torch's current XPU queue, or a process-wide queue on the SYCL CPU device).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace moe_xpu {

// Element types of A, B and the output. int8 is A's (W8A8) or B's; int4, fp8_e4m3 and mxfp4 are
// quantized weight formats of B (see sycl/kernels/moe_gemm_quant.cpp).
enum class DType : int { float32 = 0, float16 = 1, bfloat16 = 2, int8 = 3, int4 = 4, fp8_e4m3 = 5, mxfp4 = 6 };

// B is stored quantized (the quantized kernel family runs).
inline bool is_quantized(DType t) { return static_cast<int>(t) >= static_cast<int>(DType::int8); }

// Bits of one stored value of B (quantized formats: without their scales).
inline int stored_bits(DType t) {
  switch (t) {
    case DType::float32: return 32;
    case DType::float16:
    case DType::bfloat16: return 16;
    case DType::int8:
    case DType::fp8_e4m3: return 8;
    case DType::int4:
    case DType::mxfp4: return 4;
  }
  return 32;
}

// Everything one grouped GEMM launch needs; pointers are device (or, on the CPU device, host)
// addresses, strides are in elements. Filled in by the Python op layer.
struct GemmArgs {
  std::uintptr_t queue = 0;  // address of a sycl::queue; 0 = the SYCL CPU device queue
  DType dtype = DType::float32;      // of B (and bias)
  DType a_dtype = DType::float32;    // of A: dtype, or float32 with 16-bit B (see LaunchPlan)
  DType out_dtype = DType::float32;
  std::uintptr_t a = 0;
  std::int64_t a_row_stride = 0;
  std::int64_t a_rows = 0;  // rows of a (bounds gather_index)
  std::uintptr_t gather_index = 0;  // 0 = none
  bool gather_is_int64 = false;
  // moe_gemm's contract: gather_index has exactly group_offsets[-1] entries. fused_moe's own
  // launches relax it: routing slots of experts elsewhere sit past the last group (zero rows).
  bool gather_matches_offsets = true;
  std::uintptr_t b = 0;
  std::int64_t b_stride_e = 0, b_stride_k = 0, b_stride_n = 0;
  std::uintptr_t bias = 0;  // 0 = none
  std::int64_t bias_stride_e = 0;
  std::uintptr_t out = 0;
  std::int64_t out_row_stride = 0;
  std::int64_t out_rows = 0;
  std::uintptr_t group_offsets = 0;
  bool offsets_are_int64 = false;
  std::int64_t num_groups = 0;
  std::int64_t K = 0, N = 0;
  // Epilogue (fused MoE). activation: 0 none, 1 silu, 2 gelu_tanh; when set, output column n is
  // act(B column n) * (B column n + up_offset) and N is the output width. K-contiguous B only.
  int activation = 0;
  std::int64_t up_offset = 0;
  std::uintptr_t scatter_index = 0;  // 0 = none: output row m is written to row scatter_index[m]
  bool scatter_is_int64 = false;
  std::uintptr_t row_weight = 0;  // float32 [out_rows], indexed by destination row; 0 = none
  // Quantized B (dtype int8, int4, fp8_e4m3 or mxfp4): B's strides count bytes (int8, fp8) or
  // 32-bit words of eight 4-bit values (int4, mxfp4: words [E][N / 8][K / 128][8][16], K walked
  // through the words' own order, b_stride_n the stride of a chunk of 8 columns; see
  // kernels/moe_gemm_quant.cpp).
  // Scale (float32; uint8 exponents for mxfp4) of element (g, n, k) sits at g * scale_stride_e +
  // (n / scale_block_n) * scale_stride_n + (k / scale_block_k) * scale_stride_k; its zero point
  // (uint8, read by the 4-bit formats: a single constant with strides 0 where there are none)
  // likewise through the zero strides. a_scale: float32 per row of A (W8A8: int8 A). Bias is
  // float32 with quantized B.
  std::uintptr_t b_scale = 0;
  std::int64_t scale_stride_e = 0, scale_stride_n = 0, scale_stride_k = 0;
  std::int64_t scale_block_n = 1, scale_block_k = 1;
  std::uintptr_t b_zero = 0;
  std::int64_t zero_stride_e = 0, zero_stride_n = 0, zero_stride_k = 0;
  std::uintptr_t a_scale = 0;
  // Overrides for tuning and tests; 0 = chosen by the heuristic.
  int tile_m = 0;
  int tile_n = 0;
  std::int64_t num_workers = 0;
  // 0: chosen by the heuristic; 1: the vector kernels; 2: the matrix-engine kernels (an error where
  // they cannot run).
  int engine = 0;
  // 0: the calling thread runs the launch when the plan says so (LaunchPlan::calling_thread);
  // 1: never; 2: always (CPU device; tests compare the two).
  int calling_thread = 0;
  // Empty: variants and tiles are chosen for the queue's device. A GPU target name (pvc, bmg, lnl,
  // ptl, dg2, mtl): chosen as for that GPU, and run on the queue's device (tests of GPU variants).
  std::string variants_for;
};

struct DeviceInfo {
  std::string name;
  std::string backend;
  std::string driver_version;
  std::uint32_t compute_units = 0;
  std::vector<std::size_t> sub_group_sizes;
  std::size_t max_work_group_size = 0;
  std::size_t local_mem_size = 0;
  bool is_cpu = false;
  bool matrix_engine = false;  // the bf16 matrix-engine kernels run on this device
  bool matrix_engine_int8 = false;  // ... and the W8A8 one (int8 tiles: AMX-INT8, XMX)
};

// Everything one weight-gradient launch needs: dB[g] = A[rows of g]^T @ dY[rows of g] for every
// group g (rows [group_offsets[g-1], group_offsets[g]) of dY, paired with A rows through
// gather_index when given). dB is written through its three strides, so it can take the layout of
// the weights it is the gradient of.
struct WgradArgs {
  std::uintptr_t queue = 0;          // as in GemmArgs
  DType dtype = DType::float32;      // of A and dY
  DType out_dtype = DType::float32;  // of dB
  std::uintptr_t a = 0;
  std::int64_t a_row_stride = 0, a_rows = 0;
  std::uintptr_t gather_index = 0;  // 0 = none
  bool gather_is_int64 = false;
  std::uintptr_t dy = 0;
  std::int64_t dy_row_stride = 0, dy_rows = 0;
  std::uintptr_t group_offsets = 0;
  bool offsets_are_int64 = false;
  std::int64_t num_groups = 0;
  std::int64_t K = 0, N = 0;
  std::uintptr_t out = 0;
  std::int64_t out_stride_e = 0, out_stride_k = 0, out_stride_n = 0;
  std::int64_t num_workers = 0;  // 0 = chosen by the heuristic
  int engine = 0;                // as in GemmArgs: 0 chosen, 1 vector kernel, 2 matrix engine
  int calling_thread = 0;        // as in GemmArgs
  std::string variants_for;      // as in GemmArgs
};

// The launch configuration chosen for a problem (exposed for tests, the bench and `info`).
struct LaunchPlan {
  std::string kernel_name;
  int tile_m = 0;
  int tile_n = 0;  // columns per worker tile
  std::int64_t num_workers = 0;
  std::int64_t work_group_size = 0;
  int sub_group_size = 16;
  // The planned kernel runs faster with A in float32 (16-bit A, K-contiguous B, tiles of several
  // rows): the caller may pass a float32 copy of A with a_dtype = float32 (quantized B: with a
  // float32 output too, rounded to the 16-bit dtype after; the same bits).
  bool widen_a = false;
  // Runs on the matrix engine (joint_matrix: AMX on the CPU device), with this many bytes of
  // scratch area for each worker.
  bool matrix_engine = false;
  std::int64_t scratch_bytes = 0;
  // Weight gradient: dB is computed as dB^T = dY^T A (operands, sizes and strides swapped).
  bool wgrad_transposed = false;
  // CPU device: the work-groups run one after another on the calling thread (see
  // inline_flops_limit and inline_bytes_limit in variants.cpp) instead of on the runtime's thread
  // pool. Same work-groups, same bits.
  bool calling_thread = false;
};

// What the build of one kernel variant reported (the launcher refuses a device on which any of
// these differs from what the kernel needs: see check_built_kernel in launcher.cpp).
struct KernelReport {
  std::string name;
  std::uint32_t expected_sub_group_size = 0;  // what the variant is written for
  std::uint32_t required_sub_group_size = 0;  // from the kernel's attribute; 0 = none
  std::uint32_t compiled_sub_group_size = 0;  // the largest sub-group the built kernel runs with
  std::int64_t max_work_group_size = 0;
  std::int64_t local_memory_bytes = 0;        // work-group local memory the variant declares
};

LaunchPlan plan_gemm(const GemmArgs& args);
LaunchPlan plan_wgrad(const WgradArgs& args);
// The plan the launcher makes on a GPU generation (pvc, bmg, lnl, ptl, dg2, mtl), from its
// description alone: what gpu_check compiles, evaluated on any host.
LaunchPlan plan_gemm_on_gpu(const GemmArgs& args, const std::string& target);
// The (tile_m, tile_n) shapes compiled for one kernel family (k_lanes: K-contiguous B; gated:
// with the gated-activation epilogue, K-contiguous B only) on the device of a queue (0: the SYCL CPU
// device) for B of type dtype. The first is the decode shape.
std::vector<std::pair<int, int>> tile_shapes(bool k_lanes, bool gated = false, std::uintptr_t queue = 0,
                                             const std::string& variants_for = "", DType dtype = DType::float32);
// Launches the grouped GEMM. On the CPU device queue it waits for completion (torch CPU ops are
// synchronous); on a caller's queue it returns at once.
void moe_gemm(const GemmArgs& args);
// A launch whose metadata (queue, shapes, strides, dtypes, which optional inputs are given) is
// fixed: planned, and its kernel looked up, once. Each launch gives its own addresses. Launching
// never writes the object, so threads may share it.
class PreparedGemm {
 public:
  explicit PreparedGemm(const GemmArgs& args);
  // scatter_index and row_weight: the epilogue's, where the template's launch has them (fused_moe);
  // b_scale, b_zero and a_scale: quantized B's scales and zero points and W8A8's row scales.
  void launch(std::uintptr_t queue, std::uintptr_t a, std::uintptr_t b, std::uintptr_t group_offsets,
              std::uintptr_t gather_index, std::uintptr_t bias, std::uintptr_t out, std::uintptr_t scatter_index = 0,
              std::uintptr_t row_weight = 0, std::uintptr_t b_scale = 0, std::uintptr_t b_zero = 0,
              std::uintptr_t a_scale = 0) const;
  const LaunchPlan& plan() const;
  const GemmArgs& args() const { return args_; }

 private:
  struct Resolved;
  GemmArgs args_;
  std::shared_ptr<const Resolved> resolved_;  // null: nothing to launch (an empty output)
};
// Launches the weight-gradient kernel (same queue semantics as moe_gemm).
void moe_gemm_wgrad(const WgradArgs& args);
DeviceInfo device_info(std::uintptr_t queue);
// The description the launcher chooses variants and tiles from, for the device of a queue.
struct DeviceDescription;
const DeviceDescription& device_description(std::uintptr_t queue);
// Launches an empty kernel the way moe_gemm launches (the runtime's floor, for the bench): on the
// queue, or (CPU device, calling_thread) on the queue the calling thread executes.
void launch_empty(std::uintptr_t queue = 0, bool calling_thread = false);
// The OpenMP library (torch's) whose threads sleep while the CPU device's thread pool runs a
// launch; "" when none is loaded, torch runs one thread, or MOE_XPU_PARK_OPENMP=0.
std::string parked_openmp_library();
// "on" where the dot-product kernels run on the CPU device, else why not (python -m moe_xpu info):
// the bf16 ones (int8 false) or the W8A8 one (int8 true).
std::string dot_state(const std::string& family);  // "bf16", "int8" or "nibble"
// Whether prepared launches on the CPU device are enqueued through OpenCL directly (false: through
// SYCL; MOE_XPU_NATIVE_LAUNCH=0, or no OpenCL CPU device).
bool native_cpu_launches();
bool cpu_device_available();
// Builds (or loads from the persistent cache) every kernel of one dtype pair (B dtype, output
// dtype; with both A dtypes); returns seconds.
double warm_up(std::uintptr_t queue, DType dtype, DType out_dtype, const std::string& variants_for = "");
// Builds (or takes from the cache) the bundle of one dtype pair and reports its kernels.
std::vector<KernelReport> kernel_report(std::uintptr_t queue, DType dtype, DType out_dtype,
                                        const std::string& variants_for = "");
// The kernel names a bundle of one dtype pair holds on a GPU target ("" : this queue's device),
// without building it (on the CPU device a GPU's XMX variants are built only under an AMX target).
std::vector<std::string> bundle_kernel_names(std::uintptr_t queue, const std::string& variants_for,
                                             DType dtype, DType out_dtype);
// The SPIR-V modules of the bundle of one dtype pair with the variants chosen for a GPU target (or
// "" for the CPU device), built on the SYCL CPU device: what Intel's GPU compiler takes.
std::vector<std::string> spirv_modules(const std::string& variants_for, DType dtype, DType out_dtype);
// Every embedded kernel file (name, text): the shared header and one file per kernel family.
std::vector<std::pair<std::string, std::string>> kernel_files();

}  // namespace moe_xpu

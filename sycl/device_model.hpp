// A device as the kernel-variant choice sees it: read off the device a queue runs on, or, for an
// Intel GPU generation that is not present, its published figures. The choice of kernels and
// tiles (variants.hpp) depends on nothing else, so it can be evaluated, compiled (gpu_check) and
// even run on the CPU device for a GPU we do not have.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moe_xpu {

// One matrix-engine tile shape (joint_matrix, bf16 inputs, float accumulator) and the sub-group
// size it runs with: 16 x 16 x 32 for AMX; 8 x 16 x 16 at 16 lanes on Xe-HPC, Xe2 and Xe3;
// 8 x 8 x 16 at 8 lanes on Xe-HPG (XMX takes fp16 at the same shapes).
struct MatrixShape {
  int m = 0, n = 0, k = 0;
  int sub_group_size = 0;
  bool fp16 = false;  // the engine also takes float16 inputs at this shape (XMX; not AMX-BF16)
  // ... and int8 inputs with int32 sums at m x n x 2k (AMX-INT8; XMX): the W8A8 matrix kernel.
  bool int8 = false;
};

struct DeviceDescription {
  std::string name;  // "cpu", or the GPU target as ocloc names it (pvc, bmg, lnl, ptl, dg2, mtl)
  bool is_cpu = true;
  std::vector<std::size_t> sub_group_sizes;
  std::int64_t local_mem_size = 0;  // work-group local memory (SLM) one work-group may use
  std::int64_t compute_units = 0;   // cores, or Xe cores
  // CPU: floats per vector register of the code the OpenCL CPU compiler emits (16 AVX-512, 8
  // AVX/AVX2, 4 SSE): what the CPU reports, capped by the compiler's target. The vector kernels'
  // tile tables are chosen per class of it (cpu_vector_class in variants.hpp). GPUs: unused.
  int vector_width = 16;
  std::vector<MatrixShape> matrix_shapes;  // matrix-engine tiles available to the kernels
  // CPU: the compiler's target and the CPU run AVX512-BF16 (vdpbf16ps), which the bf16 dot-product
  // kernels (moe_gemm_dot.cpp) are written in. GPUs: false.
  bool bf16_dot = false;
  // CPU: the compiler's target and the CPU run AVX512-VNNI (vpdpbusd), which the W8A8 dot-product
  // kernel (moe_gemm_dot.cpp) is written in. GPUs: false.
  bool int8_dot = false;
  // CPU: the compiler's target and the CPU run AVX512-BF16, and the weight-decoding dot-product
  // kernels (moe_gemm_dot.cpp: 4-bit and fp8 weights decoded to bf16 with AVX512-BW, vdpbf16ps)
  // passed their self-check. GPUs: false.
  bool nibble_dot = false;
  // CPU: the compiler's target's vectors are 8 floats wide (AVX2), the CPU runs AVX2, FMA and F16C,
  // and the FMA dot-product kernels (moe_gemm_fma.cpp) passed their self-check. GPUs: false.
  bool fma_dot = false;

  bool has_matrix_shape(int m, int n, int k) const {
    for (const MatrixShape& s : matrix_shapes)
      if (s.m == m && s.n == n && s.k == k) return true;
    return false;
  }
};

// One entry of a device's sycl_ext_oneapi_matrix combinations, as the extension reports it (a
// size of 0 means "any up to the max_ one"); element types by name ("bf16", "fp16", "fp32", ...).
struct MatrixCombination {
  std::size_t max_msize = 0, max_nsize = 0, max_ksize = 0, msize = 0, nsize = 0, ksize = 0;
  std::string atype, btype, ctype;
};
// Which of the kernels' engine tiles (`candidates`) the combinations allow with bf16 inputs and
// float accumulators; fp16 is set where fp16 inputs are allowed at the same shape too, int8 where
// the candidate has it and signed int8 inputs with int32 accumulators are allowed at twice its k.
// A tile also needs its sub-group size among the device's.
std::vector<MatrixShape> shapes_from_combinations(const std::vector<MatrixCombination>& combinations,
                                                  const std::vector<MatrixShape>& candidates,
                                                  const std::vector<std::size_t>& sub_group_sizes);

// The Intel GPU generations the kernels are compile-checked for, in ocloc's names.
std::vector<std::string> gpu_targets();
// The published figures of one of them (throws std::invalid_argument for another name).
DeviceDescription gpu_description(const std::string& target);

}  // namespace moe_xpu

#include "device_model.hpp"

#include <stdexcept>

namespace moe_xpu {

namespace {

// Public figures of the largest part of each generation (what the variant choice reads: sub-group
// sizes, work-group local memory, Xe cores, XMX tile shapes). Work-group SLM is taken as 64 KB
// except on Xe-HPC (128 KB): the smallest a part of the generation gives a work-group, so a
// variant that fits here fits every part. Compute units only size the persistent grid.
DeviceDescription gpu(const char* name, std::int64_t xe_cores, std::int64_t slm_kb,
                      std::vector<std::size_t> sub_groups, std::vector<MatrixShape> xmx) {
  DeviceDescription d;
  d.name = name;
  d.is_cpu = false;
  d.sub_group_sizes = std::move(sub_groups);
  d.local_mem_size = slm_kb * 1024;
  d.compute_units = xe_cores;
  d.matrix_shapes = std::move(xmx);
  return d;
}

// bf16 and fp16 at these shapes; int8 (the W8A8 kernel) at twice their k, 8 x 16 x 32, where it
// fits the register file: on Xe-HPG's 8 lanes the W8A8 kernel spilled (32-544 B per thread in
// python -m moe_xpu.gpu_check, by how its epilogue columns were held), so W8A8 stays on the vector
// kernel there.
const MatrixShape kXmx16{8, 16, 16, 16, true, true};  // Xe-HPC, Xe2, Xe3: DPAS 8 x 8 on 16 lanes
const MatrixShape kXmx8{8, 8, 16, 8, true, false};    // Xe-HPG: DPAS on 8 lanes

std::vector<DeviceDescription> all_gpus() {
  return {
      gpu("pvc", 64, 128, {16, 32}, {kXmx16}),    // Data Center GPU Max 1550, per stack
      gpu("bmg", 20, 64, {16, 32}, {kXmx16}),     // Arc B580
      gpu("lnl", 8, 64, {16, 32}, {kXmx16}),      // Lunar Lake, Arc 140V
      gpu("ptl", 12, 64, {16, 32}, {kXmx16}),     // Panther Lake
      gpu("dg2", 32, 64, {8, 16, 32}, {kXmx8}),   // Arc A770
      gpu("mtl", 8, 64, {8, 16, 32}, {}),         // Meteor Lake: no XMX
  };
}

}  // namespace

namespace {

bool allows(std::size_t exact, std::size_t max, int want) {
  return exact != 0 ? exact == std::size_t(want) : want > 0 && std::size_t(want) <= max;
}

bool combination_allows(const MatrixCombination& c, const MatrixShape& s, const std::string& input,
                        const std::string& acc = "fp32", int k_factor = 1) {
  return c.atype == input && c.btype == input && c.ctype == acc && allows(c.msize, c.max_msize, s.m) &&
         allows(c.nsize, c.max_nsize, s.n) && allows(c.ksize, c.max_ksize, s.k * k_factor);
}

}  // namespace

std::vector<MatrixShape> shapes_from_combinations(const std::vector<MatrixCombination>& combinations,
                                                  const std::vector<MatrixShape>& candidates,
                                                  const std::vector<std::size_t>& sub_group_sizes) {
  std::vector<MatrixShape> shapes;
  for (MatrixShape s : candidates) {
    bool lanes = false, bf16 = false, fp16 = false, int8 = false;
    for (std::size_t size : sub_group_sizes) lanes = lanes || size == std::size_t(s.sub_group_size);
    for (const MatrixCombination& c : combinations) {
      bf16 = bf16 || combination_allows(c, s, "bf16");
      fp16 = fp16 || combination_allows(c, s, "fp16");
      int8 = int8 || combination_allows(c, s, "sint8", "sint32", 2);
    }
    if (lanes && bf16) {
      s.fp16 = fp16;
      s.int8 = s.int8 && int8;  // the candidate says whether the W8A8 kernel is built at this tile
      shapes.push_back(s);
    }
  }
  return shapes;
}

std::vector<std::string> gpu_targets() {
  std::vector<std::string> names;
  for (const DeviceDescription& d : all_gpus()) names.push_back(d.name);
  return names;
}

DeviceDescription gpu_description(const std::string& target) {
  for (DeviceDescription& d : all_gpus())
    if (d.name == target) return d;
  throw std::invalid_argument("moe_xpu: unknown GPU target '" + target + "' (known: pvc, bmg, lnl, ptl, dg2, mtl)");
}

}  // namespace moe_xpu

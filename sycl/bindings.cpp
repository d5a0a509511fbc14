// pybind11 module moe_xpu._C: the launcher's entry points, taking raw addresses and strides.
// No libtorch here: the torch op layer (moe_xpu/ops.py) unpacks tensors in Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "device_model.hpp"
#include "host_checks.hpp"
#include "launcher.hpp"
#include "variants.hpp"

namespace py = pybind11;
using moe_xpu::DType;
using moe_xpu::GemmArgs;

namespace {

// A device description and the tuning chosen from it, for `python -m moe_xpu info` and the tests.
py::dict description_dict(const moe_xpu::DeviceDescription& d) {
  using moe_xpu::Family;
  py::list shapes;
  for (const auto& s : d.matrix_shapes) shapes.append(py::make_tuple(s.m, s.n, s.k, s.sub_group_size));
  auto tiles = [&](Family f, DType t) {
    py::list out;
    for (const auto& s : moe_xpu::family_tiles(f, d, t)) out.append(py::make_tuple(s.tile_m, s.tile_n));
    return out;
  };
  return py::dict(py::arg("name") = d.name, py::arg("is_cpu") = d.is_cpu,
                  py::arg("vector_class") = moe_xpu::cpu_vector_class(d), py::arg("vector_width") = d.vector_width,
                  py::arg("sub_group_sizes") = d.sub_group_sizes, py::arg("local_mem_size") = d.local_mem_size,
                  py::arg("compute_units") = d.compute_units, py::arg("matrix_shapes") = shapes,
                  py::arg("int8_matrix") = moe_xpu::engine_takes(d, DType::int8),
                  py::arg("k_lanes_tiles") = tiles(Family::k_lanes, DType::float32),
                  py::arg("n_lanes_tiles") = tiles(Family::n_lanes, DType::float32),
                  py::arg("n_lanes_tiles_16bit") = tiles(Family::n_lanes, DType::bfloat16),
                  py::arg("quant_tiles_8bit") = tiles(Family::quant, DType::int8),
                  py::arg("quant_tiles_4bit") = tiles(Family::quant, DType::int4),
                  py::arg("nibble_lookup") = moe_xpu::nibble_lookup(d), py::arg("bf16_dot") = d.bf16_dot,
                  py::arg("int8_dot") = d.int8_dot, py::arg("nibble_dot") = d.nibble_dot,
                  py::arg("fma_dot") = d.fma_dot,
                  py::arg("inline_flops") = moe_xpu::inline_flops_limit(d),
                  py::arg("inline_bytes") = moe_xpu::inline_bytes_limit(d));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe_xpu SYCL launcher";
  py::register_exception<moe_xpu::ArgumentError>(m, "ArgumentError", PyExc_ValueError);

  py::enum_<DType>(m, "DType")
      .value("float32", DType::float32)
      .value("float16", DType::float16)
      .value("bfloat16", DType::bfloat16)
      .value("int8", DType::int8)
      .value("int4", DType::int4)
      .value("fp8_e4m3", DType::fp8_e4m3)
      .value("mxfp4", DType::mxfp4);

  // The positional constructor fills the fields every launch sets in one call (the op layer's
  // per-call cost: one attribute set from Python costs about as much as this whole call).
  py::class_<GemmArgs>(m, "GemmArgs")
      .def(py::init<>())
      .def(py::init([](std::uintptr_t queue, DType dtype, DType a_dtype, DType out_dtype, std::uintptr_t a,
                       std::int64_t a_row_stride, std::int64_t a_rows, std::uintptr_t b, std::int64_t b_stride_e,
                       std::int64_t b_stride_k, std::int64_t b_stride_n, std::uintptr_t out,
                       std::int64_t out_row_stride, std::int64_t out_rows, std::uintptr_t group_offsets,
                       bool offsets_are_int64, std::int64_t num_groups, std::int64_t K, std::int64_t N) {
             GemmArgs g;
             g.queue = queue, g.dtype = dtype, g.a_dtype = a_dtype, g.out_dtype = out_dtype;
             g.a = a, g.a_row_stride = a_row_stride, g.a_rows = a_rows;
             g.b = b, g.b_stride_e = b_stride_e, g.b_stride_k = b_stride_k, g.b_stride_n = b_stride_n;
             g.out = out, g.out_row_stride = out_row_stride, g.out_rows = out_rows;
             g.group_offsets = group_offsets, g.offsets_are_int64 = offsets_are_int64;
             g.num_groups = num_groups, g.K = K, g.N = N;
             return g;
           }))
      .def_readwrite("queue", &GemmArgs::queue)
      .def_readwrite("dtype", &GemmArgs::dtype)
      .def_readwrite("a_dtype", &GemmArgs::a_dtype)
      .def_readwrite("out_dtype", &GemmArgs::out_dtype)
      .def_readwrite("a", &GemmArgs::a)
      .def_readwrite("a_row_stride", &GemmArgs::a_row_stride)
      .def_readwrite("a_rows", &GemmArgs::a_rows)
      .def_readwrite("gather_index", &GemmArgs::gather_index)
      .def_readwrite("gather_is_int64", &GemmArgs::gather_is_int64)
      .def_readwrite("gather_matches_offsets", &GemmArgs::gather_matches_offsets)
      .def_readwrite("b", &GemmArgs::b)
      .def_readwrite("b_stride_e", &GemmArgs::b_stride_e)
      .def_readwrite("b_stride_k", &GemmArgs::b_stride_k)
      .def_readwrite("b_stride_n", &GemmArgs::b_stride_n)
      .def_readwrite("bias", &GemmArgs::bias)
      .def_readwrite("bias_stride_e", &GemmArgs::bias_stride_e)
      .def_readwrite("out", &GemmArgs::out)
      .def_readwrite("out_row_stride", &GemmArgs::out_row_stride)
      .def_readwrite("out_rows", &GemmArgs::out_rows)
      .def_readwrite("group_offsets", &GemmArgs::group_offsets)
      .def_readwrite("offsets_are_int64", &GemmArgs::offsets_are_int64)
      .def_readwrite("num_groups", &GemmArgs::num_groups)
      .def_readwrite("K", &GemmArgs::K)
      .def_readwrite("N", &GemmArgs::N)
      .def_readwrite("activation", &GemmArgs::activation)
      .def_readwrite("up_offset", &GemmArgs::up_offset)
      .def_readwrite("scatter_index", &GemmArgs::scatter_index)
      .def_readwrite("scatter_is_int64", &GemmArgs::scatter_is_int64)
      .def_readwrite("row_weight", &GemmArgs::row_weight)
      .def_readwrite("b_scale", &GemmArgs::b_scale)
      .def_readwrite("scale_stride_e", &GemmArgs::scale_stride_e)
      .def_readwrite("scale_stride_n", &GemmArgs::scale_stride_n)
      .def_readwrite("scale_stride_k", &GemmArgs::scale_stride_k)
      .def_readwrite("scale_block_n", &GemmArgs::scale_block_n)
      .def_readwrite("scale_block_k", &GemmArgs::scale_block_k)
      .def_readwrite("b_zero", &GemmArgs::b_zero)
      .def_readwrite("zero_stride_e", &GemmArgs::zero_stride_e)
      .def_readwrite("zero_stride_n", &GemmArgs::zero_stride_n)
      .def_readwrite("zero_stride_k", &GemmArgs::zero_stride_k)
      .def_readwrite("a_scale", &GemmArgs::a_scale)
      .def_readwrite("tile_m", &GemmArgs::tile_m)
      .def_readwrite("tile_n", &GemmArgs::tile_n)
      .def_readwrite("num_workers", &GemmArgs::num_workers)
      .def_readwrite("engine", &GemmArgs::engine)
      .def_readwrite("calling_thread", &GemmArgs::calling_thread)
      .def_readwrite("variants_for", &GemmArgs::variants_for);

  py::class_<moe_xpu::WgradArgs>(m, "WgradArgs")
      .def(py::init<>())
      .def_readwrite("queue", &moe_xpu::WgradArgs::queue)
      .def_readwrite("dtype", &moe_xpu::WgradArgs::dtype)
      .def_readwrite("out_dtype", &moe_xpu::WgradArgs::out_dtype)
      .def_readwrite("a", &moe_xpu::WgradArgs::a)
      .def_readwrite("a_row_stride", &moe_xpu::WgradArgs::a_row_stride)
      .def_readwrite("a_rows", &moe_xpu::WgradArgs::a_rows)
      .def_readwrite("gather_index", &moe_xpu::WgradArgs::gather_index)
      .def_readwrite("gather_is_int64", &moe_xpu::WgradArgs::gather_is_int64)
      .def_readwrite("dy", &moe_xpu::WgradArgs::dy)
      .def_readwrite("dy_row_stride", &moe_xpu::WgradArgs::dy_row_stride)
      .def_readwrite("dy_rows", &moe_xpu::WgradArgs::dy_rows)
      .def_readwrite("group_offsets", &moe_xpu::WgradArgs::group_offsets)
      .def_readwrite("offsets_are_int64", &moe_xpu::WgradArgs::offsets_are_int64)
      .def_readwrite("num_groups", &moe_xpu::WgradArgs::num_groups)
      .def_readwrite("K", &moe_xpu::WgradArgs::K)
      .def_readwrite("N", &moe_xpu::WgradArgs::N)
      .def_readwrite("out", &moe_xpu::WgradArgs::out)
      .def_readwrite("out_stride_e", &moe_xpu::WgradArgs::out_stride_e)
      .def_readwrite("out_stride_k", &moe_xpu::WgradArgs::out_stride_k)
      .def_readwrite("out_stride_n", &moe_xpu::WgradArgs::out_stride_n)
      .def_readwrite("num_workers", &moe_xpu::WgradArgs::num_workers)
      .def_readwrite("engine", &moe_xpu::WgradArgs::engine)
      .def_readwrite("calling_thread", &moe_xpu::WgradArgs::calling_thread)
      .def_readwrite("variants_for", &moe_xpu::WgradArgs::variants_for);

  py::class_<moe_xpu::LaunchPlan>(m, "LaunchPlan")
      .def_readonly("kernel_name", &moe_xpu::LaunchPlan::kernel_name)
      .def_readonly("tile_m", &moe_xpu::LaunchPlan::tile_m)
      .def_readonly("tile_n", &moe_xpu::LaunchPlan::tile_n)
      .def_readonly("num_workers", &moe_xpu::LaunchPlan::num_workers)
      .def_readonly("work_group_size", &moe_xpu::LaunchPlan::work_group_size)
      .def_readonly("sub_group_size", &moe_xpu::LaunchPlan::sub_group_size)
      .def_readonly("widen_a", &moe_xpu::LaunchPlan::widen_a)
      .def_readonly("matrix_engine", &moe_xpu::LaunchPlan::matrix_engine)
      .def_readonly("scratch_bytes", &moe_xpu::LaunchPlan::scratch_bytes)
      .def_readonly("calling_thread", &moe_xpu::LaunchPlan::calling_thread);

  py::class_<moe_xpu::DeviceInfo>(m, "DeviceInfo")
      .def_readonly("name", &moe_xpu::DeviceInfo::name)
      .def_readonly("backend", &moe_xpu::DeviceInfo::backend)
      .def_readonly("driver_version", &moe_xpu::DeviceInfo::driver_version)
      .def_readonly("compute_units", &moe_xpu::DeviceInfo::compute_units)
      .def_readonly("sub_group_sizes", &moe_xpu::DeviceInfo::sub_group_sizes)
      .def_readonly("max_work_group_size", &moe_xpu::DeviceInfo::max_work_group_size)
      .def_readonly("local_mem_size", &moe_xpu::DeviceInfo::local_mem_size)
      .def_readonly("is_cpu", &moe_xpu::DeviceInfo::is_cpu)
      .def_readonly("matrix_engine", &moe_xpu::DeviceInfo::matrix_engine)
      .def_readonly("matrix_engine_int8", &moe_xpu::DeviceInfo::matrix_engine_int8);

  py::class_<moe_xpu::KernelReport>(m, "KernelReport")
      .def_readonly("name", &moe_xpu::KernelReport::name)
      .def_readonly("expected_sub_group_size", &moe_xpu::KernelReport::expected_sub_group_size)
      .def_readonly("required_sub_group_size", &moe_xpu::KernelReport::required_sub_group_size)
      .def_readonly("compiled_sub_group_size", &moe_xpu::KernelReport::compiled_sub_group_size)
      .def_readonly("max_work_group_size", &moe_xpu::KernelReport::max_work_group_size)
      .def_readonly("local_memory_bytes", &moe_xpu::KernelReport::local_memory_bytes);

  // The GIL is released while kernels build and run so other Python threads keep going.
  m.def("moe_gemm", &moe_xpu::moe_gemm, py::arg("args"), py::call_guard<py::gil_scoped_release>());
  // A launch planned once per call metadata (moe_xpu/ops.py and fused.py keep one per metadata):
  // each call hands over its queue and addresses, which spares a repeated call building the argument
  // struct in Python and the launcher re-planning it.
  py::class_<moe_xpu::PreparedGemm>(m, "PreparedGemm")
      .def(py::init<const GemmArgs&>(), py::arg("args"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("plan", &moe_xpu::PreparedGemm::plan)
      .def("launch", &moe_xpu::PreparedGemm::launch, py::arg("queue"), py::arg("a"), py::arg("b"),
           py::arg("group_offsets"), py::arg("gather_index"), py::arg("bias"), py::arg("out"),
           py::arg("scatter_index") = 0, py::arg("row_weight") = 0, py::arg("b_scale") = 0, py::arg("b_zero") = 0,
           py::arg("a_scale") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("native_cpu_launches", &moe_xpu::native_cpu_launches);
  m.def("launch_empty", &moe_xpu::launch_empty, py::arg("queue") = 0, py::arg("calling_thread") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("parked_openmp_library", &moe_xpu::parked_openmp_library);
  m.def("bf16_dot_state", [] { return moe_xpu::dot_state("bf16"); });
  m.def("int8_dot_state", [] { return moe_xpu::dot_state("int8"); });
  m.def("nibble_dot_state", [] { return moe_xpu::dot_state("nibble"); });
  m.def("fma_dot_state", [] { return moe_xpu::dot_state("fma"); });
  m.def("sort_tokens_on_host", &moe_xpu::sort_tokens_on_host, py::arg("topk_ids"), py::arg("ids_are_int64"),
        py::arg("pairs"), py::arg("k"), py::arg("num_experts"), py::arg("gather_index"), py::arg("group_offsets"),
        py::arg("scatter_index"));
  m.def("quantize_rows_on_host", &moe_xpu::quantize_rows_on_host, py::arg("x"), py::arg("dtype"), py::arg("rows"),
        py::arg("K"), py::arg("row_stride"), py::arg("q"), py::arg("scale"));
  m.def("moe_gemm_wgrad", &moe_xpu::moe_gemm_wgrad, py::arg("args"), py::call_guard<py::gil_scoped_release>());
  m.def("plan_gemm", &moe_xpu::plan_gemm, py::arg("args"));
  m.def("plan_wgrad", &moe_xpu::plan_wgrad, py::arg("args"));
  m.def("plan_gemm_on_gpu", &moe_xpu::plan_gemm_on_gpu, py::arg("args"), py::arg("target"));
  m.def("tile_shapes", &moe_xpu::tile_shapes, py::arg("k_lanes"), py::arg("gated") = false,
        py::arg("queue") = 0, py::arg("variants_for") = "", py::arg("dtype") = DType::float32);
  m.def("device_info", &moe_xpu::device_info, py::arg("queue") = 0);
  m.def("cpu_device_available", &moe_xpu::cpu_device_available);
  m.def("warm_up", &moe_xpu::warm_up, py::arg("queue"), py::arg("dtype"), py::arg("out_dtype"),
        py::arg("variants_for") = "", py::call_guard<py::gil_scoped_release>());
  m.def("kernel_report", &moe_xpu::kernel_report, py::arg("queue"), py::arg("dtype"),
        py::arg("out_dtype"), py::arg("variants_for") = "", py::call_guard<py::gil_scoped_release>());
  m.def("spirv_modules", [](const std::string& variants_for, DType dtype, DType out_dtype) {
        std::vector<std::string> modules;
        {
          py::gil_scoped_release release;
          modules = moe_xpu::spirv_modules(variants_for, dtype, out_dtype);
        }
        py::list out;
        for (const std::string& m : modules) out.append(py::bytes(m));
        return out;
      }, py::arg("variants_for"), py::arg("dtype"), py::arg("out_dtype"));
  m.def("bundle_kernel_names", &moe_xpu::bundle_kernel_names, py::arg("queue"), py::arg("variants_for"),
        py::arg("dtype"), py::arg("out_dtype"));
  m.def("gpu_targets", &moe_xpu::gpu_targets);
  // For tests of the GPU path without a GPU: which engine tiles a list of reported matrix
  // combinations (tuples max_m, max_n, max_k, m, n, k, atype, btype, ctype) turns on, as tuples
  // (m, n, k, sub-group size, fp16, int8).
  m.def("shapes_from_combinations", [](const std::vector<std::tuple<std::size_t, std::size_t, std::size_t, std::size_t,
                                                                    std::size_t, std::size_t, std::string, std::string,
                                                                    std::string>>& combos,
                                       const std::vector<std::size_t>& sub_group_sizes) {
        std::vector<moe_xpu::MatrixCombination> list;
        for (const auto& [mm, mn, mk, m_, n_, k_, a, b_, c] : combos)
          list.push_back(moe_xpu::MatrixCombination{mm, mn, mk, m_, n_, k_, a, b_, c});
        py::list out;
        for (const auto& s : moe_xpu::shapes_from_combinations(list, moe_xpu::engine_tiles(), sub_group_sizes))
          out.append(py::make_tuple(s.m, s.n, s.k, s.sub_group_size, s.fp16, s.int8));
        return out;
      }, py::arg("combinations"), py::arg("sub_group_sizes"));
  m.def("gpu_description", [](const std::string& target) { return description_dict(moe_xpu::gpu_description(target)); },
        py::arg("target"));
  m.def("device_description", [](std::uintptr_t queue) { return description_dict(moe_xpu::device_description(queue)); },
        py::arg("queue") = 0);
  m.def("kernel_files", &moe_xpu::kernel_files);
}

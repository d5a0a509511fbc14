#include "host_checks.hpp"

#include <string>
#include <vector>

namespace moe_xpu {
namespace {

std::int64_t read_index(std::uintptr_t base, bool is_int64, std::int64_t i) {
  return is_int64 ? reinterpret_cast<const std::int64_t*>(base)[i]
                  : std::int64_t(reinterpret_cast<const std::int32_t*>(base)[i]);
}

[[noreturn]] void fail(const std::string& message) { throw ArgumentError(message); }

}  // namespace

void check_host_values(const GemmArgs& args) {
  const std::int64_t available = args.out_rows;  // rows of A, or entries of gather_index
  std::int64_t last = 0;
  for (std::int64_t g = 0; g < args.num_groups; ++g) {
    const std::int64_t end = read_index(args.group_offsets, args.offsets_are_int64, g);
    if (g == 0 && end < 0)
      fail("group_offsets must be non-negative, got group_offsets[0] = " + std::to_string(end));
    if (end < last)
      fail("group_offsets must be non-decreasing (cumulative end offsets), but group_offsets[" +
           std::to_string(g) + "] = " + std::to_string(end) + " < group_offsets[" + std::to_string(g - 1) +
           "] = " + std::to_string(last));
    last = end;
  }
  if (args.gather_index == 0) {
    if (last > available)
      fail("group_offsets[-1] = " + std::to_string(last) + " exceeds the " + std::to_string(available) +
           " rows of a");
    return;
  }
  if (args.gather_matches_offsets ? last != available : last > available)
    fail("gather_index must have group_offsets[-1] = " + std::to_string(last) + " entries, got " +
         std::to_string(available));
  for (std::int64_t i = 0; i < available; ++i) {
    const std::int64_t row = read_index(args.gather_index, args.gather_is_int64, i);
    if (row < 0 || row >= args.a_rows)
      fail("gather_index values must lie in [0, " + std::to_string(args.a_rows) + ") (rows of a), found " +
           std::to_string(row));
  }
}

void sort_tokens_on_host(std::uintptr_t topk_ids, bool ids_are_int64, std::int64_t pairs, std::int64_t k,
                         std::int64_t num_experts, std::uintptr_t gather_index, std::uintptr_t group_offsets,
                         std::uintptr_t scatter_index) {
  // Counting sort: key num_experts for the sentinel, so sentinel pairs land past the last group.
  std::vector<std::int64_t> next(std::size_t(num_experts) + 1, 0);
  for (std::int64_t p = 0; p < pairs; ++p) {
    const std::int64_t id = read_index(topk_ids, ids_are_int64, p);
    if (id == -1) {
      ++next[std::size_t(num_experts)];
    } else if (id < 0 || id >= num_experts) {
      fail("topk_ids values must lie in [0, " + std::to_string(num_experts) +
           ") or be -1 (expert elsewhere), found " + std::to_string(id));
    } else {
      ++next[std::size_t(id)];
    }
  }
  auto* offsets = reinterpret_cast<std::int32_t*>(group_offsets);
  std::int64_t start = 0;
  for (std::int64_t e = 0; e <= num_experts; ++e) {
    const std::int64_t count = next[std::size_t(e)];
    next[std::size_t(e)] = start;
    start += count;
    if (e < num_experts) offsets[e] = std::int32_t(start);
  }
  auto* gather = reinterpret_cast<std::int64_t*>(gather_index);
  auto* scatter = reinterpret_cast<std::int64_t*>(scatter_index);
  for (std::int64_t p = 0; p < pairs; ++p) {
    const std::int64_t id = read_index(topk_ids, ids_are_int64, p);
    const std::int64_t slot = next[std::size_t(id == -1 ? num_experts : id)]++;
    gather[slot] = p / k;
    scatter[slot] = p;
  }
}

}  // namespace moe_xpu

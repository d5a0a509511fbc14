#include "host_checks.hpp"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace moe_xpu {
namespace {

std::int64_t read_index(std::uintptr_t base, bool is_int64, std::int64_t i) {
  return is_int64 ? reinterpret_cast<const std::int64_t*>(base)[i]
                  : std::int64_t(reinterpret_cast<const std::int32_t*>(base)[i]);
}

[[noreturn]] void fail(const std::string& message) { throw ArgumentError(message); }

float float_bits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// An IEEE half's value (exact in float).
float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const int exponent = (h >> 10) & 0x1f;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return float_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return float_bits(sign | (std::uint32_t(exponent + 112) << 23) | (mantissa << 13));
  const float value = std::ldexp(float(mantissa), -24);  // subnormal or zero
  return sign ? -value : value;
}

// Written so that g++ vectorizes both passes with the baseline x86-64 instructions: the maximum
// over the bit patterns of |v| (an infinity's and a NaN's are above every finite one's), and on
// finite rows the rounding by adding and subtracting 1.5 * 2^23, which rounds half to even as
// nearbyint does for |v| <= 2^22 (the quotients are within 127 (1 + 2^-23): no clamp either).
template <typename Load>
void quantize_rows(Load load, std::int64_t rows, std::int64_t K, std::int64_t row_stride, std::int8_t* q,
                   float* scale) {
  constexpr float kRound = 12582912.0f;
  std::vector<float> row(static_cast<std::size_t>(K));
  float* v = row.data();
  for (std::int64_t r = 0; r < rows; ++r) {
    std::uint32_t max_bits = 0;
    for (std::int64_t k = 0; k < K; ++k) {
      v[k] = load(r * row_stride + k);
      std::uint32_t bits;
      std::memcpy(&bits, &v[k], sizeof bits);
      bits &= 0x7fffffffu;
      max_bits = bits > max_bits ? bits : max_bits;
    }
    const float s = max_bits > 0x7f800000u ? std::nanf("") : float_bits(max_bits) / 127.0f;
    const float safe = s > 0.0f ? s : 1.0f;
    scale[r] = s;
    std::int8_t* out = q + r * K;
    if (max_bits < 0x7f800000u) {
      for (std::int64_t k = 0; k < K; ++k) out[k] = std::int8_t(std::int32_t((v[k] / safe + kRound) - kRound));
      continue;
    }
    for (std::int64_t k = 0; k < K; ++k) {
      float x = std::nearbyint(v[k] / safe);
      x = x < -127.0f ? -127.0f : x > 127.0f ? 127.0f : x;
      out[k] = std::isnan(x) ? std::int8_t(0) : std::int8_t(x);
    }
  }
}

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

void quantize_rows_on_host(std::uintptr_t x, DType dtype, std::int64_t rows, std::int64_t K, std::int64_t row_stride,
                           std::uintptr_t q, std::uintptr_t scale) {
  auto* out = reinterpret_cast<std::int8_t*>(q);
  auto* scales = reinterpret_cast<float*>(scale);
  switch (dtype) {
    case DType::float32: {
      const auto* v = reinterpret_cast<const float*>(x);
      return quantize_rows([v](std::int64_t i) { return v[i]; }, rows, K, row_stride, out, scales);
    }
    case DType::bfloat16: {
      const auto* v = reinterpret_cast<const std::uint16_t*>(x);
      return quantize_rows([v](std::int64_t i) { return float_bits(std::uint32_t(v[i]) << 16); }, rows, K,
                           row_stride, out, scales);
    }
    case DType::float16: {
      const auto* v = reinterpret_cast<const std::uint16_t*>(x);
      return quantize_rows([v](std::int64_t i) { return half_to_float(v[i]); }, rows, K, row_stride, out, scales);
    }
    default: break;
  }
  fail("x must be float32, bfloat16 or float16");
}

}  // namespace moe_xpu

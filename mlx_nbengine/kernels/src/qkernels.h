// Row kernels of the quantized matrix-vector product, one set per instruction set.
//
// The weights are MLX's affine layout (what mx.quantize writes): row n of W holds K values
// packed little-endian into uint32 words (element i of a word at bits [i*bits, (i+1)*bits)),
// and group g of a row dequantizes as scale[n, g] * q + bias[n, g].

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mnb {

enum class ScaleType : int { f32 = 0, f16 = 1, bf16 = 2 };

enum class Isa : int { portable = 0, avx2 = 1, avx512 = 2 };

struct QJob {
  const float* x; // M x K, row-major
  const uint8_t* w; // N rows of K * bits / 8 bytes
  const void* scales; // N x K / group
  const void* biases; // N x K / group
  float* out; // M x N, row-major
  int M, K, N, group, bits;
  ScaleType scale_type;
  // The vectorized sets read x as int16 (`QActivations`); the portable set reads `x`.
  const int16_t* xq = nullptr; // M x K
  const float* xscale = nullptr; // M x padded_groups: x ~ xq * xscale within a group
  const float* xsum = nullptr; // M x padded_groups: the float sum of x over a group
  int padded_groups = 0; // K / group rounded up to 16
};

// x as the vectorized sets read it. Each group of each row is scaled to int16 by its own
// largest magnitude (x = xq * xscale + an error of at most xscale / 2, 2^-16 of the group's
// largest value), so the products are integer multiply-adds of 16-bit lanes:
//   sum_k (s q_k + b) x_k = s * xscale * sum_k q_k xq_k + b * sum_k x_k   (per group)
// the bias term exact in float. For 4-bit weights each 32 values of a row are stored even
// elements first, then odd ones: the order the packed nibbles unpack in.
struct QActivations {
  std::vector<int16_t> xq;
  std::vector<float> xscale, xsum;
  void prepare(QJob& job);
};

// Computes out[:, n0:n1]. The *_rows functions give nullptr where a set has no kernel for
// the job (or was not built: avx2/avx512 off x86-64).
using RowsFn = void (*)(const QJob& job, int n0, int n1);

RowsFn portable_rows(const QJob& job);
RowsFn avx2_rows(const QJob& job);
RowsFn avx512_rows(const QJob& job);

bool cpu_has_avx2();
bool cpu_has_avx512();

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else { // subnormal: normalize
      int e = -1;
      do {
        mant <<= 1;
        ++e;
      } while ((mant & 0x400) == 0);
      bits = sign | uint32_t(127 - 15 - e) << 23 | (mant & 0x3FF) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// One group of `n` values of x rounded to integers of at most `levels` (32767: int16, as the
// vectorized sets read it, see QActivations; 127: int8, see round_group8):
// q[i] = round(x[i] * levels / largest) in order, its scale (largest / levels) and its float
// sum. All zero: q stays 0 and the scale is 0. Not finite: q stays 0 and the scale is the
// largest magnitude, which lets the NaN or inf through the products.
inline void round_group(const float* x, int n, int16_t* q, float& scale, float& sum,
                        float levels = 32767.0f) {
  float largest = 0.0f, s = 0.0f;
  for (int i = 0; i < n; ++i) {
    largest = std::max(largest, std::fabs(x[i]));
    s += x[i];
  }
  sum = s;
  if (largest == 0.0f || !std::isfinite(largest)) {
    scale = largest == 0.0f ? 0.0f : largest;
    std::fill(q, q + n, int16_t(0));
    return;
  }
  scale = largest / levels;
  const float to_int = levels / largest;
  for (int i = 0; i < n; ++i) {
    q[i] = int16_t(std::lrint(x[i] * to_int));
  }
}

// The int8 rounding (levels 127) of one group, with the sum of the values it rounds to
// (scale * the integers' exact sum) in place of x's: the bias term then multiplies the same
// x as the weights' codes do, so a group's error is sum_k w_k (xq_k xscale - x_k) with w
// centred on zero, not s q_k with q up to 255 (twice the error of int8 x, measured).
inline void round_group8(const float* x, int n, int16_t* q, float& scale, float& sum) {
  round_group(x, n, q, scale, sum, 127.0f);
  if (scale == 0.0f || !std::isfinite(sum)) {
    return;
  }
  int32_t total = 0;
  for (int i = 0; i < n; ++i) {
    total += q[i];
  }
  sum = scale * float(total);
}

// Groups a row may have: each row's scales and biases are widened into a stack buffer.
constexpr int kMaxGroups = 4096;

inline float scale_at(const void* p, ScaleType t, int64_t i) {
  switch (t) {
    case ScaleType::f32:
      return static_cast<const float*>(p)[i];
    case ScaleType::f16:
      return half_to_float(static_cast<const uint16_t*>(p)[i]);
    default: {
      uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
      float f;
      __builtin_memcpy(&f, &bits, 4);
      return f;
    }
  }
}

} // namespace mnb

namespace mnb {

// Row n's scales and biases as float32.
inline void widen_row(const QJob& job, int n, float* s, float* b) {
  const int G = job.K / job.group;
  const int64_t base = int64_t(n) * G;
  for (int g = 0; g < G; ++g) {
    s[g] = scale_at(job.scales, job.scale_type, base + g);
    b[g] = scale_at(job.biases, job.scale_type, base + g);
  }
}

} // namespace mnb

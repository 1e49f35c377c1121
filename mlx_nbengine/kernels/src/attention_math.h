// The scalar forms of the softmax's functions, shared by every kernel set (the vectorized
// sets use the same constants, so all sets agree to float rounding).
//
// exp(x), x <= 0: x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2, ln2 split in two
// (Cody-Waite) so r is exact to float rounding; exp(r) by its Taylor polynomial of degree 7
// (truncation below 6e-9 relative on |r| <= ln2/2, under float32's 6e-8 rounding step);
// 2^n put into the exponent bits. x < -87.3 (beyond float32's normal range) gives 0. Its
// error, measured against float64 exp over [-87, 0], is stated in tests/test_attention_kernel.py.
//
// tanh (the soft-cap): z P(z^2) / Q(z^2) with the degree-4 fit of models/cpu_math.py, for
// |z| <= 9 (beyond it float32 tanh is +-1); error <= 3.2e-7.

#pragma once

#include <cstdint>
#include <cstring>

namespace mnb::attn {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f; // few mantissa bits: n * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpMin = -87.3f;
// 1/k! for k = 7 down to 0.
constexpr float kExpC[8] = {
    1.98412698e-4f, 1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f,
    1.66666667e-1f, 0.5f, 1.0f, 1.0f};

constexpr float kTanhLimit = 9.0f;
constexpr float kTanhP[5] = {
    0.9999999064111154f, 0.13373193403958475f, 0.0034865765808515903f,
    2.0471735757692857e-05f, 1.3184082163685872e-08f};
constexpr float kTanhQ[5] = {
    1.0f, 0.46706490278360036f, 0.025841959527310217f, 0.0003271376361793971f,
    7.702607488883779e-07f};

static inline float exp_scalar(float x) {
  if (!(x >= kExpMin)) { // also -inf and NaN-free inputs below the range
    return 0.0f;
  }
  const float n = __builtin_rintf(x * kLog2e);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpC[0];
  for (int i = 1; i < 8; ++i) {
    p = p * r + kExpC[i];
  }
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

static inline float tanh_scalar(float z) {
  z = z < -kTanhLimit ? -kTanhLimit : (z > kTanhLimit ? kTanhLimit : z);
  const float t = z * z;
  float p = kTanhP[4], q = kTanhQ[4];
  for (int i = 3; i >= 0; --i) {
    p = p * t + kTanhP[i];
    q = q * t + kTanhQ[i];
  }
  const float y = z * p / q;
  return y < -1.0f ? -1.0f : (y > 1.0f ? 1.0f : y);
}

} // namespace mnb::attn

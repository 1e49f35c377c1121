// The portable softmax row kernel: plain C++, built for the compiler's baseline target.

#include <cmath>
#include <limits>

#include "attention.h"
#include "attention_math.h"

namespace mnb {
namespace {

void rows(const SoftmaxTile& t, int r0, int r1) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const float inv_cap = t.softcap != 0.0f ? 1.0f / t.softcap : 0.0f;
  for (int r = r0; r < r1; ++r) {
    float* s = t.s + int64_t(r) * t.lds;
    const int lo = t.lo[r], hi = t.hi[r];
    const uint8_t* mask = t.mask != nullptr ? t.mask[r] : nullptr;
    float mx = ninf;
    for (int j = lo; j < hi; ++j) {
      float x = s[j];
      if (t.softcap != 0.0f) {
        x = t.softcap * attn::tanh_scalar(x * inv_cap);
      }
      if (mask != nullptr && mask[j] == 0) {
        x = ninf;
      }
      s[j] = x;
      mx = x > mx ? x : mx;
    }
    for (int j = 0; j < lo; ++j) {
      s[j] = 0.0f;
    }
    for (int j = hi > lo ? hi : lo; j < t.tk; ++j) {
      s[j] = 0.0f;
    }
    if (mx == ninf) { // nothing visible in this tile
      for (int j = lo; j < hi; ++j) {
        s[j] = 0.0f;
      }
      continue;
    }
    const float m_old = t.m[r];
    const float m_new = m_old > mx ? m_old : mx;
    const float alpha = m_old == ninf ? 0.0f : attn::exp_scalar(m_old - m_new);
    float sum = 0.0f;
    for (int j = lo; j < hi; ++j) {
      const float p = attn::exp_scalar(s[j] - m_new);
      s[j] = p;
      sum += p;
    }
    t.m[r] = m_new;
    t.l[r] = t.l[r] * alpha + sum;
    if (alpha != 1.0f) {
      float* o = t.o + int64_t(r) * t.ldo;
      for (int d = 0; d < t.dv; ++d) {
        o[d] *= alpha;
      }
    }
  }
}

void scores(const float* q, int R, int D, const float* k, int64_t ks, int tk, float* s, int lds) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < tk; ++j) {
      float a = 0.0f;
      for (int d = 0; d < D; ++d) {
        a += q[int64_t(r) * D + d] * k[j * ks + d];
      }
      s[int64_t(r) * lds + j] = a;
    }
  }
}

void values(
    const float* p, int R, int lds, const float* v, int64_t vs, int tk, float* o, int ldo, int dv) {
  for (int r = 0; r < R; ++r) {
    float* out = o + int64_t(r) * ldo;
    for (int j = 0; j < tk; ++j) {
      const float pr = p[int64_t(r) * lds + j];
      for (int d = 0; d < dv; ++d) {
        out[d] += pr * v[j * vs + d];
      }
    }
  }
}

} // namespace

SoftmaxFn softmax_portable() {
  return rows;
}

SmallProducts small_products_portable() {
  return {scores, values};
}

float exp_poly(float x) {
  return attn::exp_scalar(x);
}

} // namespace mnb

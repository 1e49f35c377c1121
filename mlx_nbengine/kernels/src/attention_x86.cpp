// The x86-64 softmax row kernels: AVX2 + FMA (8 floats a vector) and AVX-512F (16).
//
// Each function carries its own target attribute, so the file builds for the compiler's
// baseline and the CPU that runs it decides (cpu_has_*). Per row of a key tile: soft-cap and
// mask the visible scores and take their max (one pass), then exp(score - running max) and
// its sum (a second pass, in place: the probabilities the second product reads), and the
// output row rescaled where the running max grew. exp and tanh are attention_math.h's, lane
// for lane; AVX2's last partial vector runs the scalar forms.

#include <algorithm>
#include <limits>

#include "attention.h"
#include "attention_math.h"

#if defined(__x86_64__)

#include <immintrin.h>

#define MNB_AVX2 __attribute__((target("avx2,fma")))
#define MNB_AVX512 __attribute__((target("avx512f,avx2,fma")))

namespace mnb {
namespace {

constexpr float kNinf = -std::numeric_limits<float>::infinity();

static inline void zero_outside(float* s, int lo, int hi, int tk) {
  for (int j = 0; j < lo && j < tk; ++j) {
    s[j] = 0.0f;
  }
  for (int j = hi > lo ? hi : lo; j < tk; ++j) {
    s[j] = 0.0f;
  }
}

// --- AVX2 -------------------------------------------------------------------------------

MNB_AVX2 static inline __m256 exp8(__m256 x) {
  const __m256 valid = _mm256_cmp_ps(x, _mm256_set1_ps(attn::kExpMin), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(
      _mm256_mul_ps(x, _mm256_set1_ps(attn::kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(attn::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(attn::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(attn::kExpC[0]);
  for (int i = 1; i < 8; ++i) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(attn::kExpC[i]));
  }
  // Lanes out of range may hold any n: their result is masked away.
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_and_ps(n, valid)), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), valid);
}

MNB_AVX2 static inline __m256 tanh8(__m256 z) {
  const __m256 lim = _mm256_set1_ps(attn::kTanhLimit);
  z = _mm256_min_ps(_mm256_max_ps(z, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
  const __m256 t = _mm256_mul_ps(z, z);
  __m256 p = _mm256_set1_ps(attn::kTanhP[4]), q = _mm256_set1_ps(attn::kTanhQ[4]);
  for (int i = 3; i >= 0; --i) {
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(attn::kTanhP[i]));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(attn::kTanhQ[i]));
  }
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 y = _mm256_div_ps(_mm256_mul_ps(z, p), q);
  return _mm256_min_ps(_mm256_max_ps(y, _mm256_sub_ps(_mm256_setzero_ps(), one)), one);
}

MNB_AVX2 static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

MNB_AVX2 static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

MNB_AVX2 void rows_avx2(const SoftmaxTile& t, int r0, int r1) {
  const float cap = t.softcap, inv_cap = cap != 0.0f ? 1.0f / cap : 0.0f;
  const __m256 vcap = _mm256_set1_ps(cap), vinv = _mm256_set1_ps(inv_cap);
  const __m256 ninf = _mm256_set1_ps(kNinf);
  for (int r = r0; r < r1; ++r) {
    float* s = t.s + int64_t(r) * t.lds;
    const int lo = t.lo[r], hi = t.hi[r];
    const uint8_t* mask = t.mask != nullptr ? t.mask[r] : nullptr;
    zero_outside(s, lo, hi, t.tk);
    __m256 vmax = ninf;
    int j = lo;
    for (; j + 8 <= hi; j += 8) {
      __m256 x = _mm256_loadu_ps(s + j);
      if (cap != 0.0f) {
        x = _mm256_mul_ps(vcap, tanh8(_mm256_mul_ps(x, vinv)));
      }
      if (mask != nullptr) {
        const __m256i b = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask + j)));
        const __m256 off = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()));
        x = _mm256_blendv_ps(x, ninf, off);
      }
      _mm256_storeu_ps(s + j, x);
      vmax = _mm256_max_ps(vmax, x);
    }
    float mx = hmax8(vmax);
    for (; j < hi; ++j) {
      float x = s[j];
      if (cap != 0.0f) {
        x = cap * attn::tanh_scalar(x * inv_cap);
      }
      if (mask != nullptr && mask[j] == 0) {
        x = kNinf;
      }
      s[j] = x;
      mx = x > mx ? x : mx;
    }
    if (mx == kNinf) {
      for (int i = lo; i < hi; ++i) {
        s[i] = 0.0f;
      }
      continue;
    }
    const float m_old = t.m[r];
    const float m_new = m_old > mx ? m_old : mx;
    const float alpha = m_old == kNinf ? 0.0f : attn::exp_scalar(m_old - m_new);
    const __m256 vm = _mm256_set1_ps(m_new);
    __m256 vsum = _mm256_setzero_ps();
    j = lo;
    for (; j + 8 <= hi; j += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
      _mm256_storeu_ps(s + j, p);
      vsum = _mm256_add_ps(vsum, p);
    }
    float sum = hsum8(vsum);
    for (; j < hi; ++j) {
      const float p = attn::exp_scalar(s[j] - m_new);
      s[j] = p;
      sum += p;
    }
    t.m[r] = m_new;
    t.l[r] = t.l[r] * alpha + sum;
    if (alpha != 1.0f) {
      float* o = t.o + int64_t(r) * t.ldo;
      const __m256 va = _mm256_set1_ps(alpha);
      int d = 0;
      for (; d + 8 <= t.dv; d += 8) {
        _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), va));
      }
      for (; d < t.dv; ++d) {
        o[d] *= alpha;
      }
    }
  }
}

// --- the products of a tile of few rows (AVX2) -------------------------------------------

// Scores of R rows against KP keys at a time (KP = 2 keeps 2R accumulators in registers).
template <int R, int KP>
MNB_AVX2 void scores_r(const float* q, int D, const float* k, int64_t ks, int tk, float* s,
                       int lds) {
  const int D8 = D & ~7;
  int j = 0;
  for (; j + KP <= tk; j += KP) {
    __m256 a[KP][R];
    for (int c = 0; c < KP; ++c) {
      for (int r = 0; r < R; ++r) {
        a[c][r] = _mm256_setzero_ps();
      }
    }
    for (int d = 0; d < D8; d += 8) {
      __m256 x[KP];
      for (int c = 0; c < KP; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(k + (j + c + 8) * ks + d), _MM_HINT_T0);
        x[c] = _mm256_loadu_ps(k + (j + c) * ks + d);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + int64_t(r) * D + d);
        for (int c = 0; c < KP; ++c) {
          a[c][r] = _mm256_fmadd_ps(qv, x[c], a[c][r]);
        }
      }
    }
    for (int c = 0; c < KP; ++c) {
      const float* kj = k + (j + c) * ks;
      for (int r = 0; r < R; ++r) {
        float t = hsum8(a[c][r]);
        for (int d = D8; d < D; ++d) {
          t += q[int64_t(r) * D + d] * kj[d];
        }
        s[int64_t(r) * lds + j + c] = t;
      }
    }
  }
  if (j < tk) { // the odd key out
    scores_r<R, 1>(q, D, k + j * ks, ks, tk - j, s + j, lds);
  }
}

// o += P V for keys in blocks of kValueBlock, so that the passes over a block's value rows
// (one per 8 C columns) read them from cache, not memory.
constexpr int kValueBlock = 64;

template <int R>
MNB_AVX2 void values_r(const float* p, int lds, const float* v, int64_t vs, int tk, float* o,
                       int ldo, int dv) {
  constexpr int C = R <= 4 ? 2 : 1; // vectors of 8 per row and pass: 2R or R accumulators
  const int dv_vec = dv / (8 * C) * (8 * C);
  for (int j0 = 0; j0 < tk; j0 += kValueBlock) {
    const int j1 = std::min(tk, j0 + kValueBlock);
    for (int d = 0; d < dv_vec; d += 8 * C) {
      __m256 acc[R][C];
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm256_loadu_ps(o + int64_t(r) * ldo + d + 8 * c);
        }
      }
      for (int j = j0; j < j1; ++j) {
        __m256 x[C];
        if (d == 0) { // the first pass over the block brings it in
          _mm_prefetch(reinterpret_cast<const char*>(v + (j + 8) * vs), _MM_HINT_T0);
        }
        for (int c = 0; c < C; ++c) {
          x[c] = _mm256_loadu_ps(v + j * vs + d + 8 * c);
        }
        for (int r = 0; r < R; ++r) {
          const __m256 pr = _mm256_broadcast_ss(p + int64_t(r) * lds + j);
          for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_fmadd_ps(pr, x[c], acc[r][c]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
          _mm256_storeu_ps(o + int64_t(r) * ldo + d + 8 * c, acc[r][c]);
        }
      }
    }
  }
  for (int d = dv_vec; d < dv; ++d) { // a width that is not a multiple of the pass
    for (int r = 0; r < R; ++r) {
      float a = o[int64_t(r) * ldo + d];
      for (int j = 0; j < tk; ++j) {
        a += p[int64_t(r) * lds + j] * v[j * vs + d];
      }
      o[int64_t(r) * ldo + d] = a;
    }
  }
}

#define MNB_BY_ROWS(call)  \
  switch (R) {             \
    case 1: call(1); break; \
    case 2: call(2); break; \
    case 3: call(3); break; \
    case 4: call(4); break; \
    case 5: call(5); break; \
    case 6: call(6); break; \
    case 7: call(7); break; \
    default: call(8); break; \
  }

void small_scores(const float* q, int R, int D, const float* k, int64_t ks, int tk, float* s,
                  int lds) {
#define MNB_CALL(n) scores_r<n, (n <= 4 ? 2 : 1)>(q, D, k, ks, tk, s, lds)
  MNB_BY_ROWS(MNB_CALL)
#undef MNB_CALL
}

void small_values(const float* p, int R, int lds, const float* v, int64_t vs, int tk, float* o,
                  int ldo, int dv) {
#define MNB_CALL(n) values_r<n>(p, lds, v, vs, tk, o, ldo, dv)
  MNB_BY_ROWS(MNB_CALL)
#undef MNB_CALL
}

#undef MNB_BY_ROWS

// --- AVX-512 ----------------------------------------------------------------------------

MNB_AVX512 static inline __m512 exp16(__m512 x) {
  const __mmask16 valid = _mm512_cmp_ps_mask(x, _mm512_set1_ps(attn::kExpMin), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(attn::kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(attn::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(attn::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(attn::kExpC[0]);
  for (int i = 1; i < 8; ++i) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(attn::kExpC[i]));
  }
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_maskz_mov_ps(valid, n)), _mm512_set1_epi32(127)),
      23);
  return _mm512_maskz_mul_ps(valid, p, _mm512_castsi512_ps(e));
}

MNB_AVX512 static inline __m512 tanh16(__m512 z) {
  const __m512 lim = _mm512_set1_ps(attn::kTanhLimit);
  z = _mm512_min_ps(_mm512_max_ps(z, _mm512_set1_ps(-attn::kTanhLimit)), lim);
  const __m512 t = _mm512_mul_ps(z, z);
  __m512 p = _mm512_set1_ps(attn::kTanhP[4]), q = _mm512_set1_ps(attn::kTanhQ[4]);
  for (int i = 3; i >= 0; --i) {
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(attn::kTanhP[i]));
    q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(attn::kTanhQ[i]));
  }
  const __m512 y = _mm512_div_ps(_mm512_mul_ps(z, p), q);
  return _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-1.0f)), _mm512_set1_ps(1.0f));
}

MNB_AVX512 static inline __mmask16 tail_mask(int n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

MNB_AVX512 void rows_avx512(const SoftmaxTile& t, int r0, int r1) {
  const float cap = t.softcap, inv_cap = cap != 0.0f ? 1.0f / cap : 0.0f;
  const __m512 vcap = _mm512_set1_ps(cap), vinv = _mm512_set1_ps(inv_cap);
  const __m512 ninf = _mm512_set1_ps(kNinf);
  for (int r = r0; r < r1; ++r) {
    float* s = t.s + int64_t(r) * t.lds;
    const int lo = t.lo[r], hi = t.hi[r];
    const uint8_t* mask = t.mask != nullptr ? t.mask[r] : nullptr;
    zero_outside(s, lo, hi, t.tk);
    __m512 vmax = ninf;
    for (int j = lo; j < hi; j += 16) {
      const __mmask16 k = tail_mask(hi - j);
      __m512 x = _mm512_mask_loadu_ps(ninf, k, s + j);
      if (cap != 0.0f) {
        x = _mm512_mul_ps(vcap, tanh16(_mm512_mul_ps(x, vinv)));
      }
      if (mask != nullptr) {
        alignas(16) uint8_t bytes[16] = {};
        __m128i b;
        if (hi - j >= 16) {
          b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mask + j));
        } else {
          for (int i = 0; i < hi - j; ++i) {
            bytes[i] = mask[j + i];
          }
          b = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes));
        }
        const __m512i w = _mm512_cvtepu8_epi32(b);
        x = _mm512_mask_blend_ps(_mm512_test_epi32_mask(w, w), ninf, x);
      }
      _mm512_mask_storeu_ps(s + j, k, x);
      vmax = _mm512_mask_max_ps(vmax, k, vmax, x);
    }
    const float mx = _mm512_reduce_max_ps(vmax);
    if (mx == kNinf) {
      for (int i = lo; i < hi; ++i) {
        s[i] = 0.0f;
      }
      continue;
    }
    const float m_old = t.m[r];
    const float m_new = m_old > mx ? m_old : mx;
    const float alpha = m_old == kNinf ? 0.0f : attn::exp_scalar(m_old - m_new);
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int j = lo; j < hi; j += 16) {
      const __mmask16 k = tail_mask(hi - j);
      const __m512 p = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vm)));
      _mm512_mask_storeu_ps(s + j, k, p);
      vsum = _mm512_add_ps(vsum, p);
    }
    t.m[r] = m_new;
    t.l[r] = t.l[r] * alpha + _mm512_reduce_add_ps(vsum);
    if (alpha != 1.0f) {
      float* o = t.o + int64_t(r) * t.ldo;
      const __m512 va = _mm512_set1_ps(alpha);
      for (int d = 0; d < t.dv; d += 16) {
        const __mmask16 k = tail_mask(t.dv - d);
        _mm512_mask_storeu_ps(o + d, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, o + d), va));
      }
    }
  }
}

} // namespace

SoftmaxFn softmax_avx2() {
  return cpu_has_avx2() ? rows_avx2 : nullptr;
}

SoftmaxFn softmax_avx512() {
  return cpu_has_avx512() ? rows_avx512 : nullptr;
}

SmallProducts small_products_avx2() {
  return cpu_has_avx2() ? SmallProducts{small_scores, small_values} : SmallProducts{};
}

} // namespace mnb

#else // not x86-64: the portable kernel only

namespace mnb {
SoftmaxFn softmax_avx2() {
  return nullptr;
}
SoftmaxFn softmax_avx512() {
  return nullptr;
}
SmallProducts small_products_avx2() {
  return {};
}
} // namespace mnb

#endif

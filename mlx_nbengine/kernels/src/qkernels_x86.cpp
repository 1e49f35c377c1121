// The x86-64 row kernels: AVX2 (+ FMA), for the AVX2 and AVX-512 sets alike (see `pick`).
//
// Each function carries its own target attribute, so the file builds for the compiler's
// baseline and the CPU that runs it decides (cpu_has_*). The activations come as int16
// (QActivations, qkernels.h): a step widens packed weights to 16-bit lanes and multiply-adds
// them with x in pairs into int32 (vpmaddwd), so one instruction covers 16 weights; each group's int32 sums then become float under the group's weight
// scale and x scale, and the bias term is b times the group's float sum of x.

#include <cstring>

#include "qkernels.h"

#if defined(__x86_64__)

#include <immintrin.h>

#define MNB_AVX2 __attribute__((target("avx2,fma")))

namespace mnb {

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw");
}

namespace {

MNB_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Row n's scales and biases as float32, zero past the last group up to `padded_groups`. The
// kernels multiply centred weights (q - 2^(bits-1), signed), so the bias takes the centre:
// s q + b = s (q - c) + (b + c s). Centred, the products the int16 rounding of x touches are
// half as large.
inline void widen_padded(const QJob& job, int n, float* s, float* b) {
  widen_row(job, n, s, b);
  const float centre = float(1 << (job.bits - 1));
  const int G = job.K / job.group;
  for (int g = 0; g < G; ++g) {
    b[g] += centre * s[g];
  }
  for (int g = G; g < job.padded_groups; ++g) {
    s[g] = 0.0f;
    b[g] = 0.0f;
  }
}

// sum_g b[g] * xsum[g] over the padded groups (a multiple of 16).
MNB_AVX2 inline float bias_term(const float* b, const float* xsum, int padded) {
  __m256 t = _mm256_setzero_ps();
  for (int g = 0; g < padded; g += 8) {
    t = _mm256_fmadd_ps(_mm256_loadu_ps(b + g), _mm256_loadu_ps(xsum + g), t);
  }
  return hsum8(t);
}

// One group of row n against M rows of int16 x: 8 int32 partial sums per row. 8-bit: 16
// weights a step (bytes widened to 16-bit lanes); 4-bit: 32 a step (16 bytes, low nibbles
// are the even elements, high nibbles the odd ones, as QActivations stores x).
template <int BITS, int M>
MNB_AVX2 inline void group_dots(const uint8_t* wr, const int16_t* xq, int K, int k0, int group,
                                __m256i* d) {
  for (int m = 0; m < M; ++m) {
    d[m] = _mm256_setzero_si256();
  }
  if constexpr (BITS == 8) {
    for (int k = k0; k < k0 + group; k += 16) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
      // q - 128 as a signed byte is q with its top bit flipped.
      const __m256i w = _mm256_cvtepi8_epi16(_mm_xor_si128(raw, _mm_set1_epi8(char(0x80))));
      for (int m = 0; m < M; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + int64_t(m) * K + k));
        d[m] = _mm256_add_epi32(d[m], _mm256_madd_epi16(w, x));
      }
    }
  } else {
    for (int k = k0; k < k0 + group; k += 32) {
      const __m256i bytes =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k / 2)));
      const __m256i eight = _mm256_set1_epi16(8);
      const __m256i lo = _mm256_sub_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(15)), eight);
      const __m256i hi = _mm256_sub_epi16(_mm256_srli_epi16(bytes, 4), eight);
      for (int m = 0; m < M; ++m) {
        const int16_t* x = xq + int64_t(m) * K + k;
        const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
        d[m] = _mm256_add_epi32(
            d[m], _mm256_add_epi32(_mm256_madd_epi16(lo, even), _mm256_madd_epi16(hi, odd)));
      }
    }
  }
}

template <int BITS, int M>
MNB_AVX2 void rows_avx2(const QJob& job, int n0, int n1) {
  const int K = job.K, N = job.N, group = job.group, G = K / group, P = job.padded_groups;
  const int64_t row_bytes = int64_t(K) * BITS / 8;
  alignas(32) float s[kMaxGroups + 16], b[kMaxGroups + 16];
  for (int n = n0; n < n1; ++n) {
    widen_padded(job, n, s, b);
    const uint8_t* wr = job.w + n * row_bytes;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm256_setzero_ps();
    }
    for (int g = 0; g < G; ++g) {
      __m256i d[M];
      group_dots<BITS, M>(wr, job.xq, K, g * group, group, d);
      for (int m = 0; m < M; ++m) {
        const __m256 scale = _mm256_set1_ps(s[g] * job.xscale[int64_t(m) * P + g]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[m]), scale, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      job.out[int64_t(m) * N + n] = hsum8(acc[m]) + bias_term(b, job.xsum + int64_t(m) * P, P);
    }
  }
}

// The AVX-512 set runs the 256-bit kernels too: on Zen 4 (AVX-512 executed as two 256-bit
// halves) a 512-bit version of the 8-bit kernel took 23 ms for Gemma 3's 262,144 x 640 head
// against 17 ms for the 256-bit one, which already reads as fast as one core can.
template <int BITS, bool WIDE>
RowsFn pick(int M) {
#define MNB_ROWS(m) RowsFn(rows_avx2<BITS, m>)
  switch (M) {
    case 1: return MNB_ROWS(1);
    case 2: return MNB_ROWS(2);
    case 3: return MNB_ROWS(3);
    case 4: return MNB_ROWS(4);
    case 5: return MNB_ROWS(5);
    case 6: return MNB_ROWS(6);
    case 7: return MNB_ROWS(7);
    case 8: return MNB_ROWS(8);
    default: return nullptr;
  }
#undef MNB_ROWS
}

template <bool WIDE>
RowsFn choose(const QJob& job) {
  if (job.K / job.group > kMaxGroups || job.group % 32 != 0) {
    return nullptr;
  }
  if (job.bits == 8) {
    return pick<8, WIDE>(job.M);
  }
  if (job.bits == 4) {
    return pick<4, WIDE>(job.M);
  }
  return nullptr;
}

} // namespace

RowsFn avx2_rows(const QJob& job) {
  return cpu_has_avx2() ? choose<false>(job) : nullptr;
}

RowsFn avx512_rows(const QJob& job) {
  return cpu_has_avx512() ? choose<true>(job) : nullptr;
}

} // namespace mnb

#else // not x86-64: the portable kernels only

namespace mnb {
bool cpu_has_avx2() {
  return false;
}
bool cpu_has_avx512() {
  return false;
}
RowsFn avx2_rows(const QJob&) {
  return nullptr;
}
RowsFn avx512_rows(const QJob&) {
  return nullptr;
}
} // namespace mnb

#endif

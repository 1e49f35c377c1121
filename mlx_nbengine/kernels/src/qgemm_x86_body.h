// The GEMM tiles' bodies (qgemm.h), included by qgemm_x86.cpp once per set with MNB_TARGET,
// MNB_NS, MNB_LANES, MNB_NR, MNB_HALF, MNB_PER_WORD (2: int16 pairs, 4: int8 quads),
// WIDEN8/WIDEN4 and DEQ_LOAD defined, and V<lanes> (the set's vector operations, `dot` one
// word's multiply-add) declared in MNB_NS. No include guard.

namespace MNB_NS {

constexpr int kLanes = MNB_LANES;
constexpr int kNr = MNB_NR;
constexpr int kPerWord = MNB_PER_WORD;

// widen_row (qkernels.h) with float16 and bfloat16 scales and biases converted 8 at a time
// (F16C; a shift): the same values, at a tenth of the scalar conversion's cost, which had
// taken as long as the products of a tile's one block in a short step (an edit's tail).
MNB_TARGET inline void widen_scales(const QJob& job, int n, float* s, float* b) {
  if (job.scale_type == ScaleType::f32) {
    widen_row(job, n, s, b);
    return;
  }
  const int G = job.K / job.group;
  const int64_t base = int64_t(n) * G;
  const uint16_t* sp = static_cast<const uint16_t*>(job.scales) + base;
  const uint16_t* bp = static_cast<const uint16_t*>(job.biases) + base;
  const bool half = job.scale_type == ScaleType::f16;
  int g = 0;
  for (; g + 8 <= G; g += 8) {
    const __m128i sv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + g));
    const __m128i bv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + g));
    if (half) {
      _mm256_storeu_ps(s + g, _mm256_cvtph_ps(sv));
      _mm256_storeu_ps(b + g, _mm256_cvtph_ps(bv));
    } else {
      const __m256i sw = _mm256_slli_epi32(_mm256_cvtepu16_epi32(sv), 16);
      const __m256i bw = _mm256_slli_epi32(_mm256_cvtepu16_epi32(bv), 16);
      _mm256_storeu_ps(s + g, _mm256_castsi256_ps(sw));
      _mm256_storeu_ps(b + g, _mm256_castsi256_ps(bw));
    }
  }
  for (; g < G; ++g) {
    s[g] = scale_at(job.scales, job.scale_type, base + g);
    b[g] = scale_at(job.biases, job.scale_type, base + g);
  }
}

// One block of rows against a tile of columns; W: the lanes computed (kLanes, or half of them
// for a last block of few rows), the block's layout kLanes wide either way.
template <int W, typename VI, typename VF>
MNB_TARGET __attribute__((always_inline)) inline void tile_body(const GemmArgs& a) {
  VI iacc[kNr];
  VF facc[kNr];
  for (int j = 0; j < kNr; ++j) {
    facc[j] = V<W>::zerof();
  }
  for (int g = 0; g < a.groups; ++g) {
    for (int j = 0; j < kNr; ++j) {
      iacc[j] = V<W>::zeroi();
    }
    const int32_t* xg = a.xp + int64_t(g) * a.group_words * kLanes;
    const int32_t* wg = a.wt + int64_t(g) * a.group_words;
    for (int p = 0; p < a.group_words; ++p) {
      const VI xv = V<W>::loadi(xg + p * kLanes);
#pragma GCC unroll 16
      for (int j = 0; j < kNr; ++j) {
        V<W>::dot(iacc[j], xv, wg + int64_t(j) * a.wstride + p);
      }
    }
    const VF xs = V<W>::loadf(a.xs + g * kLanes);
#pragma GCC unroll 16
    for (int j = 0; j < kNr; ++j) {
      facc[j] = V<W>::fma(V<W>::cvt(iacc[j]), V<W>::mul(V<W>::set1f(a.st[j * a.groups + g]), xs),
                          facc[j]);
    }
  }
  VF bacc[kNr];
  for (int j = 0; j < kNr; ++j) {
    bacc[j] = V<W>::zerof();
  }
  for (int g = 0; g < a.groups; ++g) {
    const VF xm = V<W>::loadf(a.xm + g * kLanes);
#pragma GCC unroll 16
    for (int j = 0; j < kNr; ++j) {
      bacc[j] = V<W>::fma(V<W>::set1f(a.bt[j * a.groups + g]), xm, bacc[j]);
    }
  }
  for (int j = 0; j < kNr; ++j) {
    V<W>::storef(a.res + j * kLanes, V<W>::addf(facc[j], bacc[j]));
  }
}

MNB_TARGET void tile(const GemmArgs& a) {
  tile_body<kLanes, typename V<kLanes>::I, typename V<kLanes>::F>(a);
}

#if MNB_HALF
MNB_TARGET void tile_half(const GemmArgs& a) {
  tile_body<kLanes / 2, typename V<kLanes / 2>::I, typename V<kLanes / 2>::F>(a);
}
#endif

MNB_TARGET void widen(const QJob& job, int n0, int32_t* wt, float* st, float* bt) {
  const int K = job.K, G = K / job.group, P = K / kPerWord, S = gemm_wstride(P);
  const int64_t row_bytes = int64_t(K) * job.bits / 8;
  for (int j = 0; j < kNr; ++j) {
    const int n = n0 + j;
    int32_t* w = wt + int64_t(j) * S;
    if (n >= job.N) {
      std::memset(w, 0, sizeof(int32_t) * P);
      std::fill(st + j * G, st + (j + 1) * G, 0.0f);
      std::fill(bt + j * G, bt + (j + 1) * G, 0.0f);
      continue;
    }
    const uint8_t* row = job.w + n * row_bytes;
    if (job.bits == 8) {
      for (int k = 0; k < K; k += WIDEN8_STEP) {
        WIDEN8(row + k, w + k / kPerWord);
      }
    } else { // byte i holds elements 2i (low nibble) and 2i + 1
      for (int i = 0; i < K / 2; i += WIDEN4_STEP) {
        WIDEN4(row + i, w + i * 2 / kPerWord);
      }
    }
    widen_scales(job, n, st + j * G, bt + j * G);
  }
}

// Rows n0 .. n1 of W dequantized to float32 (row n at dst + (n - n0) * K): s * q + b.
MNB_TARGET void dequantize(const QJob& job, int n0, int n1, float* dst) {
  const int K = job.K, G = K / job.group;
  const int64_t row_bytes = int64_t(K) * job.bits / 8;
  float s[kMaxGroups], b[kMaxGroups];
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = job.w + n * row_bytes;
    float* out = dst + int64_t(n - n0) * K;
    widen_scales(job, n, s, b);
    for (int g = 0; g < G; ++g) {
      using Vec = V<kLanes>;
      const typename Vec::F sv = Vec::set1f(s[g]), bv = Vec::set1f(b[g]);
      for (int k = g * job.group; k < (g + 1) * job.group; k += kLanes) {
        Vec::storef(out + k, Vec::fma(Vec::cvt(DEQ_LOAD(row, k)), sv, bv));
      }
    }
  }
}

GemmSet set() {
  GemmSet s;
  s.lanes = kLanes;
  s.nr = kNr;
  s.tile = tile;
#if MNB_HALF
  s.tile_half = tile_half;
#endif
  s.widen = widen;
  s.dequantize = dequantize;
  return s;
}

} // namespace MNB_NS

// The x86-64 GEMM tiles (qgemm.h): AVX2 (8 rows a vector, 6 output columns a tile) and
// AVX-512 (16 rows, 12 columns), the latter with vpdpwssd where the CPU has AVX-512 VNNI,
// and there with vpdpbusd on int8 quads for a long step's int8 product.
// Each function carries its own target attribute; the CPU that runs them decides.

#include <algorithm>
#include <cstring>

#include "qgemm.h"

#if defined(__x86_64__)

#include <immintrin.h>

namespace mnb {

namespace {

bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
}

// AVX-VNNI (vpdpbusd on ymm, VEX-encoded): Intel since Alder Lake, AMD since Zen 5.
bool cpu_has_avx_vnni() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avxvnni");
}

// 4 bytes of 4-bit weights as 8 int32 lanes, each byte's low nibble first.
__attribute__((target("avx2,fma,f16c"))) inline __m256i nibbles8(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, 4);
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_set1_epi64x(
      int64_t(uint64_t(word & 0x0F0F0F0F) | uint64_t((word >> 4) & 0x0F0F0F0F) << 32)));
  // lanes 0-3: low nibbles of bytes 0-3, lanes 4-7: high ones; into element order.
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 8 bytes of 4-bit weights as 16 int32 lanes, each byte's low nibble first.
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))) inline __m512i
nibbles16(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  const __m512i bytes = _mm512_cvtepu8_epi32(
      _mm_set_epi64x(int64_t((word >> 4) & 0x0F0F0F0F0F0F0F0FULL), int64_t(word & 0x0F0F0F0F0F0F0F0FULL)));
  return _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), bytes);
}


namespace gemm2 {
template <int W>
struct V;
template <>
struct V<8> {
  using I = __m256i;
  using F = __m256;
#define T __attribute__((target("avx2,fma,f16c"), always_inline)) static inline
  T I zeroi() { return _mm256_setzero_si256(); }
  T F zerof() { return _mm256_setzero_ps(); }
  T I loadi(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  T void dot(I& acc, I a, const int32_t* w) {
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(a, _mm256_set1_epi32(*w)));
  }
  T F loadf(const float* p) { return _mm256_loadu_ps(p); }
  T void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  T F set1f(float v) { return _mm256_set1_ps(v); }
  T F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  T F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  T F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  T F addf(F a, F b) { return _mm256_add_ps(a, b); }
#undef T
};
} // namespace gemm2
#define MNB_HALF 0
#define MNB_PER_WORD 2
#define MNB_TARGET __attribute__((target("avx2,fma,f16c")))
#define MNB_NS gemm2
#define MNB_LANES 8
#define MNB_NR 6
#define WIDEN8_STEP 16
#define WIDEN8(src, dst)                                                                  \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),                                   \
                      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))))
#define WIDEN4_STEP 8
#define WIDEN4(src, dst)                                                                  \
  do {                                                                                    \
    const __m256i v =                                                                     \
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));      \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),                                 \
                        _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(15)),       \
                                        _mm256_slli_epi32(_mm256_srli_epi32(v, 4), 16))); \
  } while (0)
// 8 weights from element k of a row as int32 lanes (for 4-bit: 4 bytes, low nibble first).
#define DEQ_LOAD(row, k) (job.bits == 8 ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>((row) + (k)))) : nibbles8((row) + (k) / 2))
#include "qgemm_x86_body.h"
#undef MNB_TARGET
#undef MNB_NS
#undef MNB_PER_WORD
#undef WIDEN8_STEP
#undef WIDEN8
#undef WIDEN4_STEP
#undef WIDEN4

// AVX-VNNI's int8 product on the AVX2 set's vectors (Alder Lake and later, Zen 5): the same
// quads as gemm5q, with the VEX-encoded vpdpbusd on 8 lanes.
namespace gemm2q {
template <int W>
struct V;
template <>
struct V<8> : gemm2::V<8> {
  __attribute__((target("avx2,fma,f16c,avxvnni"), always_inline)) static inline void
  dot(I& acc, I a, const int32_t* w) {
    asm("%{vex%} vpdpbusd %1, %2, %0" : "+v"(acc) : "v"(a), "v"(_mm256_set1_epi32(*w)));
  }
};
} // namespace gemm2q
#define MNB_PER_WORD 4
#define MNB_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define MNB_NS gemm2q
#include "qgemm_x86_quads.h"
#include "qgemm_x86_body.h"
#undef MNB_TARGET
#undef MNB_NS
#undef MNB_PER_WORD
#undef DEQ_LOAD
#undef MNB_LANES
#undef MNB_NR
#undef WIDEN8_STEP
#undef WIDEN8
#undef WIDEN4_STEP
#undef WIDEN4
#define MNB_PER_WORD 2


// The AVX-512 sets' vectors: 16 lanes (zmm) and 8 (ymm, AVX-512VL: 32 registers either way),
// VNNI's in-place vpdpwssd with the weight pair broadcast by the instruction (written with
// the intrinsic, GCC 12 copies every accumulator out and back around each vpdpwssd), or
// vpmaddwd + vpaddd.
#define MNB_V512(NS, TARGET, VNNI)                                                          \
  namespace NS {                                                                            \
  template <int W>                                                                          \
  struct V;                                                                                 \
  template <>                                                                               \
  struct V<16> {                                                                            \
    using I = __m512i;                                                                      \
    using F = __m512;                                                                       \
    TARGET static I zeroi() { return _mm512_setzero_si512(); }                              \
    TARGET static F zerof() { return _mm512_setzero_ps(); }                                 \
    TARGET static I loadi(const int32_t* p) { return _mm512_loadu_si512(p); }               \
    TARGET static void dot(I& acc, I a, const int32_t* w) {                                 \
      if constexpr (VNNI) {                                                                 \
        asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*w));                  \
      } else {                                                                              \
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(a, _mm512_set1_epi32(*w)));           \
      }                                                                                     \
    }                                                                                       \
    TARGET static F loadf(const float* p) { return _mm512_loadu_ps(p); }                    \
    TARGET static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }                    \
    TARGET static F set1f(float v) { return _mm512_set1_ps(v); }                            \
    TARGET static F cvt(I v) { return _mm512_cvtepi32_ps(v); }                              \
    TARGET static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }                 \
    TARGET static F mul(F a, F b) { return _mm512_mul_ps(a, b); }                           \
    TARGET static F addf(F a, F b) { return _mm512_add_ps(a, b); }                          \
  };                                                                                        \
  /* 8 lanes: the AVX2 set's vectors (callable here: their target is a subset of this */    \
  /* one's), with VNNI's vpdpwssd where the set has it. */                                  \
  template <>                                                                               \
  struct V<8> : gemm2::V<8> {                                                               \
    TARGET static void dot(I& acc, I a, const int32_t* w) {                                 \
      if constexpr (VNNI) {                                                                 \
        asm("vpdpwssd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*w));                   \
      } else {                                                                              \
        gemm2::V<8>::dot(acc, a, w);                                                        \
      }                                                                                     \
    }                                                                                       \
  };                                                                                        \
  }
#define MNB_T512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"), always_inline)) inline
#define MNB_T512V __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni"), always_inline)) inline
MNB_V512(gemm5, MNB_T512, false)
MNB_V512(gemm5v, MNB_T512V, true)
#undef MNB_V512
#undef MNB_T512
#undef MNB_HALF
#define MNB_HALF 1
// AVX-512, twice: with vpmaddwd + vpaddd, and with VNNI's vpdpwssd (the same exact sums).
#define MNB_LANES 16
#define MNB_NR 12
#define WIDEN8_STEP 32
#define WIDEN8(src, dst)                                                                  \
  _mm512_storeu_si512(dst, _mm512_cvtepu8_epi16(                                          \
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))))
#define WIDEN4_STEP 16
#define WIDEN4(src, dst)                                                                  \
  do {                                                                                    \
    const __m512i v =                                                                     \
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));      \
    _mm512_storeu_si512(dst, _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(15)),  \
                                             _mm512_slli_epi32(_mm512_srli_epi32(v, 4), 16))); \
  } while (0)

// 16 weights from element k of a row as int32 lanes (for 4-bit: 8 bytes, low nibble first).
#define DEQ_LOAD(row, k) (job.bits == 8 ? _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>((row) + (k)))) : nibbles16((row) + (k) / 2))

#define MNB_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))
#define MNB_NS gemm5
#include "qgemm_x86_body.h"
#undef MNB_TARGET
#undef MNB_NS

#define MNB_TARGET \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
#define MNB_NS gemm5v
#include "qgemm_x86_body.h"
#undef MNB_TARGET
#undef MNB_NS
#undef WIDEN8_STEP
#undef WIDEN8
#undef WIDEN4_STEP
#undef WIDEN4
#undef MNB_PER_WORD

// AVX-512 VNNI's int8 product (a long step's `LongProducts::int8`): words of four int8 of x,
// vpdpbusd multiplying the weights' bytes (unsigned: MLX's codes) by them (signed) and adding
// four products a lane, four k a multiply-add where vpdpwssd does two.
namespace gemm5q {
template <int W>
struct V;
template <>
struct V<16> : gemm5v::V<16> {
  MNB_T512V static void dot(I& acc, I a, const int32_t* w) {
    asm("vpdpbusd %1, %2, %0" : "+v"(acc) : "v"(a), "v"(_mm512_set1_epi32(*w)));
  }
};
template <>
struct V<8> : gemm5v::V<8> {
  MNB_T512V static void dot(I& acc, I a, const int32_t* w) {
    asm("vpdpbusd %1, %2, %0" : "+v"(acc) : "v"(a), "v"(_mm256_set1_epi32(*w)));
  }
};
} // namespace gemm5q
#define MNB_PER_WORD 4
#include "qgemm_x86_quads.h"
#define MNB_TARGET \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
#define MNB_NS gemm5q
#include "qgemm_x86_body.h"
#undef MNB_TARGET
#undef MNB_NS
#undef MNB_PER_WORD
#undef MNB_T512V

// x's packing (GemmSet::pack, qgemm_x86_pack.h): the tiles' vector operations (V<16> of the
// AVX-512 set, V<8> of the AVX2 one) and those the packing adds, on one row a lane.
#define MNB_T512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"), always_inline)) static inline
struct Pack16 : gemm5::V<16> {
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  MNB_T512 Mask rows(int n) { return Mask((1u << n) - 1); }
  MNB_T512 I offsets(int K) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32(K));
  }
  MNB_T512 F gather(const float* p, I offsets, Mask rows) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rows, offsets, p, 4);
  }
  MNB_T512 I set1i(int v) { return _mm512_set1_epi32(v); }
  MNB_T512 void storei(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
  MNB_T512 F abs(F v) { return _mm512_abs_ps(v); }
  MNB_T512 F max(F a, F b) { return _mm512_max_ps(a, b); } // b where either is NaN
  MNB_T512 F div(F a, F b) { return _mm512_div_ps(a, b); }
  MNB_T512 Mask finite_nonzero(F v) { // v >= 0, never NaN
    return _mm512_cmp_ps_mask(v, _mm512_set1_ps(INFINITY), _CMP_LT_OQ) &
           _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  }
  MNB_T512 Mask nonzero_finite_sum(F scale, F s) { // scale != 0 and s finite
    return _mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_NEQ_OQ) &
           _mm512_cmp_ps_mask(_mm512_abs_ps(s), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
  }
  MNB_T512 F blend(Mask m, F no, F yes) { return _mm512_mask_blend_ps(m, no, yes); }
  MNB_T512 I round(Mask m, F v) { return _mm512_maskz_cvtps_epi32(m, v); }
  MNB_T512 I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  MNB_T512 I andi(I a, I b) { return _mm512_and_si512(a, b); }
  MNB_T512 I ori(I a, I b) { return _mm512_or_si512(a, b); }
  MNB_T512 I shl(I a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
  MNB_T512 I int16(I a) { return _mm512_srai_epi32(_mm512_slli_epi32(a, 16), 16); }
};
#undef MNB_T512
#define MNB_T256 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline
struct Pack8 : gemm2::V<8> {
  using Mask = __m256; // all ones in a lane where true
  static constexpr int kLanes = 8;
  MNB_T256 Mask rows(int n) {
    return _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  }
  MNB_T256 I offsets(int K) {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(K));
  }
  MNB_T256 F gather(const float* p, I offsets, Mask rows) {
    return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), p, offsets, rows, 4);
  }
  MNB_T256 I set1i(int v) { return _mm256_set1_epi32(v); }
  MNB_T256 void storei(int32_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  MNB_T256 F abs(F v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  MNB_T256 F max(F a, F b) { return _mm256_max_ps(a, b); } // b where either is NaN
  MNB_T256 F div(F a, F b) { return _mm256_div_ps(a, b); }
  MNB_T256 Mask finite_nonzero(F v) { // v >= 0, never NaN
    return _mm256_and_ps(_mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_LT_OQ),
                         _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NEQ_OQ));
  }
  MNB_T256 Mask nonzero_finite_sum(F scale, F s) { // scale != 0 and s finite
    return _mm256_and_ps(_mm256_cmp_ps(scale, _mm256_setzero_ps(), _CMP_NEQ_OQ),
                         _mm256_cmp_ps(abs(s), _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
  }
  MNB_T256 F blend(Mask m, F no, F yes) { return _mm256_blendv_ps(no, yes, m); }
  MNB_T256 I round(Mask m, F v) {
    return _mm256_and_si256(_mm256_castps_si256(m), _mm256_cvtps_epi32(v));
  }
  MNB_T256 I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  MNB_T256 I andi(I a, I b) { return _mm256_and_si256(a, b); }
  MNB_T256 I ori(I a, I b) { return _mm256_or_si256(a, b); }
  MNB_T256 I shl(I a, int n) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
  MNB_T256 I int16(I a) { return _mm256_srai_epi32(_mm256_slli_epi32(a, 16), 16); }
};
#undef MNB_T256
#define MNB_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))
#define MNB_PACK pack16
#define MNB_P Pack16
#include "qgemm_x86_pack.h"
#undef MNB_TARGET
#undef MNB_PACK
#undef MNB_P
#define MNB_TARGET __attribute__((target("avx2,fma,f16c")))
#define MNB_PACK pack8
#define MNB_P Pack8
#include "qgemm_x86_pack.h"
#undef MNB_TARGET
#undef MNB_PACK
#undef MNB_P

} // namespace

GemmSet gemm_avx2() {
  if (!cpu_has_avx2()) {
    return GemmSet{};
  }
  GemmSet s = gemm2::set();
  s.pack = pack8;
  if (cpu_has_avx_vnni()) {
    const GemmSet quads = gemm2q::set();
    s.tile8 = quads.tile;
    s.widen8 = quads.widen;
  }
  return s;
}

GemmSet gemm_avx512() {
  if (!cpu_has_avx512()) {
    return GemmSet{};
  }
  if (!cpu_has_avx512_vnni()) {
    GemmSet s = gemm5::set();
    s.pack = pack16;
    return s;
  }
  GemmSet s = gemm5v::set();
  s.pack = pack16;
  s.blas_rows = kVnniRows;
  const GemmSet quads = gemm5q::set();
  s.tile8 = quads.tile;
  s.tile8_half = quads.tile_half;
  s.widen8 = quads.widen;
  return s;
}

} // namespace mnb

#else // not x86-64: no GEMM sets

namespace mnb {
GemmSet gemm_avx2() {
  return GemmSet{};
}
GemmSet gemm_avx512() {
  return GemmSet{};
}
} // namespace mnb

#endif

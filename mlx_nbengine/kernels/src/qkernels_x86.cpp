// The x86-64 row kernels: AVX2 (+ FMA, F16C), compiled twice: once for AVX2 and once with
// AVX-512 (VL/BW) enabled, which lets the compiler use 32 vector registers and EVEX forms.
//
// Each function carries its own target attribute, so the file builds for the compiler's
// baseline and the CPU that runs it decides (cpu_has_*). The activations come as int16
// (QActivations, qkernels.h): a step widens packed weights (unsigned, as stored) to 16-bit
// lanes and multiply-adds them with x in pairs into int32 (vpmaddwd), 16 weights an
// instruction. Per group of a row:
//   sum_k (s q_k + b) x_k = s * xscale * sum_k q_k xq_k + b * sum_k x_k
// with the bias term exact in float. The scales and biases are read as stored (float32,
// float16 or bfloat16), several groups at once: the int32 sums of 4 groups are reduced
// together into one vector, so the float work is one multiply-add per 4 groups. More rows of
// x than the registers hold (2 under AVX2, 4 under AVX-512) go in pieces over a few output
// rows at a time, the later pieces reading the weights from cache.

#include <algorithm>
#include <cstring>

#include "qkernels.h"

#if defined(__x86_64__)

#include <immintrin.h>

#define MNB_T2 __attribute__((target("avx2,fma,f16c")))
#define MNB_T5 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))

namespace mnb {

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq");
}

namespace {

// The kernels' bodies, written once and compiled under each target (MNB_TARGET).
#define MNB_TARGET MNB_T2
#define MNB_NS avx2_set
#define MNB_PIECE_ROWS 2
#include "qkernels_x86_body.h"
#undef MNB_TARGET
#undef MNB_NS
#undef MNB_PIECE_ROWS

#define MNB_TARGET MNB_T5
#define MNB_NS avx512_set
#define MNB_PIECE_ROWS 4
#include "qkernels_x86_body.h"
#undef MNB_TARGET
#undef MNB_NS
#undef MNB_PIECE_ROWS

} // namespace

RowsFn avx2_rows(const QJob& job) {
  return cpu_has_avx2() ? avx2_set::choose(job) : nullptr;
}

RowsFn avx512_rows(const QJob& job) {
  return cpu_has_avx512() ? avx512_set::choose(job) : nullptr;
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

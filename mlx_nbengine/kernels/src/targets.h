// How the kernels' loops are compiled for each kernel set: a body written once (always
// inlined) and compiled three times, for the baseline and inside functions that carry the
// avx2 or avx512 target, where the compiler vectorizes it for that set. Which runs is chosen
// at run time (the CPU that runs them decides, never the build machine).

#pragma once

#define MNB_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__)
#define MNB_AVX2 __attribute__((target("avx2,fma")))
#define MNB_AVX512 __attribute__((target("avx512f,avx2,fma")))
#endif

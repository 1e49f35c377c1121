// The BLAS our kernels call for large products.

#pragma once

// The BLAS MLX's own matmuls call: resolved when the module loads, to the same library (the
// engine's OpenBLAS where it bound one, else the wheel's bundled BLAS).
extern "C" void cblas_sgemm(
    int order,
    int trans_a,
    int trans_b,
    int m,
    int n,
    int k,
    float alpha,
    const float* a,
    int lda,
    const float* b,
    int ldb,
    float beta,
    float* c,
    int ldc);

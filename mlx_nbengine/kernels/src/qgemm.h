// Quantized products of many rows (a prefill step, an edit's tail): x (M x K, M > kBlockRows)
// times the transpose of an MLX affine-quantized W (N x K), as a small integer GEMM.
//
// x is rounded to int16 per row and group exactly as the row kernels round it (QActivations:
// x ~ xq * xscale), and laid out so that one vector holds a pair of consecutive k of `lanes`
// rows; each tile of NR output columns has its weights widened once to int16 pairs. A
// tile's inner step broadcasts one weight pair per output column and multiply-adds it
// against the rows' pairs (vpmaddwd, or vpdpwssd where the CPU has AVX-512 VNNI) into
// int32 sums, exact over a group; per group the sums become float:
//   out[m, n] = sum_g s[n, g] xscale[m, g] dot_g(m, n)  +  sum_g b[n, g] xsum[m, g]
// each sum in group order. A row's result is the same bits whatever rows share its product
// (a cold prefill and a restored edit's tail compute the same rows alike), and the same
// under AVX2 and AVX-512 (with or without VNNI): integer sums are exact, and the float
// operations are the same in the same order.

#pragma once

#include "qkernels.h"

namespace mnb {

// Whether `isa` has a GEMM on this CPU (the vectorized sets; the portable set has none).
bool qgemm_available(Isa isa);

// out = x @ dequantize(w).T for job's M rows (job.x float32 row-major), on up to `threads`
// threads; call it where the product runs (the CPU stream's thread).
void qgemm(const QJob& job, Isa isa, int threads);

// The x86 sets (qgemm_x86.cpp). `lanes` rows of x per vector, `nr` output columns a tile.
struct GemmArgs {
  const int32_t* xp; // one block of rows: [pairs][lanes], pair p of row l = xq[2p] | xq[2p+1] << 16
  const float* xs; // [groups][lanes]: xscale
  const float* xm; // [groups][lanes]: xsum
  const int32_t* wt; // [nr][wstride]: the tile's weights widened to int16 pairs
  const float* st; // [nr][groups]: scales as float32
  const float* bt; // [nr][groups]: biases as float32
  int pairs, groups, group_pairs;
  int wstride; // ints from one column's weights to the next's (see gemm_wstride)
  float* res; // [nr][lanes]
};

struct GemmSet {
  int lanes = 0, nr = 0;
  void (*tile)(const GemmArgs& a) = nullptr;
  // The same for the first lanes / 2 rows of the block only (a last block of few rows), the
  // same operations lane by lane; nullptr where the set has none.
  void (*tile_half)(const GemmArgs& a) = nullptr;
  // The tile of output columns n0 .. n0 + nr: weights widened, scales and biases as float32
  // (columns past N zero).
  void (*widen)(const QJob& job, int n0, int32_t* wt, float* st, float* bt) = nullptr;
  // wt: [nr][gemm_wstride(K / 2)]
  // Rows n0 .. n1 of W as float32, K a row, from dst.
  void (*dequantize)(const QJob& job, int n0, int n1, float* dst) = nullptr;
};

// The weights' row stride of a tile: one cache line more than the pairs, so that the tile's
// columns (read together, a page apart when K is 2,048) do not fall in one L1 cache set.
inline int gemm_wstride(int pairs) {
  return pairs + 16;
}

GemmSet gemm_avx2(); // {} where this CPU lacks the set
GemmSet gemm_avx512();

} // namespace mnb

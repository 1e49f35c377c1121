// Quantized products of many rows (a prefill step, an edit's tail): x (M x K, M > kBlockRows)
// times the transpose of an MLX affine-quantized W (N x K), as a small integer GEMM.
//
// x is rounded per row and group exactly as the row kernels round it (QActivations:
// x ~ xq * xscale), to int16, or to int8 for a long step's int8 product (`LongProducts`), and
// laid out so that one vector holds a *word* of consecutive k of `lanes` rows: a pair of int16
// (or of int8 values held as int16), or with VNNI's int8 dot a quad of int8. Each tile of NR
// output columns has its weights widened once to words of the same shape. A tile's inner step
// broadcasts one weight word per output column and multiply-adds it against the rows' words
// (vpmaddwd, vpdpwssd where the CPU has AVX-512 VNNI, or vpdpbusd for quads) into int32 sums,
// exact over a group; per group the sums become float:
//   out[m, n] = sum_g s[n, g] xscale[m, g] dot_g(m, n)  +  sum_g b[n, g] xsum[m, g]
// each sum in group order. A row's result is the same bits whatever rows share its product
// (a cold prefill and a restored edit's tail compute the same rows alike), and the same
// under AVX2 and AVX-512 (with or without VNNI) and, for the int8 product, the portable set:
// integer sums are exact, and the float operations are the same in the same order.
//
// A long step (more than kLongRows rows) multiplies int16 x on the tiles up to the set's
// `blas_rows` and past them float32 x by the weights dequantized a tile at a time on the BLAS
// (`int16`, the default), or always on the BLAS (`blas`), or int8 x by the weights (`int8`:
// four k a multiply-add where the CPU has VNNI); the int8 product's x carries 2^-8 of its
// group's largest value where int16's carries 2^-16 (tests/integration/test_default_q8.py
// measures what that costs), and the model's variant names which product ran.

#pragma once

#include <vector>

#include "qkernels.h"

namespace mnb {

// How a long step multiplies: x rounded to int16 on the set's tiles up to its `blas_rows`,
// then W dequantized onto the BLAS (`int16`); W dequantized onto the BLAS (`blas`: the
// tests' switch for what a CPU without VNNI runs past 96 rows); or x rounded to int8 (on the
// set's quads where it has them; `int8_pairs` on its int16 tiles whatever the CPU, the same
// sums: the tests' switch for what a CPU without VNNI runs).
enum class LongProducts : int { int16 = 0, int8 = 1, int8_pairs = 2, blas = 3 };

inline bool int8_products(LongProducts p) {
  return p == LongProducts::int8 || p == LongProducts::int8_pairs;
}

// Rows past which a step is long (see above): the int8 product or the BLAS where asked for;
// else the int16 tiles up to the set's `blas_rows`, then the BLAS.
constexpr int kLongRows = 96;

// The int16 tiles' rows with VNNI's vpdpwssd (32 multiply-adds an instruction, as two FMA
// ports of float32): every step the engine makes (1,024 rows at most) and more. Measured on
// an Intel Xeon with AVX-512 VNNI, 2 threads, the default model's seven products: the tiles
// 1.2-1.6x the BLAS from 97 to 256 rows, 1.1-1.2x from 384 to 768, and from 1,024 to 2,048
// level with it (groups of 32, float32 scales) or 1.05-1.15x faster (groups of 64).
constexpr int kVnniRows = 4096;

// Whether `isa` has a GEMM on this CPU (the vectorized sets; the portable set has none but
// the int8 product of a long step).
bool qgemm_available(Isa isa);

// The most rows a product of `isa` multiplies on its int16 tiles (past them, the BLAS's
// product of W dequantized); 0 where the set has no GEMM.
int qgemm_tile_rows(Isa isa);

// Whether `isa` multiplies int8 quads at VNNI's rate on this CPU (vpdpbusd): where a long
// step's int8 product is faster than the BLAS's.
bool qgemm_int8_fast(Isa isa);

// out = x @ dequantize(w).T for job's M rows (job.x float32 row-major), on up to `threads`
// threads; call it where the product runs (the CPU stream's thread). A long step (or, on the
// portable set, any step) with `long_products` int8 takes the int8 product.
void qgemm(const QJob& job, Isa isa, int threads, LongProducts long_products);

// The x86 sets (qgemm_x86.cpp). `lanes` rows of x per vector, `nr` output columns a tile.
struct GemmArgs {
  // One block of rows: [words][lanes]; word p of row l = xq[2p] | xq[2p+1] << 16 (int16
  // pairs) or the bytes xq[4p .. 4p+3] (int8 quads).
  const int32_t* xp;
  const float* xs; // [groups][lanes]: xscale
  const float* xm; // [groups][lanes]: xsum
  const int32_t* wt; // [nr][wstride]: the tile's weights widened to words of the same shape
  const float* st; // [nr][groups]: scales as float32
  const float* bt; // [nr][groups]: biases as float32
  int words, groups, group_words;
  int wstride; // ints from one column's weights to the next's (see gemm_wstride)
  float* res; // [nr][lanes]
};

struct GemmSet {
  int lanes = 0, nr = 0;
  // Rows past which the BLAS's product of W dequantized beats the int16 tiles: kVnniRows
  // with VNNI's vpdpwssd, else kLongRows (vpmaddwd + vpaddd: the BLAS wins past 96 rows).
  int blas_rows = kLongRows;
  void (*tile)(const GemmArgs& a) = nullptr;
  // The same for the first lanes / 2 rows of the block only (a last block of few rows), the
  // same operations lane by lane; nullptr where the set has none.
  void (*tile_half)(const GemmArgs& a) = nullptr;
  // The tile of output columns n0 .. n0 + nr: weights widened, scales and biases as float32
  // (columns past N zero).
  void (*widen)(const QJob& job, int n0, int32_t* wt, float* st, float* bt) = nullptr;
  // wt: [nr][gemm_wstride(K / 2)]
  // The same three on int8 quads with vpdpbusd (wt: [nr][gemm_wstride(K / 4)], each word
  // four weights as bytes; AVX-512 VNNI, or AVX-VNNI for the AVX2 set, which has no half
  // tile); nullptr where the CPU has no VNNI (its int8 product then runs the int16 tiles on
  // int8 values: the same sums).
  void (*tile8)(const GemmArgs& a) = nullptr;
  void (*tile8_half)(const GemmArgs& a) = nullptr;
  void (*widen8)(const QJob& job, int n0, int32_t* wt, float* st, float* bt) = nullptr;
  // Rows n0 .. n1 of W as float32, K a row, from dst.
  void (*dequantize)(const QJob& job, int n0, int n1, float* dst) = nullptr;
  // x's row blocks b0 .. b1 rounded and laid out as `qgemm_pack` says, `lanes` rows a block
  // (lanes of rows past M zero), computing each lane as round_group / round_group8 computes
  // its row: the same bits, `lanes` rows at a time.
  void (*pack)(const QJob& job, int per_word, bool int8, int b0, int b1, int32_t* words,
               float* scale, float* sum) = nullptr;
};

// x rounded per row and group as the tiles of `isa` read it (`int8`: to int8 values, as
// round_group8 rounds them; else int16), `per_word` (2 or 4) consecutive k a word: words
// [block][K / per_word][lanes], scale and sum [block][groups][lanes]; `vector`: with the set's
// own packing, else the scalar loop (the tests compare the two). Returns the lanes.
int qgemm_pack(const QJob& job, Isa isa, int per_word, bool int8, bool vector,
               std::vector<int32_t>& words, std::vector<float>& scale, std::vector<float>& sum);

// The weights' row stride of a tile: one cache line more than the pairs, so that the tile's
// columns (read together, a page apart when K is 2,048) do not fall in one L1 cache set.
inline int gemm_wstride(int words) {
  return words + 16;
}

GemmSet gemm_avx2(); // {} where this CPU lacks the set
GemmSet gemm_avx512();

} // namespace mnb

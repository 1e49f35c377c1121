#include "qgemm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "blas.h"
#include "workers.h"


namespace mnb {

namespace {

GemmSet set_for(Isa isa) {
  GemmSet s;
  if (isa == Isa::avx512) {
    s = gemm_avx512();
  }
  if (s.tile == nullptr && isa != Isa::portable) {
    s = gemm_avx2();
  }
  return s;
}

// x rounded per row and group as QActivations rounds it (`int8`: as round_group8 does),
// in blocks of `lanes` rows, `per_word` (2 or 4) consecutive k a word: words
// [block][word][lane], xscale and xsum [block][group][lane]; rows past M zero.
struct PackedX {
  std::vector<int32_t> words;
  std::vector<float> scale, sum;
  // With the set's vectorized packing where it has one (`vector`), a block of rows at a
  // time; else row by row.
  void pack(const QJob& job, const GemmSet& set, int per_word, bool int8, int threads,
            bool vector = true) {
    const int M = job.M, K = job.K, group = job.group, G = K / group, W = K / per_word;
    const int lanes = set.lanes;
    const int blocks = (M + lanes - 1) / lanes;
    if (vector && set.pack != nullptr) { // every value written, the absent rows' zero
      words.resize(size_t(blocks) * W * lanes);
      scale.resize(size_t(blocks) * G * lanes);
      sum.resize(size_t(blocks) * G * lanes);
      workers().run(threads, blocks, 1, [&](int b0, int b1) {
        set.pack(job, per_word, int8, b0, b1, words.data(), scale.data(), sum.data());
      });
      return;
    }
    words.assign(size_t(blocks) * W * lanes, 0);
    scale.assign(size_t(blocks) * G * lanes, 0.0f);
    sum.assign(size_t(blocks) * G * lanes, 0.0f);
    workers().run(threads, M, std::max(1, M / (threads * 4)), [&](int m0, int m1) {
      pack_rows(job, lanes, per_word, int8, m0, m1);
    });
  }
  void pack_rows(const QJob& job, int lanes, int per_word, bool int8, int m0, int m1) {
    const int K = job.K, group = job.group, G = K / group, W = K / per_word;
    const int bits = 32 / per_word;
    const uint32_t mask = per_word == 2 ? 0xFFFFu : 0xFFu;
    std::vector<int16_t> q(static_cast<size_t>(group));
    for (int m = m0; m < m1; ++m) {
      const int b = m / lanes, l = m % lanes;
      for (int g = 0; g < G; ++g) {
        const float* x = job.x + int64_t(m) * K + int64_t(g) * group;
        const size_t at = (size_t(b) * G + g) * lanes + l;
        if (int8) {
          round_group8(x, group, q.data(), scale[at], sum[at]);
        } else {
          round_group(x, group, q.data(), scale[at], sum[at]);
        }
        int32_t* dst = words.data() + (size_t(b) * W + int64_t(g) * group / per_word) * lanes + l;
        for (int p = 0; p < group / per_word; ++p) {
          uint32_t word = 0;
          for (int i = 0; i < per_word; ++i) {
            word |= (uint32_t(uint16_t(q[per_word * p + i])) & mask) << (bits * i);
          }
          dst[int64_t(p) * lanes] = int32_t(word);
        }
      }
    }
  }
};

// Bytes of x's words one chunk of row blocks holds: the chunk stays in a core's L2 cache
// while every tile of output columns passes over it.
constexpr int64_t kChunkBytes = 512 << 10;
// Past the set's blas_rows (qgemm.h) the BLAS's float32 product of W dequantized beats the
// int16 tiles (see the README); the float copy is made this many bytes at a time.
constexpr int64_t kBlasTileBytes = 8 << 20;

} // namespace

int qgemm_pack(const QJob& job, Isa isa, int per_word, bool int8, bool vector,
               std::vector<int32_t>& words, std::vector<float>& scale, std::vector<float>& sum) {
  const GemmSet set = set_for(isa);
  if (set.tile == nullptr) {
    return 0;
  }
  PackedX x;
  x.pack(job, set, per_word, int8, 1, vector);
  words = std::move(x.words);
  scale = std::move(x.scale);
  sum = std::move(x.sum);
  return set.lanes;
}

bool qgemm_available(Isa isa) {
  return set_for(isa).tile != nullptr;
}

int qgemm_tile_rows(Isa isa) {
  const GemmSet set = set_for(isa);
  return set.tile == nullptr ? 0 : set.blas_rows;
}

bool qgemm_int8_fast(Isa isa) {
  return set_for(isa).tile8 != nullptr;
}

namespace {

// Many rows: W dequantized to float32 a tile of columns at a time (our threads), each tile
// multiplied on the BLAS (its threads), so the float copy never exceeds kBlasTileBytes.
void dequantized_product(const QJob& job, const GemmSet& set, int threads) {
  const int M = job.M, K = job.K, N = job.N;
  const int rows = int(std::clamp<int64_t>(kBlasTileBytes / (int64_t(K) * 4), 64, N));
  thread_local std::vector<float> dense; // this (the stream's) thread's; workers get a pointer
  dense.resize(size_t(rows) * K);
  float* const buffer = dense.data();
  for (int n0 = 0; n0 < N; n0 += rows) {
    const int n1 = std::min(N, n0 + rows);
    workers().run(threads, n1 - n0, std::max(16, (n1 - n0) / (threads * 4)), [&](int a, int b) {
      set.dequantize(job, n0 + a, n0 + b, buffer + int64_t(a) * K);
    });
    workers().rest(); // the BLAS's threads take the cores next
    cblas_sgemm(101, 111, 112, M, n1 - n0, K, 1.0f, job.x, K, buffer, K, 0.0f,
                job.out + n0, N);
  }
}

} // namespace

namespace {

// The tiles (`tile`, `half`, `widen`) over x packed `per_word` k a word, rounded to int8 or
// int16 values.
struct Tiles {
  void (*tile)(const GemmArgs&);
  void (*half)(const GemmArgs&);
  void (*widen)(const QJob&, int, int32_t*, float*, float*);
  int per_word;
  bool int8;
};

void tiled_product(const QJob& job, const GemmSet& set, const Tiles& tiles, int threads) {
  const int L = set.lanes, NR = set.nr;
  const int M = job.M, K = job.K, N = job.N, G = K / job.group, W = K / tiles.per_word;
  if (int64_t(M) * N * K < (int64_t(1) << 22)) {
    threads = 1;
  }
  PackedX x;
  x.pack(job, set, tiles.per_word, tiles.int8, threads);
  const int blocks = (M + L - 1) / L;
  const int per_chunk = int(std::max<int64_t>(1, kChunkBytes / (int64_t(L) * W * 4)));
  const int chunks = (blocks + per_chunk - 1) / per_chunk;
  const int column_tiles = (N + NR - 1) / NR;
  // Work item t: row chunk t / column_tiles against column tile t % column_tiles; the
  // threads take runs of items in order, so they share a chunk while it is in cache, and
  // each reads the weights of its run's tiles front to back.
  const int items = chunks * column_tiles;
  workers().run(threads, items, std::max(1, items / (threads * 8)), [&](int t0, int t1) {
    thread_local std::vector<int32_t> wt;
    thread_local std::vector<float> st, bt, res;
    wt.resize(size_t(NR) * gemm_wstride(W));
    st.resize(size_t(NR) * G);
    bt.resize(size_t(NR) * G);
    res.resize(size_t(NR) * L);
    for (int t = t0; t < t1; ++t) {
      const int c = t / column_tiles, n0 = (t % column_tiles) * NR;
      tiles.widen(job, n0, wt.data(), st.data(), bt.data());
      const int ncols = std::min(NR, N - n0);
      for (int b = c * per_chunk; b < std::min(blocks, (c + 1) * per_chunk); ++b) {
        GemmArgs a{
            x.words.data() + size_t(b) * W * L,
            x.scale.data() + size_t(b) * G * L,
            x.sum.data() + size_t(b) * G * L,
            wt.data(),
            st.data(),
            bt.data(),
            W,
            G,
            job.group / tiles.per_word,
            gemm_wstride(W),
            res.data()};
        const int rows = std::min(L, M - b * L);
        // A last block of few rows (an edit's tail of 20 is 16 + 4) on half the lanes: the
        // same operations lane by lane, so the same bits.
        (rows <= L / 2 && tiles.half != nullptr ? tiles.half : tiles.tile)(a);
        for (int l = 0; l < rows; ++l) {
          float* dst = job.out + int64_t(b * L + l) * N + n0;
          for (int j = 0; j < ncols; ++j) {
            dst[j] = res[size_t(j) * L + l];
          }
        }
      }
    }
  });
}

// The int8 product in plain C++ (the portable set): x rounded as the tiles round it, and the
// same float operations in the same order, so the same bits.
void int8_portable(const QJob& job, int threads) {
  const int M = job.M, K = job.K, N = job.N, group = job.group, G = K / group;
  std::vector<int16_t> xq(size_t(M) * K);
  std::vector<float> xs(size_t(M) * G), xm(size_t(M) * G);
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < G; ++g) {
      const int64_t at = int64_t(m) * K + int64_t(g) * group;
      round_group8(job.x + at, group, xq.data() + at, xs[size_t(m) * G + g],
                   xm[size_t(m) * G + g]);
    }
  }
  const int64_t row_bytes = int64_t(K) * job.bits / 8;
  workers().run(threads, N, std::max(1, N / (threads * 4)), [&](int n0, int n1) {
    std::vector<float> s(static_cast<size_t>(G)), b(static_cast<size_t>(G));
    std::vector<int32_t> codes(static_cast<size_t>(K));
    for (int n = n0; n < n1; ++n) {
      const uint8_t* row = job.w + n * row_bytes;
      for (int k = 0; k < K; ++k) {
        codes[k] = job.bits == 8 ? row[k] : (row[k / 2] >> (4 * (k % 2))) & 15;
      }
      widen_row(job, n, s.data(), b.data());
      for (int m = 0; m < M; ++m) {
        const int16_t* x = xq.data() + int64_t(m) * K;
        float facc = 0.0f, bacc = 0.0f;
        for (int g = 0; g < G; ++g) {
          int32_t dot = 0;
          for (int k = g * group; k < (g + 1) * group; ++k) {
            dot += codes[k] * x[k];
          }
          const float scale = s[g] * xs[size_t(m) * G + g];
          facc = std::fma(float(dot), scale, facc);
        }
        for (int g = 0; g < G; ++g) {
          bacc = std::fma(b[g], xm[size_t(m) * G + g], bacc);
        }
        job.out[int64_t(m) * N + n] = facc + bacc;
      }
    }
  });
}

} // namespace

void qgemm(const QJob& job, Isa isa, int threads, LongProducts long_products) {
  const GemmSet set = set_for(isa);
  const bool long_step = job.M > kLongRows || set.tile == nullptr;
  if (long_step && int8_products(long_products)) {
    if (set.tile8 != nullptr && long_products == LongProducts::int8) {
      tiled_product(job, set, Tiles{set.tile8, set.tile8_half, set.widen8, 4, true}, threads);
    } else if (set.tile != nullptr) {
      tiled_product(job, set, Tiles{set.tile, set.tile_half, set.widen, 2, true}, threads);
    } else {
      int8_portable(job, threads);
    }
    return;
  }
  if (job.M > set.blas_rows || set.tile == nullptr ||
      (long_step && long_products == LongProducts::blas)) {
    dequantized_product(job, set, threads);
    return;
  }
  tiled_product(job, set, Tiles{set.tile, set.tile_half, set.widen, 2, false}, threads);
}

} // namespace mnb

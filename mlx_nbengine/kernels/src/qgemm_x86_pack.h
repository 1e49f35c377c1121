// x's packing (GemmSet::pack), included by qgemm_x86.cpp once per set with MNB_TARGET,
// MNB_PACK (the function's name) and MNB_P (the set's vector operations, one row a lane)
// defined. No include guard.
//
// A group's values of the block's rows are gathered k by k, so each lane takes round_group's
// steps for its row in its order (qkernels.h): the largest magnitude, a NaN left out as
// std::max leaves it; the float sum in k order; the integers as lrint rounds (to nearest
// even, a NaN to 0); for int8, round_group8's sum (the scale times the integers' sum where
// the scale is not 0 and the sum finite). So the same bits as the scalar packing. Rows past
// M are gathered as zero: all-zero groups, as the scalar packing leaves them.

MNB_TARGET void MNB_PACK(const QJob& job, int per_word, bool int8, int b0, int b1,
                         int32_t* words, float* scale, float* sum) {
  using P = MNB_P;
  using I = P::I;
  using F = P::F;
  constexpr int L = P::kLanes;
  const int M = job.M, K = job.K, group = job.group, G = K / group, W = K / per_word;
  const int bits = 32 / per_word;
  const F levels = P::set1f(int8 ? 127.0f : 32767.0f);
  const I low = P::set1i(per_word == 2 ? 0xFFFF : 0xFF);
  const I offsets = P::offsets(K);
  alignas(64) float values[128 * L]; // one group's values, [k][lane] (groups of 32 to 128)
  for (int b = b0; b < b1; ++b) {
    const auto rows = P::rows(std::min(L, M - b * L));
    const float* base = job.x + int64_t(b) * L * K;
    for (int g = 0; g < G; ++g) {
      F largest = P::zerof(), s = P::zerof();
      for (int i = 0; i < group; ++i) {
        const F v = P::gather(base + int64_t(g) * group + i, offsets, rows);
        P::storef(values + i * L, v);
        largest = P::max(P::abs(v), largest);
        s = P::addf(s, v);
      }
      // A scale of 0 (all zero) or the largest itself (not finite) rounds nothing to 0;
      // else largest / levels, the integers rint(x * (levels / largest)).
      const auto rounds = P::finite_nonzero(largest);
      const F sc = P::blend(rounds, largest, P::div(largest, levels));
      const F to_int = P::div(levels, largest);
      I total = P::zeroi();
      int32_t* dst = words + (int64_t(b) * W + int64_t(g) * (group / per_word)) * L;
      for (int p = 0; p < group / per_word; ++p) {
        I word = P::zeroi();
        for (int i = 0; i < per_word; ++i) {
          // as int16_t(lrint(...)): a NaN or an infinity (x * inf for a subnormal largest)
          // comes out of the conversion as INT_MIN, whose low 16 bits are 0
          const I q = P::int16(P::round(rounds, P::mul(P::loadf(values + (p * per_word + i) * L), to_int)));
          total = P::addi(total, q);
          word = P::ori(word, P::shl(P::andi(q, low), bits * i));
        }
        P::storei(dst + int64_t(p) * L, word);
      }
      const F sm = int8 ? P::blend(P::nonzero_finite_sum(sc, s), s, P::mul(sc, P::cvt(total))) : s;
      P::storef(scale + (int64_t(b) * G + g) * L, sc);
      P::storef(sum + (int64_t(b) * G + g) * L, sm);
    }
  }
}

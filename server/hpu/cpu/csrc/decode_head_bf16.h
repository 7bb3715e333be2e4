// The decode attention head for bf16 queries over bf16 caches on CPUs with AVX-512 BF16:
// both products on `vdpbf16ps`, 32 bf16 multiply-adds per instruction into fp32, where
// FastHead (paged_attention.h) widens every key and value to fp32 and spends one FMA per
// product. That FMA rate, not DRAM, bounded FastHead: from L3 it read SmolLM2's batch-32 KV
// at ~20 GB/s a core, about what one core draws from DRAM.
//
// vdpbf16ps multiplies bf16 pairs, so each product pairs two rows of the block:
// - scores: key rows d and d + 1 of the transposed block ([dim, block]) are interleaved
//   word by word (vpunpck{l,h}wd, within 128-bit lanes), 32 tokens in two registers whose
//   token order is permuted by lane; the query's (d, d + 1) pair is broadcast. One
//   two-register permute per 32 scores restores the order;
// - outputs: value rows j and j + 1 ([block, dim]) are interleaved the same way, against
//   the broadcast pair of probabilities (p_j, p_j+1) rounded to bf16. The accumulators keep
//   the permuted dim order across all blocks and are put back in order once, at finish.
// Numerics are those of PyTorch's attention in a bf16 model (and of the tiled prefill
// kernel): exact bf16 products summed in fp32, the softmax in fp32, the probabilities
// rounded to bf16 for P x V. The query is not pre-scaled (that would round it again): its
// scale multiplies the fp32 scores.
#pragma once

#include "attention_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HPU_SERVE_DECODE_BF16_DOT 1

namespace hpu_serve {

namespace bf16_head {

inline __m512 as_ps(__m512i v) { return _mm512_castsi512_ps(v); }

// Lane order after vpunpck{l,h}wd of 32 tokens (or dims): lo holds 0-3, 8-11, 16-19, 24-27,
// hi holds 4-7, 12-15, 20-23, 28-31. These put 0-15 and 16-31 back in order.
inline __m512i order_first() {
  return _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
}
inline __m512i order_second() {
  return _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}

inline __m512 dot(__m512 acc, __m512i pairs, uint32_t x_pair) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(pairs),
                          reinterpret_cast<__m512bh>(_mm512_set1_epi32(x_pair)));
}

inline uint32_t pair_bits(const BFloat16* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

}  // namespace bf16_head

// The largest count up to `want` that divides `most` (32-dim chunks per output pass).
constexpr int fit_dims(int want, int most) {
  int n = want < most ? want : most;
  while (most % n != 0) --n;
  return n;
}

template <int G, int DIM>
struct Bf16Head {
  static_assert(DIM % 32 == 0, "dims go 32 at a time");
  // 32-token chunks per score pass: 2G accumulators each, up to ~12 registers
  static constexpr int JT = G >= 6 ? 1 : (G >= 3 ? 2 : (G == 2 ? 3 : 4));
  // 32-dim chunks per output pass: 2G accumulators each
  static constexpr int DC = fit_dims(G >= 6 ? 1 : (G >= 3 ? 2 : 4), DIM / 32);
  int64_t block;
  float scale = 1.f;
  uint32_t q[G][DIM / 2];  // the query's raw (d, d + 1) bf16 pairs, unscaled
  alignas(64) float acc[G][DIM];  // per 32 dims: lanes of lo, then of hi (permuted)
  float run_max[G], run_sum[G];
  std::vector<float> probs;     // [G][block] fp32
  std::vector<uint16_t> pbf16;  // [G][block] the probabilities rounded to bf16

  Bf16Head(int64_t, int64_t, int64_t block_)
      : block(block_), probs(G * block_), pbf16(G * block_) {}

  void start(const BFloat16* query, int64_t head_stride, float scale_) {
    scale = scale_;
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < DIM / 2; ++i) {
        q[g][i] = bf16_head::pair_bits(query + g * head_stride + 2 * i);
      }
      std::fill(acc[g], acc[g] + DIM, 0.f);
      run_max[g] = -std::numeric_limits<float>::infinity();
      run_sum[g] = 0.f;
    }
  }

  // Scores of NJ 32-token chunks from j0 (the block holds them all) into probs.
  template <int NJ>
  void scores32(const BFloat16* keys_t, int64_t j0, Drip& next_k) {
    __m512 lo[NJ][G], hi[NJ][G];
    for (int t = 0; t < NJ; ++t) {
      for (int g = 0; g < G; ++g) lo[t][g] = hi[t][g] = _mm512_setzero_ps();
    }
    for (int d = 0; d < DIM; d += 2) {
      next_k.next();
      const BFloat16* r0 = keys_t + d * block + j0;
      const BFloat16* r1 = r0 + block;
      for (int t = 0; t < NJ; ++t) {
        const __m512i a = _mm512_loadu_si512(r0 + 32 * t);
        const __m512i b = _mm512_loadu_si512(r1 + 32 * t);
        const __m512i pl = _mm512_unpacklo_epi16(a, b);
        const __m512i ph = _mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < G; ++g) {
          lo[t][g] = bf16_head::dot(lo[t][g], pl, q[g][d / 2]);
          hi[t][g] = bf16_head::dot(hi[t][g], ph, q[g][d / 2]);
        }
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int t = 0; t < NJ; ++t) {
      for (int g = 0; g < G; ++g) {
        float* p = probs.data() + g * block + j0 + 32 * t;
        _mm512_storeu_ps(p, _mm512_mul_ps(s, _mm512_permutex2var_ps(
                                                 lo[t][g], bf16_head::order_first(), hi[t][g])));
        _mm512_storeu_ps(p + 16, _mm512_mul_ps(s, _mm512_permutex2var_ps(
                                                      lo[t][g], bf16_head::order_second(),
                                                      hi[t][g])));
      }
    }
  }

  // Scores of the 16 tokens at j0 (a block's last 16 when 32 would run past it).
  void scores16(const BFloat16* keys_t, int64_t j0, Drip& next_k) {
    // (d, t) and (d + 1, t) side by side, tokens in order
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
        4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 s[G];
    for (int g = 0; g < G; ++g) s[g] = _mm512_setzero_ps();
    for (int d = 0; d < DIM; d += 2) {
      next_k.next();
      const BFloat16* r0 = keys_t + d * block + j0;
      const __m512i both = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + block)), 1);
      const __m512i pairs = _mm512_permutexvar_epi16(interleave, both);
      for (int g = 0; g < G; ++g) s[g] = bf16_head::dot(s[g], pairs, q[g][d / 2]);
    }
    for (int g = 0; g < G; ++g) {
      _mm512_storeu_ps(probs.data() + g * block + j0, _mm512_mul_ps(_mm512_set1_ps(scale), s[g]));
    }
  }

  // Output rows j and j + 1 (or j alone: FIRST_ZERO / SECOND_ZERO drop a row outside
  // [lo, n), whose slot may hold anything) into dims [d0, d0 + 32 DC).
  template <bool FIRST_ZERO, bool SECOND_ZERO>
  inline void values_pair(const BFloat16* values, int64_t j, int d0, __m512 (&lo)[DC][G],
                          __m512 (&hi)[DC][G]) {
    const BFloat16* r0 = values + j * DIM + d0;
    const BFloat16* r1 = r0 + DIM;
    for (int c = 0; c < DC; ++c) {
      const __m512i a = FIRST_ZERO ? _mm512_setzero_si512() : _mm512_loadu_si512(r0 + 32 * c);
      const __m512i b = SECOND_ZERO ? _mm512_setzero_si512() : _mm512_loadu_si512(r1 + 32 * c);
      const __m512i pl = _mm512_unpacklo_epi16(a, b);
      const __m512i ph = _mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < G; ++g) {
        uint32_t pp;
        std::memcpy(&pp, pbf16.data() + g * block + j, sizeof(pp));
        lo[c][g] = bf16_head::dot(lo[c][g], pl, pp);
        hi[c][g] = bf16_head::dot(hi[c][g], ph, pp);
      }
    }
  }

  void block_step(const BFloat16* keys_t, const BFloat16* values, int64_t lo, int64_t n,
                  float softcap, Drip next_k = {}, Drip next_v = {}) {
    if (n <= lo) return;
    int64_t j0 = lo / 16 * 16;
    const int64_t stop = (n + 15) / 16 * 16;
    next_k.pace(DIM / 2 * ((stop - j0 + 31) / 32));
    while (j0 < stop) {
      if (JT > 1 && j0 + 32 * JT <= block && j0 + 32 * JT <= stop + 16) {
        scores32<JT>(keys_t, j0, next_k);
        j0 += 32 * JT;
      } else if (j0 + 32 <= block && stop - j0 > 16) {
        scores32<1>(keys_t, j0, next_k);
        j0 += 32;
      } else {
        scores16(keys_t, j0, next_k);
        j0 += 16;
      }
    }
    next_k.rest();
    // token pairs (j, j + 1) from an even j: [first, last) covers [lo, n)
    const int64_t first = lo & ~int64_t{1};
    const int64_t last = (n + 1) & ~int64_t{1};
    for (int g = 0; g < G; ++g) {
      float* p = probs.data() + g * block;
      cap_scores(p + lo, n - lo, softcap);
      softmax_block(p + lo, n - lo, run_max[g], run_sum[g], acc[g], DIM);
      if (first < lo) p[first] = 0.f;
      if (last > n) p[n] = 0.f;
      uint16_t* pb = pbf16.data() + g * block;
      int64_t j = first / 16 * 16;
      for (; j + 16 <= last; j += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(p + j))));
      }
      for (; j < last; ++j) pb[j] = float_to_bf16_bits(p[j]);
    }
    next_v.pace(DIM / (32 * DC) * ((last - first) / 2));
    for (int d0 = 0; d0 < DIM; d0 += 32 * DC) {
      __m512 lo_acc[DC][G], hi_acc[DC][G];
      for (int c = 0; c < DC; ++c) {
        for (int g = 0; g < G; ++g) {
          lo_acc[c][g] = _mm512_loadu_ps(acc[g] + d0 + 32 * c);
          hi_acc[c][g] = _mm512_loadu_ps(acc[g] + d0 + 32 * c + 16);
        }
      }
      int64_t j = first;
      if (first < lo) {
        values_pair<true, false>(values, j, d0, lo_acc, hi_acc);
        j += 2;
      }
      const int64_t full_end = last > n ? last - 2 : last;
      for (; j < full_end; j += 2) {
        next_v.next();
        values_pair<false, false>(values, j, d0, lo_acc, hi_acc);
      }
      if (j < last) values_pair<false, true>(values, j, d0, lo_acc, hi_acc);
      for (int c = 0; c < DC; ++c) {
        for (int g = 0; g < G; ++g) {
          _mm512_storeu_ps(acc[g] + d0 + 32 * c, lo_acc[c][g]);
          _mm512_storeu_ps(acc[g] + d0 + 32 * c + 16, hi_acc[c][g]);
        }
      }
    }
    next_v.rest();
  }

  void finish(BFloat16* out, const float* sinks) {
    alignas(64) float row[32];
    for (int g = 0; g < G; ++g) {
      const __m512 inv = _mm512_set1_ps(softmax_inv(run_sum[g], run_max[g], sinks, g));
      for (int d0 = 0; d0 < DIM; d0 += 32) {
        const __m512 lo = _mm512_loadu_ps(acc[g] + d0);
        const __m512 hi = _mm512_loadu_ps(acc[g] + d0 + 16);
        _mm512_store_ps(row, _mm512_mul_ps(inv, _mm512_permutex2var_ps(
                                                    lo, bf16_head::order_first(), hi)));
        _mm512_store_ps(row + 16, _mm512_mul_ps(inv, _mm512_permutex2var_ps(
                                                         lo, bf16_head::order_second(), hi)));
        // rounded as PyTorch rounds (vcvtneps2bf16 flushes denormals)
#pragma omp simd
        for (int d = 0; d < 32; ++d) store(out + g * DIM + d0, d, row[d]);
      }
    }
  }
};

}  // namespace hpu_serve

#endif

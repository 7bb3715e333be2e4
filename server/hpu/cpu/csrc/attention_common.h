// Pieces every decode attention head shares (paged_attention.h, decode_head_bf16.h): the
// op's arguments, the online softmax of one block, the variants' position rules, and the
// paced prefetch of the next block.
#pragma once

#include <vector>

#include "kernel_utils.h"


namespace hpu_serve {

struct AttentionArgs {
  at::Tensor query, k_cache, v_cache, block_tables, seq_lens, out;
  float scale;
  int64_t window;  // 0: none
  float softcap;   // 0: none
  int64_t chunk = 0;  // 0: none
  const float* sinks = nullptr;  // [query heads] fp32 sink logits; nullptr: none
};

// 1 / the softmax denominator of query head g: the running sum (relative to run_max), plus
// the head's sink exp(sink - run_max) when there are sinks. An empty row (run_max -inf)
// gets 0, so its output is zeros, not NaN.
inline float softmax_inv(float run_sum, float run_max, const float* sinks, int64_t g) {
  float denom = run_sum;
  if (sinks != nullptr) denom += std::exp(sinks[g] - run_max);
  return denom > 0.f && std::isfinite(denom) ? 1.f / denom : 0.f;
}

// The sinks of kv head h's G query heads (nullptr: none).
inline const float* head_sinks(const float* sinks, int64_t h, int64_t groups) {
  return sinks == nullptr ? nullptr : sinks + h * groups;
}

// The first key position a row with `len` tokens sees (its query is the last of them):
// the later of its window's start and its chunk's.
inline int64_t first_visible(int64_t len, int64_t window, int64_t chunk) {
  const int64_t from = window > 0 ? std::max<int64_t>(len - window, 0) : 0;
  return chunk > 0 && len > 0 ? std::max<int64_t>(from, (len - 1) / chunk * chunk) : from;
}

// Scores p[0..n) -> cap * tanh(p / cap), as the PyTorch path caps them (cap 0: none).
inline void cap_scores(float* p, int64_t n, float softcap) {
  if (softcap <= 0.f) return;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) p[j] = fast_tanh(p[j] / softcap) * softcap;
}

// Attention of one (row, kv head): its query heads against the row's cached keys/values,
// block by block, with an online softmax in fp32. Each key and value is read once for all
// the query heads that share it. A block step sees slots [lo, n) of its block (lo > 0 only
// in the first block a window reaches; n < block only in the row's last one).

// The softmax part of one block for query head g: probs p[0..n) hold the scores on entry
// and exp(score - running max) on exit; the running sum and the accumulated output (dim
// floats) are rescaled when the max grows.
inline void softmax_block(float* p, int64_t n, float& run_max, float& run_sum, float* acc,
                          int64_t dim) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // 16 lanes by hand: GCC leaves the reduction below as a scalar vmaxss chain (measured
  // ~10% of the decode kernel); a max is exact in any order
  f32x16 lanes = f32x16{} + neg_inf;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const f32x16 x = load16(p + j);
    lanes = x > lanes ? x : lanes;
  }
  float block_max = neg_inf;
  for (int l = 0; l < 16; ++l) block_max = std::max(block_max, lanes[l]);
  for (; j < n; ++j) block_max = std::max(block_max, p[j]);
  const float new_max = std::max(run_max, block_max);
  // 0 on the first block (run_max is -inf there), 1 while the max holds.
  const float correction = run_max == neg_inf ? 0.f : fast_exp(run_max - new_max);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    p[j] = fast_exp(p[j] - new_max);
    sum += p[j];
  }
  run_sum = run_sum * correction + sum;
  run_max = new_max;
  if (correction != 1.f) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] *= correction;
  }
}

// The next block's keys or values, requested a few cache lines per inner iteration of the
// block in hand. A whole block's worth of prefetches issued at once (32 KiB for SmolLM2's
// 128-token blocks) fills the core's miss queue and stalls it until the lines arrive, so
// reading and computing alternated instead of overlapping. The lines go to L2 (prefetcht1):
// into L1 they evicted the block in hand (SmolLM2, batch 32, 30 layers, 2 threads: whole
// blocks at once 12-15 ms, paced into L1 9-14 ms, paced into L2 8-9.5 ms, one run).
struct Drip {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t per = 0;  // lines per call of next()

  Drip() = default;
  Drip(const void* from, int64_t bytes) : p(static_cast<const char*>(from)), end(p + bytes) {}
  // Spread what is left over `iterations` calls of next().
  void pace(int64_t iterations) {
    const int64_t lines = (end - p + 63) / 64;
    per = iterations > 0 ? (lines + iterations - 1) / iterations : lines;
  }
  void next() {
    for (int64_t i = 0; i < per && p < end; ++i, p += 64) {
      __builtin_prefetch(p, 0, 2);
    }
  }
  void rest() {
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 2);
  }
};

}  // namespace hpu_serve

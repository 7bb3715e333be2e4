// torch.ops.hpu_serve.prefill_attention: tiled (flash-style) causal attention for prompt
// chunks, keys and values read in place from the paged cache.
//
// The paged kernel (paged_attention.h) runs a prompt chunk one row per token, four at a
// time, with fp32 vector FMAs: each key is widened and multiplied once per four tokens. Here
// a tile of qtok consecutive tokens of one sequence, all G query heads of a kv head (qtok x G
// rows), meets KT keys at a time as two small GEMMs:
//   scores [rows, KT] = Q [rows, D] x K^T      (then scale, causal mask, online softmax)
//   O [rows, D]      += P [rows, KT] x V [KT, D]
// With AVX-512 BF16 (bf16 models) both run on `vdpbf16ps`, 32 multiply-adds of bf16 pairs
// per instruction into fp32: the key/value tile is packed once into the pair-interleaved
// layout the instruction reads ([pairs][columns][2]) and serves every row of the tile. The
// softmax stays in fp32 (running max and sum per row); the probabilities are rounded to bf16
// for P x V, as PyTorch's attention rounds them in a bf16 model. fp32 models (and bf16 ones on
// CPUs without BF16 instructions) take the same tiles with fp32 FMAs.
//
// The plain case only: no window, chunk, soft cap or sinks, the cache in the query's dtype,
// head sizes that are a multiple of 64, blocks of a multiple of 16 tokens. The caller
// (server/hpu/cpu/layer_ops.py) sends the other variants to decode_attention. Rows that are
// not part of a run of at least `min_run` consecutive tokens of one sequence (decodes riding
// in the chunk's batch) go to decode_attention too, from here.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HPU_SERVE_BF16_DOT 1
#endif

#include <atomic>
#include <numeric>
#include <vector>

#include "kernel_utils.h"

namespace hpu_serve {
namespace {

constexpr int KT = 64;     // keys per tile: the score tile's columns
// Query tokens per tile (times G query heads: the tile's rows): every tile packs the keys it
// reads, so longer tiles pack less per score (a 512-token chunk at 7.5k of context: 32.1 ms
// at 32, 30.3 ms at 64, SmolLM2's heads, 2 threads), but give the threads fewer items.
constexpr int QTOK_LONG = 64;
constexpr int QTOK_SHORT = 32;
constexpr int ROWS = 6;    // rows per register block: 6 x 4 accumulators + 4 operands + 1
constexpr int COLS = 64;   // columns per register block (4 x 16 fp32 lanes)

// ---- microkernels: C[rows, 64] (+)= A[rows, K] x B, B packed [K / PACK][ldb] -------------
// PACK 1: elements fp32, B[k][col]. PACK 2: bf16 bits, B[k/2][col][2] (pairs of k).

template <int R>
inline void block_f32(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k,
                      float* c, int64_t ldc, bool accumulate) {
  f32x16 acc[R][4];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 4; ++j) acc[i][j] = accumulate ? load16(c + i * ldc + 16 * j) : f32x16{};
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* bk = b + kk * ldb;
    const f32x16 b0 = load16(bk), b1 = load16(bk + 16), b2 = load16(bk + 32),
                 b3 = load16(bk + 48);
    for (int i = 0; i < R; ++i) {
      const float x = a[i * lda + kk];
      acc[i][0] += x * b0;
      acc[i][1] += x * b1;
      acc[i][2] += x * b2;
      acc[i][3] += x * b3;
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 4; ++j) store16(c + i * ldc + 16 * j, acc[i][j]);
  }
}

#ifdef HPU_SERVE_BF16_DOT
template <int R>
inline void block_bf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                       int64_t k, float* c, int64_t ldc, bool accumulate) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 4; ++j) {
      acc[i][j] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * j) : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < k / 2; ++p) {
    const uint16_t* bp = b + p * ldb;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + 32);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(bp + 64);
    const __m512bh b3 = (__m512bh)_mm512_loadu_si512(bp + 96);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, b1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], x, b2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], x, b3);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(c + i * ldc + 16 * j, acc[i][j]);
  }
}
#endif

template <typename E, int R>
inline void block_any(const E* a, int64_t lda, const E* b, int64_t ldb, int64_t k, float* c,
                      int64_t ldc, bool accumulate) {
  if constexpr (std::is_same_v<E, float>) {
    block_f32<R>(a, lda, b, ldb, k, c, ldc, accumulate);
  } else {
#ifdef HPU_SERVE_BF16_DOT
    block_bf16<R>(a, lda, b, ldb, k, c, ldc, accumulate);
#endif
  }
}

// C[rows, 64] (+)= A[rows, k] x B: ROWS rows per register block, then the remainder.
template <typename E>
void gemm_rows(int64_t rows, const E* a, int64_t lda, const E* b, int64_t ldb, int64_t k,
               float* c, int64_t ldc, bool accumulate) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) {
    block_any<E, ROWS>(a + r * lda, lda, b, ldb, k, c + r * ldc, ldc, accumulate);
  }
  switch (rows - r) {
    case 1: block_any<E, 1>(a + r * lda, lda, b, ldb, k, c + r * ldc, ldc, accumulate); break;
    case 2: block_any<E, 2>(a + r * lda, lda, b, ldb, k, c + r * ldc, ldc, accumulate); break;
    case 3: block_any<E, 3>(a + r * lda, lda, b, ldb, k, c + r * ldc, ldc, accumulate); break;
    case 4: block_any<E, 4>(a + r * lda, lda, b, ldb, k, c + r * ldc, ldc, accumulate); break;
    case 5: block_any<E, 5>(a + r * lda, lda, b, ldb, k, c + r * ldc, ldc, accumulate); break;
    default: break;
  }
}

// ---- packing -----------------------------------------------------------------------------

// One element of T as the packed element E (bf16 bits stay bits; fp32 widens).
template <typename E, typename T>
inline E element(const T* p, int64_t i) {
  if constexpr (std::is_same_v<E, float>) {
    return load(p, i);
  } else {
    return reinterpret_cast<const uint16_t*>(p)[i];
  }
}

inline uint16_t to_element(float v, uint16_t*) { return float_to_bf16_bits(v); }
inline float to_element(float v, float*) { return v; }

// 16 keys of one block (transposed: keys_t [D, block], from slot s) into tile columns
// [j, j + 16): kp [D / PACK][KT * PACK].
template <typename E, typename T, int PACK>
inline void pack_keys16(const T* keys_t, int64_t block, int64_t s, int64_t dim, E* kp,
                        int64_t j) {
#ifdef HPU_SERVE_BF16_DOT
  if constexpr (PACK == 2) {
    // out[2i] = row 2p [i], out[2i + 1] = row 2p + 1 [i]
    alignas(64) static const uint16_t order[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                   37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i idx = _mm512_load_si512(order);
    const uint16_t* src = reinterpret_cast<const uint16_t*>(keys_t) + s;
    for (int64_t p = 0; p < dim / 2; ++p) {
      const __m512i lo = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * p * block)));
      const __m512i hi = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (2 * p + 1) * block)));
      _mm512_storeu_si512(kp + p * KT * 2 + j * 2, _mm512_permutex2var_epi16(lo, idx, hi));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) {
    for (int64_t i = 0; i < 16; ++i) {
      kp[(d / PACK) * KT * PACK + (j + i) * PACK + d % PACK] =
          element<E>(keys_t, d * block + s + i);
    }
  }
}

// Keys j and j + 1 (values [block, D] rows s, s + 1; j even) into vp [KT / PACK][D * PACK].
template <typename E, typename T, int PACK>
inline void pack_values2(const T* values, int64_t s, int64_t dim, E* vp, int64_t j) {
#ifdef HPU_SERVE_BF16_DOT
  if constexpr (PACK == 2) {
    alignas(64) static const uint16_t lo_order[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t hi_order[32] = {
        16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo_idx = _mm512_load_si512(lo_order);
    const __m512i hi_idx = _mm512_load_si512(hi_order);
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(values) + s * dim;
    const uint16_t* r1 = r0 + dim;
    E* dst = vp + (j / 2) * dim * 2;
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + d0);
      const __m512i b = _mm512_loadu_si512(r1 + d0);
      _mm512_storeu_si512(dst + 2 * d0, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(dst + 2 * d0 + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
    return;
  }
#endif
  for (int64_t t = 0; t < 2; ++t) {
    for (int64_t d = 0; d < dim; ++d) {
      vp[((j + t) / PACK) * dim * PACK + d * PACK + (j + t) % PACK] =
          element<E>(values, (s + t) * dim + d);
    }
  }
}

// ---- the tiles -------------------------------------------------------------------------

#ifdef HPU_SERVE_BF16_DOT
// fast_exp (kernel_utils.h) on 16 lanes, written out: GCC's vectorisation of the scalar one
// spends ~2x the instructions (the clamps, floor and exponent bits in integer lanes), and
// with a head of 64 the softmax was a third of a tile's work. Same range reduction and
// polynomial; the scale by 2^n is vscalefps. x <= 0 here (a score minus the running max).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
                                 _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// One row of a score tile: the max of its first `seen` scaled scores with `old_max` (into
// new_max), their exponentials against it as bf16 probabilities into p (0 past seen), and
// the sum of the fp32 exponentials.
inline void softmax_tile_bf16(const float* s, uint16_t* p, int64_t seen, float scale,
                              float old_max, float& new_max, float& sum) {
  static_assert(KT == 64, "four vectors of 16 scores");
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 mask[4];
  __m512 x[4];
  __m512 m = ninf;
  for (int v = 0; v < 4; ++v) {
    const int64_t left = std::clamp<int64_t>(seen - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>((1u << left) - 1u);
    x[v] = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * v), vscale);
    m = _mm512_mask_max_ps(m, mask[v], m, x[v]);
  }
  new_max = std::max(old_max, _mm512_reduce_max_ps(m));
  const __m512 vmax = _mm512_set1_ps(new_max);
  __m512 total = _mm512_setzero_ps();
  for (int v = 0; v < 4; v += 2) {
    const __m512 e0 = _mm512_maskz_mov_ps(mask[v], exp16(_mm512_sub_ps(x[v], vmax)));
    const __m512 e1 = _mm512_maskz_mov_ps(mask[v + 1], exp16(_mm512_sub_ps(x[v + 1], vmax)));
    total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
    // lanes 0-15 from e0, 16-31 from e1; round to nearest even, as float_to_bf16_bits
    _mm512_storeu_si512(p + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  sum = _mm512_reduce_add_ps(total);
}
#endif

struct Run {
  int64_t first, count;  // rows [first, first + count): consecutive tokens of one sequence
};

struct Item {
  int64_t first, count, h, keys;  // query rows of one tile, kv head, keys the tile reads
};

struct Problem {
  const at::Tensor& query;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const int32_t* tables;
  const int32_t* lens;
  int64_t width;
  float scale;
  at::Tensor& out;
};

// Scratch of one thread, reused across its items.
template <typename E>
struct Tile {
  std::vector<E> q, kp, vp, p;
  std::vector<float> s, o, run_max, run_sum;
  Tile(int64_t rows, int64_t dim)
      : q(rows * dim), kp(KT * dim), vp(KT * dim), p(rows * KT), s(rows * KT), o(rows * dim),
        run_max(rows), run_sum(rows) {}
};

// Packs keys [k0, k0 + kn) of the sequence with block table `table`, kv head h; columns
// [kn, KT) are zero (no weight, and no stale slot can carry a NaN into P x V).
template <typename E, typename T, int PACK>
void pack_tile(const Problem& pr, Tile<E>& tile, const int32_t* table, int64_t h, int64_t k0,
               int64_t kn) {
  const int64_t block = pr.v_cache.size(2);
  const int64_t dim = pr.v_cache.size(3);
  const int64_t num_blocks = pr.k_cache.size(0);
  const int64_t head_elems = block * dim;
  const int64_t block_elems = pr.k_cache.size(1) * head_elems;
  const T* kc = pr.k_cache.data_ptr<T>();
  const T* vc = pr.v_cache.data_ptr<T>();
  if (kn < KT) {
    std::fill(tile.kp.begin(), tile.kp.end(), E{});
    std::fill(tile.vp.begin(), tile.vp.end(), E{});
  }
  for (int64_t j = 0; j < kn; j += 16) {
    const int64_t pos = k0 + j;
    const int64_t blk = table[pos / block];
    TORCH_CHECK(blk >= 0 && blk < num_blocks, "block ", blk, " out of the cache");
    const int64_t s = pos % block;  // 16-aligned: block is a multiple of 16
    const T* keys_t = kc + blk * block_elems + h * head_elems;
    const T* values = vc + blk * block_elems + h * head_elems;
    const int64_t n = std::min<int64_t>(16, kn - j);
    if (n == 16) {
      pack_keys16<E, T, PACK>(keys_t, block, s, dim, tile.kp.data(), j);
    } else {
      for (int64_t d = 0; d < dim; ++d) {
        for (int64_t i = 0; i < n; ++i) {
          tile.kp[(d / PACK) * KT * PACK + (j + i) * PACK + d % PACK] =
              element<E>(keys_t, d * block + s + i);
        }
      }
    }
    for (int64_t i = 0; i + 1 < n; i += 2) {
      pack_values2<E, T, PACK>(values, s + i, dim, tile.vp.data(), j + i);
    }
    if (n % 2 == 1) {  // the last key alone: its pair partner stays zero
      for (int64_t d = 0; d < dim; ++d) {
        tile.vp[((j + n - 1) / PACK) * dim * PACK + d * PACK + (j + n - 1) % PACK] =
            element<E>(values, (s + n - 1) * dim + d);
      }
    }
  }
}

// One item: `count` consecutive tokens from row `first` (lengths ascending by one), the G
// query heads of kv head h.
template <typename E, typename T, int PACK>
void tile_attention(const Problem& pr, Tile<E>& tile, const Item& it, int64_t groups) {
  const int64_t dim = pr.v_cache.size(3);
  const int64_t rows = it.count * groups;
  const int64_t q_row = pr.query.stride(0);
  const int64_t q_head = pr.query.stride(1);
  const int64_t num_heads = pr.query.size(1);
  const T* qp = pr.query.data_ptr<T>();
  for (int64_t t = 0; t < it.count; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = qp + (it.first + t) * q_row + (it.h * groups + g) * q_head;
      E* dst = tile.q.data() + (t * groups + g) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = element<E>(src, d);
    }
  }
  std::fill(tile.o.begin(), tile.o.begin() + rows * dim, 0.f);
  std::fill(tile.run_max.begin(), tile.run_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(tile.run_sum.begin(), tile.run_sum.end(), 0.f);
  const int32_t* table = pr.tables + it.first * pr.width;
  const float scale = pr.scale;
  for (int64_t k0 = 0; k0 < it.keys; k0 += KT) {
    const int64_t kn = std::min<int64_t>(KT, it.keys - k0);
    pack_tile<E, T, PACK>(pr, tile, table, it.h, k0, kn);
    gemm_rows<E>(rows, tile.q.data(), dim, tile.kp.data(), KT * PACK, dim, tile.s.data(), KT,
                 false);
    for (int64_t r = 0; r < rows; ++r) {
      float* s = tile.s.data() + r * KT;
      E* p = tile.p.data() + r * KT;
      // the query at position len - 1 sees keys [0, len): the causal mask, diagonal tiles only
      const int64_t seen = std::min<int64_t>(
          std::max<int64_t>(pr.lens[it.first + r / groups] - k0, 0), kn);
      const float old_max = tile.run_max[r];
      float new_max, sum;
#ifdef HPU_SERVE_BF16_DOT
      if constexpr (PACK == 2) {
        softmax_tile_bf16(s, reinterpret_cast<uint16_t*>(p), seen, scale, old_max, new_max,
                          sum);
      } else
#endif
      {
        float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
        for (int64_t j = 0; j < seen; ++j) block_max = std::max(block_max, s[j] * scale);
        new_max = std::max(old_max, block_max);
        sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < KT; ++j) {
          const float e = j < seen ? fast_exp(s[j] * scale - new_max) : 0.f;
          sum += e;
          s[j] = e;
        }
        for (int64_t j = 0; j < KT; ++j) p[j] = to_element(s[j], p);
      }
      if (seen == 0) continue;
      // 0 on the row's first tile (its max was -inf), 1 while the max holds
      const float correction =
          old_max == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(old_max - new_max);
      tile.run_sum[r] = tile.run_sum[r] * correction + sum;
      tile.run_max[r] = new_max;
      if (correction != 1.f) {
        float* o = tile.o.data() + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] *= correction;
      }
    }
    for (int64_t c0 = 0; c0 < dim; c0 += COLS) {
      gemm_rows<E>(rows, tile.p.data(), KT, tile.vp.data() + c0 * PACK, dim * PACK, KT,
                   tile.o.data() + c0, dim, true);
    }
  }
  T* op = pr.out.data_ptr<T>();
  for (int64_t t = 0; t < it.count; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r = t * groups + g;
      const float sum = tile.run_sum[r];
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // an empty row: zeros, not NaN
      T* dst = op + ((it.first + t) * num_heads + it.h * groups + g) * dim;
      const float* o = tile.o.data() + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) store(dst, d, o[d] * inv);
    }
  }
}

template <typename E, typename T, int PACK>
void run_items(const Problem& pr, const std::vector<Item>& items, int64_t groups,
               int64_t qtok) {
  const int64_t dim = pr.v_cache.size(3);
  // Threads pull the items (heaviest first) from a shared counter: a causal chunk's tiles
  // differ in cost, and a static split would leave one thread the long ones.
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), total);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Tile<E> tile(qtok * groups, dim);
    for (int64_t i = next++; i < total; i = next++) {
      tile_attention<E, T, PACK>(pr, tile, items[i], groups);
    }
  });
}

// Runs of at least `min_run` consecutive tokens of one sequence (the same block table, one
// more token each row).
std::vector<Run> find_runs(const int32_t* tables, const int32_t* lens, int64_t rows,
                           int64_t width, int64_t min_run) {
  std::vector<Run> runs;
  int64_t first = 0;
  for (int64_t r = 1; r <= rows; ++r) {
    const bool same = r < rows && lens[r] == lens[r - 1] + 1 &&
                      std::memcmp(tables + r * width, tables + (r - 1) * width,
                                  width * sizeof(int32_t)) == 0;
    if (!same) {
      if (r - first >= min_run) runs.push_back({first, r - first});
      first = r;
    }
  }
  return runs;
}

using DecodeOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double, int64_t, double,
                            int64_t, const std::optional<at::Tensor>&);

// query [rows, Hq, D] (rows and heads may be strided), caches keys [blocks, Hkv, D, B] and
// values [blocks, Hkv, B, D] in the query's dtype, block_tables int32 [rows, width],
// seq_lens int32 [rows] (tokens of each row's sequence up to and including its own), as
// decode_attention takes them -> [rows, Hq, D]. Runs of >= min_run rows are tiled; the
// other rows go to decode_attention.
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, int64_t min_run) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.stride(2) == 1,
              "query must be a CPU [rows, heads, head_dim] tensor, unit stride in head_dim");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "query must be fp32 or bf16");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "caches must be in the query's dtype");
  check_cache(k_cache, query, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  check_cache_layout(k_cache, v_cache, k_cache.size(1), query.size(2));
  const int64_t rows = query.size(0);
  const int64_t dim = query.size(2);
  const int64_t block = v_cache.size(2);
  TORCH_CHECK(dim % COLS == 0, "head_dim must be a multiple of ", COLS);
  TORCH_CHECK(block % 16 == 0, "block_size must be a multiple of 16");
  TORCH_CHECK(query.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == rows,
              "block_tables must be int32 [rows, width]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == rows,
              "seq_lens must be int32 [rows]");
  TORCH_CHECK(min_run >= 1, "min_run must be >= 1");
  const int64_t width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= width * block, "seq_len ", lens[r], " of row ", r,
                " is outside its block table");
  }
  at::Tensor out = at::empty({rows, query.size(1), dim}, query.options());
  const std::vector<Run> runs = find_runs(tables, lens, rows, width, min_run);
  const int64_t kv_heads = k_cache.size(1);
  const int64_t groups = query.size(1) / kv_heads;
  std::vector<Item> items;
  std::vector<bool> tiled(rows, false);
  int64_t long_items = 0;
  for (const Run& run : runs) long_items += (run.count + QTOK_LONG - 1) / QTOK_LONG * kv_heads;
  // long tiles while they still give every thread four items to pull
  const int64_t qtok = long_items >= 4 * at::get_num_threads() ? QTOK_LONG : QTOK_SHORT;
  for (const Run& run : runs) {
    for (int64_t t0 = 0; t0 < run.count; t0 += qtok) {
      const int64_t count = std::min<int64_t>(qtok, run.count - t0);
      for (int64_t h = 0; h < kv_heads; ++h) {
        items.push_back({run.first + t0, count, h, lens[run.first + t0 + count - 1]});
      }
    }
    std::fill(tiled.begin() + run.first, tiled.begin() + run.first + run.count, true);
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.keys * a.count > b.keys * b.count;
  });
  Problem pr{query, k_cache, v_cache, tables, lens, width, static_cast<float>(scale), out};
  if (!items.empty()) {
    if (dtype == at::kFloat) {
      run_items<float, float, 1>(pr, items, groups, qtok);
    } else {
#ifdef HPU_SERVE_BF16_DOT
      run_items<uint16_t, BFloat16, 2>(pr, items, groups, qtok);
#else
      run_items<float, BFloat16, 1>(pr, items, groups, qtok);
#endif
    }
  }
  std::vector<int64_t> rest;
  for (int64_t r = 0; r < rows; ++r) {
    if (!tiled[r]) rest.push_back(r);
  }
  if (!rest.empty()) {
    static auto decode = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("hpu_serve::decode_attention", "")
                             .typed<DecodeOp>();
    const at::Tensor index = at::tensor(rest, at::kLong);
    const at::Tensor part =
        decode.call(query.index_select(0, index), k_cache, v_cache,
                    block_tables.index_select(0, index), seq_lens.index_select(0, index), scale,
                    0, 0., 0, std::nullopt);
    out.index_copy_(0, index, part);
  }
  return out;
}

}  // namespace
}  // namespace hpu_serve

TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def(
      "prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int min_run=16) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) {
  m.impl("prefill_attention", &hpu_serve::prefill_attention);
}

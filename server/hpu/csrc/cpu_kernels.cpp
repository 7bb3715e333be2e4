// Fused CPU kernels for the eager decode path (torch.ops.hpu_serve.*).
//
// Why they exist: a decode step of a small model on CPU runs ~60 PyTorch ops per layer, and
// at a few rows per batch their dispatch cost, not their arithmetic, is most of the step.
// Each kernel here does the arithmetic of several of those ops in one call, rounding to the
// storage dtype exactly where the PyTorch path rounds, so bf16 results match it. Decode
// attention also reads every cached K/V row once, straight from its block, where the
// PyTorch path first gathers the blocks into a copy.
//
// Cache layout (per layer, slot = block * block_size + offset): values
// [num_blocks + 1, kv_heads, block_size, head_dim] as everywhere in the engine, keys
// transposed within each block, [num_blocks + 1, kv_heads, head_dim, block_size], so that
// decode attention computes 16 tokens' scores per vector instruction without horizontal
// sums. Only these kernels read or write that key layout (FusedCpuLayerOps views the
// engine's zero-filled cache that way when it takes over).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using c10::BFloat16;

// Loads and stores by element, widening to / rounding from fp32. bf16 goes through its raw
// bits (the top half of an fp32) so that loops over it vectorise.
inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t nearest_even = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? 0x7FC0u : nearest_even);  // as PyTorch's cast
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const BFloat16* p, int64_t i) {
  return bits_to_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(BFloat16* p, int64_t i, float v) {
  reinterpret_cast<uint16_t*>(p)[i] = float_to_bf16_bits(v);
}

// A float rounded through T and back: where the PyTorch path stores an intermediate in the
// model dtype, so does the kernel.
template <typename T>
inline float rounded(float v) {
  return v;
}
template <>
inline float rounded<BFloat16>(float v) {
  return bits_to_float(static_cast<uint32_t>(float_to_bf16_bits(v)) << 16);
}

// exp(x) for x in fp32, written so loops over it vectorise (std::exp is a scalar call):
// 2^n * e^r with n = round(x / ln 2) and a degree-6 polynomial on |r| <= ln 2 / 2 (the Cephes
// expf coefficients); within 2 ulp of std::exp above -87, below 1e-37 under it.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

template <typename T>
float sum_of_squares(const T* x, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(x, i);
    sum += v * v;
  }
  return sum;
}

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(T): the Llama RMSNorm of Hugging Face,
// normalising in fp32 and scaling by the weight in the model dtype.
template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  const float rstd = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    store(out, i, load(weight, i) * rounded<T>(load(x, i) * rstd));
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

template <typename T>
void add_rms_norm_impl(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                       at::Tensor& out, double eps) {
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  T* rp = residual.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = rp + r * n;
      const T* add = xp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        store(row, i, load(row, i) + load(add, i));
      }
      norm_row(row, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(-1),
              "weight must be a contiguous [hidden] tensor of x's dtype");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_impl<BFloat16>(x, weight, out, eps);
  } else {
    rms_norm_impl<float>(x, weight, out, eps);
  }
  return out;
}

// residual += x (rounded to the model dtype, as `residual + x` would be), then returns
// rms_norm(residual): the residual add of one sublayer fused with the next one's norm.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                         double eps) {
  check_rows(residual, "residual");
  check_rows(x, "x");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x must match residual");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(-1),
              "weight must be a contiguous [hidden] tensor of x's dtype");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    add_rms_norm_impl<BFloat16>(residual, x, weight, out, eps);
  } else {
    add_rms_norm_impl<float>(residual, x, weight, out, eps);
  }
  return out;
}

// silu(gate) * up for x = [gate | up] along the last dim; silu's result is rounded to the
// model dtype before the product, as `F.silu(gate) * up` does.
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t width = out.size(-1);
  const int64_t rows = out.numel() / width;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * width;
      const T* up = gate + width;
      T* o = op + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = load(gate, i);
        store(o, i, rounded<T>(g / (1.f + fast_exp(-g))) * load(up, i));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(-1) % 2 == 0, "the last dim of x must be even");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    silu_and_mul_impl<BFloat16>(x, out);
  } else {
    silu_and_mul_impl<float>(x, out);
  }
  return out;
}

// keys [blocks, Hkv, D, B] (transposed blocks), values [blocks, Hkv, B, D].
void check_cache_layout(const at::Tensor& k_cache, const at::Tensor& v_cache,
                        int64_t num_kv_heads, int64_t dim) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == num_kv_heads && v_cache.size(1) == num_kv_heads &&
                  k_cache.size(2) == dim && v_cache.size(3) == dim &&
                  k_cache.size(3) == v_cache.size(2),
              "caches must be keys [blocks, kv_heads, head_dim, block_size] and values "
              "[blocks, kv_heads, block_size, head_dim]");
}

// Rotate-half RoPE of one head in place: x * cos + cat(-x2, x1) * sin, each product and the
// sum rounded to T like the PyTorch expression in the model dtype.
template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t dim, float* tmp) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) tmp[d] = load(x, d);
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float a = rounded<T>(tmp[d] * load(cos, d));
    const float b = rounded<T>(-tmp[d + half] * load(sin, d));
    store(x, d, a + b);
  }
#pragma omp simd
  for (int64_t d = half; d < dim; ++d) {
    const float a = rounded<T>(tmp[d] * load(cos, d));
    const float b = rounded<T>(tmp[d - half] * load(sin, d));
    store(x, d, a + b);
  }
}

template <typename T>
void rotary_write_kv_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                          int64_t num_heads, int64_t num_kv_heads) {
  const int64_t tokens = qkv.size(0);
  const int64_t dim = cos.size(-1);
  const int64_t block = v_cache.size(2);
  T* base = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t row = (num_heads + 2 * num_kv_heads) * dim;
  const int64_t num_slots = k_cache.size(0) * block;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(dim);
    for (int64_t t = begin; t < end; ++t) {
      T* x = base + t * row;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        rotate_head(x + h * dim, cp + t * dim, sp + t * dim, dim, tmp.data());
      }
      // Checked here rather than with min()/max() ops: those would cost more than the kernel.
      TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " out of the cache");
      const int64_t blk = slot[t] / block;
      const int64_t off = slot[t] % block;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const T* key = x + (num_heads + h) * dim;
        T* key_dst = kc + (blk * num_kv_heads + h) * dim * block + off;  // [dim, block]
        for (int64_t d = 0; d < dim; ++d) key_dst[d * block] = key[d];
        std::memcpy(vc + ((blk * num_kv_heads + h) * block + off) * dim,
                    x + (num_heads + num_kv_heads + h) * dim, dim * sizeof(T));
      }
    }
  });
}

// qkv [tokens, (Hq + 2 Hkv) * D]: queries and keys rotated in place, then every token's key
// and value copied into its cache slot (pad tokens point at the pad block).
void rotary_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                     int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  check_rows(k_cache, "k_cache");
  check_rows(v_cache, "v_cache");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "qkv, cos, sin and the caches must share a dtype");
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == qkv.size(0),
              "qkv must be [tokens, width], cos/sin [tokens, head_dim]");
  const int64_t dim = cos.size(1);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim,
              "qkv width must be (num_heads + 2 * num_kv_heads) * head_dim");
  check_cache_layout(k_cache, v_cache, num_kv_heads, dim);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == qkv.size(0),
              "slot_mapping must be int64 [tokens]");
  if (dtype == at::kBFloat16) {
    rotary_write_kv_impl<BFloat16>(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                   num_kv_heads);
  } else {
    rotary_write_kv_impl<float>(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                num_kv_heads);
  }
}

// Attention of one (row, kv head): its query heads against the row's cached keys/values,
// block by block, with an online softmax in fp32. Each key and value is read once for all
// the query heads that share it.

// The softmax part of one block for query head g: probs p[0..n) hold the scores on entry
// and exp(score - running max) on exit; the running sum and the accumulated output (dim
// floats) are rescaled when the max grows.
inline void softmax_block(float* p, int64_t n, float& run_max, float& run_sum, float* acc,
                          int64_t dim) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float block_max = neg_inf;
#pragma omp simd reduction(max : block_max)
  for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, p[j]);
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

// Any head size, group count and block size: runtime loops (the fallback).
template <typename T>
struct GenericHead {
  int64_t dim, groups, block;
  std::vector<float> q, acc, probs, run_max, run_sum;

  GenericHead(int64_t dim_, int64_t groups_, int64_t block_)
      : dim(dim_), groups(groups_), block(block_), q(groups_ * dim_), acc(groups_ * dim_),
        probs(groups_ * block_), run_max(groups_), run_sum(groups_) {}

  void start(const T* query, int64_t head_stride, float scale) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = load(query + g * head_stride, d) * scale;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(run_sum.begin(), run_sum.end(), 0.f);
  }

  // n tokens of one block: keys_t [dim, block], values [block, dim].
  void block_step(const T* keys_t, const T* values, int64_t n) {
    for (int64_t g = 0; g < groups; ++g) {
      float* p = probs.data() + g * block;
      std::fill(p, p + n, 0.f);
      for (int64_t d = 0; d < dim; ++d) {
        const float qd = q[g * dim + d];
        for (int64_t j = 0; j < n; ++j) p[j] += qd * load(keys_t + d * block, j);
      }
      softmax_block(p, n, run_max[g], run_sum[g], acc.data() + g * dim, dim);
      float* a = acc.data() + g * dim;
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t d = 0; d < dim; ++d) a[d] += p[j] * load(values + j * dim, d);
      }
    }
  }

  void finish(T* out) {
    for (int64_t g = 0; g < groups; ++g) {
      // An empty sequence (never scheduled, but cheap to guard) yields zeros, not NaN.
      const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
      for (int64_t d = 0; d < dim; ++d) store(out + g * dim, d, acc[g * dim + d] * inv);
    }
  }
};

// 16 fp32 lanes (one AVX-512 register, two AVX2 ones, four NEON ones).
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline f32x16 load16(const BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// The common shapes (G query heads per kv head, head size DIM, blocks of a multiple of 16
// tokens) with G and DIM known at compile time: scores for 16 tokens accumulate in G
// registers from the transposed key block, one widening load per (head dim, 16 tokens);
// outputs accumulate 16 dims at a time in G registers, one widening load per (token, 16
// dims). Each key/value element is loaded and widened once.
template <typename T, int G, int DIM>
struct FastHead {
  int64_t block;
  alignas(64) float q[G][DIM];
  alignas(64) float acc[G][DIM];
  float run_max[G], run_sum[G];
  std::vector<float> probs;

  FastHead(int64_t, int64_t, int64_t block_) : block(block_), probs(G * block_) {}

  void start(const T* query, int64_t head_stride, float scale) {
    for (int g = 0; g < G; ++g) {
#pragma omp simd
      for (int d = 0; d < DIM; ++d) q[g][d] = load(query + g * head_stride, d) * scale;
      std::fill(acc[g], acc[g] + DIM, 0.f);
      run_max[g] = -std::numeric_limits<float>::infinity();
      run_sum[g] = 0.f;
    }
  }

  void block_step(const T* keys_t, const T* values, int64_t n) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      f32x16 s[G] = {};
      for (int d = 0; d < DIM; ++d) {
        const f32x16 k = load16(keys_t + d * block + j0);
        for (int g = 0; g < G; ++g) s[g] += q[g][d] * k;
      }
      for (int g = 0; g < G; ++g) store16(probs.data() + g * block + j0, s[g]);
    }
    for (int g = 0; g < G; ++g) {
      softmax_block(probs.data() + g * block, n, run_max[g], run_sum[g], acc[g], DIM);
    }
    for (int d0 = 0; d0 < DIM; d0 += 16) {
      f32x16 a[G];
      for (int g = 0; g < G; ++g) a[g] = load16(acc[g] + d0);
      for (int64_t j = 0; j < n; ++j) {
        const f32x16 v = load16(values + j * DIM + d0);
        for (int g = 0; g < G; ++g) a[g] += probs[g * block + j] * v;
      }
      for (int g = 0; g < G; ++g) store16(acc[g] + d0, a[g]);
    }
  }

  void finish(T* out) {
    for (int g = 0; g < G; ++g) {
      const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
#pragma omp simd
      for (int d = 0; d < DIM; ++d) store(out + g * DIM, d, acc[g][d] * inv);
    }
  }
};

// One decode token per row against its sequence's blocks; work items are (row, kv head).
template <typename T, typename Head>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t rows = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t block = v_cache.size(2);
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t q_row = query.stride(0);
  const int64_t q_head = query.stride(1);
  const int64_t table_width = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(0);
  const T* qp = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // Element offset of block b of row r, kv head h, in either cache (-1: past the row's end).
  auto block_offset = [&](int64_t r, int64_t h, int64_t b) -> int64_t {
    if (b * block >= lens[r]) return -1;
    const int64_t blk = tables[r * table_width + b];
    TORCH_CHECK(blk >= 0 && blk < num_blocks, "block ", blk, " out of the cache");
    return (blk * num_kv_heads + h) * block * dim;
  };
  // Blocks are short scattered streams (block x dim elements per head): the hardware
  // prefetcher ramps up too late on them (measured: ~10 GB/s from DRAM against 36 GB/s
  // from cache), so the next block is requested while this one is computed.
  const int64_t block_bytes = block * dim * static_cast<int64_t>(sizeof(T));
  auto prefetch = [&](int64_t offset) {
    if (offset < 0) return;
    const char* k = reinterpret_cast<const char*>(kc + offset);
    const char* v = reinterpret_cast<const char*>(vc + offset);
    for (int64_t i = 0; i < block_bytes; i += 64) {
      __builtin_prefetch(k + i);
      __builtin_prefetch(v + i);
    }
  };
  auto check_len = [&](int64_t r) {
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= table_width * block, "seq_len ", lens[r],
                " of row ", r, " exceeds its block table");
  };

  if (rows >= 2 * at::get_num_threads()) {
    // Enough rows to keep every thread busy: a thread takes whole rows and walks each
    // block's kv heads in memory order (one block's heads are contiguous), which streams
    // better than visiting the same block once per head.
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<Head> heads;
      for (int64_t h = 0; h < num_kv_heads; ++h) heads.emplace_back(dim, groups, block);
      for (int64_t r = begin; r < end; ++r) {
        check_len(r);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          heads[h].start(qp + r * q_row + h * groups * q_head, q_head, fscale);
        }
        const int64_t len = lens[r];
        for (int64_t start = 0, b = 0; start < len; start += block, ++b) {
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t next = h + 1 < num_kv_heads ? block_offset(r, h + 1, b)
                                                      : block_offset(r, 0, b + 1);
            prefetch(next >= 0 ? next : (r + 1 < end ? block_offset(r + 1, 0, 0) : -1));
            const int64_t offset = block_offset(r, h, b);
            heads[h].block_step(kc + offset, vc + offset, std::min(block, len - start));
          }
        }
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          heads[h].finish(op + (r * num_heads + h * groups) * dim);
        }
      }
    });
    return;
  }
  // Few rows (latency-bound small batches): split each row's kv heads across threads.
  at::parallel_for(0, rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Head head(dim, groups, block);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / num_kv_heads;
      const int64_t h = item % num_kv_heads;
      check_len(r);
      head.start(qp + r * q_row + h * groups * q_head, q_head, fscale);
      const int64_t len = lens[r];
      for (int64_t start = 0, b = 0; start < len; start += block, ++b) {
        const int64_t next = block_offset(r, h, b + 1);
        prefetch(next >= 0 ? next
                           : (item + 1 < end ? block_offset((item + 1) / num_kv_heads,
                                                            (item + 1) % num_kv_heads, 0)
                                             : -1));
        const int64_t offset = block_offset(r, h, b);
        head.block_step(kc + offset, vc + offset, std::min(block, len - start));
      }
      head.finish(op + (r * num_heads + h * groups) * dim);
    }
  });
}

template <typename T, int DIM>
bool dispatch_groups(int64_t groups, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale, at::Tensor& out) {
#define HPU_SERVE_GROUPS(G)                                                                 \
  case G:                                                                                  \
    decode_attention_impl<T, FastHead<T, G, DIM>>(query, k_cache, v_cache, block_tables,    \
                                                  seq_lens, scale, out);                   \
    return true;
  switch (groups) {
    HPU_SERVE_GROUPS(1)
    HPU_SERVE_GROUPS(2)
    HPU_SERVE_GROUPS(3)
    HPU_SERVE_GROUPS(4)
    HPU_SERVE_GROUPS(5)
    HPU_SERVE_GROUPS(6)
    HPU_SERVE_GROUPS(7)
    HPU_SERVE_GROUPS(8)
    default:
      return false;
  }
#undef HPU_SERVE_GROUPS
}

template <typename T>
void decode_attention_dispatch(const at::Tensor& query, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t groups = query.size(1) / k_cache.size(1);
  const int64_t dim = query.size(2);
  if (v_cache.size(2) % 16 == 0) {
    if (dim == 64 && dispatch_groups<T, 64>(groups, query, k_cache, v_cache, block_tables,
                                             seq_lens, scale, out)) {
      return;
    }
    if (dim == 128 && dispatch_groups<T, 128>(groups, query, k_cache, v_cache, block_tables,
                                               seq_lens, scale, out)) {
      return;
    }
  }
  decode_attention_impl<T, GenericHead<T>>(query, k_cache, v_cache, block_tables, seq_lens,
                                           scale, out);
}

// query [rows, Hq, D] (rows and heads may be strided, e.g. a view into qkv), caches as in
// check_cache_layout, block_tables int32 [rows, width], seq_lens int32 [rows] (tokens of
// each row, including the one being decoded) -> [rows, Hq, D].
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.stride(2) == 1,
              "query must be a CPU [rows, heads, head_dim] tensor, unit stride in head_dim");
  check_rows(k_cache, "k_cache");
  check_rows(v_cache, "v_cache");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "query must be fp32 or bf16");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "caches must have query's dtype");
  check_cache_layout(k_cache, v_cache, k_cache.size(1), query.size(2));
  TORCH_CHECK(query.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == query.size(0),
              "block_tables must be int32 [rows, width]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == query.size(0),
              "seq_lens must be int32 [rows]");
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  if (dtype == at::kBFloat16) {
    decode_attention_dispatch<BFloat16>(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                        out);
  } else {
    decode_attention_dispatch<float>(query, k_cache, v_cache, block_tables, seq_lens, scale, out);
  }
  return out;
}

// Index of each row's largest value (the first on ties, a NaN counting as largest), as
// torch.argmax(x, -1): PyTorch's CPU argmax is a scalar loop (2.2 ms for 64 x 49k logits
// measured, ~4% of a decode step). Here 16 lanes each keep their best value and its index
// in one vectorised pass, then the lanes reduce to the first index of the maximum.
typedef int32_t i32x16 __attribute__((vector_size(64)));

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t whole = n / 16 * 16;
  f32x16 best = f32x16{} + neg_inf;
  i32x16 where = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  i32x16 position = where;
  i32x16 nan = i32x16{};
  for (int64_t i = 0; i < whole; i += 16) {
    const f32x16 v = load16(row + i);
    const i32x16 better = v > best;
    best = better ? v : best;
    where = better ? position : where;
    nan |= v != v;
    position += 16;
  }
  float top = neg_inf;
  int64_t index = n;  // none yet
  for (int l = 0; l < 16; ++l) {
    if (nan[l]) {
      for (int64_t i = 0; i < n; ++i) {
        if (load(row, i) != load(row, i)) return i;
      }
    }
    if (whole > 0 && best[l] != neg_inf &&
        (best[l] > top || (best[l] == top && where[l] < index))) {
      top = best[l];
      index = where[l];
    }
  }
  for (int64_t i = whole; i < n; ++i) {
    const float v = load(row, i);
    if (v != v) return i;
    if (v > top) {
      top = v;
      index = i;
    }
  }
  return index == n ? 0 : index;  // all -inf: the first element, as torch
}

template <typename T>
void argmax_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
}

at::Tensor argmax(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dim");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor out = at::empty(shape, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kBFloat16) {
    argmax_impl<BFloat16>(x, out);
  } else {
    argmax_impl<float>(x, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(hpu_serve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "rotary_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.def(
      "decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_write_kv", &rotary_write_kv);
  m.impl("decode_attention", &decode_attention);
  m.impl("argmax", &argmax);
}

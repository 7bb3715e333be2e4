// Fused CPU kernels for the eager path of a decoder layer (torch.ops.hpu_serve.*): RMSNorm
// (with the residual add before it), SiLU x up and GeGLU, RoPE (whole or partial heads)
// with the KV-cache write (the model's dtype or fp8 e4m3), and greedy argmax. Decode
// attention is in paged_attention.cpp.
//
// Why they exist: a decode step of a small model on CPU runs ~60 PyTorch ops per layer, and
// at a few rows per batch their dispatch cost, not their arithmetic, is most of the step.
// Each kernel does the arithmetic of several of those ops in one call, rounding to the
// storage dtype exactly where the PyTorch path rounds, so bf16 results match it.
//
// Cache layout (per layer, slot = block * block_size + offset): values
// [num_blocks + 1, kv_heads, block_size, head_dim] as everywhere in the engine, keys
// transposed within each block, [num_blocks + 1, kv_heads, head_dim, block_size] (see
// paged_attention.cpp). Only these kernels read or write that key layout
// (FusedCpuLayerOps views the engine's zero-filled cache that way when it takes over).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "kernel_utils.h"

namespace hpu_serve {
namespace {

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
// normalising in fp32 and scaling by the weight in the model dtype. A float32 weight W
// under bf16 activations (Gemma's 1 + w) scales before the one rounding instead, as
// TorchLayerOps.rms_norm does.
template <typename T, typename W>
void norm_row(const T* x, const W* weight, T* out, int64_t n, float eps) {
  const float rstd = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  if constexpr (std::is_same_v<T, W>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      store(out, i, load(weight, i) * rounded<T>(load(x, i) * rstd));
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store(out, i, (load(x, i) * rstd) * load(weight, i));
  }
}

template <typename T, typename W>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  const T* xp = x.data_ptr<T>();
  const W* wp = weight.data_ptr<W>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

template <typename T, typename W>
void add_rms_norm_impl(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                       at::Tensor& out, double eps) {
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  T* rp = residual.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const W* wp = weight.data_ptr<W>();
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

// A [hidden] weight in x's dtype, or in float32 (Gemma's norms, kept in float).
void check_norm_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK((weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat) &&
                  weight.is_contiguous() && weight.numel() == x.size(-1),
              "weight must be a contiguous [hidden] tensor of x's dtype or float32");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_norm_weight(x, weight);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float, float>(x, weight, out, eps);
  } else if (weight.scalar_type() == at::kFloat) {
    rms_norm_impl<BFloat16, float>(x, weight, out, eps);
  } else {
    rms_norm_impl<BFloat16, BFloat16>(x, weight, out, eps);
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
  check_norm_weight(x, weight);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float, float>(residual, x, weight, out, eps);
  } else if (weight.scalar_type() == at::kFloat) {
    add_rms_norm_impl<BFloat16, float>(residual, x, weight, out, eps);
  } else {
    add_rms_norm_impl<BFloat16, BFloat16>(residual, x, weight, out, eps);
  }
  return out;
}

// act(gate) * up for x = [gate | up] along the last dim; act's result is rounded to the
// model dtype before the product, as `F.silu(gate) * up` does. GELU_TANH: GeGLU (Gemma),
// 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3), computed as the equal
// g / (1 + exp(-2y)), accurate where 1 + tanh(y) cancels.
template <typename T, bool GELU_TANH>
void gated_act_impl(const at::Tensor& x, at::Tensor& out) {
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
        const float z = GELU_TANH ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
        store(o, i, rounded<T>(g / (1.f + fast_exp(-z))) * load(up, i));
      }
    }
  });
}

template <bool GELU_TANH>
at::Tensor gated_act(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(-1) % 2 == 0, "the last dim of x must be even");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    gated_act_impl<BFloat16, GELU_TANH>(x, out);
  } else {
    gated_act_impl<float, GELU_TANH>(x, out);
  }
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) { return gated_act<false>(x); }
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) { return gated_act<true>(x); }

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

// Partial rotary embeddings (Phi-3/4's partial_rotary_factor): tables of rot < dim dims
// rotate a head's first rot dims, the rest pass through. C: the cache's dtype (T, or fp8
// e4m3 from the rounded T values, as `key.to(cache.dtype)` stores them).
template <typename T, typename C>
void rotary_write_kv_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                          int64_t num_heads, int64_t num_kv_heads) {
  const int64_t tokens = qkv.size(0);
  const int64_t rot = cos.size(-1);
  const int64_t dim = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  const int64_t block = v_cache.size(2);
  T* base = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t row = (num_heads + 2 * num_kv_heads) * dim;
  const int64_t num_slots = k_cache.size(0) * block;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(rot);
    for (int64_t t = begin; t < end; ++t) {
      T* x = base + t * row;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        rotate_head(x + h * dim, cp + t * rot, sp + t * rot, rot, tmp.data());
      }
      // Checked here rather than with min()/max() ops: those would cost more than the kernel.
      TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " out of the cache");
      const int64_t blk = slot[t] / block;
      const int64_t off = slot[t] % block;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const T* key = x + (num_heads + h) * dim;
        C* key_dst = kc + (blk * num_kv_heads + h) * dim * block + off;  // [dim, block]
        const T* value = x + (num_heads + num_kv_heads + h) * dim;
        C* value_dst = vc + ((blk * num_kv_heads + h) * block + off) * dim;
        if constexpr (std::is_same_v<T, C>) {
          for (int64_t d = 0; d < dim; ++d) key_dst[d * block] = key[d];
          std::memcpy(value_dst, value, dim * sizeof(T));
        } else {
          for (int64_t d = 0; d < dim; ++d) store(key_dst, d * block, load(key, d));
          for (int64_t d = 0; d < dim; ++d) store(value_dst, d, load(value, d));
        }
      }
    }
  });
}

// qkv [tokens, (Hq + 2 Hkv) * D], cos/sin [tokens, R], R <= D: queries and keys rotated in
// place, then every token's key and value copied into its cache slot (pad tokens point at
// the pad block).
void rotary_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                     int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  check_cache(k_cache, qkv, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "qkv, cos and sin must share a dtype");
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == qkv.size(0),
              "qkv must be [tokens, width], cos/sin [tokens, rotary_dim]");
  const int64_t heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(heads > 0 && qkv.size(1) % heads == 0,
              "qkv width must be (num_heads + 2 * num_kv_heads) * head_dim");
  const int64_t dim = qkv.size(1) / heads;
  TORCH_CHECK(cos.size(1) % 2 == 0 && cos.size(1) <= dim,
              "rotary_dim must be even and at most head_dim");
  check_cache_layout(k_cache, v_cache, num_kv_heads, dim);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == qkv.size(0),
              "slot_mapping must be int64 [tokens]");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (dtype == at::kBFloat16) {
    if (fp8) {
      rotary_write_kv_impl<BFloat16, Float8_e4m3fn>(qkv, cos, sin, k_cache, v_cache,
                                                    slot_mapping, num_heads, num_kv_heads);
    } else {
      rotary_write_kv_impl<BFloat16, BFloat16>(qkv, cos, sin, k_cache, v_cache, slot_mapping,
                                               num_heads, num_kv_heads);
    }
  } else if (fp8) {
    rotary_write_kv_impl<float, Float8_e4m3fn>(qkv, cos, sin, k_cache, v_cache, slot_mapping,
                                               num_heads, num_kv_heads);
  } else {
    rotary_write_kv_impl<float, float>(qkv, cos, sin, k_cache, v_cache, slot_mapping,
                                       num_heads, num_kv_heads);
  }
}

// Index of each row's largest value (the first on ties, a NaN counting as largest), as
// torch.argmax(x, -1): PyTorch's CPU argmax is a scalar loop (2.2 ms for 64 x 49k logits
// measured, ~4% of a decode step). Here 16 lanes each keep their best value and its index
// in one vectorised pass, then the lanes reduce to the first index of the maximum.
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
}  // namespace hpu_serve

// Each source registers the ops it implements; the library is their union.
TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def(
      "rotary_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.def("argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) {
  m.impl("rms_norm", &hpu_serve::rms_norm);
  m.impl("add_rms_norm_", &hpu_serve::add_rms_norm_);
  m.impl("silu_and_mul", &hpu_serve::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &hpu_serve::gelu_tanh_and_mul);
  m.impl("rotary_write_kv", &hpu_serve::rotary_write_kv);
  m.impl("argmax", &hpu_serve::argmax);
}

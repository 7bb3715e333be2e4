// Shared pieces of the fused CPU kernels: element loads/stores that widen to and round
// from fp32 the way PyTorch's casts do (bf16, and fp8 e4m3 for KV caches), a vectorisable
// exp and tanh, 16-lane vector types and the argument checks. Header-only (inline), included
// by each kernel file.
#pragma once

#include <ATen/ATen.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace hpu_serve {

using c10::BFloat16;
using c10::Float8_e4m3fn;

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
// fp8 e4m3 (KV caches only): c10's own conversions, so a cache written here holds the bytes
// `tensor.to(torch.float8_e4m3fn)` would store (round to nearest even, saturating at 448).
inline float load(const Float8_e4m3fn* p, int64_t i) { return static_cast<float>(p[i]); }
inline void store(Float8_e4m3fn* p, int64_t i, float v) { p[i] = Float8_e4m3fn(v); }

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

// tanh(x) = 1 - 2 / (exp(2x) + 1), vectorisable; saturates to +-1 at both ends (fast_exp
// clamps). Absolute error ~1e-7: soft-capped scores (cap * tanh(s / cap)) land within
// ~1e-7 * cap of PyTorch's.
inline float fast_tanh(float x) { return 1.f - 2.f / (fast_exp(2.f * x) + 1.f); }

// 16 fp32 lanes (one AVX-512 register, two AVX2 ones, four NEON ones).
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// bf16 -> fp32 is a 16-bit shift. GCC splits the generic widening into 256-bit halves
// (extract, two zero-extends, insert: 4 shuffles per 16 values) where AVX-512 has one
// zero-extending load; the decode attention's inner loops are bound by these shuffles.
inline f32x16 load16(const BFloat16* p) {
#ifdef __AVX512F__
  const __m512i w = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  f32x16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#else
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#endif
}
// fp8 e4m3 by bit arithmetic (no table gather): a normal |x| = (e, m) is the fp32 with
// exponent e + 120 and mantissa m << 20; a subnormal is m * 2^-9; 0x7F is NaN. Exact, as
// every e4m3 value is an fp32 one.
inline f32x16 load16(const Float8_e4m3fn* p) {
  u8x16 b;
  std::memcpy(&b, p, sizeof(b));
  const u32x16 w = __builtin_convertvector(b, u32x16);
  const u32x16 mag = w & 0x7Fu;
  const u32x16 sign = (w & 0x80u) << 24;
  const u32x16 normal = (mag << 20) + (120u << 23);
  const f32x16 sub = __builtin_convertvector(mag, f32x16) * (1.f / 512.f);
  u32x16 sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub_bits));
  u32x16 bits = mag < 8u ? sub_bits : normal;
  bits = mag == 0x7Fu ? u32x16{} + 0x7FC00000u : bits;
  bits |= sign;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
// 16 values, each rounded as float_to_bf16_bits rounds it.
inline void store16(BFloat16* p, f32x16 v) {
  u32x16 u;
  std::memcpy(&u, &v, sizeof(u));
  const u32x16 nearest_even = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const u32x16 nan = reinterpret_cast<u32x16>((u & 0x7FFFFFFFu) > 0x7F800000u);
  const u16x16 bits = __builtin_convertvector((nan & 0x7FC0u) | (~nan & nearest_even), u16x16);
  std::memcpy(p, &bits, sizeof(bits));
}

// 32 bf16 lanes as 16 dwords: lane pair (2j, 2j + 1) is column j's value at inputs k, k + 1.
typedef uint16_t u16x32 __attribute__((vector_size(64)));

// part += x[k] * w[k] + x[k + 1] * w[k + 1] per column, x's pair given as its 32 raw bits.
// Products of bf16 values are exact in fp32, so each add is the only rounding (the odd
// input first, as vdpbf16ps adds them; denormals flush to zero there).
inline f32x16 dot_pair(f32x16 part, u16x32 w, uint32_t x_pair) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<f32x16>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(part),
                                                   reinterpret_cast<__m512bh>(w),
                                                   reinterpret_cast<__m512bh>(
                                                       _mm512_set1_epi32(x_pair))));
#else
  const float x0 = bits_to_float(x_pair << 16);
  const float x1 = bits_to_float(x_pair & 0xFFFF0000u);
  for (int l = 0; l < 16; ++l) {
    const float w0 = bits_to_float(static_cast<uint32_t>(w[2 * l]) << 16);
    const float w1 = bits_to_float(static_cast<uint32_t>(w[2 * l + 1]) << 16);
    part[l] = std::fma(x0, w0, std::fma(x1, w1, part[l]));
  }
  return part;
#endif
}

inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#ifdef __AVX512F__
  return reinterpret_cast<f32x16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                  reinterpret_cast<__m512>(b),
                                                  reinterpret_cast<__m512>(c)));
#else
  for (int l = 0; l < 16; ++l) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
#endif
}

inline f32x16 splat(float v) { return f32x16{} + v; }

// The small-batch GEMMs' row count as a compile-time constant: f(std::integral_constant<int,
// M>{}) for M = rows, 1 to Max (Max past it: a pass holds at most Max rows' accumulators).
template <int Max = 8, typename F>
inline void dispatch_rows(int64_t rows, F&& f) {
  if constexpr (Max == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (rows >= Max) {
    f(std::integral_constant<int, Max>{});
  } else {
    dispatch_rows<Max - 1>(rows, std::forward<F>(f));
  }
}

// A linear's output shape: x's, with out_features last.
inline std::vector<int64_t> out_shape(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return shape;
}

inline u16x32 load_u16x32(const uint16_t* p) {
  u16x32 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// A KV cache: the model's dtype, or fp8 e4m3 (--kv-cache-dtype fp8).
inline void check_cache(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == like.scalar_type() || t.scalar_type() == at::kFloat8_e4m3fn,
              name, " must be ", like.scalar_type(), " or float8_e4m3fn, got ", t.scalar_type());
}

// keys [blocks, Hkv, D, B] (transposed blocks), values [blocks, Hkv, B, D].
inline void check_cache_layout(const at::Tensor& k_cache, const at::Tensor& v_cache,
                        int64_t num_kv_heads, int64_t dim) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == num_kv_heads && v_cache.size(1) == num_kv_heads &&
                  k_cache.size(2) == dim && v_cache.size(3) == dim &&
                  k_cache.size(3) == v_cache.size(2),
              "caches must be keys [blocks, kv_heads, head_dim, block_size] and values "
              "[blocks, kv_heads, block_size, head_dim]");
}

}  // namespace hpu_serve

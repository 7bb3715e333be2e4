// torch.ops.hpu_serve.encoder_attention: bidirectional attention of an encoder (BERT-style
// embedders and cross-encoders) over a right-padded batch, read straight from the fused QKV
// projection's output.
//
// PyTorch's CPU flash attention runs such batches at ~30 GFLOP/s: encoders have small heads
// (bge-small, MiniLM: 32 dims), so its per-block GEMMs are tiny and its bookkeeping
// dominates. Here one work item is (sequence, head): its keys are widened to fp32 once and
// transposed, so a block of 32 scores for QT query rows is 2 x QT vector FMA chains per head
// dimension (each key vector loaded once for QT rows); softmax in fp32; then the values,
// each loaded once for QT rows. Keys past a sequence's length are never read (no padding
// work), and padding query rows are written as zeros (pooling drops them).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "kernel_utils.h"

namespace hpu_serve {
namespace {

constexpr int QT = 4;       // query rows sharing each key / value load
constexpr int KB = 32;      // keys per score block (two 16-lane vectors)

// DIM: head size (a multiple of 16; dispatch_dim lists the instantiated ones)
template <typename T, int DIM>
void encoder_attention_impl(const T* qkv, const int64_t* lens, T* out, int64_t bs, int64_t n,
                            int64_t heads, float scale) {
  constexpr int VD = DIM / 16;
  const int64_t hidden = heads * DIM;
  const int64_t row = 3 * hidden;
  const int64_t padded = (n + KB - 1) / KB * KB;
  at::parallel_for(0, bs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(DIM * padded);  // keys, transposed: [DIM][padded]
    std::vector<float> vals(n * DIM);     // values: [n][DIM]
    std::vector<float> scores(QT * padded);
    float q[QT][DIM];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads;
      const int64_t h = item % heads;
      const int64_t len = std::min<int64_t>(std::max<int64_t>(lens[b], 0), n);
      T* ob = out + b * n * hidden + h * DIM;
      for (int64_t i = len; i < n; ++i) {
        for (int d = 0; d < DIM; ++d) store(ob + i * hidden, d, 0.f);
      }
      if (len == 0) continue;
      const T* base = qkv + b * n * row + h * DIM;
      const int64_t blocks = (len + KB - 1) / KB * KB;
      for (int64_t j = 0; j < len; ++j) {
        const T* k = base + j * row + hidden;
        const T* v = base + j * row + 2 * hidden;
        for (int d = 0; d < DIM; ++d) kt[d * padded + j] = load(k, d);
        for (int c = 0; c < VD; ++c) store16(&vals[j * DIM + c * 16], load16(v + c * 16));
      }
      for (int d = 0; d < DIM; ++d) {
        for (int64_t j = len; j < blocks; ++j) kt[d * padded + j] = 0.f;
      }
      for (int64_t i0 = 0; i0 < len; i0 += QT) {
        const int count = static_cast<int>(std::min<int64_t>(QT, len - i0));
        for (int t = 0; t < QT; ++t) {
          const T* qr = base + std::min<int64_t>(i0 + t, len - 1) * row;
          for (int d = 0; d < DIM; ++d) q[t][d] = load(qr, d) * scale;
        }
        for (int64_t j = 0; j < blocks; j += KB) {
          f32x16 lo[QT] = {}, hi[QT] = {};
          for (int d = 0; d < DIM; ++d) {
            const f32x16 k0 = load16(&kt[d * padded + j]);
            const f32x16 k1 = load16(&kt[d * padded + j + 16]);
            for (int t = 0; t < QT; ++t) {
              lo[t] += q[t][d] * k0;
              hi[t] += q[t][d] * k1;
            }
          }
          for (int t = 0; t < QT; ++t) {
            store16(&scores[t * padded + j], lo[t]);
            store16(&scores[t * padded + j + 16], hi[t]);
          }
        }
        float inv[QT];
        for (int t = 0; t < QT; ++t) {  // softmax in 16-lane vectors (no scalar reductions)
          float* s = &scores[t * padded];
          for (int64_t j = len; j < blocks; ++j) s[j] = s[0];  // neutral for the max
          f32x16 top = load16(s);
          for (int64_t j = 16; j < blocks; j += 16) {
            const f32x16 v = load16(s + j);
            top = v > top ? v : top;
          }
          float m = top[0];
          for (int l = 1; l < 16; ++l) m = std::max(m, top[l]);
          for (int64_t j = 0; j < blocks; ++j) s[j] = fast_exp(s[j] - m);
          for (int64_t j = len; j < blocks; ++j) s[j] = 0.f;
          f32x16 sum = {};
          for (int64_t j = 0; j < blocks; j += 16) sum += load16(s + j);
          float total = 0.f;
          for (int l = 0; l < 16; ++l) total += sum[l];
          inv[t] = 1.f / total;
        }
        f32x16 acc[QT][VD] = {};
        for (int64_t j = 0; j < len; ++j) {
          f32x16 v[VD];
          for (int c = 0; c < VD; ++c) v[c] = load16(&vals[j * DIM + c * 16]);
          for (int t = 0; t < QT; ++t) {
            const float p = scores[t * padded + j];
            for (int c = 0; c < VD; ++c) acc[t][c] += p * v[c];
          }
        }
        for (int t = 0; t < count; ++t) {
          T* o = ob + (i0 + t) * hidden;
          for (int c = 0; c < VD; ++c) {
            for (int l = 0; l < 16; ++l) store(o, c * 16 + l, acc[t][c][l] * inv[t]);
          }
        }
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& qkv, const at::Tensor& lengths, at::Tensor& out,
                  int64_t heads, int64_t dim, float scale) {
  const T* q = qkv.data_ptr<T>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  const int64_t bs = qkv.size(0), n = qkv.size(1);
  switch (dim) {
    case 16: return encoder_attention_impl<T, 16>(q, lens, o, bs, n, heads, scale);
    case 32: return encoder_attention_impl<T, 32>(q, lens, o, bs, n, heads, scale);
    case 64: return encoder_attention_impl<T, 64>(q, lens, o, bs, n, heads, scale);
    case 96: return encoder_attention_impl<T, 96>(q, lens, o, bs, n, heads, scale);
    case 128: return encoder_attention_impl<T, 128>(q, lens, o, bs, n, heads, scale);
    default: TORCH_CHECK(false, "encoder_attention: head size ", dim, " is not 16, 32, 64, 96 or 128");
  }
}

// qkv [bs, n, 3 * heads * dim] contiguous (queries, keys, values, each heads x dim), fp32 or
// bf16; lengths int64 [bs] (valid tokens of each row, right-padded) -> [bs, n, heads * dim]
// in qkv's dtype: softmax(q k^T * scale) v over each row's first `lengths` keys.
at::Tensor encoder_attention(const at::Tensor& qkv, const at::Tensor& lengths, int64_t heads,
                             double scale) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 3 && qkv.is_contiguous(),
              "qkv must be a contiguous CPU [batch, tokens, 3 * hidden] tensor");
  TORCH_CHECK(heads > 0 && qkv.size(2) % (3 * heads) == 0,
              "qkv's last dimension must be 3 * heads * head_dim");
  TORCH_CHECK(lengths.device().is_cpu() && lengths.scalar_type() == at::kLong &&
                  lengths.is_contiguous() && lengths.numel() == qkv.size(0),
              "lengths must be a contiguous int64 CPU tensor of one length per row");
  const int64_t dim = qkv.size(2) / (3 * heads);
  at::Tensor out = at::empty({qkv.size(0), qkv.size(1), heads * dim}, qkv.options());
  if (qkv.scalar_type() == at::kBFloat16) {
    dispatch_dim<BFloat16>(qkv, lengths, out, heads, dim, static_cast<float>(scale));
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kFloat, "qkv must be fp32 or bf16");
    dispatch_dim<float>(qkv, lengths, out, heads, dim, static_cast<float>(scale));
  }
  return out;
}

}  // namespace
}  // namespace hpu_serve

TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def("encoder_attention(Tensor qkv, Tensor lengths, int heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) {
  m.impl("encoder_attention", &hpu_serve::encoder_attention);
}

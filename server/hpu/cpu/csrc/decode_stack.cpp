// torch.ops.hpu_serve.decode_layers: every decoder layer of a decode step in one call.
//
// Why: at batch 1 the kernels of SmolLM2's 30 layers take ~6 ms, and the Python between them
// (module calls, views, argument checks, ~9 op dispatches a layer) another ~2.5 ms. This loop
// makes the same kernel calls, in the same order, with the same arguments, as the Python
// layer loop of server/models/llama.py with FusedCpuLayerOps, so its results are the same
// bits; only the Python goes. It serves pre-norm attention then a gated MLP, with per-head
// q/k norms (Qwen3, Gemma 3), sandwich norms (Gemma 2 / 3) and a local RoPE table for some
// layers (Gemma 3) where the model has them, at one token a sequence, any batch: projections
// run our small-batch kernels (int4_gemm.cpp, bf16_gemm.cpp) up to their rows and
// oneDNN's packed GEMM past them, as the modules do.
//
// Each kernel is called through its registered op (a typed dispatcher handle looked up once),
// not its C++ function: the kernels keep their argument checks and stay private to their
// units, and the dispatch costs well under a microsecond.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

namespace hpu_serve {
namespace {

using OptTensor = std::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("hpu_serve::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>
      add_rms_norm = op<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "hpu_serve::add_rms_norm_");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                      std::optional<at::ScalarType>)>
      int4_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                  std::optional<at::ScalarType>)>("hpu_serve::int4_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      int64_t, std::optional<at::ScalarType>)>
      bf16_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                                  std::optional<at::ScalarType>)>("hpu_serve::bf16_linear");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                                at::Tensor&, const at::Tensor&, int64_t, int64_t)>
      rotary = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                       at::Tensor&, const at::Tensor&, int64_t, int64_t)>(
          "hpu_serve::rotary_write_kv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, double, int64_t,
                                      double, int64_t, const OptTensor&)>
      attention = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t, double,
                                int64_t, const OptTensor&)>("hpu_serve::decode_attention");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      std::string_view, c10::List<std::optional<at::Scalar>>,
                                      std::optional<std::string_view>)>
      dense_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                   std::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<std::string_view>)>("mkldnn::_linear_pointwise");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      op<at::Tensor(const at::Tensor&)>("hpu_serve::silu_and_mul");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> gelu_tanh_and_mul =
      op<at::Tensor(const at::Tensor&)>("hpu_serve::gelu_tanh_and_mul");
};

const Ops& ops() {
  static const Ops handles;  // after every unit's registration (the library is loaded)
  return handles;
}

constexpr int64_t kProjections = 4;  // qkv, o, gate_up, down

// One projection, as SmallBatchInt4Linear / PackedLinear choose: up to its int4 rows, int4
// codes (then the bias, added as `out + bias` is); up to its bf16 rows, the bf16 kernel's
// copy (its fp32 bias inside); past them oneDNN's packed weight (its epilogue adds the bias).
struct Projections {
  const c10::List<OptTensor>& int4;
  const c10::List<OptTensor>& int4_biases;
  const c10::List<OptTensor>& bf16;
  const c10::List<OptTensor>& bf16_biases;
  at::TensorList dense;
  const c10::List<OptTensor>& dense_biases;
  at::IntArrayRef params;  // per projection: output features, int4 group, int4 rows, bf16 rows

  at::Tensor operator()(const at::Tensor& x, int64_t p) const {
    const int64_t out_features = params[4 * p];
    const int64_t rows = x.size(0);
    if (const OptTensor codes = int4.get(p); codes.has_value() && rows <= params[4 * p + 2]) {
      at::Tensor out = ops().int4_linear.call(x, *codes, params[4 * p + 1], out_features,
                                              std::nullopt);
      const OptTensor bias = int4_biases.get(p);
      return bias.has_value() ? at::add(out, *bias) : out;
    }
    if (const OptTensor weight = bf16.get(p); weight.has_value() && rows <= params[4 * p + 3]) {
      return ops().bf16_linear.call(x, *weight, bf16_biases.get(p), out_features, std::nullopt);
    }
    TORCH_CHECK(static_cast<int64_t>(dense.size()) > p,
                "decode_layers: a batch past the small-batch rows needs the dense weights");
    return ops().dense_linear.call(x, dense[p], dense_biases.get(p), "none",
                                   c10::List<std::optional<at::Scalar>>(), "");
  }
};

// Norm weights per layer, in this order (absent ones None): input, post-attention (a plain
// layer's pre-MLP norm; a sandwich layer's norm of the attention output), pre-feedforward
// and post-feedforward (sandwich layers), q and k (per head).
constexpr int64_t kNorms = 6;
enum Norm { kInput, kPostAttention, kPreFeedforward, kPostFeedforward, kQ, kK };

// x [rows, 1, hidden]: the embeddings (the first layer's input, on a zero residual stream);
// residual: the stream, updated in place; rope: cos, sin, then the local table's cos, sin
// (each [rows, rotary_dim]); per layer i: k_caches[i], v_caches[i], norms[6i .. 6i + 5]
// (see Norm), layer_params[2i] its window (0: none) and [2i + 1] whether it takes the local
// table, and the projections 4i .. 4i + 3 (qkv, o, gate_up, down), each with its small-batch
// weights (int4 codes, a bf16 copy or both, see Projections) and, where a batch can
// exceed them, its oneDNN weight (dense: empty when no projection needs it). Returns the
// last layer's MLP output (after its post-feedforward norm, if any), x's shape.
at::Tensor decode_layers(const at::Tensor& x, at::Tensor& residual, at::TensorList rope,
                         at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const c10::List<OptTensor>& norms,
                         const c10::List<OptTensor>& int4,
                         const c10::List<OptTensor>& int4_biases,
                         const c10::List<OptTensor>& bf16,
                         const c10::List<OptTensor>& bf16_biases, at::TensorList dense,
                         const c10::List<OptTensor>& dense_biases, at::IntArrayRef params,
                         at::IntArrayRef layer_params, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, double eps, double scale, double softcap,
                         bool gelu) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const int64_t projections = kProjections * layers;
  TORCH_CHECK(rope.size() == 4 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == kNorms * layers &&
                  static_cast<int64_t>(layer_params.size()) == 2 * layers &&
                  static_cast<int64_t>(int4.size()) == projections &&
                  static_cast<int64_t>(int4_biases.size()) == projections &&
                  static_cast<int64_t>(bf16.size()) == projections &&
                  static_cast<int64_t>(bf16_biases.size()) == projections &&
                  (dense.empty() || static_cast<int64_t>(dense.size()) == projections) &&
                  dense_biases.size() == dense.size() &&
                  static_cast<int64_t>(params.size()) == 4 * projections,
              "decode_layers: per-layer lists of inconsistent lengths");
  TORCH_CHECK(x.dim() >= 2 && x.sizes() == residual.sizes() && residual.is_contiguous(),
              "x and residual must be [rows, ..., hidden], residual contiguous");
  const int64_t hidden = x.size(-1);
  const int64_t rows = x.numel() / hidden;
  const int64_t q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  const Projections project{int4, int4_biases, bf16, bf16_biases, dense, dense_biases, params};
  at::Tensor stream = residual.view({rows, hidden});  // in place, as the caller's tensor
  at::Tensor h = x.reshape({rows, hidden}).contiguous();
  const Ops& k = ops();
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t p = kProjections * i;
    const auto norm = [&](Norm n) { return norms.get(kNorms * i + n); };
    at::Tensor normed = k.add_rms_norm.call(stream, h, *norm(kInput), eps);
    at::Tensor qkv = project(normed, p);
    if (const OptTensor qn = norm(kQ), kn = norm(kK); qn.has_value() && kn.has_value()) {
      // per head, as the model's _norm_qk: q and k normalised, v as it is
      at::Tensor q =
          k.rms_norm.call(qkv.narrow(1, 0, q_size).reshape({-1, head_dim}).contiguous(), *qn, eps);
      at::Tensor kk =
          k.rms_norm.call(qkv.narrow(1, q_size, kv_size).reshape({-1, head_dim}).contiguous(), *kn,
                          eps);
      qkv = at::cat({q.reshape({rows, -1}), kk.reshape({rows, -1}),
                     qkv.narrow(1, q_size + kv_size, kv_size)}, -1);
    }
    at::Tensor k_cache = k_caches[i];
    at::Tensor v_cache = v_caches[i];
    const int64_t table = layer_params[2 * i + 1] ? 2 : 0;
    k.rotary.call(qkv, rope[table], rope[table + 1], k_cache, v_cache, slot_mapping, num_heads,
                  num_kv_heads);
    at::Tensor query = qkv.view({rows, num_heads + 2 * num_kv_heads, -1}).narrow(1, 0, num_heads);
    at::Tensor attn = k.attention.call(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                       layer_params[2 * i], softcap, 0, std::nullopt);
    at::Tensor out = project(attn.view({rows, -1}), p + 1);
    const OptTensor pre_ff = norm(kPreFeedforward);
    if (pre_ff.has_value()) {  // sandwich: norm the attention output, then add
      normed = k.add_rms_norm.call(stream, k.rms_norm.call(out, *norm(kPostAttention), eps),
                                   *pre_ff, eps);
    } else {
      normed = k.add_rms_norm.call(stream, out, *norm(kPostAttention), eps);
    }
    at::Tensor gate_up = project(normed, p + 2);
    at::Tensor act = gelu ? k.gelu_tanh_and_mul.call(gate_up) : k.silu_and_mul.call(gate_up);
    h = project(act, p + 3);
    if (const OptTensor post_ff = norm(kPostFeedforward); post_ff.has_value()) {
      h = k.rms_norm.call(h, *post_ff, eps);
    }
  }
  return h.view(x.sizes());
}

}  // namespace
}  // namespace hpu_serve

TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def(
      "decode_layers(Tensor x, Tensor(a!) residual, Tensor[] rope, Tensor(b!)[] k_caches, "
      "Tensor(c!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor?[] norms, Tensor?[] int4, Tensor?[] int4_biases, Tensor?[] bf16, "
      "Tensor?[] bf16_biases, Tensor[] dense, "
      "Tensor?[] dense_biases, int[] params, int[] layer_params, int num_heads, "
      "int num_kv_heads, int head_dim, float eps, float scale, float softcap, bool gelu) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) { m.impl("decode_layers", &hpu_serve::decode_layers); }

// oneDNN's packed weights (opaque MkldnnCPU tensors) among the arguments pick this key
TORCH_LIBRARY_IMPL(hpu_serve, MkldnnCPU, m) {
  m.impl("decode_layers", &hpu_serve::decode_layers);
}

// torch.ops.hpu_serve.decode_attention: the argument checks, the dispatch on dtypes and the
// op's registration; the kernels are in paged_attention.h. This unit instantiates caches
// stored in the model's dtype.

#include <torch/library.h>

#include "paged_attention.h"

namespace hpu_serve {
namespace {

// query [rows, Hq, D] (rows and heads may be strided, e.g. a view into qkv), caches as in
// check_cache_layout (the query's dtype or fp8 e4m3), block_tables int32 [rows, width],
// seq_lens int32 [rows] (tokens of each row, including the one being decoded), window
// (tokens a query sees, itself included; 0: all), softcap (0: none), chunk (attention
// chunk: a query sees the keys of its own chunk of positions only; 0: none), sinks (fp32
// [Hq] sink logits, gpt-oss; None: none) -> [rows, Hq, D].
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            double softcap, int64_t chunk,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.stride(2) == 1,
              "query must be a CPU [rows, heads, head_dim] tensor, unit stride in head_dim");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "query must be fp32 or bf16");
  check_cache(k_cache, query, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  check_cache_layout(k_cache, v_cache, k_cache.size(1), query.size(2));
  TORCH_CHECK(query.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == query.size(0),
              "block_tables must be int32 [rows, width]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == query.size(0),
              "seq_lens must be int32 [rows]");
  TORCH_CHECK(window >= 0 && softcap >= 0. && chunk >= 0,
              "window, softcap and chunk must be >= 0 (0: none)");
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                    sinks->is_contiguous() && sinks->numel() == query.size(1),
                "sinks must be a contiguous fp32 CPU tensor of one logit per query head");
  }
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  AttentionArgs args{query, k_cache, v_cache, block_tables, seq_lens, out,
                     static_cast<float>(scale), window, static_cast<float>(softcap), chunk};
  args.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    attention_fp8_cache(args);
  } else if (dtype == at::kBFloat16) {
    attention_dispatch<BFloat16, BFloat16, true>(args);
  } else {
    attention_dispatch<float, float, true>(args);
  }
  return out;
}

}  // namespace
}  // namespace hpu_serve

TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def(
      "decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window=0, float softcap=0., int chunk=0, "
      "Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) {
  m.impl("decode_attention", &hpu_serve::decode_attention);
}

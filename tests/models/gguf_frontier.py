"""GGUF files of the frontier families written from tiny transformers models the way
llama.cpp's converter (convert_hf_to_gguf.py: DeepseekV2Model, GptOssModel) lays them out,
for test_gguf_frontier.py: "deepseek2" (both kv_b_proj layouts) and "gpt-oss" (F32 experts,
or MXFP4 blocks repacked from a checkpoint's own)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf_files import _tokenizer

_TOP = {"model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_DEEPSEEK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_GPT_OSS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp",
}


def _close(writer) -> None:  # noqa: ANN001 - a GGUFWriter
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _common_header(writer, cfg, tokenizer) -> None:  # noqa: ANN001
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if tokenizer is not None:
        _tokenizer(writer, tokenizer)


def _yarn_header(writer, rope: dict) -> None:  # noqa: ANN001
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
    writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))


def write_deepseek2_gguf(path: Path, hf_model: torch.nn.Module, split_kv_b: bool = True,
                         tokenizer=None, skip: str | None = None) -> None:  # noqa: ANN001
    """DeepSeek-V2 / V3 as llama.cpp's converter writes it: MLA as multi-query over the
    latent (head_count_kv 1, key_length r + dr, value_length r, the per-head sizes in
    key_length_mla / value_length_mla); ``split_kv_b``: kv_b_proj as newer converters write
    it, ``attn_k_b [H, r, dn]`` (transposed) and ``attn_v_b [H, dv, r]``, else whole
    (``attn_kv_b``, older files, whose key_length / value_length are the per-head sizes);
    experts stacked, the router bias as ``exp_probs_b.bias``; the gating function written
    for V3 (sigmoid) and left out for V2 (llama.cpp's default, softmax)."""
    import gguf

    cfg = hf_model.config
    v3 = cfg.model_type == "deepseek_v3"
    r, dr, dn, dv = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                     cfg.v_head_dim)
    heads = cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    if skip is not None:
        add = writer.add_tensor
        writer.add_tensor = lambda name, *a, **k: None if name == skip else add(name, *a, **k)
    _common_header(writer, cfg, tokenizer)
    writer.add_head_count_kv(1)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(r)
    if split_kv_b:
        writer.add_key_length(r + dr)
        writer.add_value_length(r)
        writer.add_key_length_mla(dn + dr)
        writer.add_value_length_mla(dv)
    else:
        writer.add_key_length(dn + dr)
        writer.add_value_length(dv)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if v3 and cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    if v3:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_rope_dimension_count(dr)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        _yarn_header(writer, rope)
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name in _TOP:
            writer.add_tensor(_TOP[name], array)
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(array, 2, axis=1)
            writer.add_tensor(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(up))
        elif rest == "mlp.experts.down_proj":  # [E, H, I]
            writer.add_tensor(f"{blk}.ffn_down_exps.weight", array)
        elif rest == "mlp.gate.e_score_correction_bias":
            writer.add_tensor(f"{blk}.exp_probs_b.bias", array)
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            kv_b = array.reshape(heads, dn + dv, r)
            writer.add_tensor(f"{blk}.attn_k_b.weight",
                              np.ascontiguousarray(kv_b[:, :dn].transpose(0, 2, 1)))
            writer.add_tensor(f"{blk}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, dn:]))
        else:
            module, kind = rest.rsplit(".", 1)
            writer.add_tensor(f"{blk}.{_DEEPSEEK[module]}.{kind}", array)
    _close(writer)


def mxfp4_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """A checkpoint's MXFP4 ``blocks [..., G, 16]`` (byte j: element 2j in the low nibble,
    2j + 1 in the high one) and ``scales [..., G]`` -> ggml's block_mxfp4 rows ``[..., G *
    17]``: the scale byte, then 16 bytes where byte j holds element j (low nibble) and
    element j + 16 (high), as ggml's 4-bit blocks do. Written from the two layouts'
    definitions, not from the converter's bit shuffle."""
    b = blocks.numpy()
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales.numpy()[..., None], packed], axis=-1)
    return np.ascontiguousarray(out.reshape(*out.shape[:-2], -1).astype(np.uint8))


def write_gpt_oss_gguf(path: Path, hf_model: torch.nn.Module,
                       mxfp4: dict[str, torch.Tensor] | None = None, tokenizer=None
                       ) -> None:  # noqa: ANN001
    """gpt-oss as llama.cpp's converter writes it: the experts' interleaved gate/up split
    into ``ffn_gate_exps`` / ``ffn_up_exps [E, I, H]`` (biases [E, I] likewise), down
    ``[E, H, I]``; the sinks as ``attn_sinks.weight``, the pre-MLP norm as
    ``post_attention_norm``; the window and the expert width in the header. ``mxfp4``: the
    checkpoint's ``..._blocks`` / ``..._scales`` (output-major, gate/up rows interleaved),
    repacked as ggml MXFP4 blocks instead of the model's F32 experts."""
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    _common_header(writer, cfg, tokenizer)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_sliding_window(cfg.sliding_window)
    _yarn_header(writer, cfg.rope_parameters)
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name in _TOP:
            writer.add_tensor(_TOP[name], array)
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "self_attn.sinks":
            writer.add_tensor(f"{blk}.attn_sinks.weight", array)
        elif rest == "mlp.experts.gate_up_proj_bias":  # [E, 2I], gate at even entries
            writer.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(array[:, ::2]))
            writer.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(array[:, 1::2]))
        elif rest == "mlp.experts.down_proj_bias":
            writer.add_tensor(f"{blk}.ffn_down_exps.bias", array)
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            _expert_tensors(writer, blk, rest, array, mxfp4 and {
                part: mxfp4[f"{name}_{part}"] for part in ("blocks", "scales")})
        else:
            module, kind = rest.rsplit(".", 1)
            writer.add_tensor(f"{blk}.{_GPT_OSS[module]}.{kind}", array)
    _close(writer)


def _expert_tensors(writer, blk: str, rest: str, array: np.ndarray,  # noqa: ANN001
                    mxfp4: dict[str, torch.Tensor] | None) -> None:
    import gguf

    if mxfp4 is None:  # transformers' [E, in, out] -> [E, out, in]
        rows = array.transpose(0, 2, 1)
        add = lambda name, a: writer.add_tensor(name, np.ascontiguousarray(a))  # noqa: E731
    else:  # the checkpoint's blocks are output-major already
        rows = mxfp4_gguf_blocks(mxfp4["blocks"], mxfp4["scales"])
        add = lambda name, a: writer.add_tensor(  # noqa: E731
            name, np.ascontiguousarray(a), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    if rest == "mlp.experts.down_proj":
        add(f"{blk}.ffn_down_exps.weight", rows)
    else:  # gate and up rows interleaved
        add(f"{blk}.ffn_gate_exps.weight", rows[:, ::2])
        add(f"{blk}.ffn_up_exps.weight", rows[:, 1::2])


_QWEN3_NEXT = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def write_qwen3next_gguf(path: Path, hf_model: torch.nn.Module, tokenizer=None
                         ) -> None:  # noqa: ANN001
    """Qwen3-Next as llama.cpp's converter writes it: the delta rule's sizes as ``ssm.*``
    keys; ``in_proj_qkvz`` (rows grouped per key head: q, k, its value heads' v, then z)
    regrouped into ``attn_qkv`` (q of all heads, k, v) and ``attn_gate`` (z), ``in_proj_ba``
    as it is (``ssm_ba``); ``A_log`` stored as ``-exp(A_log)`` (``ssm_a``, no suffix),
    ``dt_bias`` as ``ssm_dt.bias``, the convolution taps squeezed to ``[C, K]``; every norm
    but the delta rule's own stored as ``1 + w``; the pre-MLP norm as
    ``post_attention_norm``; experts stacked."""
    import gguf

    cfg = hf_model.config
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    writer = gguf.GGUFWriter(str(path), "qwen3next")
    _common_header(writer, cfg, tokenizer)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(hk)
    writer.add_ssm_time_step_rank(hv)
    writer.add_ssm_inner_size(dv * hv)
    writer.add_full_attention_interval(4)
    partial = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
    writer.add_rope_dimension_count(int(cfg.head_dim * partial))
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name in _TOP:
            writer.add_tensor(_TOP[name], array + 1 if name == "model.norm.weight" else array)
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(array, 2, axis=1)
            writer.add_tensor(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(up))
        elif rest == "mlp.experts.down_proj":
            writer.add_tensor(f"{blk}.ffn_down_exps.weight", array)
        elif rest == "linear_attn.A_log":
            writer.add_tensor(f"{blk}.ssm_a", -np.exp(array))
        elif rest == "linear_attn.dt_bias":
            writer.add_tensor(f"{blk}.ssm_dt.bias", array)
        elif rest == "linear_attn.conv1d.weight":
            writer.add_tensor(f"{blk}.ssm_conv1d.weight", np.ascontiguousarray(array[:, 0]))
        elif rest == "linear_attn.in_proj_qkvz.weight":
            grouped = array.reshape(hk, -1, array.shape[-1])
            q, k, v, z = np.split(grouped, np.cumsum([dk, dk, hv // hk * dv]), axis=1)
            flat = [part.reshape(-1, array.shape[-1]) for part in (q, k, v, z)]
            writer.add_tensor(f"{blk}.attn_qkv.weight", np.concatenate(flat[:3]))
            writer.add_tensor(f"{blk}.attn_gate.weight", np.ascontiguousarray(flat[3]))
        else:
            module, kind = rest.rsplit(".", 1)
            offset = 1 if module.endswith("norm") and module != "linear_attn.norm" else 0
            writer.add_tensor(f"{blk}.{_QWEN3_NEXT[module]}.{kind}", array + offset)
    _close(writer)

"""Quantized checkpoints written here in each format's on-disk layout (from a tiny model's
weights, quantized by this test): they load to the weights the codes and scales stand for,
and the engine's greedy tokens equal transformers' on those weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from server import LLM, SamplingParams
from server.models.loader import load_model, resolve_model_source

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing: nibble i holds column ORDER[i]


def pack_words(codes: np.ndarray) -> np.ndarray:
    """[..., 8] int codes 0..15 -> [...] int32 words, code i in bits 4i..4i+3."""
    words = np.zeros(codes.shape[:-1], dtype=np.uint64)
    for i in range(8):
        words |= codes[..., i].astype(np.uint64) << np.uint64(4 * i)
    return words.astype(np.uint32).view(np.int32)


def int4(weight: torch.Tensor, g_idx: np.ndarray, symmetric: bool):
    """Codes [in, out], zeros and fp16 scales [groups, out], and the weight they encode."""
    w = weight.t().double().numpy()  # [in, out]
    groups = g_idx.max() + 1
    scales = np.zeros((groups, w.shape[1]))
    zeros = np.zeros((groups, w.shape[1]), dtype=np.int64)
    for g in range(groups):
        rows = w[g_idx == g]
        if symmetric:
            scales[g] = np.abs(rows).max(0) / 7
            zeros[g] = 8
        else:
            lo, hi = rows.min(0), rows.max(0)
            scales[g] = (hi - lo) / 15
            zeros[g] = np.clip(np.round(-lo / scales[g]), 0, 15)
    scales = scales.astype(np.float16)
    s = scales.astype(np.float64)[g_idx]
    codes = np.clip(np.round(w / s) + zeros[g_idx], 0, 15).astype(np.int64)
    reference = torch.from_numpy((codes - zeros[g_idx]) * s).float().t()  # [out, in]
    return codes, zeros, scales, reference


def gptq_parts(weight: torch.Tensor, act_order: bool, rng: np.random.Generator):
    rows = weight.shape[1]
    g_idx = np.arange(rows) // GROUP
    if act_order:
        g_idx = rng.permutation(g_idx)  # desc_act: rows of a group are scattered
    codes, zeros, scales, reference = int4(weight, g_idx, symmetric=True)
    qweight = pack_words(codes.reshape(rows // 8, 8, -1).transpose(0, 2, 1))  # along the input
    stored = zeros - 1  # GPTQ v1 keeps zero - 1
    qzeros = pack_words(stored.reshape(stored.shape[0], -1, 8))  # along the output
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales,
             "g_idx": g_idx.astype(np.int32)}
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()}, reference


def awq_parts(weight: torch.Tensor, _: bool, __: np.random.Generator):
    rows = weight.shape[1]
    codes, zeros, scales, reference = int4(weight, np.arange(rows) // GROUP, symmetric=False)

    def pack(values: np.ndarray) -> np.ndarray:
        grouped = values.reshape(values.shape[0], -1, 8)
        return pack_words(grouped[..., list(AWQ_ORDER)])

    parts = {"qweight": pack(codes), "qzeros": pack(zeros), "scales": scales}
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()}, reference


def fp8_parts(weight: torch.Tensor, per_channel: bool, _: np.random.Generator):
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
    scale = (amax / 448.0).float()
    codes = (weight / scale).to(torch.float8_e4m3fn)
    scale = scale if per_channel else scale.reshape(1)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale.reshape(
        -1, 1 if per_channel else 1)


def fp8_block_parts(weight: torch.Tensor, _: bool, __: np.random.Generator):
    out, inp = weight.shape
    blocks = weight.reshape(out // 32, 32, inp // 32, 32)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / 448.0).float()  # [out/32, in/32]
    full = scale_inv.repeat_interleave(32, 0).repeat_interleave(32, 1)
    codes = (weight / full).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale_inv}, codes.float() * full


FORMATS = {
    "gptq": (gptq_parts, {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                          "desc_act": True, "sym": True}),
    "awq": (awq_parts, {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                        "zero_point": True, "version": "gemm"}),
    "fp8-tensor": (fp8_parts, {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                    "targets": ["Linear"]}}}),
    "fp8-channel": (fp8_parts, {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "targets": ["Linear"]}}}),
    "fp8-block": (fp8_block_parts, {"quant_method": "fp8", "weight_block_size": [32, 32]}),
}


def write_quantized(src: Path, dst: Path, fmt: str, hf_model) -> dict[str, torch.Tensor]:
    """The checkpoint in ``fmt``; returns the dequantized reference weights by HF name, and
    loads them into ``hf_model`` (so it computes what the codes stand for)."""
    make, qconfig = FORMATS[fmt]
    option = fmt in ("gptq", "fp8-channel")  # act-order / per-channel scales
    rng = np.random.default_rng(0)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    (single,) = list(src.glob("*.safetensors"))
    tensors, references = {}, {}
    for name, tensor in load_file(single).items():
        module, _, leaf = name.rpartition(".")
        if module.rsplit(".", 1)[-1] in LINEARS and leaf == "weight":
            parts, reference = make(tensor, option, rng)
            tensors.update({f"{module}.{k}": v for k, v in parts.items()})
            references[name] = reference
        else:
            tensors[name] = tensor
    save_file(tensors, dst / single.name, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    state = hf_model.state_dict()
    with torch.no_grad():
        for name, reference in references.items():
            state[name].copy_(reference)
    return references


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_checkpoint_loads_what_its_codes_encode(tiny_model_factory, tmp_path,
                                                          fmt: str) -> None:
    import copy

    folder, hf_model, _ = tiny_model_factory(tie=False, num_kv_heads=2)
    reference_model = copy.deepcopy(hf_model)
    references = write_quantized(Path(folder), tmp_path, fmt, reference_model)
    loaded = load_model(resolve_model_source(str(tmp_path)), "float32", torch.device("cpu"))
    assert loaded.config.quant is not None
    layer = loaded.model.layers[1]
    q, k, v = (references[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj",
                                                                          "v_proj"))
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    torch.testing.assert_close(layer.mlp.down_proj.weight,
                               references["model.layers.1.mlp.down_proj.weight"])
    assert not torch.equal(layer.mlp.down_proj.weight,
                           hf_model.model.layers[1].mlp.down_proj.weight)  # it was quantized
    # served: greedy tokens equal transformers' on the dequantized weights
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, max_num_seqs=4)
    prompt = [5, 17, 42, 9, 77, 3, 120]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                ignore_eos=True))[0].outputs[0].token_ids
    reference_model.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = reference_model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                            do_sample=False, eos_token_id=None,
                                            pad_token_id=0)[0, len(prompt):].tolist()
    assert out == expected


def test_wrong_quantization_flag_and_unsupported_formats(tiny_model, tmp_path) -> None:
    from server.models.quantized import QuantConfig

    with pytest.raises(ValueError, match="8-bit weights is not supported|4-bit only"):
        QuantConfig.from_hf({"quant_method": "gptq", "bits": 8})
    with pytest.raises(ValueError, match="unsupported quantization 'bitsandbytes'"):
        QuantConfig.from_hf({"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="--quantization awq: the checkpoint is not quantized"):
        LLM(tiny_model[0], dtype="float32", quantization="awq")

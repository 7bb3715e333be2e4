from pathlib import Path

import pytest
import torch

from server.models.gguf import gguf_model_config
from server.models.loader import (
    DEFAULT_MODEL_FILE,
    load_model,
    resolve_dtype,
    resolve_model_source,
)


def test_default_source_is_the_embedded_gguf() -> None:
    source = resolve_model_source(None)
    assert source.gguf_file == DEFAULT_MODEL_FILE
    assert (Path(source.folder) / DEFAULT_MODEL_FILE).is_file()


def test_gguf_header_config_matches_transformers(smollm2_gguf) -> None:
    import gguf
    from transformers import AutoConfig

    folder, name = smollm2_gguf
    ours = gguf_model_config(gguf.GGUFReader(str(Path(folder) / name)))
    hf = AutoConfig.from_pretrained(folder, gguf_file=name)
    assert (ours.num_layers, ours.hidden_size, ours.num_heads, ours.num_kv_heads) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads)
    assert ours.intermediate_size == hf.intermediate_size
    assert ours.vocab_size == hf.vocab_size
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])


def test_missing_model_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a local folder or .gguf file"):
        resolve_model_source("meta-llama/Llama-3-8B")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_source(str(tmp_path))


def test_dtype_resolution(tiny_model) -> None:
    loaded = load_model(resolve_model_source(tiny_model[0]), "auto", torch.device("cpu"))
    assert loaded.dtype == torch.float32  # the checkpoint was saved in float32
    assert resolve_dtype("bfloat16", loaded.config, resolve_model_source(None), "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int3", loaded.config, resolve_model_source(None), "cpu")


def test_incomplete_checkpoint_is_rejected(tiny_model, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    src = Path(tiny_model[0])
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (st,) = list(tmp_path.glob("*.safetensors"))
    tensors = load_file(st)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj|gate_up_proj"):
        load_model(resolve_model_source(str(tmp_path)), "float32", torch.device("cpu"))


def test_sharded_checkpoint_loads_the_shards_its_index_lists(tiny_model, tmp_path: Path) -> None:
    """A checkpoint split in shards with an index, beside a stray full copy (as Mistral's
    repositories ship consolidated.safetensors): the shards are loaded, the copy is not."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = Path(tiny_model[0])
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    (single,) = list(src.glob("*.safetensors"))
    tensors = load_file(single)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file, metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: file for file, keys in shards.items() for k in keys}}))
    # a stray copy with different keys would fail the load if it were read
    save_file({"junk.weight": torch.zeros(2)}, tmp_path / "consolidated.safetensors")
    sharded = load_model(resolve_model_source(str(tmp_path)), "float32", torch.device("cpu"))
    whole = load_model(resolve_model_source(tiny_model[0]), "float32", torch.device("cpu"))
    for (name, a), (_, b) in zip(sharded.model.state_dict().items(),
                                 whole.model.state_dict().items()):
        assert torch.equal(a, b), name
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_model(resolve_model_source(str(tmp_path)), "float32", torch.device("cpu"))


def test_unsupported_architecture_is_a_clear_error(tiny_model, tmp_path: Path) -> None:
    import json
    import shutil

    for f in Path(tiny_model[0]).iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*supported: .*Qwen3ForCausalLM"):
        load_model(resolve_model_source(str(tmp_path)), "float32", torch.device("cpu"))


def _copy_model(src: str, dst: Path) -> Path:
    import shutil

    for f in Path(src).iterdir():
        shutil.copy(f, dst / f.name)
    (st,) = list(dst.glob("*.safetensors"))
    return st


def test_moe_checkpoint_missing_one_expert_is_rejected(tiny_model_factory, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    st = _copy_model(tiny_model_factory(model_type="mixtral", tie=False)[0], tmp_path)
    tensors = load_file(st)
    assert "model.layers.1.block_sparse_moe.experts.5.w3.weight" in tensors  # Hub names
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.w_gate_up#5\.1"):
        load_model(resolve_model_source(str(tmp_path)), "float32", torch.device("cpu"))


def test_moe_stacked_expert_names_load_alike(tiny_model_factory, tmp_path: Path) -> None:
    """transformers >= 5's in-memory layout (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) loads into the same weights as the per-expert files."""
    from safetensors.torch import save_file

    folder, hf_model, _ = tiny_model_factory(model_type="qwen3_moe", tie=True)
    st = _copy_model(folder, tmp_path)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()
             if k != "lm_head.weight"}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, st, metadata={"format": "pt"})
    stacked = load_model(resolve_model_source(str(tmp_path)), "float32", torch.device("cpu"))
    per_expert = load_model(resolve_model_source(folder), "float32", torch.device("cpu"))
    for (name, a), (_, b) in zip(stacked.model.state_dict().items(),
                                 per_expert.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_moe_gguf_of_a_dense_only_family_is_a_clear_error(tmp_path: Path) -> None:
    """Expert tensors under a name whose family has no mixture-of-experts variant here
    (llama.cpp's "llama" with experts is Mixtral, see test_gguf_families.py): refused, not
    half loaded."""
    import gguf

    path = tmp_path / "granite-moe.gguf"
    writer = gguf.GGUFWriter(str(path), "granite")
    writer.add_expert_count(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'granite' is not supported as a mixture-of-experts"):
        gguf_model_config(gguf.GGUFReader(str(path)))

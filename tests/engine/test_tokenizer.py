"""The tokenizer wrapper: GGUF and HF folders, chat templates, EOS ids, token strings."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from server.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


def test_gguf_tokenizer_and_chat_template(smol: Tokenizer) -> None:
    assert smol.eos_token_ids == frozenset({2})
    assert smol.vocab_size == 49152
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"}]
    text = smol.apply_chat_template(messages)
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = smol.encode_chat(messages)
    assert smol.decode(ids, skip_special_tokens=False) == text
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                          {"type": "text", "text": "there"}]}]
    assert smol.apply_chat_template(parts) == smol.apply_chat_template(
        [{"role": "user", "content": "Hi there"}])


def test_chat_template_override_and_missing_template(tiny_model, tmp_path) -> None:
    tok = Tokenizer.from_model_path(tiny_model[0])
    prompt = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert prompt == "<|user|>x</s><|assistant|>"
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    over = Tokenizer.from_model_path(tiny_model[0], chat_template=str(template))
    assert over.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    tok.hf.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="text content"):
        over.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


@pytest.mark.parametrize("eos", [[1, 5], 5])
def test_generation_config_eos_ids_are_added(tiny_model, tmp_path, eos) -> None:
    for f in Path(tiny_model[0]).iterdir():
        shutil.copy(f, tmp_path / f.name)
    plain = Tokenizer.from_model_path(str(tmp_path))
    assert 5 not in plain.eos_token_ids
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    tok = Tokenizer.from_model_path(str(tmp_path), extra_eos_ids=[7])
    assert tok.eos_token_ids == plain.eos_token_ids | {5, 7}


def test_from_hf_wraps_a_built_tokenizer(tiny_model) -> None:
    hf = tiny_model[2]
    tok = Tokenizer.from_hf(hf, extra_eos_ids=(3,))
    assert tok.hf is hf
    assert tok.vocab_size == len(hf)
    assert tok.eos_token_ids == {hf.eos_token_id, 3}
    assert tok.bos_token_id == hf.bos_token_id
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(ids) == "hello world"
    assert tok.decode([hf.eos_token_id] + ids) == "hello world"
    assert tok.decode([hf.eos_token_id] + ids, skip_special_tokens=False).startswith("</s>")


def test_token_strings(smol: Tokenizer) -> None:
    ids = smol.encode("Hello world 日本", add_special_tokens=False)
    strs = [smol.token_str(i) for i in ids]
    assert strs[:2] == ["Hello", " world"]
    assert "\ufffd" in "".join(strs)  # a token holding part of a CJK character
    assert smol.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    assert smol.token_str(2) == "<|im_end|>"  # special tokens are shown, not skipped


def test_chat_template_edge_cases(tiny_model, tmp_path) -> None:
    template = "{{ messages[0]['content'] }}!"  # a Jinja string, not a file
    tok = Tokenizer.from_hf(copy.deepcopy(tiny_model[2]), chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": None}]) == "!"
    assert tok.apply_chat_template([{"role": "user", "content": []}]) == "!"
    assert tok.encode_chat([{"role": "user", "content": "hello"}]) == tok.encode(
        "hello!", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_hf(copy.deepcopy(tiny_model[2]), chat_template=str(tmp_path / "no.jinja"))
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_model_path(str(tmp_path / "missing"))


@pytest.mark.slow
def test_gguf_tokenizer_conversion_is_cached(smollm2_gguf, smol: Tokenizer, tmp_path) -> None:
    folder, gguf_file = smollm2_gguf
    cold = Tokenizer.from_model_path(folder, gguf_file=gguf_file, cache_dir=tmp_path)
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1
    assert (entries[0] / "tokenizer_config.json").exists()
    warm = Tokenizer.from_model_path(folder, gguf_file=gguf_file, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == entries  # reused, not converted again
    texts = ["Hello world", "<|im_start|>user hi<|im_end|>", "héllo 日本語 🙂", " a\tb\n\nc  "]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for tok in (cold, warm):
        assert [tok.encode(t) for t in texts] == [smol.encode(t) for t in texts]
        assert tok.encode_chat(chat) == smol.encode_chat(chat)
        assert (tok.eos_token_ids, tok.bos_token_id, tok.vocab_size) == (
            smol.eos_token_ids, smol.bos_token_id, smol.vocab_size)
    # the key is the file's metadata: a copy elsewhere finds the entry; a file with another
    # vocabulary (one special token respelled) is converted again, next to it
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    shutil.copy(Path(folder) / gguf_file, copy_dir / "renamed.gguf")
    Tokenizer.from_model_path(str(copy_dir), gguf_file="renamed.gguf", cache_dir=tmp_path)
    assert [p for p in tmp_path.iterdir() if p.name != "copy"] == entries
    data = (Path(folder) / gguf_file).read_bytes()
    assert data.count(b"<repo_name>") == 1
    (copy_dir / "edited.gguf").write_bytes(data.replace(b"<repo_name>", b"<repo_nbme>"))
    edited = Tokenizer.from_model_path(str(copy_dir), gguf_file="edited.gguf", cache_dir=tmp_path)
    assert len([p for p in tmp_path.iterdir() if p.name != "copy"]) == 2
    assert edited.encode("<repo_nbme>", add_special_tokens=False) == smol.encode(
        "<repo_name>", add_special_tokens=False)


def test_documents_and_continue_final_message_reach_the_template(tiny_model, tmp_path) -> None:
    """vLLM's documents (RAG templates) and continue_final_message, through transformers'
    template call."""
    template = tmp_path / "rag.jinja"
    template.write_text(
        "{% for d in documents or [] %}[doc {{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = Tokenizer.from_model_path(tiny_model[0], chat_template=str(template))
    messages = [{"role": "user", "content": "where?"}, {"role": "assistant", "content": "In"}]
    text = tok.apply_chat_template(messages, False, documents=[
        {"title": "atlas", "text": "Paris is in France"}])
    assert text.startswith("[doc atlas: Paris is in France]<|user|>where?")
    assert text.endswith("<|assistant|>In</s>")
    assert tok.apply_chat_template(messages, False, continue_final_message=True).endswith(
        "<|assistant|>In")

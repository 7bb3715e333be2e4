from __future__ import annotations

import pytest

from server.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_model_path(smollm2_gguf[0], gguf_file=smollm2_gguf[1])


def test_gguf_tokenizer_and_chat_template(smol: Tokenizer) -> None:
    assert smol.eos_token_ids == frozenset({2}) and smol.vocab_size == 49152
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
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|user|>x</s><|assistant|>"
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    over = Tokenizer.from_model_path(tiny_model[0], chat_template=str(template))
    assert over.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    tok.hf.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="text content"):
        over.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_generation_config_eos_ids_are_added(tiny_model, tmp_path) -> None:
    import json
    import shutil

    for f in __import__("pathlib").Path(tiny_model[0]).iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    tok = Tokenizer.from_model_path(str(tmp_path))
    assert {1, 5} <= tok.eos_token_ids

"""Tiny random pooling checkpoints, saved as sentence-transformers folders: BERT, XLM-R and a
Qwen3-style decoder embedder, plus cross-encoders (``*ForSequenceClassification``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CORPUS, build_tokenizer

WORDS = sorted({w for line in CORPUS for w in line.split()} | set("abcdefghijklmnopqrstuvwxyz")
               | {"quick", "fox", "keys", "again", "and"})


def bert_tokenizer(folder: Path):
    """A WordPiece tokenizer over the corpus' words and letters (offline), with BERT's
    [CLS] A [SEP] B [SEP] template and segment ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    del folder
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    vocab = {t: i for i, t in enumerate([*specials, *WORDS, *pieces])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids",
                                                      "attention_mask"])


def save_hf(folder: Path, kind: str, classify: bool = False, num_labels: int = 1,
            seed: int = 0, config_kwargs: dict | None = None) -> None:
    """A random ``kind`` (bert, xlm-roberta, modernbert, qwen3) checkpoint with its
    tokenizer; ``config_kwargs`` go to the config as they are."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "qwen3":
        tok = build_tokenizer()
        tok.pad_token = "<unk>"
        # sentence-transformers 6 renders a chat template around plain texts: none here,
        # as an embedder's raw text is embedded (chat-style input is its own request field)
        tok.chat_template = None
        cfg = tf.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, max_position_embeddings=256,
                             pad_token_id=tok.pad_token_id, num_labels=num_labels)
        cls = tf.Qwen3ForSequenceClassification if classify else tf.Qwen3Model
    else:
        tok = bert_tokenizer(folder)
        common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_labels=num_labels,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        if kind == "bert":
            cfg = tf.BertConfig(max_position_embeddings=128, **common)
            cls = tf.BertForSequenceClassification if classify else tf.BertModel
        elif kind == "modernbert":
            # 4 layers: global, local, local, global; a local token sees 4 positions either
            # side, so the test texts (longer than that) tell the two kinds apart
            cfg = tf.ModernBertConfig(
                vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, num_labels=num_labels,
                max_position_embeddings=128, local_attention=8, global_attn_every_n_layers=3,
                pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2,
                eos_token_id=3, **(config_kwargs or {}))
            cls = tf.ModernBertForSequenceClassification if classify else tf.ModernBertModel
        else:  # positions start after the padding id (0 here: the WordPiece [PAD])
            cfg = tf.XLMRobertaConfig(max_position_embeddings=130, pad_token_id=0,
                                      type_vocab_size=1, **common)
            cls = tf.XLMRobertaForSequenceClassification if classify else tf.XLMRobertaModel
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases and norms, so a swapped or skipped tensor shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if kind in ("xlm-roberta", "modernbert"):  # no segment types: no type ids
        path = folder / "tokenizer_config.json"
        tok_cfg = json.loads(path.read_text())
        tok_cfg["model_input_names"] = ["input_ids", "attention_mask"]
        path.write_text(json.dumps(tok_cfg))


def save_st(folder: Path, kind: str, pooling: str = "mean", normalize: bool = True,
            max_seq_length: int | None = None, prompts: dict[str, str] | None = None) -> None:
    """A sentence-transformers folder over a random ``kind`` encoder."""
    from sentence_transformers import SentenceTransformer, models

    save_hf(folder / "hf", kind)
    transformer = models.Transformer(str(folder / "hf"), max_seq_length=max_seq_length)
    modules = [transformer, models.Pooling(transformer.get_word_embedding_dimension(),
                                           pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(folder / "st"))


@pytest.fixture(scope="session")
def st_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Builds (once per settings) a sentence-transformers folder; returns its path."""
    cache: dict[str, str] = {}

    def make(kind: str = "bert", pooling: str = "mean", normalize: bool = True,
             max_seq_length: int | None = None,
             prompts: dict[str, str] | None = None) -> str:
        key = json.dumps([kind, pooling, normalize, max_seq_length, prompts])
        if key not in cache:
            root = tmp_path_factory.mktemp(f"st-{kind}-{pooling}")
            save_st(root, kind, pooling, normalize, max_seq_length, prompts)
            cache[key] = str(root / "st")
        return cache[key]

    return make


@pytest.fixture(scope="session")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Builds (once per kind) a one-label ``*ForSequenceClassification`` checkpoint."""
    cache: dict[str, str] = {}

    def make(kind: str = "bert") -> str:
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"ce-{kind}")
            save_hf(root, kind, classify=True, num_labels=1, seed=1)
            cache[kind] = str(root)
        return cache[kind]

    return make


# vLLM's --hf-overrides for the original Qwen3-Reranker checkpoints
QWEN3_RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                            "classifier_from_token": ["no", "yes"],
                            "is_original_qwen3_reranker": True}


def save_qwen3_lm(folder: Path, tie: bool, seed: int = 2) -> None:
    """A random ``Qwen3ForCausalLM`` (as Qwen3-Reranker ships) whose tokenizer has "yes"
    and "no" tokens; ``tie``: the LM head is the embedding table (Qwen3-Reranker-0.6B)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.add_tokens(["yes", "no"])
    tok.pad_token = "<unk>"
    cfg = tf.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, tie_word_embeddings=tie,
                         pad_token_id=tok.pad_token_id)
    model = tf.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms, so a skipped or swapped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.fixture(scope="session")
def qwen3_lm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], str]:
    """Builds (once per ``tie``) a random Qwen3 causal LM with yes/no tokens."""
    cache: dict[bool, str] = {}

    def make(tie: bool = True) -> str:
        if tie not in cache:
            root = tmp_path_factory.mktemp(f"qwen3-lm-{'tied' if tie else 'untied'}")
            save_qwen3_lm(root, tie)
            cache[tie] = str(root)
        return cache[tie]

    return make

"""Small GGUF files for the tests, written with the gguf library's GGUFWriter the way llama.cpp's
converter (convert_hf_to_gguf.py) writes a Llama: the `llama` metadata, the q and k rows permuted for
GGML's RoPE (`llama_cpp_permute`, LlamaModel.permute), a byte-level BPE tokenizer in the metadata; and
the same weights as a Hugging Face format folder, so a test can load one model both ways."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
from safetensors.numpy import save_file

CONFIG = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
CORPUS = ["The capital of France is Paris.", "Decoding reads the cache, then writes one more key and value.",
          "A quantized cache stores fewer bits per element; the scales come on top.", "12 + 30 = 42 tokens."]
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
Q = gguf.GGMLQuantizationType


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE trained on CORPUS: <|endoftext|> first, the 256 byte
    characters, then the merges' tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return tokens, [" ".join(merge) if isinstance(merge, list) else merge for merge in model["merges"]]


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece-style BPE vocabulary as llama.cpp stores Llama 2's:
    <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF>, then pieces ('▁' for a space) trained on CORPUS,
    best-scored first, and no merges (a reader derives them from the scores)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    vocab = json.loads(tokenizer.to_str())["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]  # unknown, control, byte, normal
    return tokens, [0.0] * 259 + [-float(i) for i in range(len(pieces))], types


def random_weights(vocab_size: int, tied: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face name -> float32 weights of a Llama of CONFIG's shape, norms away from 1."""
    rng = np.random.default_rng(seed)
    d, ffn = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    hd = d // CONFIG["num_attention_heads"]
    q, kv = CONFIG["num_attention_heads"] * hd, CONFIG["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (vocab_size, d), "model.norm.weight": (d,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab_size, d)
    for i in range(CONFIG["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes.update({f"{layer}.input_layernorm.weight": (d,), f"{layer}.post_attention_layernorm.weight": (d,),
                       f"{layer}.self_attn.q_proj.weight": (q, d), f"{layer}.self_attn.k_proj.weight": (kv, d),
                       f"{layer}.self_attn.v_proj.weight": (kv, d), f"{layer}.self_attn.o_proj.weight": (d, q),
                       f"{layer}.mlp.gate_proj.weight": (ffn, d), f"{layer}.mlp.up_proj.weight": (ffn, d),
                       f"{layer}.mlp.down_proj.weight": (d, ffn)})
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            weights[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            scale = (3.0 if "embed" in name else 1.0) / np.sqrt(shape[1])
            weights[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return weights


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: Optional[int]) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: q/k rows from rotate-half to GGML's pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def stored_name(name: str) -> str:
    """The GGUF name of a Hugging Face one; any other name (rope_freqs.weight) as it is."""
    stem, kind = name.rsplit(".", 1)
    if stem in GLOBAL:
        return f"{GLOBAL[stem]}.{kind}"
    if not stem.startswith("model.layers."):
        return name
    _, _, index, part = stem.split(".", 3)
    return f"blk.{index}.{LAYER[part]}.{kind}"


def quantized(values: np.ndarray, kind: Q) -> np.ndarray:
    """What a GGUF file of type `kind` holds for float32 `values`, dequantized back to float32."""
    return gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind).reshape(values.shape)


def write_gguf(path: Path, weights: dict[str, np.ndarray], kind: Q = Q.F32, architecture: str = "llama",
               metadata: Optional[dict] = None, leave_out: tuple[str, ...] = (), tokenizer: Optional[str] = "gpt2",
               tokenizer_metadata: Optional[dict] = None) -> Path:
    """`weights` (Hugging Face names, float32) as a GGUF file: 2-D tensors stored as `kind`, norms as F32,
    q and k permuted; `metadata` adds or replaces keys after "<architecture>." (None removes one);
    `tokenizer`: gpt2 (byte_level_vocab), llama (sentencepiece_vocab) or None; `tokenizer_metadata` adds
    or replaces keys after "tokenizer.ggml." (None removes one), typed as `typed_value` says."""
    heads, kv_heads = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    vocab_size = weights["model.embed_tokens.weight"].shape[0]
    fields = {"block_count": CONFIG["num_hidden_layers"], "context_length": 2048, "embedding_length": CONFIG["hidden_size"],
              "feed_forward_length": CONFIG["intermediate_size"], "attention.head_count": heads,
              "attention.head_count_kv": kv_heads, "rope.freq_base": CONFIG["rope_theta"],
              "attention.layer_norm_rms_epsilon": CONFIG["rms_norm_eps"], "vocab_size": vocab_size,
              "rope.dimension_count": CONFIG["hidden_size"] // heads, **(metadata or {})}
    writer = gguf.GGUFWriter(path, architecture)
    for key, value in fields.items():
        if value is not None:
            writer.add_key_value(f"{architecture}.{key}", value,
                                 gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else
                                 gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32)
    fields: dict = {}
    if tokenizer == "gpt2":
        tokens, merges = byte_level_vocab()
        fields = {"pre": "default", "tokens": tokens, "token_type": [3 if token.startswith("<|") else 1 for token in tokens],
                  "merges": merges, "bos_token_id": 0, "eos_token_id": 0}
    elif tokenizer == "llama":
        tokens, scores, types = sentencepiece_vocab()
        fields = {"tokens": tokens, "scores": scores, "token_type": types, "unknown_token_id": 0, "bos_token_id": 1,
                  "eos_token_id": 2}
    if tokenizer:
        fields["model"] = tokenizer
    for key, value in {**fields, **(tokenizer_metadata or {})}.items():
        if value is not None:
            # token types are INT32 as GGUFWriter.add_token_types writes them (llama.cpp refuses other kinds)
            default_types = key == "token_type" and value is fields.get(key)
            writer.add_key_value(f"tokenizer.ggml.{key}", value,
                                 *((gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32) if default_types else typed_value(value)))
    for name, values in weights.items():
        if name in leave_out:
            continue
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            values = llama_cpp_permute(values, heads, kv_heads if "k_proj" in name else heads)
        if values.ndim == 1 or kind == Q.F32:
            writer.add_tensor(stored_name(name), values)
        elif kind == Q.F16:
            writer.add_tensor(stored_name(name), values.astype(np.float16))
        else:
            writer.add_tensor(stored_name(name), gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def typed_value(value) -> tuple:
    """(GGUF value type, entry type) GGUFWriter writes `value` as: a negative int as INT32, a list by its
    first entry's type."""
    T = gguf.GGUFValueType
    if isinstance(value, list):
        return T.ARRAY, typed_value(value[0])[0] if value else T.UINT32
    if isinstance(value, bool):
        return T.BOOL, None
    if isinstance(value, int):
        return (T.INT32 if value < 0 else T.UINT32), None
    return {float: T.FLOAT32, str: T.STRING}[type(value)], None


def write_folder(folder: Path, weights: dict[str, np.ndarray]) -> Path:
    """The same weights as a Hugging Face format folder (config.json, model.safetensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "vocab_size": weights["model.embed_tokens.weight"].shape[0],
              "tie_word_embeddings": "lm_head.weight" not in weights}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return folder

"""The tokenizer a GGUF file describes in its metadata, built as a `tokenizers` Tokenizer, so a text
prompt (`prompt=FILE`) goes through the model's own vocabulary.

A GGUF file has no tokenizer.json: llama.cpp's converter stores the vocabulary (`tokenizer.ggml.tokens`,
`token_type`, `scores`), the BPE `merges`, the special ids and flags (`bos_token_id`, `eos_token_id`,
`unknown_token_id`, `padding_token_id`, `add_bos_token`, `add_eos_token`), the kind of model
(`tokenizer.ggml.model`) and the name of the pre-tokenizer that splits text before BPE
(`tokenizer.ggml.pre`). `gguf_tokenizer` builds what transformers' GGUF conversion builds
(transformers/integrations/gguf/gguf_tokenizer_mapping.py; tests/test_gguf.py and tests/test_smollm2.py compare ids):

- `gpt2`: byte-level BPE, its vocabulary spelled in GPT-2's byte alphabet, text split by GPT-2's
  regex or, for the pre-tokenizers PRE_TOKENIZER_SPLITS names, by their own;
- `llama`: SentencePiece-style BPE (a space is '▁', one is put in front of the text, unknown
  characters fall back to byte tokens), with the file's merges or, where it has none, merges derived
  from the tokens' scores.

Tokens the file marks as control (and the special ids) are special tokens, matched whole; those
marked user-defined are added whole. BOS goes in front where `add_bos_token` says so (absent: yes for
`llama`, as llama.cpp does; no for `gpt2`), EOS behind where `add_eos_token` does. Another tokenizer
model, or a pre-tokenizer this module does not know, is refused (CheckpointError) rather than guessed: text
split another way gives other ids.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from harness.config.validate import first_line
from harness.model.checkpoint_fields import CheckpointError, Field, checked_fields, shown
from harness.model.gguf_file import metadata

TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values this module builds
TOKEN_TYPES = range(0, 7)  # llama.cpp's llama_token_type: undefined, normal, unknown, control, user-defined, unused, byte
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex that splits text before BPE; None: GPT-2's own. `smollm` is llama.cpp's
# GPT-2 split with digits cut one by one, which gives the same ids on a vocabulary that, like SmolLM's,
# has no token of two digits (transformers splits it as GPT-2 does).
PRE_TOKENIZER_SPLITS = {
    "default": None, "gpt2": None, "smollm": None,
    "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT,
}
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of the GGUF file at `path` (the module docstring); CheckpointError in one line where
    the file's metadata is not what `tokenizer_fields` allows, or names a tokenizer this module does not
    build (whatever the tokenizers library raises while building it, too)."""
    fields = tokenizer_fields(path)
    try:
        return _built(path, fields)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - the library raises its own Exception for what it refuses
        raise CheckpointError(f"'{path}': the tokenizers library cannot build the tokenizer its metadata describes "
                              f"({first_line(error, typed=False)}); give token ids as .json or .npy instead") from None


def tokenizer_fields(path: Path) -> dict:
    """The tokenizer's metadata (after `tokenizer.ggml.`) checked as a shape's fields are
    (harness.model.checkpoint_fields): the kinds and values of TOKENIZER_FIELDS, the per-token lists as
    long as the token list, special ids within it, the tokens distinct, each merge two known tokens
    joined by one space. CheckpointError in one line naming the key otherwise."""
    where = lambda field: f"'{path}': tokenizer.ggml.{field}"  # noqa: E731
    kind, tokens = metadata(path, "tokenizer.ggml.model"), metadata(path, "tokenizer.ggml.tokens")
    if kind not in TOKENIZER_MODELS or tokens is None:
        raise CheckpointError(f"'{path}': tokenizer.ggml.model is {shown(kind)}{'' if tokens else ' with no tokens'}; "
                              f"text prompts need {' or '.join(TOKENIZER_MODELS)} (give token ids as .json or .npy instead)")
    fields = checked_fields({"tokens": tokens}, (Field("tokens", "texts"),), where)
    count = len(tokens)
    table = (Field("pre", "text", "default", allowed=tuple(PRE_TOKENIZER_SPLITS)),
             Field("token_type", "integers", [], low=min(TOKEN_TYPES), high=max(TOKEN_TYPES), length=count),
             Field("scores", "numbers", None, length=count), Field("merges", "texts", []),
             *(Field(key, "integer", None, low=0, high=count - 1) for key in SPECIAL_IDS),
             Field("add_bos_token", "bool", None), Field("add_eos_token", "bool", None))
    values = {field.name: metadata(path, f"tokenizer.ggml.{field.name}") for field in table}
    if values["merges"] == []:
        values["merges"] = None  # an empty list: no merges, as absent
    fields.update(checked_fields(values, table, where), model=kind)
    repeated = next((token for token, n in Counter(tokens).items() if n > 1), None)
    if repeated is not None:
        raise CheckpointError(f"{where('tokens')} holds {shown(repeated)} {Counter(tokens)[repeated]:,} times; "
                              "each token must be there once (its id would be ambiguous)")
    fields["merges"] = [_merge(merge, where) for merge in fields["merges"]]
    return fields


def _merge(merge: str, where) -> tuple[str, str]:
    left, space, right = merge.partition(" ")
    if not (space and left and right and " " not in right):
        raise CheckpointError(f"{where('merges')} holds {shown(merge)}; each merge is two tokens joined by one space")
    return left, right


def _built(path: Path, fields: dict) -> Tokenizer:
    kind, tokens, pre, merges = fields["model"], fields["tokens"], fields["pre"], fields["merges"]
    if kind == "gpt2":
        alphabet = byte_alphabet()
        spelled = set(alphabet.values())
        vocab = {token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode()): index
                 for index, token in enumerate(tokens)}
        _known_merges(path, merges, vocab)
        tokenizer = Tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                                         fuse_unk=False))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        vocab = {token: index for index, token in enumerate(tokens)}
        if not merges:
            scores = fields["scores"]
            merges = merges_from_scores(vocab, dict(zip(tokens, scores)) if scores else None)
        _known_merges(path, merges, vocab)
        tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                               decoders.Strip(" ", 1, 0)])
    if PRE_TOKENIZER_SPLITS[pre] is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    _add_special_tokens(tokenizer, fields, vocab, byte_level=kind == "gpt2")
    _add_bos_eos(tokenizer, fields, add_bos_default=kind == "llama")
    return tokenizer


def _known_merges(path: Path, merges: list[tuple[str, str]], vocab: dict[str, int]) -> None:
    unknown = next((merge for merge in merges if merge[0] not in vocab or merge[1] not in vocab), None)
    if unknown is not None:
        raise CheckpointError(f"'{path}': tokenizer.ggml.merges holds {shown(' '.join(unknown))}, whose "
                              f"{'left' if unknown[0] not in vocab else 'right'} part is not in tokenizer.ggml.tokens; "
                              "each merge joins two tokens of the vocabulary")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable bytes stand for themselves, the others for the
    characters from U+0100 on, in byte order, so every byte string is spelled in visible characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable}, **{byte: chr(256 + i) for i, byte in enumerate(others)}}


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """A SentencePiece vocabulary's BPE merges, recovered: every split of a token into two tokens,
    ranked by the token's score, best first (no scores: by its id, first first), ties by the parts'
    lengths, as transformers' generate_merges ranks them."""
    ranked = scores if scores else vocab
    merges = []
    for token, rank in ranked.items():
        pairs = [(token[:i], token[i:], rank) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(pairs, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=bool(scores))
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tokenizer: Tokenizer, fields: dict, vocab: dict[str, int], byte_level: bool) -> None:
    """Control tokens and the special ids as special tokens; user-defined tokens as added ones. In a
    byte-level vocabulary a control token with a character outside the byte alphabet is a mislabel
    llama.cpp makes, skipped (as transformers skips it)."""
    tokens, types = fields["tokens"], fields["token_type"]
    spelled = set(byte_alphabet().values()) if byte_level else None
    special = {index for index, kind in enumerate(types) if kind == CONTROL
               and (spelled is None or set(tokens[index]) <= spelled)}
    special |= {fields[key] for key in SPECIAL_IDS if fields[key] is not None}
    tokenizer.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special)])
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token, kind in zip(tokens, types)
                          if kind == USER_DEFINED and token in vocab])


def _add_bos_eos(tokenizer: Tokenizer, fields: dict, add_bos_default: bool) -> None:
    """BOS in front and EOS behind each encoded text where the file's flags say so."""
    single, specials, tokens = "$A", [], fields["tokens"]
    for key, default, place in (("bos", add_bos_default, "{} $A"), ("eos", False, "$A {}")):
        index, add = fields[f"{key}_token_id"], fields[f"add_{key}_token"]
        if (default if add is None else add) and index is not None:
            single = place.format(tokens[index]).replace("$A", single)
            specials.append((tokens[index], index))
    tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)

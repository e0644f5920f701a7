"""Prompt tokens from a file (`prompt=PATH`): real text for a point instead of seeded random ids.

A file holds token ids, or text:
- `.json`: a list of ids (one stream), or a list of lists (one row of ids per sequence);
- `.npy`: a 1-D (one stream) or 2-D (one row per sequence) integer array;
- any other name: UTF-8 text, tokenized with the checkpoint's own `tokenizer.json` (the `tokenizers`
  library, special tokens as the tokenizer adds them: Llama's BOS once, at the start).

A point of `batch` sequences takes `batch` windows of ctx + decode_tokens + 1 tokens: consecutive
windows of a stream, or the first that many ids of the first `batch` rows. Each window's first ctx
tokens are the prompt; the rest is the text the accuracy pass feeds and scores (harness.measure.
accuracy: decode_tokens steps, each step's logits judged on the next token of the text). A file too
short for that, ids outside the vocabulary, or text without a tokenizer are refused (PromptError)
when the sweep is planned. The file's content hash (with the tokenizer's, for text) goes into the
point, and the point's own process checks it again before it measures.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np

TOKEN_FILES = (".json", ".npy")  # file suffixes read as token ids; any other is text


class PromptError(ValueError):
    """A prompt file a point cannot use. str() is one line naming the file."""


def window_tokens(ctx: int, decode_tokens: int) -> int:
    """Tokens one sequence takes from the file: the prompt, the fed text, and the last step's target."""
    return ctx + decode_tokens + 1


def content_hash(path: Path, tokenizer: Optional[Path]) -> str:
    """sha256 of the file, and of the tokenizer that turns it into ids (text only)."""
    digest = hashlib.sha256(path.read_bytes())
    if tokenizer is not None and path.suffix not in TOKEN_FILES:
        digest.update(tokenizer.read_bytes())
    return digest.hexdigest()[:16]


def read_tokens(path: str | Path, tokenizer: Optional[Path]) -> np.ndarray:
    """The file's token ids, int64: [N] for a stream, [rows, N] for rows. Cached per file, its size and
    time, and the tokenizer."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise PromptError(f"'{path}' is {'a folder, not a file' if file.exists() else 'no file'}")
    stat = file.stat()
    stamp = (stat.st_size, stat.st_mtime_ns, str(tokenizer), tokenizer.stat().st_mtime_ns if tokenizer else 0)
    return _read_tokens(file, tokenizer, stamp)


@functools.lru_cache(maxsize=8)
def _read_tokens(file: Path, tokenizer: Optional[Path], _stamp: tuple) -> np.ndarray:
    if file.suffix == ".npy":
        try:
            ids = np.load(file, allow_pickle=False)
        except (ValueError, OSError, EOFError) as error:
            raise PromptError(f"'{file}' is not a NumPy array file ({str(error).splitlines()[0]})") from None
    elif file.suffix == ".json":
        try:
            ids = np.asarray(json.loads(file.read_text()))
        except (ValueError, UnicodeDecodeError) as error:
            raise PromptError(f"'{file}' is not JSON ({str(error).splitlines()[0]})") from None
    else:
        ids = np.asarray(_tokenize(file, tokenizer))
    if ids.dtype == object or ids.ndim not in (1, 2) or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise PromptError(f"'{file}' must hold integer token ids, a list or rows of equal length "
                          f"(got {ids.dtype} of shape {list(ids.shape)})")
    return ids.astype(np.int64)


def _tokenize(file: Path, tokenizer: Optional[Path]) -> list[int]:
    if tokenizer is None:
        raise PromptError(f"'{file}' is text, which needs a tokenizer: set model.checkpoint to a folder with "
                          f"tokenizer.json, or give token ids as {' or '.join(TOKEN_FILES)}")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PromptError(f"'{file}' is neither UTF-8 text nor token ids ({', '.join(TOKEN_FILES)})") from None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tokenizer)).encode(text).ids
    except Exception as error:  # the library raises its own Exception for a malformed tokenizer.json
        raise PromptError(f"'{tokenizer}' cannot tokenize '{file}': {str(error).splitlines()[0]}") from None


def windows(ids: np.ndarray, batch: int, length: int, vocab_size: int, name: str = "the file") -> np.ndarray:
    """`batch` windows of `length` ids [batch, length], as the module docstring says, or PromptError."""
    if ids.ndim == 1:
        have = ids.shape[0] // length
        rows = ids[: batch * length].reshape(-1, length) if have >= batch else None
        counted = f"{ids.shape[0]:,} tokens: {have} window(s)"
    else:
        have = ids.shape[0] if ids.shape[1] >= length else 0
        rows = ids[:batch, :length] if have >= batch else None
        counted = f"{ids.shape[0]} row(s) of {ids.shape[1]:,} tokens"
    if rows is None:
        raise PromptError(f"{name} holds {counted}; batch={batch} needs {batch} window(s) of ctx + decode_tokens + 1 = "
                          f"{length:,} tokens ({batch * length:,} as one stream)")
    if rows.min() < 0 or rows.max() >= vocab_size:
        raise PromptError(f"{name} has token id {int(rows.max() if rows.max() >= vocab_size else rows.min())}, "
                          f"outside the model's vocabulary [0, {vocab_size})")
    return rows


def tokenizer_of(checkpoint: Optional[str]) -> Optional[Path]:
    """The checkpoint folder's tokenizer.json, where there is a checkpoint and it has one."""
    path = Path(checkpoint).expanduser() / "tokenizer.json" if checkpoint else None
    return path.resolve() if path is not None and path.is_file() else None


def point_windows(path: str, checkpoint: Optional[str], expected_hash: str, batch: int, length: int,
                  vocab_size: int) -> np.ndarray:
    """The point's windows [batch, length], read in the point's own process: the file (and tokenizer)
    must still be what the plan hashed."""
    tokenizer = tokenizer_of(checkpoint)
    found = content_hash(Path(path), tokenizer)
    if found != expected_hash:
        raise PromptError(f"'{path}' changed since the sweep was planned (hash {found}, planned {expected_hash})")
    return windows(read_tokens(path, tokenizer), batch, length, vocab_size, f"'{path}'")


def point_prompt(point, device) -> "torch.Tensor":
    """The windows of a point's prompt file [batch, ctx + decode_tokens + 1] on `device` (the point
    has `prompt` and `prompt_hash`, harness.config.Point)."""
    import torch

    length = window_tokens(point.ctx, point.decode_tokens)
    ids = point_windows(point.prompt, point.model.checkpoint, point.prompt_hash, point.batch, length,
                        point.model.vocab_size)
    return torch.from_numpy(np.ascontiguousarray(ids)).to(device)

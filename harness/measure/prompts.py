"""Prompt tokens from a file or a built-in text (`prompt=PATH`, `prompt=python-docs`): real text for a
point instead of seeded random ids.

A file holds token ids, or text:
- `.json`: a list of ids (one stream), or a list of lists (one row of ids per sequence);
- `.npy`: a 1-D (one stream) or 2-D (one row per sequence) integer array;
- any other name: UTF-8 text, tokenized with the checkpoint's own `tokenizer.json` (the `tokenizers`
  library, special tokens as the tokenizer adds them: Llama's BOS once, at the start).
A built-in text (harness.config.texts: `python-docs`) is tokenized as a text file is.

The timed run: a point of `batch` sequences takes `batch` windows of ctx + decode_tokens + 1 tokens,
consecutive windows of a stream, or the first that many ids of the first `batch` rows; each window's
first ctx tokens are the prompt.
The accuracy pass of an approximate strategy (harness.measure.accuracy) takes its own windows, as many
as score accuracy.tokens tokens in all (`accuracy_windows`): window i of a stream has the prompt
ids[i*s : i*s + ctx] and scores the s = accuracy.steps tokens after it, each predicted by a decode step
fed the token before it, so the windows' prompts overlap and their scored tokens never do (a row of a
2-D file is a stream of its own). A file too short for either, ids outside the vocabulary, or text
without a tokenizer are refused (PromptError) when the sweep is planned. The content hash (with the
tokenizer's, for text) goes into the point, and the point's own process checks it again before it
measures.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from harness.config.texts import builtin_text, is_builtin_text

TOKEN_FILES = (".json", ".npy")  # file suffixes read as token ids; any other is text


class PromptError(ValueError):
    """A prompt file a point cannot use. str() is one line naming the file."""


def window_tokens(ctx: int, decode_tokens: int) -> int:
    """Tokens one sequence takes from the file: the prompt, the fed text, and the last step's target."""
    return ctx + decode_tokens + 1


def content_hash(source: str | Path, tokenizer: Optional[Path]) -> str:
    """sha256 of the file or built-in text, and of the tokenizer that turns it into ids (text only)."""
    if is_builtin_text(source):
        digest = hashlib.sha256(builtin_text(str(source)).encode())
    else:
        path = Path(source)
        digest = hashlib.sha256(path.read_bytes())
        if path.suffix in TOKEN_FILES:
            return digest.hexdigest()[:16]
    if tokenizer is not None:
        digest.update(tokenizer.read_bytes())
    return digest.hexdigest()[:16]


def read_tokens(source: str | Path, tokenizer: Optional[Path]) -> np.ndarray:
    """The token ids of a file or built-in text, int64: [N] for a stream, [rows, N] for rows. Cached
    per file, its size and time, and the tokenizer."""
    tokenizer_stamp = (str(tokenizer), tokenizer.stat().st_mtime_ns if tokenizer else 0)
    if is_builtin_text(source):
        return _builtin_tokens(str(source), tokenizer, tokenizer_stamp)
    file = Path(source).expanduser().resolve()
    if not file.is_file():
        raise PromptError(f"'{source}' is {'a folder, not a file' if file.exists() else 'no file'}")
    stat = file.stat()
    return _read_tokens(file, tokenizer, (stat.st_size, stat.st_mtime_ns, *tokenizer_stamp))


@functools.lru_cache(maxsize=2)
def _builtin_tokens(name: str, tokenizer: Optional[Path], _stamp: tuple) -> np.ndarray:
    if tokenizer is None:
        raise PromptError(f"'{name}' is a built-in text, which needs a tokenizer: set model.checkpoint to a "
                          "checkpoint with one")
    return np.asarray(_encode(builtin_text(name), tokenizer, f"'{name}'"), dtype=np.int64)


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
    return _encode(text, tokenizer, f"'{file}'")


def _encode(text: str, tokenizer: Path, name: str) -> list[int]:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tokenizer)).encode(text).ids
    except Exception as error:  # the library raises its own Exception for a malformed tokenizer.json
        raise PromptError(f"'{tokenizer}' cannot tokenize {name}: {str(error).splitlines()[0]}") from None


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


def checked_tokens(point) -> np.ndarray:
    """The ids of a point's prompt (it has `prompt` and `prompt_hash`, harness.config.Point), read in
    the point's own process: the file or text (and tokenizer) must still be what the plan hashed."""
    tokenizer = tokenizer_of(point.model.checkpoint)
    found = content_hash(point.prompt, tokenizer)
    if found != point.prompt_hash:
        raise PromptError(f"'{point.prompt}' changed since the sweep was planned (hash {found}, planned "
                          f"{point.prompt_hash})")
    return read_tokens(point.prompt, tokenizer)


def point_prompt(point, device) -> "torch.Tensor":
    """The timed run's windows of a point's prompt [batch, ctx + decode_tokens + 1] on `device`."""
    import torch

    length = window_tokens(point.ctx, point.decode_tokens)
    ids = windows(checked_tokens(point), point.batch, length, point.model.vocab_size, f"'{point.prompt}'")
    return torch.from_numpy(np.ascontiguousarray(ids)).to(device)


@dataclass(frozen=True)
class TextWindows:
    """The accuracy pass's windows of a text (the module docstring), as arrays over windows: window i
    prefills prompts[i], then decode step j is fed fed[i, j] and scored on targets[i, j] where
    scored[i, j] (a window past the text's end or the tokens asked for is fed padding, never scored)."""

    prompts: np.ndarray  # [W, ctx] int64
    fed: np.ndarray  # [W, steps] int64: the token each decode step is fed
    targets: np.ndarray  # [W, steps] int64: the text's next token, which the step's logits are scored on
    scored: np.ndarray  # [W, steps] bool


def scoreable_tokens(ids: np.ndarray, ctx: int) -> int:
    """Tokens the accuracy pass can score after a prompt of ctx: a stream's (or each row's) length less
    the prompt and the first fed token."""
    streams = ids.reshape(-1, ids.shape[-1])
    return int(streams.shape[0] * max(0, streams.shape[1] - ctx - 1))


def accuracy_windows(ids: np.ndarray, ctx: int, steps: int, tokens: int, vocab_size: int,
                     name: str = "the file") -> TextWindows:
    """Windows scoring `tokens` tokens in all, `steps` a window, from ids [N] or [rows, N]; PromptError
    when the text has fewer, or ids outside the vocabulary."""
    have = scoreable_tokens(ids, ctx)
    if have < tokens:
        counted = (f"{ids.shape[0]:,} tokens" if ids.ndim == 1 else f"{ids.shape[0]} row(s) of {ids.shape[1]:,} tokens")
        raise PromptError(f"{name} holds {counted}; scoring accuracy.tokens={tokens:,} after ctx={ctx:,} needs "
                          f"ctx + accuracy.tokens + 1 = {ctx + tokens + 1:,} tokens of one stream (it has {have:,} to "
                          "score); give a longer text or fewer accuracy.tokens")
    prompts, fed, targets, scored = [], [], [], []
    left = tokens
    for stream in ids.reshape(-1, ids.shape[-1]):
        start = 0
        while left and start + ctx + 1 < stream.shape[0]:
            count = min(steps, left, stream.shape[0] - start - ctx - 1)  # tokens this window scores
            text = stream[start + ctx : start + ctx + count + 1]
            prompts.append(stream[start : start + ctx])
            fed.append(np.pad(text[:-1], (0, steps - count)))
            targets.append(np.pad(text[1:], (0, steps - count)))
            scored.append(np.arange(steps) < count)
            left, start = left - count, start + steps
    found = np.concatenate(prompts + fed + targets)
    if found.min() < 0 or found.max() >= vocab_size:
        raise PromptError(f"{name} has token id {int(found.max() if found.max() >= vocab_size else found.min())}, "
                          f"outside the model's vocabulary [0, {vocab_size})")
    return TextWindows(np.stack(prompts), np.stack(fed), np.stack(targets), np.stack(scored))

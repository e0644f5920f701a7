"""Prompt tokens from a file or a built-in text (`prompt=PATH`, `prompt=python-docs`): real text for a
point instead of seeded random ids.

A file holds token ids, or text:
- `.json`: a list of ids (one stream), or a list of lists (one row of ids per sequence);
- `.npy`: a 1-D (one stream) or 2-D (one row per sequence) integer array, memory-mapped;
- any other name: UTF-8 text, tokenized with the checkpoint's own tokenizer (a folder's
  `tokenizer.json`, or the one a GGUF file's metadata describes, harness.model.gguf_tokenizer; the
  `tokenizers` library, special tokens as the tokenizer adds them: Llama's BOS once, at the start).
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

Bounded work: `read_tokens(..., limit=N)` reads only what N tokens need. Text is tokenized in growing
prefixes of the file (READ_BYTES_PER_TOKEN bytes a token at first, doubled until enough), each cut at
its last line break (else its last space, else the start of its last character: a text without
either is never read whole), and the prefix gives SPARE_TOKENS more than it returns, so a cut never
changes a token returned (a cut inside a word changes the tokens of that word only): the first N ids
are those of the whole file, whatever its size.
The content hash (`content_hash`) is as bounded: sha256 of the file's size, its first HASHED_HEAD_BYTES
(every token of a point of up to about four million tokens of text) and last HASHED_TAIL_BYTES, and
the tokenizer's (tokenizer.json's bytes, or a GGUF checkpoint's own content hash, which covers its
metadata); an edit past the first 16 MiB that keeps the file's size and its last MiB goes unnoticed.
A built-in text is tokenized whole, once per tokenizer and process (about 120,000 tokens), and hashed
whole.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tokenizers import Tokenizer

from harness.config.paths import expanded, kind_of
from harness.config.texts import builtin_text, is_builtin_text
from harness.config.validate import first_line
from harness.model.checkpoint import read_checkpoint
from harness.model.checkpoint_fields import CheckpointError
from harness.model.gguf_tokenizer import gguf_tokenizer

TOKEN_FILES = (".json", ".npy")  # file suffixes read as token ids; any other is text
HASHED_HEAD_BYTES = 16 * 2**20  # the content hash reads this much of the file's start...
HASHED_TAIL_BYTES = 2**20  # ...and this much of its end
READ_BYTES_PER_TOKEN = 8  # the first prefix of a text file read for `limit` tokens: twice English text's ~4 bytes a token
SPARE_TOKENS = 64  # tokens a prefix must give beyond those returned: the cut may change the last few
JSON_MAX_BYTES = 64 * 2**20  # a .json file of ids is parsed whole: ~10 million ids at most; .npy is mapped


class PromptError(ValueError):
    """A prompt file a point cannot use. str() is one line naming the file."""


def window_tokens(ctx: int, decode_tokens: int) -> int:
    """Tokens one sequence takes from the file: the prompt, the fed text, and the last step's target."""
    return ctx + decode_tokens + 1


def content_hash(source: str | Path, tokenizer: Optional[Path]) -> str:
    """The file's bounded content hash, or a built-in text's, with its tokenizer's for text (the module
    docstring)."""
    if is_builtin_text(source):
        digest = hashlib.sha256(builtin_text(str(source)).encode())
        if tokenizer is not None:
            digest.update(_tokenizer_fingerprint(tokenizer))
        return digest.hexdigest()[:16]
    path = expanded(str(source)).resolve()
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}\0".encode())
    with open(path, "rb") as f:
        digest.update(f.read(HASHED_HEAD_BYTES))
        f.seek(max(0, size - HASHED_TAIL_BYTES))
        digest.update(f.read(HASHED_TAIL_BYTES))
    if tokenizer is not None and path.suffix not in TOKEN_FILES:
        digest.update(_tokenizer_fingerprint(tokenizer))
    return digest.hexdigest()[:16]


def _tokenizer_fingerprint(tokenizer: Path) -> bytes:
    if tokenizer.suffix == ".gguf":
        return read_checkpoint(tokenizer).content_hash.encode()
    return tokenizer.read_bytes()


def read_tokens(path: str | Path, tokenizer: Optional[Path], limit: Optional[int] = None) -> np.ndarray:
    """The token ids of a file or built-in text, integers: [N] for a stream (with `limit`, at most its first
    `limit`), [rows, N] for rows. Cached per file, its size and time, the tokenizer and the limit."""
    if is_builtin_text(path):
        return _builtin_tokens(str(path), tokenizer, tokenizer.stat().st_mtime_ns if tokenizer else 0)[:limit]
    file = expanded(str(path)).resolve()
    if not file.is_file():
        raise PromptError(f"'{path}' is {kind_of(file)}, not a file of prompts")
    stat = file.stat()
    stamp = (stat.st_size, stat.st_mtime_ns, str(tokenizer), tokenizer.stat().st_mtime_ns if tokenizer else 0)
    return _read_tokens(file, tokenizer, limit, stamp)


@functools.lru_cache(maxsize=2)
def _builtin_tokens(name: str, tokenizer: Optional[Path], _mtime_ns: int) -> np.ndarray:
    if tokenizer is None:
        raise PromptError(f"'{name}' is a built-in text, which needs a tokenizer: set model.checkpoint to a "
                          "checkpoint with one")
    try:
        ids = _tokenizer(tokenizer, tokenizer.stat().st_mtime_ns).encode(builtin_text(name)).ids
    except PromptError:
        raise
    except Exception as error:  # the library raises its own Exception for what it cannot encode
        raise PromptError(f"'{tokenizer}' cannot tokenize '{name}': {str(error).splitlines()[0]}") from None
    return np.asarray(ids, dtype=np.int64)


@functools.lru_cache(maxsize=8)
def _read_tokens(file: Path, tokenizer: Optional[Path], limit: Optional[int], _stamp: tuple) -> np.ndarray:
    if file.suffix == ".npy":
        try:
            ids = np.load(file, mmap_mode="r", allow_pickle=False)  # mapped: a window reads only its own pages
        except (ValueError, OSError, EOFError) as error:
            raise PromptError(f"'{file}' is not a NumPy array file ({str(error).splitlines()[0]})") from None
    elif file.suffix == ".json":
        ids = _json_ids(file)
    else:
        ids = np.asarray(_tokenize(file, tokenizer, limit), dtype=np.int64)
    if ids.dtype == object or ids.ndim not in (1, 2) or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise PromptError(f"'{file}' must hold integer token ids, a list or rows of equal length "
                          f"(got {ids.dtype} of shape {list(ids.shape)})")
    return ids[:limit] if ids.ndim == 1 else ids


def _json_ids(file: Path) -> np.ndarray:
    """The ids a .json file holds, as an array; PromptError saying which rule the file breaks."""
    size = file.stat().st_size
    if size > JSON_MAX_BYTES:
        raise PromptError(f"'{file}' is {size:,} bytes of JSON, more than {JSON_MAX_BYTES:,}: give the ids as .npy, "
                          "which is memory-mapped and read only where a window is")
    try:
        value = json.loads(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
        raise PromptError(f"'{file}' is not JSON ({first_line(error, typed=False)})") from None
    except RecursionError:
        raise PromptError(f"'{file}' nests its JSON deeper than Python reads; token ids are a list, or a list of "
                          "lists") from None
    rows = value if isinstance(value, list) and value and all(isinstance(row, list) for row in value) else None
    if rows is not None and len({len(row) for row in rows}) > 1:
        raise PromptError(f"'{file}' holds rows of {min(map(len, rows)):,} to {max(map(len, rows)):,} ids; rows of "
                          "token ids must be of equal length (one row per sequence)")
    # JSON's true and false are no ids: NumPy would read a list mixing them with integers as 1 and 0
    entries = (v for row in rows for v in row) if rows is not None else value if isinstance(value, list) else ()
    if any(type(v) is bool for v in entries):
        raise PromptError(f"'{file}' holds true or false where token ids belong: ids are integers")
    try:
        return np.asarray(value)
    except (ValueError, OverflowError) as error:  # rows of lists within lists, numbers beyond int64
        raise PromptError(f"'{file}' must hold integer token ids, a list or rows of equal length "
                          f"({first_line(error, typed=False)})") from None


def _tokenize(file: Path, tokenizer: Optional[Path], limit: Optional[int]) -> list[int]:
    """The ids of the file's text, or with `limit` of the shortest prefix that gives them (the module docstring)."""
    if tokenizer is None:
        raise PromptError(f"'{file}' is text, which needs a tokenizer: set model.checkpoint to a folder with "
                          f"tokenizer.json or to a GGUF file, or give token ids as {' or '.join(TOKEN_FILES)}")
    encoder = _tokenizer(tokenizer, tokenizer.stat().st_mtime_ns)
    size = file.stat().st_size
    read = size if limit is None else min(size, (limit + SPARE_TOKENS) * READ_BYTES_PER_TOKEN)
    with open(file, "rb") as f:
        while True:
            f.seek(0)
            data = f.read(read)
            whole = read >= size
            cut = len(data) if whole else (data.rfind(b"\n") + 1 or data.rfind(b" ") + 1 or _character_start(data))
            if whole or cut:  # a line break or a space (almost a token boundary), else a character's start
                try:
                    text = data[:cut].decode("utf-8")
                except UnicodeDecodeError:
                    raise PromptError(f"'{file}' is neither UTF-8 text nor token ids "
                                      f"({', '.join(TOKEN_FILES)})") from None
                try:
                    ids = encoder.encode(text).ids
                except Exception as error:  # the library raises its own Exception for what it cannot encode
                    raise PromptError(f"'{tokenizer}' cannot tokenize '{file}': {str(error).splitlines()[0]}") from None
                if whole or len(ids) >= limit + SPARE_TOKENS:
                    return ids
            read = min(size, 2 * read)


def _character_start(data: bytes) -> int:
    """Where the last UTF-8 character of `data` starts (0 when none does): a prefix of text without a
    space or a line break is cut there, not read whole."""
    for back in range(1, min(len(data), 4) + 1):
        if data[-back] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            return len(data) - back
    return 0


@functools.lru_cache(maxsize=2)
def _tokenizer(path: Path, _mtime_ns: int):
    """The `tokenizers` Tokenizer of a tokenizer.json or a GGUF file's metadata (built once per process)."""
    if path.suffix == ".gguf":
        try:
            return gguf_tokenizer(path)
        except CheckpointError as error:
            raise PromptError(str(error)) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # the library raises its own Exception for a malformed tokenizer.json
        raise PromptError(f"'{path}' is not a tokenizer the tokenizers library reads: "
                          f"{str(error).splitlines()[0]}") from None


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
    return rows.astype(np.int64)  # a copy: a mapped .npy file's rows leave the file behind


def file_windows(path: str | Path, tokenizer: Optional[Path], batch: int, length: int, vocab_size: int) -> np.ndarray:
    """`batch` windows of `length` ids from the file [batch, length]: only the batch * length tokens they
    take are read from a stream, never the whole file."""
    return windows(read_tokens(path, tokenizer, limit=batch * length), batch, length, vocab_size, f"'{path}'")


def tokenizer_of(checkpoint: Optional[str]) -> Optional[Path]:
    """Where the checkpoint's tokenizer is: a folder's tokenizer.json, or a GGUF file itself (its metadata
    holds one); None without a checkpoint or a tokenizer."""
    if not checkpoint:
        return None
    path = expanded(checkpoint)
    path = path if path.suffix == ".gguf" else path / "tokenizer.json"
    return path.resolve() if path.is_file() else None


def checked_tokens(point, limit: int) -> np.ndarray:
    """The ids of a point's prompt (it has `prompt` and `prompt_hash`, harness.config.Point), at most
    `limit` of a stream, read in the point's own process: the file or text (and tokenizer) must still
    be what the plan hashed."""
    tokenizer = tokenizer_of(point.model.checkpoint)
    found = content_hash(point.prompt, tokenizer)
    if found != point.prompt_hash:
        raise PromptError(f"'{point.prompt}' changed since the sweep was planned (hash {found}, planned "
                          f"{point.prompt_hash})")
    return read_tokens(point.prompt, tokenizer, limit=limit)


def point_prompt(point, device) -> torch.Tensor:
    """The timed run's windows of a point's prompt [batch, ctx + decode_tokens + 1] on `device`."""
    length = window_tokens(point.ctx, point.decode_tokens)
    ids = windows(checked_tokens(point, point.batch * length), point.batch, length, point.model.vocab_size,
                  f"'{point.prompt}'")
    return torch.from_numpy(np.ascontiguousarray(ids)).to(device)


def accuracy_tokens_needed(ctx: int, tokens: int) -> int:
    """Tokens of one stream the accuracy pass reads: the first window's prompt, every scored token, and
    the token fed before the first."""
    return ctx + tokens + 1


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
    ids = ids[: accuracy_tokens_needed(ctx, tokens)] if ids.ndim == 1 else ids
    have = scoreable_tokens(ids, ctx)
    if have < tokens:
        counted = (f"{ids.shape[0]:,} tokens" if ids.ndim == 1 else f"{ids.shape[0]} row(s) of {ids.shape[1]:,} tokens")
        raise PromptError(f"{name} holds {counted}; scoring accuracy.tokens={tokens:,} after ctx={ctx:,} needs "
                          f"ctx + accuracy.tokens + 1 = {accuracy_tokens_needed(ctx, tokens):,} tokens of one stream (it has {have:,} to "
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


# --- The recall probe: a span of the prompt repeated at a distance (harness.measure.accuracy) --------

RECALL_CUE_TOKENS = 16  # the span's first tokens end the probe's prompt: the cue that points back at it
RECALL_SPAN_START_SHARE = 16  # the span starts ctx // this into the prompt: past the first tokens (sinks)


@dataclass(frozen=True)
class RecallWindows:
    """The recall probe over the accuracy pass's prompts: window i prefills prompts[i], whose body is
    the accuracy prompt's first ctx - cue tokens and whose last cue tokens repeat the body's tokens
    from `span_start` on; decode step j is fed fed[i, j] and scored on targets[i, j], the span's next
    tokens. Every scored token stands `distance` positions after its first occurrence, so a cache
    that dropped that occurrence can only guess it, while an exact cache copies it (induction heads)."""

    prompts: np.ndarray  # [W, ctx] int64
    fed: np.ndarray  # [W, steps] int64: the span's tokens after the cue
    targets: np.ndarray  # [W, steps] int64: the token after each fed one, the span's own
    span_start: int  # position in the prompt of the span's first token
    distance: int  # positions between a repeated token and its first occurrence

    @property
    def steps(self) -> int:
        return self.fed.shape[1]


def recall_span_start(ctx: int) -> int:
    """Where the repeated span starts in a prompt of ctx tokens."""
    return ctx // RECALL_SPAN_START_SHARE


def recall_steps(ctx: int, steps: int) -> int:
    """Repeat tokens a probe window of ctx scores, at most `steps`: the span (cue, scored tokens and the
    last target) must lie in the prompt's body, before the cue that ends the prompt. 0: too short."""
    body = ctx - RECALL_CUE_TOKENS
    return max(0, min(steps, body - recall_span_start(ctx) - RECALL_CUE_TOKENS - 1))


def recall_windows(prompts: np.ndarray, steps: int) -> Optional[RecallWindows]:
    """The probe built from the accuracy pass's prompts [W, ctx] (the class docstring), scoring at most
    `steps` tokens a window; None when ctx leaves no room for a span and its repeat."""
    ctx = prompts.shape[1]
    count = recall_steps(ctx, steps)
    if count == 0:
        return None
    body, start = ctx - RECALL_CUE_TOKENS, recall_span_start(ctx)
    span = prompts[:, start : start + RECALL_CUE_TOKENS + count + 1]  # [W, cue + count + 1]
    probe = np.concatenate([prompts[:, :body], span[:, :RECALL_CUE_TOKENS]], axis=1)  # [W, ctx]
    return RecallWindows(np.ascontiguousarray(probe, dtype=np.int64),
                         np.ascontiguousarray(span[:, RECALL_CUE_TOKENS:-1], dtype=np.int64),
                         np.ascontiguousarray(span[:, RECALL_CUE_TOKENS + 1 :], dtype=np.int64),
                         span_start=start, distance=body - start)

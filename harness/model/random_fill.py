"""Seeded random fill of large tensors, fast enough that building a model is not most of a point's time.

torch fills a CPU tensor from a generator on one thread, so at the 8B width (1.27 G parameters at
depth 1) building the model would take many times longer than timing its decode steps. This
module draws uniform values of the same standard deviation (cheaper per value than normal ones) and splits
the tensor into pieces filled on all cores, each piece from its own generator seeded by the parent
generator in a fixed order: the values depend on the seed, the tensor's shape and layout and
PIECE_ELEMENTS, never on the thread count or the order the threads finish in.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

PIECE_ELEMENTS = 1 << 22  # ~16 MB of fp32 per piece: enough work per task, enough tasks to share
_SEED_RANGE = 1 << 62  # seeds drawn for the pieces


def _pieces(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views that cover `tensor` exactly once: slices of its flat view when contiguous, else its
    sub-tensors along dim 0, recursively (a cache table narrowed to its filled prefix is not)."""
    if tensor.is_contiguous():
        flat = tensor.view(-1)
        for start in range(0, flat.numel(), PIECE_ELEMENTS):
            yield flat[start:start + PIECE_ELEMENTS]
    else:
        for sub in tensor.unbind(0):
            yield from _pieces(sub)


@torch.no_grad()
def uniform_like_normal_(tensor: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """Fill `tensor` in place with values of mean 0 and standard deviation `std`, uniform on
    [-std * sqrt(3), std * sqrt(3)], drawn from `generator` (consumed deterministically)."""
    bound = std * math.sqrt(3.0)
    if tensor.device.type != "cpu":  # GPU generators fill at memory speed already
        return tensor.uniform_(-bound, bound, generator=generator)
    pieces = list(_pieces(tensor))
    seeds = torch.randint(_SEED_RANGE, (len(pieces),), generator=generator).tolist()

    def fill(piece: torch.Tensor, seed: int) -> None:
        # Grad and inference modes are per thread: the pool's threads do not inherit the caller's, and
        # a tensor made under inference mode (a point's) can only be written under it.
        with torch.inference_mode(piece.is_inference()), torch.no_grad():
            piece.uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))

    if len(pieces) == 1:
        fill(pieces[0], seeds[0])
    else:
        # torch releases the GIL inside uniform_, so threads fill pieces in parallel.
        with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
            list(pool.map(fill, pieces, seeds))
    return tensor

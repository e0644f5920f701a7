"""A cpu_small decode step with each piece of the C small-batch path in turn, timed interleaved in one process.

Variants (same seeded weights): `onednn` (matmul=onednn: packed linears, torch's small operators);
`c_linear` (the C linears only); `c_linear_norm` (and the C RMSNorm); `c_block` (matmul=c as shipped:
each decoder block two C calls, harness.model.cpu_gemv.GemvBlock). With `--against DIR`, also
`against:c_block`: matmul=c and `contiguous` as another checkout of the project builds them (an
earlier revision: `git worktree add --detach /tmp/before REV`), imported into this process beside this
checkout's (a checkout from before the kernels became one torch extension, as docs/performance.md's
figures used: a later one registers the same operators, and the script refuses it). One step of each
in turn (harness.measure.rounds, the order rotating), every step at position ctx (the session is
rewound outside the timed call), medians and each variant's paired ratio to `onednn` printed with
whether all pick the same next tokens.

Before the steps, the cost of one kernel call from Python: the C linear on a 1 x 16 input and a
16 x 16 weight (no work to speak of), in loops of `--calls` calls, this checkout's and, with
--against, the other's, interleaved with F.linear on the same tensors; medians over the rounds (the
first eighth of the rounds run untimed, as warm-up).

The figures behind docs/performance.md's "The kernels' call cost". Run it under `flock /tmp/cpu.lock`.

    python scripts/step_kernels_ab.py --batch 1 --ctx 256 [--against /tmp/before]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from harness.config import ModelConfig
from harness.config.paths import config_dir
from harness.measure.rounds import RoundsOptions, Step, time_rounds
from harness.model import build_model, cpu_gemv, decoder
from strategies.caches.contiguous import ContiguousStrategy

VARIANTS = ("onednn", "c_linear", "c_linear_norm", "c_block")
PACKAGES = ("harness", "strategies")


@contextlib.contextmanager
def other_checkout(root: Path):
    """`harness` and `strategies` imported from another checkout inside the block, this checkout's again
    after it (what was imported inside keeps its own modules). The other checkout's torch.library
    registrations are skipped where they collide with this one's: the steps here run eager."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] in PACKAGES}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    library, register_fake = torch.library.Library, torch.library.register_fake
    define, impl = library.define, library.impl

    def tolerant(method):
        def call(self, *args, **kwargs):
            with contextlib.suppress(RuntimeError):
                return method(self, *args, **kwargs)
        return call

    library.define, library.impl = tolerant(define), tolerant(impl)
    torch.library.register_fake = lambda *args, **kwargs: (lambda function: function)
    try:
        with warnings.catch_warnings():  # an implementation registered over this checkout's
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        library.define, library.impl, torch.library.register_fake = define, impl, register_fake
        sys.path.remove(str(root))
        for name in [name for name in sys.modules if name.split(".")[0] in PACKAGES]:
            del sys.modules[name]
        sys.modules.update(saved)


def variant_model(shape: ModelConfig, kind: str, batch: int) -> decoder.Decoder:
    """matmul=c's model with the pieces after `kind` put back to torch's (or matmul=onednn's model)."""
    model = build_model(shape, torch.device("cpu"), torch.float32, 0, "onednn" if kind == "onednn" else "c",
                        batch_hint=batch)
    if kind in ("c_linear", "c_linear_norm"):
        model.layers = torch.nn.ModuleList(layer.block for layer in model.layers)  # the block's own modules
    if kind == "c_linear":
        for block in model.layers:
            for name in ("attention_norm", "ffn_norm"):
                norm = decoder.RMSNorm(shape.d_model, shape.norm_eps)
                norm.weight = getattr(block, name).weight
                setattr(block, name, norm)
    return model


def timed_rounds(calls: dict, rounds: int, repeat: int = 1, reference: str | None = None):
    """The calls timed together in `rounds` rounds (harness.measure.rounds), `repeat` calls a round each;
    the first eighth of the rounds as untimed warm-up. Returns the Rounds, times per `repeat` calls."""
    repeated = {name: (lambda call=call: [call() for _ in range(repeat)]) if repeat > 1 else call
                for name, call in calls.items()}
    return time_rounds(repeated, RoundsOptions(rounds=rounds, warmup=max(1, rounds // 8), reference=reference))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cpu_small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=2000, help="kernel calls per round of the call-cost loop")
    parser.add_argument("--against", type=Path, help="another checkout whose matmul=c step to time beside this one's")
    args = parser.parse_args()
    if args.against is not None and (args.against / "harness" / "kernels" / "csrc" / "ops.cpp").exists():
        # Its extension registers the operator namespace this checkout's does, and torch aborts the
        # process on a second registration: only checkouts from before the extension (ctypes) load here.
        sys.exit(f"--against: {args.against} builds the kernels as a torch extension, whose operators would "
                 "collide with this checkout's in one process; time its steps in alternating processes, or its "
                 "kernels with scripts/kernels_ab.py --against REV")
    if cpu_gemv.unavailable():
        sys.exit(f"the C kernels cannot run here: {cpu_gemv.unavailable()}")
    shape = ModelConfig(**yaml.safe_load((config_dir() / "model" / f"{args.model}.yaml").read_text()))
    x, weight = torch.randn(1, 16), torch.randn(16, 16)  # [1, in], [out, in]: a call with no work to speak of
    calls = {"F.linear": lambda: F.linear(x, weight), "this checkout": lambda: cpu_gemv.gemv(x, weight)}
    models = {kind: (variant_model(shape, kind, args.batch), ContiguousStrategy()) for kind in VARIANTS}
    if args.against is not None:
        with other_checkout(args.against.resolve()):
            from harness.model import build_model as other_build_model
            from harness.model import cpu_gemv as other_gemv
            from strategies.caches.contiguous import ContiguousStrategy as OtherContiguous

            if other_gemv.unavailable():
                sys.exit(f"the other checkout's C kernels cannot run here: {other_gemv.unavailable()}")
            calls["against"] = lambda: other_gemv.gemv(x, weight)
            model = other_build_model(shape, torch.device("cpu"), torch.float32, 0, "c", batch_hint=args.batch)
            models["against:c_block"] = (model, OtherContiguous())
    with torch.inference_mode():
        per_call = timed_rounds(calls, args.rounds, args.calls).medians()
        print(f"one call, 1 x 16 @ 16 x 16, median of {args.rounds} rounds of {args.calls}: " + ", ".join(
            f"{name} {seconds / args.calls * 1e6:.2f} us" for name, seconds in per_call.items()))
        sessions = {}
        for kind, (model, strategy) in models.items():
            session = strategy.new_session(model, args.batch, args.ctx + 2)
            session.fill_random(args.ctx, torch.Generator().manual_seed(0))
            sessions[kind] = session
        token = torch.zeros(args.batch, dtype=torch.int64)
        logits = {}

        def step(kind) -> Step:  # [B, vocab] logits kept; the session rewound to ctx before every step
            return Step(lambda: sessions[kind].step(token), before=lambda: sessions[kind].rewind(args.ctx),
                        after=lambda output: logits.__setitem__(kind, output))

        steps = timed_rounds({kind: step(kind) for kind in sessions}, args.rounds, reference="onednn")
    same = all(torch.equal(logits[kind].argmax(-1), logits["onednn"].argmax(-1)) for kind in sessions)
    ratios = steps.ratios()
    print(f"{args.model} b={args.batch} ctx={args.ctx}: " + ", ".join(
        f"{kind} {seconds * 1e3:.2f} ms" + (f" ({ratios[kind].median:.3f}x onednn)" if kind in ratios else "")
        for kind, seconds in steps.medians().items()) + f"; same tokens: {same}")
    if "against:c_block" in steps.seconds:
        against = steps.ratio("c_block", "against:c_block")
        print(f"c_block / against:c_block: {against.median:.3f} [{against.low:.3f}, {against.high:.3f}]")


if __name__ == "__main__":
    main()

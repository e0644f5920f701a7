"""Stage 2 of the pipeline: the Llama-3-style decoder with seeded random weights, and its CPU linears."""
from harness.model.decoder import Decoder, RotaryTable, build_model

__all__ = ["Decoder", "RotaryTable", "build_model"]

"""Stage 2 of the pipeline: the Llama-3-style decoder, its weights (seeded random, or a Hugging Face checkpoint's), and its CPU linears."""
from harness.model.factory import build_model
from harness.model.decoder import Decoder, RotaryTable

__all__ = ["Decoder", "RotaryTable", "build_model"]

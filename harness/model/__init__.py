"""Stage 2 of the pipeline: the Llama-3-style decoder, its weights (seeded random, or a checkpoint's: a Hugging Face folder or a GGUF file), and its CPU linears."""
from harness.model.factory import build_model
from harness.model.decoder import Decoder, RotaryTable

__all__ = ["Decoder", "RotaryTable", "build_model"]

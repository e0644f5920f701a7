"""The CPU kernels: one torch C++ extension (csrc/), built on first use and loaded by harness.kernels.extension."""

"""Native kernels: the C build and load every C kernel of the project goes through (harness.kernels.build)."""

"""Stage 3 of the pipeline: measure one point in its own process. Timing (CUDA events or perf_counter,
CUDA graphs), memory peaks, the calibration kernels, and DRAM traffic through Nsight Compute."""

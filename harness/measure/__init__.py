"""Stage 3 of the pipeline: measure a group of points, timed together in one process (its own with isolate=true). Timing (CUDA events or perf_counter,
CUDA graphs), memory peaks, the calibration kernels, and DRAM traffic through Nsight Compute."""

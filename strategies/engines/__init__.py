"""Engines: foreign runtimes users deploy instead of the harness (llama.cpp, OpenVINO, ONNX Runtime
GenAI), measured as members of a group beside the caches, one file each.

An engine bypasses the harness's decoder: it reads the same weights converted to its own format,
keeps its own cache and runs its own kernels. The contract every engine follows, and what they share,
is in `strategies.engines.engine`; what they build and convert (weight copies, converted models,
llama.cpp's library and its build for this machine) in `strategies.engines.artifacts`.

Nothing here imports strategies.caches (an import-linter contract in pyproject.toml).
"""

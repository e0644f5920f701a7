"""What the engines build and convert from the harness's weights and from their own packages: the float
GGUF copy every engine reads (gguf_writer), OpenVINO's stateful IR (openvino_ir), and llama.cpp's library
as its wheel ships it (llamacpp_library). Each is made once and kept under the kernel cache's folder.
"""

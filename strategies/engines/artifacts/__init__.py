"""What the engines build and convert, each made once, kept under the kernel cache's folder and
published whole by one process at a time (harness.files.publish):

- gguf_writer: the float GGUF copy of the checkpoint every engine reads (the decoder's own numbers);
- hf_copy: that copy read by transformers, in memory or as a Hugging Face folder;
- openvino_ir: OpenVINO's stateful IR of it;
- ortgenai_model: ONNX Runtime GenAI's builder's model of it;
- llamacpp_library: llama.cpp's library loaded (this machine's build, else the wheel's, patched for an
  older glibc where it needs one);
- llamacpp_build: llama.cpp built from source for this machine (one command; the member prefers it).
"""

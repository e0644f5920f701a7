"""The harness's weights as a stateful OpenVINO IR model (strategies/engines/openvino.py runs it), converted once per
checkpoint hash beside the engines' other copies and published whole (harness.files.publish).

OpenVINO's route for LLMs is a stateful IR: the past K/V of every layer are the model's variables
(ReadValue/Assign pairs), never inputs, and its CPU plugin fuses each ReadValue -> Concat -> SDPA -> Assign
chain into one attention node that owns the cache in the KV precision asked for at compile time
(KV_CACHE_PRECISION). optimum-intel's exporter makes that model but pulls nncf, scikit-learn, scipy and a
torch of its own; so the harness converts with `openvino.convert_model` alone: transformers' model read
from the same F32 GGUF copy the other engines get (strategies.engines.artifacts.hf_copy), wrapped in a forward whose past K/V are flat tensors (traceable: no Cache objects, no branch on a shape), then
OpenVINO's own make-stateful transformation with a `beam_idx` gather on each state (the layout of the
stateful LLMs OpenVINO's tools write, which the CPU plugin's fusion expects).

Inputs: input_ids, attention_mask [B, past + T], position_ids [B, T], beam_idx [B]; output: logits [B, V]
of the last position only (a prompt's other positions are never read).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from harness.files import publish
from strategies.engines.artifacts.gguf_writer import weights_dir
from strategies.engines.artifacts.hf_copy import transformers_model

XML = "openvino_model.xml"
STATE_PAIRS = ("key", "value")


class FlatPast(torch.nn.Module):
    """A Llama-family transformers model whose past K/V are flat [B, Hkv, past, D] tensors in and
    [B, Hkv, past + T, D] tensors out, each layer's attention one scaled_dot_product_attention over the
    concatenated cache (the chain OpenVINO's CPU plugin fuses)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids)
        batch, count = input_ids.shape
        keys = torch.arange(attention_mask.shape[1])
        # causal by position, and only the positions attention_mask keeps: an additive mask, finite (an
        # all-masked row would otherwise give NaN)
        allowed = (keys[None, None, :] <= position_ids[:, :, None]) & (attention_mask[:, None, :] > 0)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]
        group = self.heads // self.kv_heads
        present = []
        for i, layer in enumerate(inner.layers):
            attention = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q = attention.q_proj(normed).view(batch, count, self.heads, self.head_dim).transpose(1, 2)
            k = attention.k_proj(normed).view(batch, count, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attention.v_proj(normed).view(batch, count, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = torch.cat([past[2 * i], k], dim=2), torch.cat([past[2 * i + 1], v], dim=2)
            present += [k, v]
            length = k.shape[2]
            # grouped-query heads as unsqueeze -> broadcast -> reshape: the GQA form the fusion recognises
            wide_k = k[:, :, None].expand(batch, self.kv_heads, group, length, self.head_dim).reshape(
                batch, self.heads, length, self.head_dim)
            wide_v = v[:, :, None].expand(batch, self.kv_heads, group, length, self.head_dim).reshape(
                batch, self.heads, length, self.head_dim)
            out = torch.nn.functional.scaled_dot_product_attention(q, wide_k, wide_v, attn_mask=mask,
                                                                   scale=self.head_dim ** -0.5)
            hidden = hidden + attention.o_proj(out.transpose(1, 2).reshape(batch, count, self.heads * self.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return (self.model.lm_head(inner.norm(hidden[:, -1])), *present)


def stateful_model(gguf: str) -> Path:
    """The stateful fp32 IR of the float GGUF copy's model (converted once; its .xml file)."""
    folder = weights_dir() / "openvino" / f"{Path(gguf).stem}-stateful"
    publish(folder, lambda building: _convert(Path(gguf), building / XML), f"converting {folder.name}",
            complete=lambda path: (path / XML).exists(), folder=True)
    return folder / XML


def _convert(gguf: Path, target: Path) -> None:
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    hf = transformers_model(gguf)  # converted in memory: no Hugging Face folder is written on the way
    flat = FlatPast(hf.eval())
    layers = flat.model.config.num_hidden_layers
    past_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in STATE_PAIRS]
    # an example with past and new tokens both > 1 wide, so no dimension is traced as a constant 1
    batch, new, past = 2, 3, 5
    example = (torch.ones(batch, new, dtype=torch.int64), torch.ones(batch, past + new, dtype=torch.int64),
               torch.arange(past, past + new).repeat(batch, 1),
               *(torch.randn(batch, flat.kv_heads, past, flat.head_dim) for _ in past_names))
    with torch.no_grad():  # every dimension but heads and head width comes out dynamic
        model = ov.convert_model(flat, example_input=example)
    for port, name in zip(model.inputs, ["input_ids", "attention_mask", "position_ids", *past_names]):
        port.get_tensor().set_names({name})  # the traced *past arguments come unnamed
    present_names = [name.replace("past_key_values", "present") for name in past_names]
    for output, name in zip(model.outputs, ["logits", *present_names]):
        output.get_tensor().set_names({name})
    beam_idx = opset13.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    model.add_parameters([beam_idx])
    for name in past_names:  # each state read through a gather by beam_idx, as OpenVINO's stateful LLMs do
        port = model.input(name)
        consumers = port.get_target_inputs()
        gathered = opset13.gather(port, beam_idx, opset13.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gathered.output(0))
    model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(model, dict(zip(past_names, present_names)))
    # each state starts empty: [B, Hkv, 0, D] with B from input_ids
    rows = opset13.gather(opset13.shape_of(model.input("input_ids"), output_type="i64"), opset13.constant([0]),
                          opset13.constant(0))
    rest = opset13.constant(np.array([flat.kv_heads, 0, flat.head_dim], dtype=np.int64))
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            op.set_arguments([opset13.broadcast(opset13.constant(0.0, dtype=ov.Type.f32),
                                                opset13.concat([rows, rest], axis=0))])
    model.validate_nodes_and_infer_types()
    ov.save_model(model, target, compress_to_fp16=False)  # fp32 weights: the harness's, not a half copy

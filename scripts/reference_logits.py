#!/usr/bin/env python3
"""Expected logits from the peer implementation: HF transformers' own `qwen3_5_moe` model, fp32.

Reads a model directory written by `lily-engine synth` (HF bf16 or MLX affine format), builds
transformers' Qwen3_5MoeForCausalLM from its text config, loads the weights (MLX weights are
dequantised, renamed and un-shifted back to the HF convention), runs teacher-forced forward passes
over seeded random token sequences and writes:

    OUT.json  metadata: command, versions, sequences, shape
    OUT.f32   little-endian float32 logits, [sum of lengths, vocab], sequence after sequence

Usage (needs torch + transformers >= 5.2; not needed by CI, which only reads the fixtures):
    lily-engine synth --preset tiny --format mlx --seed 1 --out /tmp/tiny-mlx
    python3 scripts/reference_logits.py --model /tmp/tiny-mlx --out crates/lily-core/tests/fixtures/parity/tiny-mlx
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

ZERO_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


def load_tensors(model_dir):
    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            # safetensors.numpy cannot hold bf16: read raw and widen by hand.
            tensors.update(read_safetensors(os.path.join(model_dir, name)))
    return tensors


def read_safetensors(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[a:b]
        shape = info["shape"]
        dt = info["dtype"]
        if dt == "BF16":
            u = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            arr = u.view(np.float32).reshape(shape)
        elif dt == "F32":
            arr = np.frombuffer(raw, dtype=np.float32).reshape(shape)
        elif dt == "U32":
            arr = np.frombuffer(raw, dtype=np.uint32).reshape(shape)
        else:
            raise SystemExit(f"{name}: unsupported dtype {dt}")
        out[name] = arr
    return out


def dequantise(w, scales, biases, group=64):
    """MLX affine: w = scale * q + bias, q packed little-endian, low bits first (MODEL.md §3.4)."""
    cols = scales.shape[-1] * group
    bits = w.shape[-1] * 32 // cols
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    q = ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], cols).astype(np.float32)
    s = np.repeat(scales, group, axis=-1)
    b = np.repeat(biases, group, axis=-1)
    return s * q + b


def hf_state_dict(tensors, fmt):
    sd = {}
    if fmt == "hf":
        for name, arr in tensors.items():
            key = name.replace("model.language_model.", "model.", 1)
            sd[key] = arr
        return sd
    # MLX -> HF naming and conventions.
    deq = {}
    for name, arr in tensors.items():
        if name.endswith(".scales") or name.endswith(".biases"):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        if base + ".scales" in tensors:
            arr = dequantise(arr, tensors[base + ".scales"], tensors[base + ".biases"])
        deq[name] = arr
    for name, arr in deq.items():
        key = name.replace("language_model.model.", "model.", 1).replace("language_model.lm_head", "lm_head", 1)
        if key.endswith("conv1d.weight"):
            arr = np.moveaxis(arr, 2, 1)  # [C, K, 1] -> [C, 1, K]
        if key.endswith(ZERO_CENTRED_NORMS) or key == "model.norm.weight":
            arr = arr - 1.0  # MLX stores 1 + w; HF adds the 1 itself
        if ".switch_mlp." in key:
            continue
        sd[key] = arr
    for name in deq:
        if name.endswith("switch_mlp.gate_proj.weight"):
            prefix = name[: -len("switch_mlp.gate_proj.weight")].replace("language_model.model.", "model.", 1)
            gate = deq[name]
            up = deq[name.replace("gate_proj", "up_proj")]
            down = deq[name.replace("gate_proj", "down_proj")]
            sd[prefix + "experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            sd[prefix + "experts.down_proj"] = down
    return sd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="output prefix (writes PREFIX.json and PREFIX.f32)")
    ap.add_argument("--seqs", default="100:11,17:12", help="comma list of LENGTH:SEED token sequences")
    args = ap.parse_args()

    torch.manual_seed(0)
    config_json = json.load(open(os.path.join(args.model, "config.json")))
    fmt = "mlx" if "quantization" in config_json else "hf"
    text = dict(config_json.get("text_config", config_json))
    text.pop("model_type", None)
    config = transformers.Qwen3_5MoeTextConfig(**text)
    config._attn_implementation = "eager"
    model = transformers.Qwen3_5MoeForCausalLM(config).to(torch.float32).eval()

    sd = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in hf_state_dict(load_tensors(args.model), fmt).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing[:10]} unexpected {unexpected[:10]}")

    vocab = config.vocab_size
    seqs = []
    chunks = []
    with torch.no_grad():
        for spec in args.seqs.split(","):
            length, seed = (int(x) for x in spec.split(":"))
            rng = np.random.default_rng(seed)
            ids = rng.integers(0, vocab, size=length).tolist()
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            seqs.append(ids)
            chunks.append(logits.float().numpy().astype("<f4"))
    all_logits = np.concatenate(chunks, axis=0)
    all_logits.tofile(args.out + ".f32")
    meta = {
        "made_by": "scripts/reference_logits.py " + " ".join(sys.argv[1:]),
        "peer": f"transformers {transformers.__version__} Qwen3_5MoeForCausalLM, eager attention, fp32, torch {torch.__version__}, CPU",
        "model": config_json.get("lily_synthetic", {}),
        "format": fmt,
        "vocab": vocab,
        "sequences": seqs,
        "logits": os.path.basename(args.out) + ".f32",
    }
    with open(args.out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {args.out}.json/.f32: {all_logits.shape[0]} positions x {vocab}")


if __name__ == "__main__":
    main()

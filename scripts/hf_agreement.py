#!/usr/bin/env python3
"""Full-size agreement check (GPU machine): HF transformers' own bf16 path vs the fp32 reference.

Inputs: an MLX synthetic checkpoint of the full Qwen3.6-35B-A3B shape, and the teacher-forced fp32
reference logits written by `lily-engine score --device cpu` (PREFIX.f32 + PREFIX.json with the
token ids). Optionally other `score` outputs (e.g. Lily CUDA's production path) to compare too.

HF runs on the GPU in bf16 with the checkpoint's weights dequantised (w = scale*q + bias, then
rounded to bf16), the model's fp32-kept modules in fp32, as `from_pretrained(dtype=bfloat16)` would.

    python3 scripts/hf_agreement.py --model /tmp/full-mlx --ref /tmp/ref-cpu --other /tmp/lily-cuda --out $OUT/agreement.json

Without --ref, the token ids are those of `lily-engine score --len N --seed S` (the same seeded
generator, `prompt` below) or of another score output (--ids-from); --save PREFIX writes HF's logits
in score's format (PREFIX.f32 + PREFIX.json) for scripts/agreement_table.py:

    python3 scripts/hf_agreement.py --model /tmp/full-mlx --len 1024 --save /tmp/agree/hf-bf16 --out /tmp/agree/hf.json
"""

import argparse
import json
import os
import time

import numpy as np
import torch
import transformers

ZERO_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


def open_safetensors(model_dir):
    """name -> (memmap, dtype, shape) for every tensor of the directory."""
    out = {}
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, name)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        base = 8 + n
        for tname, info in header.items():
            if tname == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[tname] = (mm[base + a: base + b], info["dtype"], info["shape"])
    return out


def to_torch(entry, device):
    raw, dtype, shape = entry
    if dtype == "BF16":
        return torch.from_numpy(np.array(raw).view(np.int16).reshape(shape)).to(device).view(torch.bfloat16)
    if dtype == "F32":
        return torch.from_numpy(np.array(raw).view(np.float32).reshape(shape)).to(device)
    if dtype == "U32":
        return torch.from_numpy(np.array(raw).view(np.int32).reshape(shape)).to(device)
    raise SystemExit(f"unsupported dtype {dtype}")


def prompt(length, vocab, seed=0):
    """The token ids of `lily-engine score --len LENGTH --seed SEED` (cli_bench.rs `prompt`)."""
    mask = (1 << 64) - 1
    top = min(vocab, 248_044)
    s = (seed ^ 0x9E3779B97F4A7C15) & mask
    ids = []
    for _ in range(length):
        s = (s * 6364136223846793005 + 1442695040888963407) & mask
        ids.append((s >> 33) % top)
    return ids


def dequantise(w, scales, biases, group=64):
    cols = scales.shape[-1] * group
    bits = w.shape[-1] * 32 // cols
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=w.device, dtype=torch.int32) * bits
    q = ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], cols).float()
    s = scales.float().repeat_interleave(group, dim=-1)
    b = biases.float().repeat_interleave(group, dim=-1)
    return s * q + b


def hf_tensors(st, device):
    """Yields (hf_name, fp32 tensor) for the whole text model."""
    experts = {}
    for name in st:
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        t = to_torch(st[name], device)
        if base + ".scales" in st:
            t = dequantise(t, to_torch(st[base + ".scales"], device), to_torch(st[base + ".biases"], device))
        else:
            t = t.float()
        key = name.replace("language_model.model.", "model.", 1).replace("language_model.lm_head", "lm_head", 1)
        if key.endswith("conv1d.weight"):
            t = t.movedim(2, 1)
        if key.endswith(ZERO_CENTRED_NORMS) or key == "model.norm.weight":
            t = t - 1.0
        if ".switch_mlp." in key:
            prefix, part = key.split("switch_mlp.")
            experts.setdefault(prefix, {})[part] = t
            group = experts[prefix]
            if len(group) == 3:
                yield prefix + "experts.gate_up_proj", torch.cat([group["gate_proj.weight"], group["up_proj.weight"]], dim=1)
                yield prefix + "experts.down_proj", group["down_proj.weight"]
                del experts[prefix]
            continue
        yield key, t


def compare(ours, ref, vocab):
    ours = ours.reshape(-1, vocab).astype(np.float64)
    ref = ref.reshape(-1, vocab).astype(np.float64)
    rel = float(np.sqrt(((ours - ref) ** 2).sum() / (ref ** 2).sum()))
    per_pos = np.sqrt(((ours - ref) ** 2).sum(1) / (ref ** 2).sum(1))
    top1 = float((ours.argmax(1) == ref.argmax(1)).mean())
    return {"rel_l2": rel, "rel_l2_median_position": float(np.median(per_pos)), "top1_agreement": top1, "positions": int(ref.shape[0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ref", help="prefix of the fp32 reference (lily-engine score --device cpu)")
    ap.add_argument("--ids-from", help="without --ref: the token ids of this score output (PREFIX.json)")
    ap.add_argument("--len", type=int, help="without --ref / --ids-from: the ids of `lily-engine score --len N`")
    ap.add_argument("--seed", type=int, default=0, help="with --len: score's --seed")
    ap.add_argument("--save", help="write HF's logits as PREFIX.f32 + PREFIX.json (score's format)")
    ap.add_argument("--other", action="append", default=[], help="prefix of another score output to compare")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (the real check) or cpu (a dry run on tiny models)")
    ap.add_argument("--skip-hf", action="store_true", help="compare the --other outputs only (HF's own number is unchanged for the same seed)")
    args = ap.parse_args()

    cfg_json = json.load(open(os.path.join(args.model, "config.json")))
    text = dict(cfg_json.get("text_config", cfg_json))
    text.pop("model_type", None)
    config = transformers.Qwen3_5MoeTextConfig(**text)
    vocab = config.vocab_size
    if args.ref:
        ref_meta = json.load(open(args.ref + ".json"))
        ids = ref_meta["ids"]
        ref = np.fromfile(args.ref + ".f32", dtype="<f4")
    elif args.ids_from:
        ref_meta, ref = {}, None
        ids = json.load(open(args.ids_from + ".json"))["ids"]
    elif args.len:
        ref_meta, ref = {}, None
        ids = prompt(args.len, vocab, args.seed)
    else:
        raise SystemExit("give --ref, --ids-from or --len")

    results = {"reference": ref_meta.get("backend"), "positions": len(ids), "transformers": transformers.__version__, "torch": torch.__version__}
    for other in args.other if ref is not None else []:
        meta = json.load(open(other + ".json"))
        assert meta["ids"] == ids, f"{other} scored other tokens"
        results[meta.get("backend", other)] = compare(np.fromfile(other + ".f32", dtype="<f4"), ref, vocab)
    if args.skip_hf:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps(results, indent=1))
        return

    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(args.device):
        model = transformers.Qwen3_5MoeForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    keep_fp32 = getattr(model, "_keep_in_fp32_modules", None) or []
    params = dict(model.named_parameters())
    st = open_safetensors(args.model)
    loaded = set()
    with torch.no_grad():
        for key, t in hf_tensors(st, args.device):
            if key not in params:
                continue
            p = params[key]
            if any(k in key for k in keep_fp32):
                p.data = t.to(torch.float32)
            else:
                p.copy_(t.to(p.dtype))
            loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise SystemExit(f"parameters not loaded: {missing[:10]}")
    load_s = time.time() - t0
    model.eval()
    with torch.no_grad():
        t1 = time.time()
        logits = model(input_ids=torch.tensor([ids], device=args.device), use_cache=False).logits[0].float().cpu().numpy()
        if args.device == "cuda":
            torch.cuda.synchronize()
        fwd_s = time.time() - t1
    if ref is not None:
        results["hf_transformers_bf16"] = compare(logits, ref, vocab)
    results["hf_load_s"] = load_s
    results["hf_forward_s"] = fwd_s
    results["hf_keep_in_fp32"] = list(keep_fp32)
    if args.save:
        np.ascontiguousarray(logits, dtype="<f4").tofile(args.save + ".f32")
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
        meta = {"backend": f"hf transformers {transformers.__version__} bf16 (torch {torch.__version__}, {device_name})",
                "model": args.model, "ids": ids, "vocab": vocab, "positions_done": len(ids),
                "seconds": fwd_s, "load_seconds": load_s}
        with open(args.save + ".json", "w") as f:
            json.dump(meta, f)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""HF transformers references that must be made on the GPU itself.

Writes a safetensors file with, for the first WINDOWS perplexity windows of
heldout.txt (<|bos|> + 2047 tokens each): input_ids, the bf16 argmax with
sdpa and with eager attention, and fp32 logits of the first 256 positions of
window 0. tests/test_transformer.cpp (CudaPyLlama) reads it through
KVFORGE_HF_CUDA_REFERENCE. Run by scripts/gpu_checks.sh.
"""
import argparse
import json

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()

    tokenizer = Tokenizer.from_file(f"{args.model}/tokenizer.json")
    with open(args.text, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False).ids
    bos = json.load(open(f"{args.model}/config.json"))["bos_token_id"]
    rows = [[bos] + ids[w * 2047:(w + 1) * 2047] for w in range(args.windows)]
    input_ids = torch.tensor(rows, dtype=torch.long, device="cuda")

    out = {"input_ids": input_ids.float().cpu()}
    with torch.no_grad():
        for attn in ("sdpa", "eager"):
            model = AutoModelForCausalLM.from_pretrained(
                args.model, dtype=torch.bfloat16, attn_implementation=attn).cuda().eval()
            out[f"argmax_{attn}"] = model(input_ids).logits.argmax(-1).float().cpu()
            del model
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
        out["logits_fp32_first256"] = model(input_ids[:1]).logits[:, :256].float().cpu().contiguous()
    save_file(out, args.out)
    agree = (out["argmax_sdpa"] == out["argmax_eager"]).float().mean().item()
    print(f"HF bf16 sdpa vs eager argmax agreement on the GPU: {agree:.4f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Reference fixtures for kvforge's C++ forward pass, produced with Hugging Face transformers.

Default mode (``--mode fixtures``) writes, deterministically (fixed seeds, CPU):

  <out>/models/<name>/          tiny randomly initialised float32 checkpoints
                                (llama3, llama2_linear, mistral, qwen2, qwen3)
  <out>/reference/<name>.safetensors + <name>.json
                                logits / argmax / greedy tokens of those checkpoints
  <out>/reference/pyllama_fp32.safetensors, pyllama_bf16.safetensors,
  <out>/reference/pyllama_ppl.json, pyllama_greedy.json
                                references from <shared>/models/pyllama-16m
  <out>/reference/README.md     what every file and tensor means

``--mode full-ppl`` (not run by default) computes the perplexity of pyllama-16m over all
windows of a text file (default <shared>/data/heldout.txt), batched, sdpa attention, on CUDA
when available, and writes a JSON to ``--ppl-out``.

Usage:
  python3 scripts/make_model_fixtures.py --shared /work/shared --out tests/fixtures
  python3 scripts/make_model_fixtures.py --shared ../shared --mode full-ppl \
      --ppl-dtype bfloat16 --ppl-out /tmp/pyllama_full_ppl.json

Only F32 / F16 / BF16 tensors are written (the C++ safetensors reader supports only those);
integer ids are stored as F32 (exact below 2^24). Reference safetensors files carry no
__metadata__; metadata lives in the JSON files next to them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

WINDOW_TEXT_TOKENS = 2047  # README protocol: 2047 text tokens + <|bos|> = 2048 context
BOS_ID = 0                 # pyllama-16m <|bos|>
TINY_SEQ = 24
TINY_BATCH = 2
TINY_VOCAB = 320
GREEDY_PROMPT_LEN = 5
GREEDY_NEW_TOKENS = 12
PYLLAMA_FP32_LEN = 64
PYLLAMA_FP32_POSITIONS = [0, 1, 31, 62, 63]
PYLLAMA_PPL_WINDOWS = 4
PYLLAMA_GREEDY_PROMPTS = ["def fibonacci(n):\n", "import numpy as np\n\n\nclass "]
PYLLAMA_GREEDY_NEW_TOKENS = 32

PPL_PROTOCOL = (
    "The text file is read as UTF-8 and tokenized as a whole with tokenizer.json (tokenizers "
    "library, add_special_tokens=False). The token stream is cut into consecutive pieces of "
    "2047 tokens starting at token 0; the remainder (< 2047 tokens) is dropped. Each piece gets "
    "<|bos|> (id 0) prepended, giving a 2048-token window. The model sees the window (positions "
    "0..2047, no cache, no padding); the loss of a window is the mean over its 2047 predicted "
    "tokens (positions 1..2047, each predicted from the logits at the previous position) of "
    "-log_softmax(logits.float())[target]. Perplexity = exp(mean NLL over all scored tokens) "
    "(= exp of the mean of the window means, all windows having 2047 scored tokens)."
)


# ----------------------------------------------------------------------------------------------
# helpers


def versions() -> dict:
    import tokenizers
    import transformers
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch_num_threads": torch.get_num_threads(),
    }
    try:
        import safetensors
        info["safetensors"] = safetensors.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Writes a .safetensors file with only F32 / F16 / BF16 tensors and no __metadata__."""
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            if t.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool):
                if t.numel() and int(t.abs().max()) >= 2 ** 24:
                    raise ValueError(f"{name}: integer too large for exact F32")
                t = t.to(torch.float32)
            else:
                raise ValueError(f"{name}: unsupported dtype {t.dtype}")
        out[name] = t
    try:
        from safetensors.torch import save_file
        save_file(out, str(path))
    except ImportError:  # pragma: no cover - minimal writer, same format
        _write_safetensors(path, out)


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:  # pragma: no cover
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def read_text(path: Path) -> str:
    # newline="" keeps the file byte-exact (no newline translation)
    with open(path, "r", encoding="utf-8", newline="") as f:
        return f.read()


def load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def cut_windows(ids: list[int]) -> torch.Tensor:
    """[n_windows, 2048] windows: <|bos|> + 2047 consecutive text tokens; remainder dropped."""
    n = len(ids) // WINDOW_TEXT_TOKENS
    t = torch.tensor(ids[: n * WINDOW_TEXT_TOKENS], dtype=torch.long).view(n, WINDOW_TEXT_TOKENS)
    return torch.cat([torch.full((n, 1), BOS_ID, dtype=torch.long), t], dim=1)


def window_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-window mean NLL [B] over predicted tokens 1..T-1 (float32 log-softmax)."""
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return nll.mean(dim=1)


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def greedy_no_cache(model, prompt: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy decoding by full recomputation (no KV cache): cross-check for generate()."""
    ids = prompt
    for _ in range(n_new):
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, prompt.shape[1]:]


@torch.no_grad()
def greedy_margins(model, prompt: torch.Tensor, new_tokens: torch.Tensor) -> list[float]:
    """top-1 minus top-2 logit at every greedy step (small = near tie, fragile step)."""
    ids = torch.cat([prompt, new_tokens], dim=1)
    logits = model(ids, use_cache=False).logits[0, prompt.shape[1] - 1: ids.shape[1] - 1]
    return [round(x, 5) for x in top2_margin(logits).tolist()]


def generate_greedy(model, prompt: torch.Tensor, n_new: int, stop_at_eos: bool) -> torch.Tensor:
    from transformers import GenerationConfig
    gc = GenerationConfig(
        max_new_tokens=n_new,
        do_sample=False,
        num_beams=1,
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id if stop_at_eos else None,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
    )
    if not stop_at_eos:
        gc.min_new_tokens = n_new  # belt and braces: never stop early
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
    return out[:, prompt.shape[1]:]


def file_sizes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------------
# tiny random checkpoints


def tiny_specs() -> dict:
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        vocab_size=TINY_VOCAB,
        intermediate_size=128,
        max_position_embeddings=256,
        initializer_range=0.15,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    return {
        "llama3": dict(
            seed=1001,
            model_cls=LlamaForCausalLM,
            config=LlamaConfig(
                **common,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                tie_word_embeddings=False,
                attention_bias=False,
                # original_max_position_embeddings 64 (not 32): with theta 5e5 and head_dim 16
                # the rotary wavelengths are 6.3, 32.4, 167, ... so 64 puts one frequency in
                # each llama3 regime (kept / smoothly interpolated / divided by factor).
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
        "llama2_linear": dict(
            seed=1002,
            model_cls=LlamaForCausalLM,
            config=LlamaConfig(
                **common,
                num_attention_heads=4,
                num_key_value_heads=4,
                tie_word_embeddings=True,
                attention_bias=False,
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            ),
        ),
        "mistral": dict(
            seed=1003,
            model_cls=MistralForCausalLM,
            config=MistralConfig(
                **common,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=16,
                sliding_window=8,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
        ),
        "qwen2": dict(
            seed=1004,
            model_cls=Qwen2ForCausalLM,
            config=Qwen2Config(
                **common,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=False,
                use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
        ),
        "qwen3": dict(
            seed=1005,
            model_cls=Qwen3ForCausalLM,
            config=Qwen3Config(
                **common,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                attention_bias=False,
                tie_word_embeddings=False,
                use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
        ),
    }


@torch.no_grad()
def randomize_extras(model, seed: int) -> dict:
    """Norm weights (init to ones) -> 1 + 0.1*randn; q/k/v biases (init to zero) -> 0.3*randn."""
    g = torch.Generator().manual_seed(seed + 7777)
    touched = {"norm_weights": [], "biases": []}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, norm, q_norm, k_norm
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            touched["norm_weights"].append(name)
        elif name.endswith(".bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
            touched["biases"].append(name)
    return touched


def rope_forms(cfg_json: dict) -> dict:
    return {
        "rope_parameters": cfg_json.get("rope_parameters"),
        "rope_scaling": cfg_json.get("rope_scaling", "<absent>"),
        "rope_theta_top_level": cfg_json.get("rope_theta", "<absent>"),
    }


@torch.no_grad()
def attention_visibility(model, ids: torch.Tensor) -> list[list[int]]:
    """Per layer: number of keys with nonzero attention weight for each query (batch 0, head 0)."""
    out = model(ids, output_attentions=True, use_cache=False)
    return [(a[0, 0] > 0).sum(-1).tolist() for a in out.attentions]


@torch.no_grad()
def make_tiny(name: str, spec: dict, out: Path, log) -> dict:
    from transformers import AutoModelForCausalLM
    seed = spec["seed"]
    torch.manual_seed(seed)
    cfg = spec["config"]
    cfg._attn_implementation = "eager"
    model = spec["model_cls"](cfg).to(torch.float32).eval()
    touched = randomize_extras(model, seed)

    mdir = out / "models" / name
    if mdir.exists():
        shutil.rmtree(mdir)
    mdir.mkdir(parents=True)
    model.save_pretrained(str(mdir))  # transformers 5: always safetensors (safe_serialization gone)
    # generation_config.json is redundant for the fixtures (C++ reads config.json only)
    gen_cfg = mdir / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()
    cfg_json = json.loads((mdir / "config.json").read_text())

    # Reference values come from the checkpoint as written to disk.
    m32 = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32,
                                               attn_implementation="eager").eval()
    sd_saved = load_tensors(mdir / "model.safetensors")
    for k, v in model.state_dict().items():
        if k in sd_saved:
            assert torch.equal(sd_saved[k], v), k
    for k, v in m32.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), f"reload mismatch {k}"

    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, TINY_VOCAB, (TINY_BATCH, TINY_SEQ), generator=g)
    logits = m32(input_ids, use_cache=False).logits.float()

    mbf = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.bfloat16,
                                               attn_implementation="eager").eval()
    logits_bf = mbf(input_ids, use_cache=False).logits
    argmax_bf = logits_bf.float().argmax(-1)

    prompt = torch.randint(0, TINY_VOCAB, (1, GREEDY_PROMPT_LEN), generator=g)
    greedy = generate_greedy(m32, prompt, GREEDY_NEW_TOKENS, stop_at_eos=False)
    greedy_check = greedy_no_cache(m32, prompt, GREEDY_NEW_TOKENS)
    assert greedy.shape == (1, GREEDY_NEW_TOKENS), greedy.shape
    assert torch.equal(greedy, greedy_check), f"{name}: generate {greedy} != no-cache {greedy_check}"

    # sliding-window check (also documents what a query sees)
    visible = attention_visibility(m32, input_ids)

    ref = out / "reference"
    save_tensors(ref / f"{name}.safetensors", {
        "input_ids": input_ids,
        "logits": logits,
        "logits_bf16_argmax": argmax_bf,
        "logits_bf16": logits_bf.to(torch.bfloat16),
        "logits_bf16_top2_margin": top2_margin(logits_bf),
        "greedy_prompt": prompt,
        "greedy_tokens": greedy,
    })
    argmax32 = logits.argmax(-1)
    meta = {
        "model_dir": f"models/{name}",
        "architecture": cfg_json["architectures"][0],
        "seed": seed,
        "config_rope_forms": rope_forms(cfg_json),
        "config_layer_types": cfg_json.get("layer_types", "<absent>"),
        "config_sliding_window": cfg_json.get("sliding_window", "<absent>"),
        "config_use_sliding_window": cfg_json.get("use_sliding_window", "<absent>"),
        "config_head_dim": cfg_json.get("head_dim", "<absent>"),
        "tie_word_embeddings": cfg_json.get("tie_word_embeddings"),
        "checkpoint_tensors": {k: list(v.shape) for k, v in sorted(sd_saved.items())},
        "randomized_after_init": touched,
        "attn_implementation": "eager",
        "logits_stats": {"std": logits.std().item(), "absmax": logits.abs().max().item()},
        "bf16_vs_fp32_argmax_agreement": (argmax_bf == argmax32).float().mean().item(),
        "bf16_vs_fp32_logits_max_abs_diff": (logits_bf.float() - logits).abs().max().item(),
        "fp32_top2_margin_min": top2_margin(logits).min().item(),
        "greedy": {
            "method": "model.generate(do_sample=False, num_beams=1, max_new_tokens=12, "
                      "EOS stopping disabled), fp32 eager; identical to argmax decoding "
                      "by full recomputation without cache (checked)",
            "prompt": prompt[0].tolist(),
            "new_tokens": greedy[0].tolist(),
            "top2_margin_per_step": greedy_margins(m32, prompt, greedy),
        },
        "keys_visible_per_query_layer0_head0": visible[0],
    }
    write_json(ref / f"{name}.json", meta)
    log(f"[{name}] rope={rope_forms(cfg_json)} layer_types={meta['config_layer_types']} "
        f"sliding_window={meta['config_sliding_window']} logits std={meta['logits_stats']['std']:.3f} "
        f"bf16 argmax agree={meta['bf16_vs_fp32_argmax_agreement']:.3f} visible={visible[0]}")
    return meta


# ----------------------------------------------------------------------------------------------
# pyllama-16m


def load_pyllama(model_dir: Path, dtype: torch.dtype, attn: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attn)
    return m.to(device).eval()


@torch.no_grad()
def make_pyllama(shared: Path, out: Path, log) -> dict:
    model_dir = shared / "models" / "pyllama-16m"
    ref = out / "reference"
    tok = load_tokenizer(model_dir)
    heldout = encode(tok, read_text(shared / "data" / "heldout.txt"))
    calib = encode(tok, read_text(shared / "data" / "calib.txt"))
    log(f"[pyllama] heldout tokens={len(heldout)} calib tokens={len(calib)}")

    m32 = load_pyllama(model_dir, torch.float32, "eager")
    mbf = load_pyllama(model_dir, torch.bfloat16, "eager")

    # --- fp32, 2 x 64
    n = PYLLAMA_FP32_LEN - 1
    ids = torch.tensor([[BOS_ID] + heldout[:n], [BOS_ID] + calib[:n]])
    logits = m32(ids, use_cache=False).logits.float()
    pos = torch.tensor(PYLLAMA_FP32_POSITIONS)
    save_tensors(ref / "pyllama_fp32.safetensors", {
        "input_ids": ids,
        "positions": pos,
        "logits_at": logits[:, pos],
        "argmax": logits.argmax(-1),
        "logsumexp": torch.logsumexp(logits, dim=-1),
        "top2_margin": top2_margin(logits),
    })
    fp32_64_nll = token_nll(logits, ids).mean(1).tolist()

    # --- bf16, 1 x 2048 (first heldout window)
    win = torch.tensor([[BOS_ID] + heldout[:WINDOW_TEXT_TOKENS]])
    lbf = mbf(win, use_cache=False).logits
    l32w = m32(win, use_cache=False).logits.float()
    argmax_bf = lbf.float().argmax(-1)
    argmax_32 = l32w.argmax(-1)
    save_tensors(ref / "pyllama_bf16.safetensors", {
        "input_ids": win,
        "argmax": argmax_bf,
        "top2_margin": top2_margin(lbf),
        "nll": token_nll(lbf, win),
        "argmax_fp32": argmax_32,
        "top2_margin_fp32": top2_margin(l32w),
        "nll_fp32": token_nll(l32w, win),
    })
    agree = (argmax_bf == argmax_32).float().mean().item()
    log(f"[pyllama] bf16 vs fp32 argmax agreement over 2048 positions: {agree:.4f}")

    # --- fp16, the same window (eager, CPU)
    m16 = load_pyllama(shared / "models" / "pyllama-16m", torch.float16, "eager")
    save_tensors(ref / "pyllama_fp16.safetensors", {
        "input_ids": win,
        "argmax": m16(win, use_cache=False).logits.float().argmax(-1),
    })
    del m16

    # --- perplexity, first 4 heldout windows
    windows_all = cut_windows(heldout)
    windows = windows_all[:PYLLAMA_PPL_WINDOWS]
    ppl = {}
    for label, key, m in (("float32", "fp32", m32), ("bfloat16", "bf16", mbf)):
        per = []
        for w in windows:  # one window at a time: eager attention on CPU
            per.append(window_nll(m(w[None], use_cache=False).logits, w[None]).item())
        mean = sum(per) / len(per)
        ppl[key] = {"dtype": label, "window_mean_nll": per, "mean_nll": mean,
                    "perplexity": math.exp(mean), "tokens_scored": len(per) * WINDOW_TEXT_TOKENS,
                    "attn_implementation": "eager", "device": "cpu"}
        log(f"[pyllama] ppl {label}: per-window {['%.4f' % x for x in per]} "
            f"mean {mean:.4f} ppl {math.exp(mean):.4f}")
    ppl_json = {
        "model": "pyllama-16m",
        "text": "data/heldout.txt",
        "protocol": PPL_PROTOCOL,
        "context": WINDOW_TEXT_TOKENS + 1,
        "bos": BOS_ID,
        "windows": PYLLAMA_PPL_WINDOWS,
        "total_windows": int(windows_all.shape[0]),
        "text_tokens_total": len(heldout),
        "tokens_scored_whole_file": int(windows_all.shape[0]) * WINDOW_TEXT_TOKENS,
        "first_window_input_ids_first16": windows_all[0, :16].tolist(),
        "heldout_text_token_ids_first16": heldout[:16],
        **ppl,
        "readme_whole_file_bf16": {"windows": 603, "tokens_scored": 1234341, "loss": 1.7908,
                                   "perplexity": 5.994},
        "versions": versions(),
    }
    write_json(ref / "pyllama_ppl.json", ppl_json)

    # --- greedy generation
    readme_demo = {}
    metrics_path = model_dir / "fixture_metrics.json"
    if metrics_path.exists():
        readme_demo = dict(json.loads(metrics_path.read_text()).get("meta", {}).get("demo", []))
    greedy = {
        "method": "model.generate(do_sample=False, num_beams=1, max_new_tokens=32) with the "
                  "model's eos (1) stopping, eager attention, CPU; prompt_ids = <|bos|> (0) + "
                  "tokenizer(prompt, add_special_tokens=False); text = tokenizers "
                  "decode(generated_ids, skip_special_tokens=False). generated_ids / text / "
                  "top2_margin_per_step are the float32 reference (equal to argmax decoding by "
                  "full recomputation without cache, checked); 'bf16' holds the same from the "
                  "bfloat16 model for comparison with the pyllama README samples (bf16, GPU).",
        "prompts": [],
    }
    for text in PYLLAMA_GREEDY_PROMPTS:
        prompt = torch.tensor([[BOS_ID] + encode(tok, text)])
        case = {"prompt": text, "prompt_ids": prompt[0].tolist()}
        for label, m in (("float32", m32), ("bfloat16", mbf)):
            gen = generate_greedy(m, prompt, PYLLAMA_GREEDY_NEW_TOKENS, stop_at_eos=True)
            ids_new = gen[0].tolist()
            if label == "float32":
                check = greedy_no_cache(m, prompt, len(ids_new))
                assert check[0].tolist() == ids_new, (check, ids_new)
            res = {"generated_ids": ids_new,
                   "text": tok.decode(ids_new, skip_special_tokens=False),
                   "top2_margin_per_step": greedy_margins(m, prompt, gen),
                   "stopped_at_eos": bool(len(ids_new) < PYLLAMA_GREEDY_NEW_TOKENS)}
            if label == "float32":
                case.update(res)
            else:
                case["bf16"] = res
        if text in readme_demo:
            rd = readme_demo[text]
            case["readme_bf16_sample"] = rd
            for label, r in (("fp32", case), ("bf16", case["bf16"])):
                t = r["text"]
                k = next((i for i, (a_, b_) in enumerate(zip(t, rd)) if a_ != b_), min(len(t), len(rd)))
                case[f"{label}_text_is_prefix_of_readme_sample"] = rd.startswith(t)
                case[f"{label}_first_char_differing_from_readme_sample"] = None if rd.startswith(t) else k
        greedy["prompts"].append(case)
        log(f"[pyllama] greedy fp32 {text!r} -> {case['text']!r}")
        log(f"[pyllama] greedy bf16 {text!r} -> {case['bf16']['text']!r}")
    write_json(ref / "pyllama_greedy.json", greedy)
    return {"fp32_min_margin": top2_margin(logits).min().item(), "fp32_64_nll": fp32_64_nll, "bf16_fp32_argmax_agreement_2048": agree, "ppl": ppl,
            "windows_in_file": int(windows_all.shape[0]), "heldout_tokens": len(heldout)}


# ----------------------------------------------------------------------------------------------
# full perplexity (GPU mode)


@torch.no_grad()
def full_ppl(args, log) -> None:
    dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}[args.ppl_dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = Path(args.model) if args.model else args.shared / "models" / "pyllama-16m"
    text_path = Path(args.ppl_text) if args.ppl_text else args.shared / "data" / "heldout.txt"
    tok = load_tokenizer(model_dir)
    t0 = time.time()
    ids = encode(tok, read_text(text_path))
    windows = cut_windows(ids)
    n_all = windows.shape[0]
    if args.ppl_max_windows:
        windows = windows[: args.ppl_max_windows]
    log(f"[full-ppl] {text_path}: {len(ids)} tokens, {n_all} windows, evaluating {windows.shape[0]} "
        f"(tokenized in {time.time() - t0:.1f}s); dtype={dtype} device={device} attn={args.ppl_attn}")
    model = load_pyllama(model_dir, dtype, args.ppl_attn, device)
    per = []
    t1 = time.time()
    for i in range(0, windows.shape[0], args.ppl_batch):
        w = windows[i: i + args.ppl_batch].to(device)
        logits = model(w, use_cache=False).logits
        per.extend(window_nll(logits, w).double().cpu().tolist())
        del logits
        if (i // args.ppl_batch) % 10 == 0:
            log(f"[full-ppl] {len(per)}/{windows.shape[0]} windows, running mean "
                f"{sum(per) / len(per):.4f}")
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.time() - t1
    mean = sum(per) / len(per)
    def shown(path: Path) -> str:  # paths under --shared are written as <shared>/...
        try:
            return "<shared>/" + str(path.resolve().relative_to(args.shared.resolve()))
        except ValueError:
            return str(path)

    result = {
        "model": shown(model_dir),
        "text": shown(text_path),
        "protocol": PPL_PROTOCOL,
        "dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": args.ppl_attn,
        "batch_windows": args.ppl_batch,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "text_tokens_total": len(ids),
        "windows_in_file": int(n_all),
        "windows_evaluated": len(per),
        "tokens_scored": len(per) * WINDOW_TEXT_TOKENS,
        "mean_nll": mean,
        "perplexity": math.exp(mean),
        "per_window_mean_nll": per,
        "eval_seconds": elapsed,
        "versions": {**versions(), "device": device},
    }
    out = Path(args.ppl_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    log(f"[full-ppl] {len(per)} windows, mean NLL {mean:.5f}, perplexity {math.exp(mean):.4f}, "
        f"{elapsed:.1f}s -> {out}")


# ----------------------------------------------------------------------------------------------
# README + verification


def write_readme(out: Path, tiny_meta: dict, py_meta: dict) -> None:
    v = versions()
    lines = []
    a = lines.append
    a("# Reference fixtures (Hugging Face transformers)")
    a("")
    a("Produced by `python3 scripts/make_model_fixtures.py --shared /work/shared --out tests/fixtures`")
    a(f"on CPU ({v['cpu']}, {v['torch_num_threads']} threads) with torch {v['torch']}, transformers "
      f"{v['transformers']}, tokenizers {v['tokenizers']}, safetensors {v.get('safetensors', '?')}, "
      f"Python {v['python']}. The script is deterministic (fixed seeds); rerunning it rewrites the same "
      "tiny checkpoints and the same ids. Float results can differ in the last bits across CPUs / "
      "thread counts / library versions.")
    a("")
    a("All `.safetensors` files here hold only F32 / F16 / BF16 tensors; token ids and positions are "
      "stored as **F32** (exact integers, < 2^24). Reference files have no `__metadata__`; the "
      "checkpoints written by `save_pretrained` have `__metadata__ = {\"format\": \"pt\"}`.")
    a("")
    a("## Tiny random checkpoints: `../models/<name>/` and `<name>.safetensors`, `<name>.json`")
    a("")
    a("`models/<name>/` = `config.json` + `model.safetensors` (float32) from `save_pretrained` "
      "(transformers 5 always writes safetensors; `generation_config.json` is removed). All: "
      "hidden_size 64, 2 layers, vocab 320, intermediate 128, max_position_embeddings 256, "
      "rms_norm_eps 1e-6, normal init std 0.15 (`initializer_range`), then every RMSNorm weight "
      "(input/post-attention/final norm, Qwen3 q_norm/k_norm) set to 1 + 0.1·randn and every "
      "q/k/v bias (Qwen2) to 0.3·randn. bos 1 / eos 2 in the config (unused by the references).")
    a("")
    a("| name | class | heads / kv heads | head_dim | rope (as written in config.json) | other |")
    a("|---|---|---|---|---|---|")
    desc = {
        "llama3": "tie_word_embeddings false",
        "llama2_linear": "tie_word_embeddings true (no `lm_head.weight` in the file)",
        "mistral": "sliding_window 8",
        "qwen2": "q/k/v biases; use_sliding_window false; tie false",
        "qwen3": "q_norm / k_norm (RMSNorm over head_dim, before RoPE); attention_bias false; head_dim 32 ≠ 64/4",
    }
    for name, m in tiny_meta.items():
        cfg = json.loads((out / "models" / name / "config.json").read_text())
        rf = m["config_rope_forms"]
        rope = f"`rope_parameters` = `{json.dumps(rf['rope_parameters'], sort_keys=True)}`"
        if rf["rope_scaling"] != "<absent>":
            rope += f"; `rope_scaling` = `{json.dumps(rf['rope_scaling'])}`"
        if rf["rope_theta_top_level"] != "<absent>":
            rope += f"; top-level `rope_theta` = {rf['rope_theta_top_level']}"
        hd = cfg.get("head_dim", f"absent (= {cfg['hidden_size']}/{cfg['num_attention_heads']})")
        a(f"| {name} | {m['architecture']} | {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} "
          f"| {hd} | {rope} | {desc[name]} |")
    a("")
    a("Config form: transformers 5.17.0 writes RoPE settings **only** as `rope_parameters` (with "
      "`rope_type` and `rope_theta` inside); it writes neither `rope_scaling` nor a top-level "
      "`rope_theta`. (Legacy `rope_scaling` / `rope_theta` passed to a config constructor are "
      "converted into `rope_parameters`.) `layer_types` (list of `full_attention` / "
      "`sliding_attention`, one per layer) is written for Qwen2 and Qwen3 (here all "
      "`full_attention`, `sliding_window` null) but not for Llama or Mistral; Mistral has a "
      "single `sliding_window` applying to every layer. Other details of the written configs: "
      "the dtype key is `dtype` (\"float32\"), not `torch_dtype`; Qwen2's config has neither "
      "`head_dim` nor `attention_bias` (q/k/v biases are implied by the class), Qwen2/Qwen3 also "
      "carry `use_sliding_window` false, `sliding_window` null and `max_window_layers` 28 "
      "(irrelevant once `layer_types` is given); `pad_token_id` is null.")
    a("")
    a("llama3 RoPE: `original_max_position_embeddings` is 64 so that with theta 5e5 and head_dim 16 "
      "(wavelengths 6.3, 32.4, 167, 862, ... positions) the three llama3 regimes all occur: "
      "frequency 0 kept (wavelength < 64/4), frequency 1 smoothly interpolated (scale 2.442), "
      "frequencies 2..7 divided by 8.")
    a("")
    a("Sliding window (transformers 5.17.0 `masking_utils.sliding_window_overlay`): query i sees "
      "key j iff `i - sliding_window < j <= i`, i.e. exactly `sliding_window` keys including "
      "itself (checked: `keys_visible_per_query_layer0_head0` in mistral.json is "
      "1,2,...,8,8,8,...). The same holds for cached decoding in `generate` (greedy tokens equal "
      "argmax decoding by full recomputation).")
    a("")
    a("`<name>.safetensors`:")
    a("")
    a("| tensor | dtype | shape | meaning |")
    a("|---|---|---|---|")
    a(f"| input_ids | F32 | [2, 24] | random ids in [0, 320) (torch.Generator seeded per model) |")
    a("| logits | F32 | [2, 24, 320] | `model(input_ids).logits`, float32 weights, eager attention, no padding, positions 0..23 |")
    a("| logits_bf16_argmax | F32 | [2, 24] | argmax of the logits of the same checkpoint loaded with dtype=bfloat16 (eager) |")
    a("| logits_bf16 | BF16 | [2, 24, 320] | those bfloat16 logits (extra, for tolerance studies) |")
    a("| logits_bf16_top2_margin | F32 | [2, 24] | top-1 minus top-2 of those bf16 logits: bf16 argmax is only stable where this is well above the bf16 logit error (~0.1 here) |")
    a("| greedy_prompt | F32 | [1, 5] | random prompt ids |")
    a("| greedy_tokens | F32 | [1, 12] | the 12 new tokens of `generate(prompt, max_new_tokens=12, do_sample=False)`, fp32, EOS stopping disabled |")
    a("")
    a("`<name>.json`: config forms as written, tensors in the checkpoint, the randomized parameters, "
      "logit statistics, bf16-vs-fp32 argmax agreement, greedy ids, keys visible per query.")
    a("")
    a("| name | logits std | bf16/fp32 argmax agreement | max abs logit diff bf16 vs fp32 |")
    a("|---|---|---|---|")
    for name, m in tiny_meta.items():
        a(f"| {name} | {m['logits_stats']['std']:.3f} | {m['bf16_vs_fp32_argmax_agreement']:.3f} | "
          f"{m['bf16_vs_fp32_logits_max_abs_diff']:.3f} |")
    a("")
    a("## pyllama-16m (`<shared>/models/pyllama-16m`, bf16 checkpoint)")
    a("")
    a("Token ids come from `tokenizer.json` via the `tokenizers` library, `add_special_tokens=False`; "
      "`<|bos|>` = 0 is prepended explicitly. fp32 references load the checkpoint with "
      "`dtype=torch.float32` (exact upcast of the bf16 weights), bf16 ones with "
      "`dtype=torch.bfloat16` (pure bf16 weights and activations; HF computes RMSNorm in fp32 and "
      "eager softmax in fp32, casting back to bf16). Attention is **eager** everywhere on CPU "
      "(fast enough). Only `--mode full-ppl` uses sdpa.")
    a("")
    a("`pyllama_fp32.safetensors` (fp32, eager):")
    a("")
    a("| tensor | dtype | shape | meaning |")
    a("|---|---|---|---|")
    a("| input_ids | F32 | [2, 64] | row 0: 0 + first 63 tokens of data/heldout.txt; row 1: 0 + first 63 tokens of data/calib.txt |")
    a("| positions | F32 | [5] | 0, 1, 31, 62, 63 |")
    a("| logits_at | F32 | [2, 5, 8192] | logits at those positions |")
    a("| argmax | F32 | [2, 64] | argmax of the logits at every position |")
    a("| logsumexp | F32 | [2, 64] | logsumexp of the logits at every position |")
    a("| top2_margin | F32 | [2, 64] | top-1 minus top-2 logit (small = near tie, argmax fragile) |")
    a("")
    a("`pyllama_bf16.safetensors` (first heldout perplexity window):")
    a("")
    a("| tensor | dtype | shape | meaning |")
    a("|---|---|---|---|")
    a("| input_ids | F32 | [1, 2048] | 0 + first 2047 tokens of data/heldout.txt |")
    a("| argmax | F32 | [1, 2048] | argmax of the bf16 model's logits (eager, CPU) |")
    a("| top2_margin | F32 | [1, 2048] | bf16 model: top-1 minus top-2 logit |")
    a("| nll | F32 | [1, 2047] | bf16 model: -log p(input_ids[t+1]) from the logits at t (float32 log-softmax) |")
    a("| argmax_fp32, top2_margin_fp32, nll_fp32 | F32 | as above | the same from the fp32 model |")
    a("")
    a(f"Smallest fp32 top-2 margin in pyllama_fp32 (argmax exactness): "
      f"{py_meta['fp32_min_margin']:.4g}. bf16 vs fp32 argmax agreement over these 2048 positions: "
      f"{py_meta['bf16_fp32_argmax_agreement_2048']:.4f}. bf16 results on a GPU differ from this "
      "CPU bf16 run (different accumulation), so compare bf16 argmax with a tolerance (or only "
      "where `top2_margin` is not small).")
    a("")
    p = py_meta["ppl"]
    p = {"float32": p["fp32"], "bfloat16": p["bf16"]}
    a(f"`pyllama_ppl.json`: the README perplexity protocol on the first 4 windows of heldout.txt "
      f"(8188 scored tokens), fp32 and bf16, eager, CPU: per-window mean NLL, mean NLL and "
      f"perplexity (fp32 {p['float32']['perplexity']:.4f}, bf16 {p['bfloat16']['perplexity']:.4f}); "
      f"also the protocol in words, the number of text tokens in the file "
      f"({py_meta['heldout_tokens']}) and of windows ({py_meta['windows_in_file']}), and the first "
      "16 ids of the first window.")
    a("")
    a("`pyllama_ppl.json` keys: `context` (2048), `bos` (0), `windows` (4), `total_windows` "
      "(whole file), `text_tokens_total`, `first_window_input_ids_first16` (with the bos), "
      "`heldout_text_token_ids_first16`, and `fp32` / `bf16` objects with `window_mean_nll`, "
      "`mean_nll`, `perplexity`, `tokens_scored`.")
    a("")
    a("`pyllama_greedy.json`: `prompts` = list over `\"def fibonacci(n):\\n\"` and "
      "`\"import numpy as np\\n\\n\\nclass \"`, each with `prompt_ids` (0 prepended), the fp32 "
      "reference `generated_ids` / `text` / `top2_margin_per_step` of `generate(max_new_tokens=32, "
      "do_sample=False)` (model eos 1 stops it; it did not stop early), and `bf16` with the same "
      "from the bfloat16 model. The pyllama README's samples (bf16 on a GPU) are included: the "
      "first prompt's 32 tokens (fp32 and CPU bf16) are a prefix of the README sample; the second "
      "differs at generated token 9 (' G'iven vs ' A' class), where the two candidates are "
      "0.053 apart in fp32 and tie in bf16, i.e. a numerical near-tie, not a protocol difference.")
    a("")
    a("## Full-file perplexity (not run by default)")
    a("")
    a("`python3 scripts/make_model_fixtures.py --shared ../shared --mode full-ppl --ppl-dtype bfloat16 "
      "--ppl-out out/pyllama_full_ppl.json` evaluates all windows (batches of `--ppl-batch` = 16, "
      "sdpa, no_grad, CUDA when available). README value: heldout 603 windows, loss 1.7908, ppl 5.994.")
    runs = sorted((out / "reference").glob("pyllama_full_ppl*.json"))
    if runs:
        a("")
        a("Full-file runs of that mode kept here (written by `--mode full-ppl`, copied in by hand with "
          "`model`/`text` shown relative to `<shared>`; the default mode leaves them alone; "
          "`per_window_mean_nll` has all windows, so the first 4 can be checked against "
          "pyllama_ppl.json):")
        a("")
        a("| file | dtype | device | attention | windows | tokens scored | mean NLL | perplexity |")
        a("|---|---|---|---|---|---|---|---|")
        for r in runs:
            j = json.loads(r.read_text())
            a(f"| {r.name} | {j['dtype']} | {j['device_name'] or j['device']} | {j['attn_implementation']} "
              f"| {j['windows_evaluated']} | {j['tokens_scored']} | {j['mean_nll']:.5f} | {j['perplexity']:.4f} |")
    a("")
    a("## Sizes")
    a("")
    for rel, size in file_sizes(out / "models").items():
        a(f"- models/{rel}: {size} bytes")
    for rel, size in file_sizes(out / "reference").items():
        if rel != "README.md":
            a(f"- reference/{rel}: {size} bytes")
    total = sum(file_sizes(out / "models").values()) + sum(
        v for k, v in file_sizes(out / "reference").items() if k != "README.md")
    a(f"- total (without this README): {total} bytes")
    (out / "reference" / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def verify(out: Path, log) -> None:
    log("[verify] reloading every fixture")
    total = 0
    for p in sorted(list((out / "models").rglob("*")) + list((out / "reference").rglob("*"))):
        if not p.is_file():
            continue
        total += p.stat().st_size
        if p.stat().st_size > 2 * 1024 * 1024:
            raise SystemExit(f"{p} is over 2 MB")
        if p.suffix == ".safetensors":
            t = load_tensors(p)
            for k, v in t.items():
                assert v.dtype in (torch.float32, torch.float16, torch.bfloat16), (p, k, v.dtype)
                assert torch.isfinite(v.float()).all(), (p, k)
            log(f"  {p.relative_to(out)} ({p.stat().st_size} B): " +
                ", ".join(f"{k} {str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                          for k, v in sorted(t.items())))
        elif p.suffix == ".json":
            json.loads(p.read_text())
    log(f"[verify] total {total} bytes")
    if total > 6.5 * 1024 * 1024:
        raise SystemExit("fixtures over the size budget")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", type=Path, default=Path("../shared"))
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    ap.add_argument("--mode", choices=["fixtures", "tiny", "pyllama", "full-ppl"], default="fixtures",
                    help="fixtures = tiny + pyllama + README (default); full-ppl = whole-file perplexity")
    ap.add_argument("--ppl-out", help="full-ppl: output JSON path")
    ap.add_argument("--ppl-dtype", default="bfloat16",
                    choices=["bfloat16", "bf16", "float16", "fp16", "float32", "fp32"])
    ap.add_argument("--ppl-batch", type=int, default=16, help="full-ppl: windows per forward")
    ap.add_argument("--ppl-attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--ppl-text", help="full-ppl: text file (default <shared>/data/heldout.txt)")
    ap.add_argument("--ppl-max-windows", type=int, default=0, help="full-ppl: 0 = all")
    ap.add_argument("--model", help="full-ppl: model dir (default <shared>/models/pyllama-16m)")
    ap.add_argument("--device", help="full-ppl: cuda / cpu (default cuda if available)")
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass

    if args.mode == "full-ppl":
        if not args.ppl_out:
            ap.error("--mode full-ppl needs --ppl-out")
        full_ppl(args, log)
        return

    torch.manual_seed(0)
    out = args.out
    (out / "reference").mkdir(parents=True, exist_ok=True)
    (out / "models").mkdir(parents=True, exist_ok=True)
    tiny_meta, py_meta = {}, None
    if args.mode in ("fixtures", "tiny"):
        for name, spec in tiny_specs().items():
            tiny_meta[name] = make_tiny(name, spec, out, log)
    if args.mode in ("fixtures", "pyllama"):
        py_meta = make_pyllama(args.shared, out, log)
    if args.mode == "fixtures":
        write_readme(out, tiny_meta, py_meta)
    verify(out, log)


if __name__ == "__main__":
    main()

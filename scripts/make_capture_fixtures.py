#!/usr/bin/env python3
"""Reference fixtures for `kvforge capture`, produced with Hugging Face transformers.

Writes, deterministically (CPU, float32, eager attention):

  <out>/reference/capture_<name>.safetensors + capture_<name>.json
      for the tiny checkpoints <out>/models/{llama3,mistral,qwen2,qwen3} (written by
      scripts/make_model_fixtures.py), input_ids [2, 24] taken from <out>/reference/<name>.safetensors
  <out>/reference/capture_pyllama.safetensors + capture_pyllama.json
      for <shared>/models/pyllama-16m, input_ids [1, 32] = <|bos|> (0) + the first 31 tokens of
      <shared>/data/calib.txt; float32 weights (exact upcast of the bf16 checkpoint), plus the
      bfloat16 model's q / k_pre / v (stored as F32) under `bf16.`
  <out>/reference/README.md
      the section between the `capture fixtures` markers is (re)written; the rest is left alone

Per layer i the files hold
  layers.<i>.q         [B, heads, T, D]     queries as attention multiplies them (after q_norm
                                            for Qwen3, after RoPE)
  layers.<i>.k_pre     [B, kv_heads, T, D]  keys before RoPE (k_proj output incl. bias; after
                                            k_norm for Qwen3)
  layers.<i>.k_post    [B, kv_heads, T, D]  keys after RoPE (before repeat_kv)
  layers.<i>.v         [B, kv_heads, T, D]  values (v_proj output incl. bias, before repeat_kv)
  layers.<i>.fisher_k  [B, kv_heads, T, D]  (d loss / d k_pre)^2
  layers.<i>.fisher_v  [B, kv_heads, T, D]  (d loss / d v)^2
with loss = model(input_ids, labels=input_ids).loss (HF's mean cross-entropy over the B*(T-1)
shifted predictions).

Method: q / k_post / v are recorded by a custom attention function registered in transformers'
AttentionInterface (it stores query/key/value as received and delegates to the model's own
eager_attention_forward); transformers 5 builds the attention mask only for implementations
registered in AttentionMaskInterface, so the same name is registered there with the eager mask
function (otherwise the model silently runs WITHOUT a causal mask). k_pre / v with gradients come
from forward hooks on self_attn.k_proj (self_attn.k_norm for Qwen3) and self_attn.v_proj that call
retain_grad(); fisher = grad**2 after loss.backward().

Checks (all asserted, results in the JSON): logits and loss identical to a plain
attn_implementation="eager" model; logits equal to the <name>.safetensors reference; k_post equals
HF's apply_rotary_pos_emb(k_pre) and q equals apply_rotary_pos_emb(pre-RoPE q); v from the hook
equals v in attention; key/value gradients match a float64 model's and a float64 central finite
difference of the loss along a random direction; the last position's Fisher is exactly zero.

Usage:
  python3 scripts/make_capture_fixtures.py --shared /work/shared --out tests/fixtures

Only F32 tensors are written (ids as F32, exact below 2^24); no __metadata__.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

CAPTURE_ATTN = "kvforge_capture"
TINY_NAMES = ["llama3", "mistral", "qwen2", "qwen3"]
BOS_ID = 0
PYLLAMA_TEXT_TOKENS = 31  # + <|bos|> = 32
FD_EPS = 1e-4             # float64 central difference step
FD_SEED = 4242
SIZE_WARN = int(1.5 * 1024 * 1024)
README_BEGIN = "<!-- capture fixtures: begin (written by scripts/make_capture_fixtures.py) -->"
README_END = "<!-- capture fixtures: end -->"

METHOD = (
    "transformers {tv}, torch {pv}, CPU. The checkpoint is loaded with AutoModelForCausalLM."
    "from_pretrained(dtype={dtype}, attn_implementation='" + CAPTURE_ATTN + "'), eval mode. '"
    + CAPTURE_ATTN + "' is a function registered with transformers.AttentionInterface.register: it "
    "receives (module, query, key, value, attention_mask, scaling, dropout, **kwargs) exactly as "
    "the model's attention module passes them to any attn_implementation (query/key after q_norm/"
    "k_norm and RoPE, key/value before repeat_kv, [B, heads or kv_heads, T, D]), stores query "
    "(-> layers.<i>.q), key (-> k_post) and value, and returns the model's own "
    "eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, "
    "dropout=dropout, **kwargs). The same name is registered with transformers.masking_utils."
    "AttentionMaskInterface.register -> the eager mask function (additive float mask with "
    "finfo.min; sliding window for Mistral), because transformers 5 skips mask creation (mask = "
    "None, i.e. no causal mask at all) for attention names not in that registry. Forward hooks on "
    "self_attn.k_proj (self_attn.k_norm for Qwen3; its output is [B, T, kv_heads, D]) and "
    "self_attn.v_proj keep their outputs (pre-RoPE keys including any k_proj bias; values) and call "
    "retain_grad(); they are viewed as [B, T, kv_heads, D] and transposed to [B, kv_heads, T, D] "
    "(-> k_pre, v). out = model(input_ids, labels=input_ids, use_cache=False); loss = out.loss "
    "(ForCausalLMLoss: labels padded with -100 on the right and shifted, mean cross-entropy over "
    "the B*(T-1) predictions, float32 logits); loss.backward(); fisher_k = k_pre.grad**2, fisher_v "
    "= v.grad**2 (same layout). Position ids 0..T-1, no padding, no cache."
)


# ----------------------------------------------------------------------------------------------
# helpers (same conventions as scripts/make_model_fixtures.py)


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
    """F32 only, no __metadata__; integer tensors (ids) are stored as exact F32."""
    from safetensors.torch import save_file
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype in (torch.int64, torch.int32):
            if t.numel() and int(t.abs().max()) >= 2 ** 24:
                raise ValueError(f"{name}: integer too large for exact F32")
        elif t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name}: unsupported dtype {t.dtype}")
        out[name] = t.to(torch.float32)
    save_file(out, str(path))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def read_text(path: Path) -> str:
    with open(path, "r", encoding="utf-8", newline="") as f:
        return f.read()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def model_module(model):
    """The modeling_<arch> module of the model (its eager_attention_forward, apply_rotary_pos_emb)."""
    return sys.modules[type(model.model.layers[0].self_attn).__module__]


# ----------------------------------------------------------------------------------------------
# capture machinery


class AttnRecorder:
    """Receives what every attention module hands to its attn_implementation."""

    def __init__(self):
        self.records: dict[int, dict] | None = None
        self.kwargs_seen: set[str] = set()
        self.mask_shapes: set = set()

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if self.records is not None:
            self.records[module.layer_idx] = {
                "q": query.detach().clone(), "k_post": key.detach().clone(),
                "v": value.detach().clone(), "scaling": scaling,
            }
            self.kwargs_seen.update(kwargs)
            self.mask_shapes.add(None if attention_mask is None else tuple(attention_mask.shape))
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


RECORDER = AttnRecorder()


def register_capture_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(CAPTURE_ATTN, RECORDER)
    # Without this, create_causal_mask returns None for an unknown name -> no causal mask.
    AttentionMaskInterface.register(CAPTURE_ATTN, eager_mask)
    AttentionInterface.register(F64_ATTN, float64_eager_attention)
    AttentionMaskInterface.register(F64_ATTN, eager_mask)


def key_module(attn):
    """Module whose output is the pre-RoPE key: k_norm when present (Qwen3), else k_proj."""
    return attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj


def query_module(attn):
    return attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj


class Hooks:
    """Forward hooks on the pre-RoPE q / k and v producers of every layer."""

    def __init__(self, model, retain_grad: bool, perturb: dict | None = None):
        self.out: dict[tuple[int, str], torch.Tensor] = {}
        self.handles = []
        self.retain_grad = retain_grad
        self.perturb = perturb or {}  # (layer, "k"|"v") -> tensor added to the module output
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            for kind, mod in (("q", query_module(a)), ("k", key_module(a)), ("v", a.v_proj)):
                self.handles.append(mod.register_forward_hook(self._hook(i, kind)))

    def _hook(self, i: int, kind: str):
        def fn(module, inputs, output):
            if (i, kind) in self.perturb:
                output = output + self.perturb[(i, kind)]
            if self.retain_grad and output.requires_grad:
                output.retain_grad()
            self.out[(i, kind)] = output
            return output
        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


def to_bhtd(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[B, T, heads*D] or [B, T, heads, D] -> [B, heads, T, D]."""
    b, s = t.shape[:2]
    return t.reshape(b, s, heads, head_dim).transpose(1, 2)


def load_model(model_dir: Path, dtype: torch.dtype, attn: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                attn_implementation=attn).eval()


def capture(model, ids: torch.Tensor, with_grad: bool) -> dict:
    """Runs the model once (with backward when with_grad) and returns per-layer tensors."""
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    attn0 = model.model.layers[0].self_attn
    head_dim = attn0.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hooks = Hooks(model, retain_grad=with_grad)
    RECORDER.records = {}
    try:
        with torch.set_grad_enabled(with_grad):
            out = model(ids, labels=ids, use_cache=False)
            if with_grad:
                out.loss.backward()
    finally:
        recs, RECORDER.records = RECORDER.records, None
        hooks.remove()
    assert sorted(recs) == list(range(n_layers)), sorted(recs)

    mm = model_module(model)
    rotary = model.model.rotary_emb
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    layers, checks = [], []
    for i in range(n_layers):
        r = recs[i]
        k_raw, v_raw, q_raw = hooks.out[(i, "k")], hooks.out[(i, "v")], hooks.out[(i, "q")]
        k_pre = to_bhtd(k_raw.detach(), hkv, head_dim)
        v = to_bhtd(v_raw.detach(), hkv, head_dim)
        q_pre = to_bhtd(q_raw.detach(), hq, head_dim)
        # sanity: RoPE of the hooked tensors reproduces what attention received
        cos, sin = rotary(k_pre, pos)
        q_rot, k_rot = mm.apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
        c = {
            "k_post_vs_rope_of_k_pre_max_abs": max_abs_diff(r["k_post"], k_rot),
            "q_vs_rope_of_pre_rope_q_max_abs": max_abs_diff(r["q"], q_rot),
            "v_hook_vs_attention_max_abs": max_abs_diff(r["v"], v),
            "scaling": r["scaling"],
        }
        assert c["k_post_vs_rope_of_k_pre_max_abs"] == 0.0, (i, c)
        assert c["q_vs_rope_of_pre_rope_q_max_abs"] == 0.0, (i, c)
        assert c["v_hook_vs_attention_max_abs"] == 0.0, (i, c)
        assert r["q"].shape == (ids.shape[0], hq, ids.shape[1], head_dim), r["q"].shape
        assert r["k_post"].shape == (ids.shape[0], hkv, ids.shape[1], head_dim), r["k_post"].shape
        entry = {"q": r["q"], "k_pre": k_pre, "k_post": r["k_post"], "v": v}
        if with_grad:
            assert k_raw.grad is not None and v_raw.grad is not None, i
            entry["grad_k"] = to_bhtd(k_raw.grad, hkv, head_dim)
            entry["grad_v"] = to_bhtd(v_raw.grad, hkv, head_dim)
            entry["fisher_k"] = entry["grad_k"] ** 2
            entry["fisher_v"] = entry["grad_v"] ** 2
        layers.append(entry)
        checks.append(c)
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "layers": layers,
            "checks": checks}


F64_ATTN = "kvforge_float64_eager"


def float64_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """HF's eager attention without its float32 softmax (softmax in the query dtype)."""
    mm = sys.modules[type(module).__module__]
    k = mm.repeat_kv(key, module.num_key_value_groups)
    v = mm.repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


def _rmsnorm_same_dtype(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def make_float64_exact(model):
    """HF computes RMSNorm and the eager softmax in float32 even for a float64 model; replace those
    two by mathematically identical float64 versions so that finite differences are meaningful."""
    import types
    n = 0
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(_rmsnorm_same_dtype, mod)
            n += 1
    assert n > 0
    return model


NO_MASK_ATTN = "kvforge_no_mask_demo"


def unregistered_mask_demo(model_dir: Path, ids: torch.Tensor, eager_logits: torch.Tensor) -> dict:
    """Documents the pitfall: an attention name registered only in AttentionInterface (not in
    AttentionMaskInterface) receives attention_mask=None, i.e. no causal mask."""
    from transformers import AttentionInterface
    seen = []

    def fn(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        seen.append(None if attention_mask is None else list(attention_mask.shape))
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    AttentionInterface.register(NO_MASK_ATTN, fn)
    m = load_model(model_dir, torch.float32, NO_MASK_ATTN)
    with torch.no_grad():
        logits = m(ids, use_cache=False).logits
    return {"attention_mask_received": seen[0],
            "logits_max_abs_diff_vs_eager": max_abs_diff(logits, eager_logits)}


def loss64(model, ids: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (mean CE over the B*(T-1) shifted predictions) without the float32 cast."""
    logits = model(ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def float64_checks(model_dir: Path, ids: torch.Tensor, cap32: dict, log) -> dict:
    """Independent gradient checks in float64 with plain eager attention (no custom function):
    (1) fp32 gradients vs fp64 gradients; (2) fp64 gradients vs a central finite difference of
    the loss along a random direction added to each hooked k / v output."""
    m = make_float64_exact(load_model(model_dir, torch.float64, F64_ATTN))
    cfg = m.config
    head_dim = m.model.layers[0].self_attn.head_dim
    hkv = cfg.num_key_value_heads
    hooks = Hooks(m, retain_grad=True)
    loss = loss64(m, ids)
    loss.backward()
    raw = {key: (t.detach(), t.grad.detach()) for key, t in hooks.out.items() if key[1] in ("k", "v")}
    hooks.remove()
    res = {"note": "float64 model; RMSNorm and the eager attention softmax made float64 (HF runs "
                   "both in float32 even for a float64 model, which makes finite differences noisy); loss recomputed in float64 as the mean "
                   "cross-entropy of logits[:, :-1] vs input_ids[:, 1:] (HF's ForCausalLMLoss calls "
                   "logits.float(), which would round a float64 model's loss to float32)",
           "loss_float64": loss.item(),
           "loss_float32_minus_float64": cap32["loss"].item() - loss.item(), "layers": []}
    g = torch.Generator().manual_seed(FD_SEED)
    for i in range(cfg.num_hidden_layers):
        lr = {}
        for kind in ("k", "v"):
            val, grad = raw[(i, kind)]
            g64 = to_bhtd(grad, hkv, head_dim)
            g32 = cap32["layers"][i]["grad_k" if kind == "k" else "grad_v"].double()
            rel = ((g32 - g64).abs().max() / g64.abs().max()).item()
            delta = torch.randn(val.shape, generator=g, dtype=torch.float64)
            with torch.no_grad():
                lp = []
                for sgn in (1.0, -1.0):
                    h = Hooks(m, retain_grad=False, perturb={(i, kind): sgn * FD_EPS * delta})
                    lp.append(loss64(m, ids).item())
                    h.remove()
            fd = (lp[0] - lp[1]) / (2 * FD_EPS)
            an = (grad * delta).sum().item()
            fd_rel = abs(fd - an) / max(abs(an), 1e-300)
            lr[kind] = {"grad_fp32_vs_fp64_max_abs_over_max": rel,
                        "directional_derivative_autograd_fp64": an,
                        "directional_derivative_central_difference_fp64": fd,
                        "relative_difference": fd_rel}
            assert fd_rel < 1e-5, (model_dir, i, kind, an, fd)
            assert rel < 1e-3, (model_dir, i, kind, rel)
        res["layers"].append(lr)
        log(f"    layer {i}: fp32/fp64 grad rel k {lr['k']['grad_fp32_vs_fp64_max_abs_over_max']:.2e} "
            f"v {lr['v']['grad_fp32_vs_fp64_max_abs_over_max']:.2e}; finite-difference rel "
            f"k {lr['k']['relative_difference']:.2e} v {lr['v']['relative_difference']:.2e}")
    return res


def fisher_stats(f: torch.Tensor) -> dict:
    """f: [B, kv_heads, T, D]."""
    flat = f.flatten().double()
    nz = flat[flat != 0]
    med = flat.median().item()
    zero_pos = []
    for b in range(f.shape[0]):
        per_pos = f[b].transpose(0, 1).reshape(f.shape[2], -1)  # [T, kv_heads*D]
        zero_pos.append([t for t in range(f.shape[2]) if bool((per_pos[t] == 0).all())])
    zero_elems = int((flat == 0).sum())
    return {
        "max": flat.max().item(),
        "median": med,
        "max_over_median": flat.max().item() / med if med > 0 else None,
        "median_nonzero": nz.median().item() if nz.numel() else None,
        "mean": flat.mean().item(),
        "min_nonzero": nz.min().item() if nz.numel() else None,
        "zero_elements": zero_elems,
        "zero_elements_outside_zero_positions": zero_elems - sum(len(z) for z in zero_pos) * f.shape[1] * f.shape[3],
        "positions_all_zero_per_batch_row": zero_pos,
        "argmax_index_b_h_t_d": [int(x) for x in (f == f.max()).nonzero()[0].tolist()],
        "top3_positions_by_sum_batch0": f[0].sum(dim=(0, 2)).argsort(descending=True)[:3].tolist(),
        "per_position_sum_batch0": [round(x, 9) for x in f[0].sum(dim=(0, 2)).double().tolist()],
    }


def layer_tensors(prefix: str, layers: list[dict], keys) -> dict:
    return {f"{prefix}layers.{i}.{k}": L[k] for i, L in enumerate(layers) for k in keys}


CAPTURE_KEYS = ("q", "k_pre", "k_post", "v", "fisher_k", "fisher_v")


def describe(tensors: dict) -> dict:
    return {k: list(v.shape) for k, v in tensors.items()}


def common_meta(cap: dict, ids: torch.Tensor) -> dict:
    fisher = []
    for i, L in enumerate(cap["layers"]):
        fisher.append({"layer": i, "k": fisher_stats(L["fisher_k"]), "v": fisher_stats(L["fisher_v"])})
        T = ids.shape[1]
        assert all(z == [T - 1] for z in fisher[-1]["k"]["positions_all_zero_per_batch_row"]), fisher[-1]
        assert all(z == [T - 1] for z in fisher[-1]["v"]["positions_all_zero_per_batch_row"]), fisher[-1]
    return {
        "loss": cap["loss"].item(),
        "predictions_scored": ids.shape[0] * (ids.shape[1] - 1),
        "fisher": fisher,
        "fisher_scale_summary": [
            {"layer": f["layer"], "k_max": f["k"]["max"], "k_median": f["k"]["median"],
             "k_max_over_median": f["k"]["max_over_median"], "v_max": f["v"]["max"],
             "v_median": f["v"]["median"]} for f in fisher],
        "zero_fisher_explanation": (
            "Position T-1 (the last token) has exactly zero gradient for keys and values in every "
            "layer and every batch row: HF's loss pads the labels with -100 and shifts them, so the "
            "logits at T-1 predict nothing and get zero gradient; with a causal mask the key/value "
            "at T-1 reach only the query at T-1 (earlier queries give it weight exp(finfo.min) = 0 "
            "exactly), whose output flows only into the hidden state at T-1 and so only into the "
            "logits at T-1 -> exact zeros, not round-off. No other element is zero."),
        "attention_call": {"kwargs_passed_besides_mask_and_scaling": sorted(RECORDER.kwargs_seen),
                           "mask_shapes": [list(s) if s else None for s in sorted(RECORDER.mask_shapes, key=str)]},
        "sanity_per_layer": cap["checks"],
    }


# ----------------------------------------------------------------------------------------------
# fixtures


def make_tiny(name: str, out: Path, log) -> dict:
    mdir = out / "models" / name
    ref = load_tensors(out / "reference" / f"{name}.safetensors")
    ids = ref["input_ids"].round().long()
    RECORDER.kwargs_seen.clear()
    RECORDER.mask_shapes.clear()
    m = load_model(mdir, torch.float32, CAPTURE_ATTN)
    assert m.config._attn_implementation == CAPTURE_ATTN, m.config._attn_implementation
    cap = capture(m, ids, with_grad=True)

    eager = load_model(mdir, torch.float32, "eager")
    with torch.no_grad():
        eo = eager(ids, labels=ids, use_cache=False)
    checks = {
        "logits_vs_eager_model_max_abs": max_abs_diff(cap["logits"], eo.logits),
        "loss_vs_eager_model_abs": abs(cap["loss"].item() - eo.loss.item()),
        "logits_vs_reference_fixture_max_abs": max_abs_diff(cap["logits"], ref["logits"]),
    }
    assert checks["logits_vs_eager_model_max_abs"] == 0.0, checks
    assert checks["loss_vs_eager_model_abs"] == 0.0, checks
    assert checks["logits_vs_reference_fixture_max_abs"] < 1e-4, checks
    checks["unregistered_mask_demo"] = unregistered_mask_demo(mdir, ids, eo.logits)
    log(f"[{name}] loss {cap['loss'].item():.6f}; {checks}")
    f64 = float64_checks(mdir, ids, cap, log)

    tensors = {"input_ids": ids, "loss": cap["loss"].reshape(1),
               **layer_tensors("", cap["layers"], CAPTURE_KEYS)}
    path = out / "reference" / f"capture_{name}.safetensors"
    save_tensors(path, tensors)
    cfg = m.config
    meta = {
        "model_dir": f"models/{name}",
        "architecture": type(m).__name__,
        "input_ids_source": f"reference/{name}.safetensors input_ids",
        "input_ids": ids.tolist(),
        "dtype": "float32",
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": m.model.layers[0].self_attn.head_dim,
        "pre_rope_key_hook": "self_attn.k_norm" if hasattr(m.model.layers[0].self_attn, "k_norm") else "self_attn.k_proj",
        "shapes": describe(tensors),
        **common_meta(cap, ids),
        "checks": checks,
        "float64_gradient_checks": f64,
        "method": METHOD.format(tv=versions()["transformers"], pv=torch.__version__, dtype="torch.float32"),
        "versions": versions(),
    }
    write_json(out / "reference" / f"capture_{name}.json", meta)
    return meta


def make_pyllama(shared: Path, out: Path, log) -> dict:
    from tokenizers import Tokenizer
    model_dir = shared / "models" / "pyllama-16m"
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    calib = tok.encode(read_text(shared / "data" / "calib.txt"), add_special_tokens=False).ids
    ids = torch.tensor([[BOS_ID] + calib[:PYLLAMA_TEXT_TOKENS]])
    checks = {}
    fp32_ref = out / "reference" / "pyllama_fp32.safetensors"
    if fp32_ref.exists():  # row 1 there = 0 + first 63 tokens of calib.txt
        same = torch.equal(load_tensors(fp32_ref)["input_ids"][1, : ids.shape[1]].round().long(), ids[0])
        checks["input_ids_equal_pyllama_fp32_row1_prefix"] = same
        assert same

    RECORDER.kwargs_seen.clear()
    RECORDER.mask_shapes.clear()
    m = load_model(model_dir, torch.float32, CAPTURE_ATTN)
    cap = capture(m, ids, with_grad=True)
    eager = load_model(model_dir, torch.float32, "eager")
    with torch.no_grad():
        eo = eager(ids, labels=ids, use_cache=False)
    checks["logits_vs_eager_model_max_abs"] = max_abs_diff(cap["logits"], eo.logits)
    checks["loss_vs_eager_model_abs"] = abs(cap["loss"].item() - eo.loss.item())
    assert checks["logits_vs_eager_model_max_abs"] == 0.0, checks
    assert checks["loss_vs_eager_model_abs"] == 0.0, checks
    log(f"[pyllama] loss {cap['loss'].item():.6f}; {checks}")
    f64 = float64_checks(model_dir, ids, cap, log)

    mbf = load_model(model_dir, torch.bfloat16, CAPTURE_ATTN)
    cbf = capture(mbf, ids, with_grad=False)
    bf16_vs_fp32 = []
    for i, (Lb, L) in enumerate(zip(cbf["layers"], cap["layers"])):
        d = {}
        for k in ("q", "k_pre", "k_post", "v"):
            assert Lb[k].dtype == torch.bfloat16, (k, Lb[k].dtype)
            diff = (Lb[k].float() - L[k]).abs()
            d[k] = {"max_abs_diff": diff.max().item(), "fp32_absmax": L[k].abs().max().item(),
                    "max_abs_diff_over_absmax": (diff.max() / L[k].abs().max()).item(),
                    "max_rel_diff_where_abs_gt_0.1_absmax": (
                        (diff / L[k].abs())[L[k].abs() > 0.1 * L[k].abs().max()].max().item())}
        bf16_vs_fp32.append(d)
    log(f"[pyllama] bf16 loss {cbf['loss'].item():.6f}; layer 4 bf16-vs-fp32 max|diff|/absmax "
        + ", ".join(f"{k} {v['max_abs_diff_over_absmax']:.4f}" for k, v in bf16_vs_fp32[-1].items()))

    tensors = {"input_ids": ids, "loss": cap["loss"].reshape(1),
               **layer_tensors("", cap["layers"], CAPTURE_KEYS),
               **layer_tensors("bf16.", cbf["layers"], ("k_pre", "v", "q"))}
    save_tensors(out / "reference" / "capture_pyllama.safetensors", tensors)
    cfg = m.config
    meta = {
        "model_dir": "<shared>/models/pyllama-16m",
        "architecture": type(m).__name__,
        "input_ids_source": "<|bos|> (0) + first 31 tokens of <shared>/data/calib.txt (whole file "
                            "tokenized with tokenizer.json, tokenizers library, add_special_tokens=False)",
        "input_ids": ids.tolist(),
        "dtype": "float32 (dtype=torch.float32: exact upcast of the bf16 checkpoint); bf16.* from "
                 "dtype=torch.bfloat16 (bf16 weights and activations), stored as F32 (exact)",
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": m.model.layers[0].self_attn.head_dim,
        "pre_rope_key_hook": "self_attn.k_proj",
        "shapes": describe(tensors),
        **common_meta(cap, ids),
        "bf16_loss": cbf["loss"].item(),
        "bf16_vs_fp32_per_layer": bf16_vs_fp32,
        "bf16_sanity_per_layer": cbf["checks"],
        "checks": checks,
        "float64_gradient_checks": f64,
        "method": METHOD.format(tv=versions()["transformers"], pv=torch.__version__,
                                dtype="torch.float32") + " bf16.*: the same forward (no backward) "
                  "with dtype=torch.bfloat16; q / k_pre / v are bf16 tensors cast to float32.",
        "versions": versions(),
    }
    write_json(out / "reference" / "capture_pyllama.json", meta)
    return meta


# ----------------------------------------------------------------------------------------------
# README section + verification


def readme_section(metas: dict, out: Path) -> str:
    v = versions()
    lines = []
    a = lines.append
    demos = {n: m["checks"]["unregistered_mask_demo"] for n, m in metas.items()
             if "unregistered_mask_demo" in m["checks"]}
    nomask = ("attention_mask received: None; tiny-model logits then differ from eager by up to "
              f"{max(d['logits_max_abs_diff_vs_eager'] for d in demos.values()):.2g}") if demos \
        else "see the tiny JSONs"
    a(README_BEGIN)
    a("## `kvforge capture` references: `capture_<name>.safetensors`, `capture_<name>.json`")
    a("")
    a("Produced by `python3 scripts/make_capture_fixtures.py --shared /work/shared --out tests/fixtures` "
      f"(CPU, {v['torch_num_threads']} threads, torch {v['torch']}, transformers {v['transformers']}; "
      "deterministic; run it after `make_model_fixtures.py`, which rewrites this README from scratch "
      "and drops this section). Names: llama3, mistral, qwen2, qwen3 (tiny checkpoints in "
      "`../models/<name>`, input_ids [2, 24] = those of `<name>.safetensors`) and pyllama "
      "(`<shared>/models/pyllama-16m` loaded with dtype=float32, input_ids [1, 32] = 0 + the first "
      "31 tokens of data/calib.txt, = the first 32 ids of row 1 of `pyllama_fp32.safetensors`). "
      "All tensors F32, no `__metadata__`.")
    a("")
    a("| tensor | shape | meaning |")
    a("|---|---|---|")
    a("| input_ids | [B, T] | token ids (F32) |")
    a("| loss | [1] | `model(input_ids, labels=input_ids).loss`: mean cross-entropy over the B·(T-1) shifted predictions |")
    a("| layers.<i>.q | [B, heads, T, D] | queries exactly as attention multiplies them: after q_norm (Qwen3) and RoPE |")
    a("| layers.<i>.k_pre | [B, kv_heads, T, D] | keys before RoPE: k_proj output incl. bias (Qwen2), after k_norm (Qwen3) |")
    a("| layers.<i>.k_post | [B, kv_heads, T, D] | keys after RoPE, before repeat_kv (= HF `apply_rotary_pos_emb(k_pre)`, bit-exact) |")
    a("| layers.<i>.v | [B, kv_heads, T, D] | values (v_proj output incl. bias), before repeat_kv |")
    a("| layers.<i>.fisher_k | [B, kv_heads, T, D] | (∂loss/∂k_pre)² |")
    a("| layers.<i>.fisher_v | [B, kv_heads, T, D] | (∂loss/∂v)² |")
    a("| bf16.layers.<i>.{q,k_pre,v} | as above | capture_pyllama only: the same from the model loaded with dtype=bfloat16 (values are exact bf16, cast to F32); no gradients |")
    a("")
    a("Method: q / k_post / v are recorded by an attention function registered with "
      "`transformers.AttentionInterface.register(\"" + CAPTURE_ATTN + "\", fn)` (it stores "
      "query/key/value as the attention module passes them and returns the model's own "
      "`eager_attention_forward`); the model is loaded with `attn_implementation=\""
      + CAPTURE_ATTN + "\"`. **transformers 5 only builds an attention mask for names registered in "
      "`masking_utils.AttentionMaskInterface`**: for any other name `create_causal_mask` returns None "
      "and the model silently runs *without a causal mask* (" + nomask + "; "
      "`checks.unregistered_mask_demo` in each tiny JSON), so the name "
      "is also registered there with `eager_mask`. k_pre / v (and their gradients) come from forward "
      "hooks on `self_attn.k_proj` (`self_attn.k_norm` for Qwen3, output [B, T, kv_heads, D]) and "
      "`self_attn.v_proj` calling `retain_grad()`; after `loss.backward()`, fisher = grad². "
      "Checks (asserted; values in the JSON): logits and loss bit-identical to a plain "
      "`attn_implementation=\"eager\"` model (and to the `<name>.safetensors` logits); k_post and q "
      "bit-identical to HF's `apply_rotary_pos_emb` of the hooked pre-RoPE tensors; gradients agree "
      "with a float64 model (RMSNorm and attention softmax kept in float64, since HF runs both in float32 even for float64 weights) and with a float64 central finite difference "
      "of the loss along a random direction (relative difference < 1e-5).")
    a("")
    a("Zero Fisher: position T-1 (the last token) has **exactly zero** key and value gradient in every "
      "layer and batch row. HF's loss pads labels with -100 and shifts them, so the logits at T-1 "
      "predict nothing; with the causal mask the key/value at T-1 are seen only by the query at T-1 "
      "(earlier queries weight it by exp(finfo.min) = 0), and that query's output only reaches the "
      "logits at T-1. No other element is zero. The other positions' Fisher spans many orders of "
      "magnitude (below); mistral (sliding window 8) has no additional zeros.")
    a("")
    a("| file | B×T | loss | layer: fisher_k max / median (max/median) | fisher_v max / median |")
    a("|---|---|---|---|---|")
    for name, m in metas.items():
        ks = "; ".join(f"{s['layer']}: {s['k_max']:.3g} / {s['k_median']:.3g} ({s['k_max_over_median']:.3g})"
                       for s in m["fisher_scale_summary"])
        vs = "; ".join(f"{s['layer']}: {s['v_max']:.3g} / {s['v_median']:.3g}" for s in m["fisher_scale_summary"])
        B, T = len(m["input_ids"]), len(m["input_ids"][0])
        a(f"| capture_{name} | {B}×{T} | {m['loss']:.6f} | {ks} | {vs} |")
    a("")
    if "pyllama" in metas:
        p = metas["pyllama"]
        worst = {k: max(L[k]["max_abs_diff_over_absmax"] for L in p["bf16_vs_fp32_per_layer"])
                 for k in ("q", "k_pre", "v")}
        a("bf16 (capture_pyllama): loss of the bf16 model {:.6f} vs fp32 {:.6f}; over all layers, "
          "max |bf16 − fp32| / max|fp32| is q {:.4f}, k_pre {:.4f}, v {:.4f} (errors accumulate over "
          "layers; bf16 CPU arithmetic differs from a GPU's, so compare bf16 captures with a tolerance "
          "of this order, not bit-exactly).".format(p["bf16_loss"], p["loss"], worst["q"], worst["k_pre"],
                                                     worst["v"]))
        a("")
    a("`capture_<name>.json`: input_ids, shapes, loss, per-layer Fisher statistics (max, median, "
      "max/median, median of nonzero, min nonzero, exact-zero count, all-zero positions per batch row, "
      "per-position sums for batch row 0), the sanity checks, the float64 gradient checks, the kwargs "
      "the attention function received, the method in words and versions; capture_pyllama.json also "
      "bf16-vs-fp32 differences per layer.")
    a("")
    for name in metas:
        for ext in ("safetensors", "json"):
            p = out / "reference" / f"capture_{name}.{ext}"
            a(f"- reference/{p.name}: {p.stat().st_size} bytes")
    a(README_END)
    return "\n".join(lines) + "\n"


def update_readme(out: Path, section: str) -> None:
    path = out / "reference" / "README.md"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        tail = rest.split(README_END, 1)[1].lstrip("\n")
        text = head + section + (("\n" + tail) if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text, encoding="utf-8")


def verify(out: Path, names, log) -> None:
    for name in names:
        p = out / "reference" / f"capture_{name}.safetensors"
        t = load_tensors(p)
        meta = json.loads((out / "reference" / f"capture_{name}.json").read_text())
        for k, v in t.items():
            assert v.dtype == torch.float32, (p, k, v.dtype)
            assert torch.isfinite(v).all(), (p, k)
            assert list(v.shape) == meta["shapes"][k], (p, k)
        size = p.stat().st_size
        log(f"[verify] {p.name}: {size} bytes, {len(t)} tensors"
            + (" (over 1.5 MB)" if size > SIZE_WARN else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", type=Path, default=Path("../shared"))
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    ap.add_argument("--only", nargs="*", choices=TINY_NAMES + ["pyllama"],
                    help="subset to regenerate (README section then lists only these)")
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, flush=True)

    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    register_capture_attention()

    names = args.only or TINY_NAMES + ["pyllama"]
    metas = {}
    for name in names:
        metas[name] = make_pyllama(args.shared, args.out, log) if name == "pyllama" \
            else make_tiny(name, args.out, log)
    verify(args.out, names, log)
    update_readme(args.out, readme_section(metas, args.out))
    log("[done] README section updated")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Train a decoder-only transformer written in plain PyTorch: layerswap's main job.

    pip install . && LAYERSWAP_BUDGET=75% python samples/train_transformer.py

Nothing in the training code knows about layerswap: run it with LAYERSWAP_BUDGET (or LAYERSWAP=1) in the
environment, or through `python -m layerswap run`, and PyTorch allocates through layerswap. The script only
asks layerswap for its statistics at the end, when layerswap is active.

The model: token embedding; N pre-norm blocks, each RMSNorm (or LayerNorm) -> causal
scaled_dot_product_attention -> residual, norm -> GELU MLP -> residual; a final norm; an LM head, separate or
tied to the embedding. bf16 parameters, AdamW (foreach), random tokens from a seeded generator, cross-entropy.
The default size (d_model 2048, 20 layers, 16 heads, MLP 4x, vocab 32000) has 1,137,788,928 parameters
(`count_params` gives the formula).

--deterministic makes two runs of the same command produce bit-identical losses (deterministic algorithms,
fixed cuBLAS workspace, fixed seeds); tests/python/test_gpu_torch.py compares such runs with and without
layerswap. --json writes the losses (floats and float.hex strings), step times and peak memory, and under layerswap
its statistics (layerswap.stats()) and its launch tracker's (layerswap.tracker.stats()).
"""

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

NO_GPU_MESSAGE = ("no CUDA GPU is visible: this sample trains on a GPU; see README for the tests you can run "
                  "without one")

# cuBLAS picks its workspace size (and with it, its reduction order) from this variable when PyTorch creates
# its first cuBLAS handle. ":4096:8" is one of the two settings PyTorch accepts as deterministic.
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


# ---------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 32000
    d_model: int = 2048
    layers: int = 20
    heads: int = 16
    mlp_ratio: int = 4
    norm: str = "rms"  # "rms" or "layer"
    tie: bool = False  # LM head shares the embedding matrix

    @property
    def d_ff(self):
        return self.mlp_ratio * self.d_model

    @property
    def head_dim(self):
        return self.d_model // self.heads

    def check(self):
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm must be 'rms' or 'layer', not {self.norm!r}")
        for name in ("vocab", "d_model", "layers", "heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


def count_params(cfg):
    """Parameter count from the formula (no bias in any Linear):
    embedding V*d; per block: qkv 3d^2 + out d^2 + MLP 2*d*d_ff + two norms; final norm; head V*d unless tied.
    A norm is d weights (RMSNorm) or d weights + d biases (LayerNorm)."""
    d, v = cfg.d_model, cfg.vocab
    norm = d if cfg.norm == "rms" else 2 * d
    block = 4 * d * d + 2 * d * cfg.d_ff + 2 * norm
    return v * d + cfg.layers * block + norm + (0 if cfg.tie else v * d)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 from plain ops (each deterministic)."""

    def __init__(self, dim, eps=1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def make_norm(cfg, device, dtype):
    if cfg.norm == "rms":
        return RMSNorm(cfg.d_model, device=device, dtype=dtype)
    return nn.LayerNorm(cfg.d_model, eps=1e-5, device=device, dtype=dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg, device, dtype):
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        b, s, d = x.shape
        # (b, s, 3, heads, head_dim) -> (3, b, heads, s, head_dim): q, k, v with a contiguous last dim.
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg, device, dtype):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg, device, dtype):
        super().__init__()
        self.norm1 = make_norm(cfg, device, dtype)
        self.attn = CausalSelfAttention(cfg, device, dtype)
        self.norm2 = make_norm(cfg, device, dtype)
        self.mlp = MLP(cfg, device, dtype)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, cfg, device=None, dtype=None):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(Block(cfg, device, dtype) for _ in range(cfg.layers))
        self.norm = make_norm(cfg, device, dtype)
        self.head = None if cfg.tie else nn.Linear(cfg.d_model, cfg.vocab, bias=False, device=device, dtype=dtype)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return F.linear(x, self.embed.weight if self.head is None else self.head.weight)


@torch.no_grad()
def init_weights(model):
    """GPT-2 style: N(0, 0.02) for matrices, residual projections scaled by 1/sqrt(2 * layers); norms at 1/0.
    Draws from the default generator of the parameters' device, which the caller seeds."""
    std = 0.02
    residual_std = std / math.sqrt(2 * model.cfg.layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            is_residual = name.endswith("attn.proj") or name.endswith("mlp.proj")
            nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def build_model(cfg, device, dtype=torch.bfloat16, seed=0):
    """The model, its parameters created directly on `device` in `dtype` and initialised from `seed`."""
    torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
    model = Transformer(cfg, device=device, dtype=dtype)
    init_weights(model)
    return model


def make_batches(vocab, batch, seq, count, seed):
    """`count` (inputs, targets) pairs of random tokens on the CPU, from a generator of their own."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed + 1)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen, dtype=torch.long)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def loss_fn(logits, targets):
    # (batch*seq, vocab) float32 logits: the 2-D form of cross_entropy, whose CUDA kernels are deterministic.
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------

def make_deterministic(seed):
    """Everything PyTorch needs for bit-identical reruns. CUBLAS_WORKSPACE_CONFIG must be set before the
    first cuBLAS handle exists: main() sets it before any CUDA work."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)
    import random
    random.seed(seed)


# Note [CUBLAS_WORKSPACE_CONFIG after the first step]
# PyTorch 2.11 parses CUBLAS_WORKSPACE_CONFIG with a new std::regex every time it hands out a cuBLAS handle, that is
# at every GEMM (at::cuda::getCurrentCUDABlasHandle -> setWorkspaceForHandle -> getChosenWorkspaceSize ->
# parseChosenWorkspaceSize), whenever the variable is set; unset, it returns its default size without parsing. On the
# H100 that is 55-63 us of the launching thread's CPU per GEMM, and a 1.1B LoRA step 1.65x slower when deterministic
# (bench/cublas_regex_probe.py; docs/history.md, session 39). Deterministic runs must set the variable, but PyTorch
# checks it once (Context::alertCuBLASConfigNotDeterministic caches the answer at the first cuBLAS call) and cuBLAS
# creates each thread's handle while it is set; PyTorch then gives every handle a workspace of the size it parses.
# On sm90 its default is 4096 KiB x 8, the size ":4096:8" asks for, so unsetting the variable after the first step
# (every thread that runs GEMMs has made its handle) leaves the workspace and the results as they were, and the
# steps cost what they cost in ordinary training. Elsewhere the default differs, and the variable stays.
# bench/swap.py does the same in every side (bench/swap_models.py).
def drop_cublas_config(device):
    """Unsets CUBLAS_WORKSPACE_CONFIG where that keeps PyTorch's cuBLAS workspace size (Note
    [CUBLAS_WORKSPACE_CONFIG after the first step]); call it after the first step. Returns what it did, for the
    record."""
    value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if value is None:
        return "unset"
    if torch.device(device).type != "cuda":
        return f"kept {value}: not a CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if value != CUBLAS_DETERMINISTIC_WORKSPACE or capability != (9, 0):
        return f"kept {value}: sm{capability[0]}{capability[1]}'s default workspace differs"
    del os.environ["CUBLAS_WORKSPACE_CONFIG"]
    return f"{value} for the first step, then unset (the same workspace: sm90's default)"


def attention_backends(deterministic):
    """Deterministic runs keep scaled_dot_product_attention to FlashAttention (whose backward honours
    use_deterministic_algorithms) and the math fallback; other runs let PyTorch choose."""
    if not deterministic:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


def active_layerswap():
    """The layerswap module when it is PyTorch's allocator in this process, else None. Never raises."""
    try:
        import layerswap
        return layerswap if layerswap.is_enabled() else None
    except Exception:  # not installed, or broken: this sample runs without it
        return None


def layerswap_requested():
    """Whether the environment asks for layerswap (the rule of layerswap's torch autoload)."""
    switch = os.environ.get("LAYERSWAP", "").strip().lower()
    if switch in ("0", "false", "off", "no"):
        return False
    return os.environ.get("LAYERSWAP_BUDGET", "").strip().lower() not in ("", "none") or switch != ""


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def train(cfg, *, steps, warmup, batch, seq, seed, device, deterministic=False, keep_cublas_config=False, lr=3e-4,
          log=print):
    """Trains `steps` steps; returns a dict of losses, step times and peak memory (see --json).
    Each step is timed between two device synchronisations; the first `warmup` steps are left out of the
    median. A deterministic run unsets CUBLAS_WORKSPACE_CONFIG after its first step where that keeps cuBLAS's
    workspace, unless `keep_cublas_config` (Note [CUBLAS_WORKSPACE_CONFIG after the first step]). Bench and tests
    import this module and call it in a fresh process."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"

    def sync():
        if on_cuda:
            torch.cuda.synchronize(device)

    if deterministic:
        make_deterministic(seed)

    model = build_model(cfg, device, torch.bfloat16, seed)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != count_params(cfg):
        raise AssertionError(f"parameter count {n_params:,} differs from the formula's {count_params(cfg):,}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    batches = make_batches(cfg.vocab, batch, seq, steps, seed)
    log(f"model: {n_params:,} parameters ({n_params / 1e9:.3f} B): d_model {cfg.d_model}, {cfg.layers} layers, "
        f"{cfg.heads} heads, MLP {cfg.d_ff}, vocab {cfg.vocab}, {cfg.norm} norm, "
        f"{'tied' if cfg.tie else 'separate'} head; batch {batch} x seq {seq}; bf16, AdamW(foreach)"
        f"{'; deterministic' if deterministic else ''}")

    losses, times = [], []
    cublas_config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset")
    model.train()
    for step, (inputs, targets) in enumerate(batches):
        sync()
        t0 = time.perf_counter()
        inputs = inputs.to(device)
        targets = targets.to(device)
        with attention_backends(deterministic):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"loss is {value} at step {step + 1}")
        losses.append(value)
        times.append(dt)
        if step == 0 and deterministic and not keep_cublas_config:
            cublas_config = drop_cublas_config(device)
        log(f"step {step + 1:3d}/{steps}  loss {value:.6f}  time {dt:.4f} s")

    timed = times[warmup:] if warmup < len(times) else times
    result = {
        "losses": losses,
        "losses_hex": [float(x).hex() for x in losses],
        "step_times_s": times,
        "warmup": min(warmup, len(times)),
        "median_step_s": statistics.median(timed) if timed else None,
        "params": n_params,
        "tokens_per_step": batch * seq,
        "config": {**asdict(cfg), "batch": batch, "seq": seq, "steps": steps, "seed": seed,
                   "deterministic": deterministic, "lr": lr},
        "cublas_workspace_config": cublas_config,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "peak_allocated": None,
        "peak_reserved": None,
        "layerswap": False,
        "layerswap_stats": None,
        "device": str(device),
    }
    if on_cuda:
        result["device"] = torch.cuda.get_device_name(device)
        result["cuda"] = torch.version.cuda
        try:
            result["peak_allocated"] = torch.cuda.max_memory_allocated(device)
            result["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        except Exception as err:  # report it, keep the losses
            log(f"warning: torch.cuda.max_memory_allocated/reserved failed: {type(err).__name__}: {err}")
        ls = active_layerswap()
        result["layerswap"] = ls is not None
        if ls is not None:
            try:
                index = device.index if device.index is not None else torch.cuda.current_device()
                result["layerswap_stats"] = ls.stats().get(index)
            except Exception as err:
                log(f"warning: layerswap.stats() failed: {type(err).__name__}: {err}")
            try:  # the launch tracker's counters (layerswap.tracker.stats()), where it ran
                import layerswap.tracker
                result["tracker_stats"] = layerswap.tracker.stats()
            except Exception as err:
                log(f"warning: layerswap.tracker.stats() failed: {type(err).__name__}: {err}")
    return result


def print_summary(result, log=print):
    n = result["params"]
    timed = result["step_times_s"][result["warmup"]:]
    log("-" * 72)
    log(f"parameters:        {n:,} ({n / 1e9:.3f} B)")
    if result["median_step_s"] is not None:
        first = result["warmup"] + 1
        log(f"median step time:  {result['median_step_s']:.4f} s over steps {first}-{first + len(timed) - 1} "
            f"({result['tokens_per_step'] / result['median_step_s']:,.0f} tokens/s)")
    log(f"loss:              {result['losses'][0]:.6f} -> {result['losses'][-1]:.6f}")
    log(f"peak memory:       allocated {fmt_bytes(result['peak_allocated'])}, "
        f"reserved {fmt_bytes(result['peak_reserved'])} (torch.cuda.max_memory_allocated/reserved)")
    log(f"device:            {result['device']}, torch {result['torch']}")
    st = result.get("layerswap_stats")
    if result["layerswap"]:
        if st:
            def peak(key):
                return fmt_bytes(st.get(key, {}).get("peak"))
            budget = st.get("budget") or 0
            log(f"layerswap:         budget {fmt_bytes(budget) if budget else 'none'}; device memory held peak "
                f"{peak('device_bytes')}; allocated peak {peak('allocated_bytes')}, reserved peak "
                f"{peak('reserved_bytes')}")
            log(f"                   pages created {st.get('num_device_alloc')}, released "
                f"{st.get('num_device_free')}; reclaim retries {st.get('num_alloc_retries')}; host waits "
                f"{st.get('num_host_waits')}; OOMs {st.get('num_ooms')}")
        else:
            log("layerswap:         enabled (no statistics available)")
    else:
        log("layerswap:         not enabled (PyTorch's own CUDA allocator)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a decoder-only transformer (plain PyTorch, bf16, AdamW) on random tokens. "
                    "Enable layerswap from outside: LAYERSWAP_BUDGET=75%% python samples/train_transformer.py")
    d = ModelConfig()
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median step time (default 3)")
    p.add_argument("--layers", type=int, default=d.layers, help=f"transformer blocks (default {d.layers})")
    p.add_argument("--d-model", type=int, default=d.d_model, help=f"model width (default {d.d_model})")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default d_model / 128)")
    p.add_argument("--mlp-ratio", type=int, default=d.mlp_ratio, help=f"MLP width / d_model (default {d.mlp_ratio})")
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"vocabulary size (default {d.vocab})")
    p.add_argument("--norm", choices=("rms", "layer"), default=d.norm, help="RMSNorm or LayerNorm (default rms)")
    p.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the token stream (default 0)")
    p.add_argument("--deterministic", action="store_true",
                   help="bit-reproducible run: deterministic algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8 (unset "
                        "after the first step on sm90, where that keeps cuBLAS's workspace: PyTorch 2.11 parses it "
                        "at every GEMM), cudnn deterministic, fixed seeds")
    p.add_argument("--keep-cublas-config", action="store_true",
                   help="with --deterministic: keep CUBLAS_WORKSPACE_CONFIG set for every step")
    p.add_argument("--json", metavar="PATH", help="write losses, step times and peak memory to PATH")
    # Hidden: the same code path on the CPU with a tiny model, for checking this script without a GPU.
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu_smoke:  # tiny defaults unless given explicitly
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        for flag, attr, value in (("--layers", "layers", 2), ("--d-model", "d_model", 64), ("--vocab", "vocab", 256),
                                  ("--batch", "batch", 2), ("--seq", "seq", 32), ("--steps", "steps", 6),
                                  ("--warmup", "warmup", 1)):
            if flag not in given:
                setattr(args, attr, value)
        if "--lr" not in given:
            args.lr = 1e-2
    if args.heads is None:
        args.heads = max(1, args.d_model // 128) if not args.cpu_smoke else 4
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def config_from_args(args):
    cfg = ModelConfig(vocab=args.vocab, d_model=args.d_model, layers=args.layers, heads=args.heads,
                      mlp_ratio=args.mlp_ratio, norm=args.norm, tie=args.tie)
    cfg.check()
    return cfg


def main(argv=None):
    args = parse_args(argv)
    if args.deterministic:
        # Before anything touches CUDA (importing torch does not create cuBLAS handles).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    if args.cpu_smoke:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print(NO_GPU_MESSAGE, file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        if layerswap_requested() and active_layerswap() is None:
            print("warning: LAYERSWAP/LAYERSWAP_BUDGET is set but layerswap is not PyTorch's allocator in this "
                  "process (is it installed? pip install .); running on PyTorch's own allocator", flush=True)

    result = train(cfg, steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq, seed=args.seed,
                   device=device, deterministic=args.deterministic, keep_cublas_config=args.keep_cublas_config,
                   lr=args.lr, log=lambda s: print(s, flush=True))
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(folder, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
            f.write("\n")
    print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

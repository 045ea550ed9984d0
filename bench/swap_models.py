"""The models and the training loop of bench/swap.py: one definition shared by every side of the benchmark.

Three cases, each built from a config with random weights, in bf16, from fixed seeds:

  llama-lora  a Llama-style decoder (transformers' LlamaForCausalLM, SDPA attention; ~1.1 B parameters at the
              default size: hidden 2048, 22 layers, MLP 5632, 32 heads, 4 KV heads, vocab 32000) with LoRA
              adapters (peft, r=16 on q/k/v/o, no dropout) trained with AdamW. The base weights are frozen bf16;
              peft keeps the adapters in fp32 (its default `autocast_adapter_dtype`), so their AdamW state is fp32.
              AdamW(foreach=True): the adapters are small and one foreach update is what a user gets by default.
  llama-full  the same model, every parameter trained with AdamW. The optimizer state is bf16, like the
              parameters (what torch.optim.AdamW keeps for bf16 parameters): 2 x 2 bytes per parameter, so a
              1.1 B model holds 2.2 GB of weights, 2.2 GB of gradients and 4.4 GB of state. AdamW(foreach=False):
              the update walks the parameters one at a time (as DeepSpeed/OneTrainer-style offloaders do), so the
              step needs one parameter's temporaries, not a full copy of the model's (foreach would). The
              benchmark's --adamw picks foreach or fused instead, for this case and the UNet (ADAMW_FORMS).
  unet        a UNet-style convolutional net written here (Conv2d + GroupNorm + SiLU residual blocks, strided-conv
              downsampling, nearest upsampling, skip connections concatenated on the way up), ~300 M parameters,
              trained fully with AdamW(foreach=False) on random latents and targets (MSE).

Every side builds the model the same way, directly on the device it trains on, so that the initial weights
are bit-identical everywhere (same seed, same sequence of RNG calls); the peers (bench/peers.py) move weights
to the host afterwards. The data are drawn on the CPU from a generator of their own, before training: identical
for every side and every step.

`groups()` names the model's layer groups in forward order, with their bytes (weights, gradients, optimizer
state): bench/swap.py feeds them to its Belady simulation and its budget rule.

Nothing here imports layerswap: the layerswap side is this same code in a process whose environment turns
layerswap on.
"""

import contextlib
import math
import os
import pathlib
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# The training sample's deterministic setup, SDPA backends and token batches serve here too (one definition).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "samples"))
import train_transformer as sample  # noqa: E402
from step_phases import median_phases  # noqa: E402  (torch-free: bench/swap.py's parent pools phases too)

CASES = ("llama-lora", "llama-full", "unet")


# ---------------------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------------------

make_deterministic = sample.make_deterministic  # everything PyTorch needs for bit-identical reruns


def layerswap_side(side, out):
    """The layerswap module on the layerswap side of a check, where `import torch` must have enabled it
    (LAYERSWAP_BUDGET set by the parent), with its settings put in out["layerswap_config"]; None on any other side."""
    if side != "layerswap":
        return None
    import layerswap
    if not layerswap.is_enabled():
        raise RuntimeError("LAYERSWAP_BUDGET is set but `import torch` did not enable layerswap")
    out["layerswap_config"] = dict(layerswap.config())
    return layerswap


def attention_backends():
    """scaled_dot_product_attention restricted to FlashAttention (whose backward honours
    use_deterministic_algorithms) and the math fallback: the sample's deterministic choice."""
    return sample.attention_backends(True)


# ---------------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaSize:
    hidden: int = 2048
    layers: int = 22
    intermediate: int = 5632
    heads: int = 32
    kv_heads: int = 4
    vocab: int = 32000
    lora_r: int = 16


@dataclass(frozen=True)
class UNetSize:
    in_channels: int = 4
    channels: tuple = (192, 384, 768, 1280)
    blocks_per_level: int = 2
    groups: int = 32
    resolution: int = 64
    batch: int = 8


# --llama-size: the default ~1.1 B (TinyLlama's shape) and DESIGN.md's peer model, ~2.8 B (26 layers, hidden 3072,
# MLP 8192, 24 heads, 8 KV heads: Llama 3.2 3B's shape with 26 layers and a 32000 vocab).
LLAMA_SIZES = {"1b": LlamaSize(),
               "3b": LlamaSize(hidden=3072, layers=26, intermediate=8192, heads=24, kv_heads=8)}
QUICK_LLAMA = LlamaSize(hidden=64, layers=4, intermediate=176, heads=4, kv_heads=2, vocab=512, lora_r=4)
QUICK_UNET = UNetSize(in_channels=3, channels=(16, 32), blocks_per_level=1, groups=4, resolution=16, batch=2)


# AdamW's implementations for the cases that train every parameter (llama-full, unet): the keyword each passes, and
# how it is described. "single" (foreach=False) is the default: one parameter's temporaries at a time.
ADAMW_FORMS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def full_adamw(params, cfg, betas):
    """AdamW over `params` in the form `cfg.adamw` names (ADAMW_FORMS), and its description."""
    if cfg.adamw not in ADAMW_FORMS:
        raise ValueError(f"unknown AdamW form {cfg.adamw!r}; the forms are {', '.join(ADAMW_FORMS)}")
    kw = ADAMW_FORMS[cfg.adamw]
    text = ", ".join(f"{k}={v}" for k, v in kw.items())
    return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=0.01, **kw), text


@dataclass
class RunConfig:
    """What one worker trains. The same for every side of a case, except `side` and its options."""
    case: str
    device: str = "cuda"
    quick: bool = False
    steps: int = 30
    warmup: int = 5
    batch: int = 1
    seq: int = 1024
    seed: int = 0
    lr: float = 1e-4
    unet_batch: int = 0       # 0: the size's default
    unet_resolution: int = 0  # 0: the size's default
    llama: str = "1b"         # a key of LLAMA_SIZES
    pin_threads: bool = False  # pin the busy threads to cores of their own before the timed steps (pin_threads())
    pin_cores: str = ""        # their cores, comma-separated in PINNED_THREADS' order ("": pin_threads() picks)
    keep_cublas_config: bool = False  # keep CUBLAS_WORKSPACE_CONFIG set after the first step (drop_cublas_config())
    adamw: str = "single"  # the full-training cases' AdamW: one tensor at a time, foreach or fused (ADAMW_FORMS)

    def llama_size(self):
        if self.quick:
            return QUICK_LLAMA
        if self.llama not in LLAMA_SIZES:
            raise ValueError(f"unknown Llama size {self.llama!r}; the sizes are {', '.join(LLAMA_SIZES)}")
        return LLAMA_SIZES[self.llama]

    def unet_size(self):
        size = QUICK_UNET if self.quick else UNetSize()
        if self.unet_batch or self.unet_resolution:
            size = UNetSize(**{**asdict(size), "batch": self.unet_batch or size.batch,
                               "resolution": self.unet_resolution or size.resolution})
        return size


# ---------------------------------------------------------------------------------------------------------
# Llama (transformers) + LoRA (peft)
# ---------------------------------------------------------------------------------------------------------

def llama_config(size, seq):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=max(2048, seq), rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False,
        attention_dropout=0.0, attn_implementation="sdpa")


def build_llama(size, seq, device, seed, lora):
    """LlamaForCausalLM with random bf16 weights created on `device` (wrapped by peft when `lora`)."""
    from transformers import LlamaForCausalLM
    cfg = llama_config(size, seq)
    torch.manual_seed(seed)
    with torch.device(device):
        try:
            model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16)
    if next(model.parameters()).dtype != torch.bfloat16:
        model = model.to(torch.bfloat16)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"the Llama model uses attention {model.config._attn_implementation!r}, not sdpa")
    if lora:
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(seed + 7)
        lcfg = LoraConfig(r=size.lora_r, lora_alpha=2 * size.lora_r, lora_dropout=0.0, bias="none",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        model = get_peft_model(model, lcfg)
    model.train()
    return model


def llama_base(model):
    """The LlamaForCausalLM inside a peft wrapper (or the model itself)."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def llama_groups(model):
    """[(name, [modules], bwd_reads)] in forward order: the embedding, each decoder layer, the final norm + head.
    bwd_reads: whether backward reads the group's weights (an embedding's backward needs only the indices)."""
    base = llama_base(model)
    groups = [("embed", [base.model.embed_tokens], False)]
    groups += [(f"layer.{i}", [layer], True) for i, layer in enumerate(base.model.layers)]
    groups.append(("final", [base.model.norm, base.lm_head], True))
    return groups


def llama_blocks(model):
    """The decoder layers, in order: what the block swapper and accelerate's offload work on."""
    return list(llama_base(model).model.layers)


def llama_loss(model, batch, device):
    inputs, targets = (t.to(device, non_blocking=False) for t in batch)
    logits = model(input_ids=inputs, use_cache=False).logits
    # (batch*seq, vocab) float32 logits: the 2-D form of cross_entropy, whose CUDA kernels are deterministic.
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


# ---------------------------------------------------------------------------------------------------------
# UNet
# ---------------------------------------------------------------------------------------------------------

class ResBlock(nn.Module):
    """GroupNorm -> SiLU -> Conv3x3, twice, plus the input (through a 1x1 conv when the channels change)."""

    def __init__(self, cin, cout, groups):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class Downsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest x2 then Conv3x3. The nearest step is an expand + reshape, whose backward is a plain sum (no
    atomics), so it is deterministic on every device without relying on interpolate's backward."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x):
        b, c, h, w = x.shape
        x = x[:, :, :, None, :, None].expand(b, c, h, 2, w, 2).reshape(b, c, 2 * h, 2 * w)
        return self.conv(x)


class UNet(nn.Module):
    """Down path: per level, `blocks_per_level` ResBlocks (the last one's output is kept as that level's skip),
    then a strided conv (not after the last level). Middle: two ResBlocks. Up path, deepest level first: the
    level's skip concatenated on the channels, `blocks_per_level` ResBlocks, then nearest upsampling + conv to
    the next level's channels. Out: GroupNorm -> SiLU -> Conv3x3 to the input channels."""

    def __init__(self, size):
        super().__init__()
        ch, g, n = size.channels, size.groups, size.blocks_per_level
        self.stem = nn.Conv2d(size.in_channels, ch[0], 3, padding=1)
        self.down = nn.ModuleList()
        self.downsample = nn.ModuleList()
        prev = ch[0]
        for level, c in enumerate(ch):
            self.down.append(nn.ModuleList(ResBlock(prev if i == 0 else c, c, g) for i in range(n)))
            prev = c
            self.downsample.append(Downsample(c) if level < len(ch) - 1 else nn.Identity())
        self.mid = nn.ModuleList([ResBlock(prev, prev, g), ResBlock(prev, prev, g)])
        self.up = nn.ModuleList()
        self.upsample = nn.ModuleList()
        for level in reversed(range(len(ch))):
            c = ch[level]
            self.up.append(nn.ModuleList(ResBlock(prev + c if i == 0 else c, c, g) for i in range(n)))
            prev = c
            self.upsample.append(Upsample(c, ch[level - 1]) if level > 0 else nn.Identity())
            if level > 0:
                prev = ch[level - 1]
        self.out_norm = nn.GroupNorm(g, prev)
        self.out_conv = nn.Conv2d(prev, size.in_channels, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        skips = []
        for blocks, down in zip(self.down, self.downsample):
            for block in blocks:
                x = block(x)
            skips.append(x)
            x = down(x)
        for block in self.mid:
            x = block(x)
        for blocks, up in zip(self.up, self.upsample):
            x = torch.cat([x, skips.pop()], dim=1)
            for block in blocks:
                x = block(x)
            x = up(x)
        return self.out_conv(F.silu(self.out_norm(x)))


def build_unet(size, device, seed):
    torch.manual_seed(seed)
    with torch.device(device):
        model = UNet(size).to(torch.bfloat16)
    model.train()
    return model


def unet_groups(model):
    """Each conv/ResBlock module in forward order; the stem's backward does not read its weight (the input
    needs no gradient)."""
    groups = [("stem", [model.stem], False)]
    for level, (blocks, down) in enumerate(zip(model.down, model.downsample)):
        groups += [(f"down.{level}.{i}", [b], True) for i, b in enumerate(blocks)]
        if isinstance(down, Downsample):
            groups.append((f"downsample.{level}", [down], True))
    groups += [(f"mid.{i}", [b], True) for i, b in enumerate(model.mid)]
    for j, (blocks, up) in enumerate(zip(model.up, model.upsample)):
        groups += [(f"up.{j}.{i}", [b], True) for i, b in enumerate(blocks)]
        if isinstance(up, Upsample):
            groups.append((f"upsample.{j}", [up], True))
    groups.append(("out", [model.out_norm, model.out_conv], True))
    return groups


def make_image_batches(size, count, seed):
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed + 1)
    shape = (size.batch, size.in_channels, size.resolution, size.resolution)
    return [(torch.randn(shape, generator=gen).to(torch.bfloat16), torch.randn(shape, generator=gen).to(torch.bfloat16))
            for _ in range(count)]


def unet_loss(model, batch, device):
    x, target = (t.to(device) for t in batch)
    return F.mse_loss(model(x).float(), target.float())


# ---------------------------------------------------------------------------------------------------------
# One case, built
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Built:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list
    loss: callable            # loss(model, batch, device) -> scalar tensor
    groups: list              # [(name, [modules], bwd_reads)] in forward order
    blocks: list = field(default_factory=list)  # the repeated blocks a block swapper would move (Llama layers)
    describe: dict = field(default_factory=dict)
    uses_sdpa: bool = False


def llama_optimizer(model, cfg, lora):
    """The Llama cases' AdamW over the model's trainable parameters, and its description: LoRA's adapters with
    foreach, full training's in the form `cfg.adamw` names. Also for a model whose parameters were replaced
    (FSDP2's sharded ones, bench/ddp_check.py)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if lora:
        return torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True), "foreach=True"
    return full_adamw(trainable, cfg, (0.9, 0.95))


def build_case(cfg):
    """The model, optimizer, data and loss of `cfg.case`, on `cfg.device`, from `cfg.seed`."""
    device = torch.device(cfg.device)
    if cfg.case in ("llama-lora", "llama-full"):
        size = cfg.llama_size()
        lora = cfg.case == "llama-lora"
        model = build_llama(size, cfg.seq, device, cfg.seed, lora)
        opt, adamw = llama_optimizer(model, cfg, lora)
        batches = sample.make_batches(size.vocab, cfg.batch, cfg.seq, cfg.steps, cfg.seed)
        describe = {"arch": "LlamaForCausalLM (transformers, sdpa)", "size": "quick" if cfg.quick else cfg.llama,
                    **asdict(size), "batch": cfg.batch,
                    "seq": cfg.seq, "dtype": "bfloat16",
                    "training": ("LoRA r=%d on q,k,v,o (peft; adapters fp32), AdamW foreach" % size.lora_r) if lora
                    else f"full fine-tune, AdamW ({adamw}, state bf16 like the parameters)"}
        return Built(model, opt, batches, llama_loss, llama_groups(model), llama_blocks(model), describe,
                     uses_sdpa=True)
    if cfg.case == "unet":
        size = cfg.unet_size()
        model = build_unet(size, device, cfg.seed)
        opt, adamw = full_adamw(model.parameters(), cfg, (0.9, 0.99))
        batches = make_image_batches(size, cfg.steps, cfg.seed)
        describe = {"arch": "UNet (Conv2d+GroupNorm+SiLU ResBlocks, skip concatenation)", **asdict(size),
                    "dtype": "bfloat16", "training": f"full, AdamW ({adamw}, state bf16), MSE on random targets"}
        return Built(model, opt, batches, unet_loss, unet_groups(model), [], describe)
    raise ValueError(f"unknown case {cfg.case!r}; the cases are {', '.join(CASES)}")


def tensor_bytes(t):
    """The bytes `t` holds on this process's device: a DTensor's (FSDP2's sharded parameters) local shard."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def group_accounting(built):
    """Per group, in forward order: {"name", "frozen_bytes", "trainable_bytes", "grad_bytes", "state_bytes",
    "bwd_reads"}. Gradient bytes are those of the trainable parameters (same dtype); state bytes are the tensors
    the optimizer holds for them (call after at least one step; AdamW's CPU `step` counters are not counted).
    Parameters in no named group go to a last group "other"."""
    opt_state = built.optimizer.state
    seen = set()
    rows = []

    def add(name, params, bwd_reads):
        row = {"name": name, "frozen_bytes": 0, "trainable_bytes": 0, "grad_bytes": 0, "state_bytes": 0,
               "params": 0, "bwd_reads": bwd_reads}
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            row["params"] += p.numel()
            if p.requires_grad:
                row["trainable_bytes"] += tensor_bytes(p)
                row["grad_bytes"] += tensor_bytes(p)
                for key, value in opt_state.get(p, {}).items():
                    if key != "step" and torch.is_tensor(value):
                        row["state_bytes"] += tensor_bytes(value)
            else:
                row["frozen_bytes"] += tensor_bytes(p)
        rows.append(row)

    for name, modules, bwd_reads in built.groups:
        add(name, [p for m in modules for p in m.parameters()], bwd_reads)
    rest = [p for p in built.model.parameters() if id(p) not in seen]
    if rest:
        add("other", rest, True)
    return rows


# ---------------------------------------------------------------------------------------------------------
# The transient memory of a step
# ---------------------------------------------------------------------------------------------------------

class TransientMeter:
    """The peak device memory that is neither parameters, gradients nor optimizer state: activations, workspaces
    and temporaries, the memory that cannot move (CUDA only).

    max_memory_allocated minus every movable byte undercounts it when the peak comes before the gradients exist
    (full fine-tuning: the activations peak at the start of backward, when few gradients are allocated). So the
    step is cut into intervals at each gradient's arrival (a post-accumulate-grad hook on every trainable
    parameter): for each interval, its peak allocated minus the movable bytes allocated at its end (parameters,
    optimizer state, the gradients arrived so far) is a lower bound of the transient at that peak, off by at most
    one gradient. The last interval is the optimizer step. The meter resets torch's peak counter at each cut;
    `peak_allocated` keeps the overall peak. Used during the warm-up steps of the resident run only, then removed:
    its hooks cost a little time.
    """

    def __init__(self, model, optimizer, device, peak=None, reset=None):
        self.device = torch.device(device)
        # The allocator's counters; the self-test passes stand-ins to check the accounting on a CPU.
        self.peak = peak or (lambda: torch.cuda.max_memory_allocated(self.device))
        self.reset = reset or (lambda: torch.cuda.reset_peak_memory_stats(self.device))
        self.optimizer = optimizer
        self.param_bytes = sum(tensor_bytes(p) for p in model.parameters())
        self.peak_transient = 0
        self.peak_allocated = 0
        self.grad_bytes = 0
        self.state_bytes = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                        for p in model.parameters() if p.requires_grad]

    def _state_bytes(self):
        return sum(tensor_bytes(v) for st in self.optimizer.state.values() for k, v in st.items()
                   if k != "step" and torch.is_tensor(v))

    def _cut(self, movable):
        peak = self.peak()
        self.peak_allocated = max(self.peak_allocated, peak)
        self.peak_transient = max(self.peak_transient, peak - movable)
        self.reset()

    def _on_grad(self, p):
        self.grad_bytes += tensor_bytes(p.grad)
        self._cut(self.param_bytes + self.state_bytes + self.grad_bytes)

    def begin_step(self):
        self.grad_bytes = 0
        self.state_bytes = self._state_bytes()

    def end_step(self):
        """After the optimizer step and zero_grad: the optimizer interval held every gradient."""
        self._cut(self.param_bytes + self._state_bytes() + self.grad_bytes)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


# ---------------------------------------------------------------------------------------------------------
# The training loop: the same for every side
# ---------------------------------------------------------------------------------------------------------

def thread_times():
    """{tid: (name, on-CPU seconds, run-queue seconds)} for every thread of this process, from Linux's
    /proc/self/task/*/{comm,schedstat} (nanosecond counters); {} where they cannot be read."""
    out = {}
    try:
        tasks = list(pathlib.Path("/proc/self/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
            run_ns, queue_ns = (task / "schedstat").read_text().split()[:2]
        except (OSError, ValueError):
            continue  # the thread ended, or no schedstat in this kernel
        out[task.name] = (name, int(run_ns) / 1e9, int(queue_ns) / 1e9)
    return out


class ThreadClock:
    """A thread's on-CPU seconds, read from /proc/self/task/TID/schedstat (the autograd thread's, by its name);
    None where there is no such thread or no schedstat."""

    def __init__(self, name):
        self.path = next((pathlib.Path("/proc/self/task") / tid / "schedstat"
                          for tid, (n, _, _) in thread_times().items() if n == name), None)

    def __call__(self):
        if self.path is None:
            return None
        try:
            return int(self.path.read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            return None


def proc_stat_steal():
    """{"cpu": all CPUs summed, "cpu0": ..., "cpu1": ...}: the seconds of CPU time the hypervisor took, /proc/stat's
    `steal` column in USER_HZ ticks; {} where it cannot be read. A run on a machine whose host is busy loses CPU time
    it cannot see otherwise (a CPU-bound step then slows with no change of its own)."""
    out = {}
    try:
        tick = os.sysconf("SC_CLK_TCK")
        for line in pathlib.Path("/proc/stat").read_text().splitlines():
            fields = line.split()
            if fields and fields[0].startswith("cpu") and len(fields) > 8:
                out[fields[0]] = int(fields[8]) / tick
    except (OSError, ValueError):
        return {}
    return out


def cpu_steal_s(steal=None):
    """Seconds of steal of all this machine's CPUs, summed, from proc_stat_steal() (read now unless given); None
    where it cannot be read."""
    return (proc_stat_steal() if steal is None else steal).get("cpu")


def cpu_steal_by_core(steal=None):
    """{core: seconds of steal} from proc_stat_steal()'s per-CPU lines (read now unless given); {} where it cannot
    be read."""
    steal = proc_stat_steal() if steal is None else steal
    return {int(name[3:]): s for name, s in steal.items() if name != "cpu"}


def thread_time_per_step(before, after, steps):
    """Per-step CPU figures of each thread name between two thread_times() samples: {name: {"threads",
    "cpu_s", "runqueue_s"}}, by CPU time, largest first. A thread that started in between counts from zero."""
    by_name = {}
    for tid, (name, run_s, queue_s) in after.items():
        _, run0, queue0 = before.get(tid, (name, 0.0, 0.0))
        agg = by_name.setdefault(name, {"threads": 0, "cpu_s": 0.0, "runqueue_s": 0.0})
        agg["threads"] += 1
        agg["cpu_s"] += (run_s - run0) / steps
        agg["runqueue_s"] += (queue_s - queue0) / steps
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]["cpu_s"]))


# The threads pin_threads() gives a core of their own, by name, in the order they take the cores; None: the thread
# that trains (the Python thread).
PINNED_THREADS = (None, "pt_autograd_0", "layerswap-move", "layerswap-learn")


def pin_threads(cores_wanted="", log=print):
    """Gives each busy thread of this process a core of its own and every other thread the cores left, so that the
    scheduler neither moves the busy threads between cores nor puts two of them on one (--pin-threads). The cores
    are `cores_wanted` (comma-separated, in PINNED_THREADS' order) or else every other one of this process's allowed
    cores from the third, so that neighbours stay free. Returns {thread name: core}, or {} where the machine has too
    few cores."""
    cores = sorted(os.sched_getaffinity(0))
    if cores_wanted:
        wanted = [int(c) for c in cores_wanted.split(",")]
        if len(wanted) != len(PINNED_THREADS) or not set(wanted) <= set(cores):
            raise ValueError(f"--pin-cores {cores_wanted!r}: give {len(PINNED_THREADS)} of the allowed cores "
                             f"{cores}, comma-separated")
    else:
        wanted = cores[2::2][:len(PINNED_THREADS)]
    if len(wanted) < len(PINNED_THREADS):
        log(f"pin_threads: {len(cores)} cores are too few to pin {len(PINNED_THREADS)} threads; not pinned")
        return {}
    rest = [c for c in cores if c not in wanted]
    main = threading.get_native_id()
    names = {int(tid): name for tid, (name, _, _) in thread_times().items()}
    placed = {}
    for tid, name in names.items():
        key = None if tid == main else name
        if key in PINNED_THREADS and key not in placed:
            core = wanted[PINNED_THREADS.index(key)]
            placed[key] = core
        else:
            core = None
        try:
            os.sched_setaffinity(tid, {core} if core is not None else set(rest))
        except OSError:
            pass  # the thread ended
    return {("python" if k is None else k): v for k, v in placed.items()}


def note_timed_window(start, end):
    """Appends "pid start end" (CLOCK_MONOTONIC seconds) of the timed steps to the file PERF_THREADS_WINDOWS names,
    when it is set: bench/perf_threads.sh reports each process's threads over that window alone."""
    path = os.environ.get("PERF_THREADS_WINDOWS")
    if path and start is not None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {start:.6f} {end:.6f}\n")


# The rule that unsets CUBLAS_WORKSPACE_CONFIG after each side's first step is the sample's (Note
# [CUBLAS_WORKSPACE_CONFIG after the first step] in samples/train_transformer.py), so that the benchmark and the
# sample's deterministic runs keep one definition of it.
drop_cublas_config = sample.drop_cublas_config


def train(built, cfg, *, after_step=None, record=None, meter=None, log=print):
    """Trains len(built.batches) steps; returns {"losses", "losses_hex", "step_times_s", "median_step_s", ...}.
    Each step is timed between two device synchronisations; the first `cfg.warmup` steps are left out of the
    median. `after_step(step_index)` runs after each step's synchronisation, outside the timed region (the
    layerswap side snapshots its statistics there; the block swapper tunes itself after step 1). `record`, when
    given, is the dict filled step by step, so that a run that fails half-way still reports its first losses.
    `meter` (a TransientMeter) measures the warm-up steps and is removed before the timed ones."""
    device = torch.device(cfg.device)
    on_cuda = device.type == "cuda"

    def sync():
        if on_cuda:
            torch.cuda.synchronize(device)

    model, opt = built.model, built.optimizer
    record = {} if record is None else record
    losses = record.setdefault("losses", [])
    losses_hex = record.setdefault("losses_hex", [])
    times = record.setdefault("step_times_s", [])
    # Each step's tail: how much longer the device synchronisation took than the synchronisation of the stream the
    # step ran on (work on other streams: layerswap's copies for the next step, a block swapper's side stream).
    tails = record.setdefault("tail_times_s", [])
    # Where the launching threads' time goes within a step: wall, main-thread CPU and autograd-thread CPU seconds of
    # the forward pass (the loss issued), the backward pass (backward() returned: the autograd thread has issued it)
    # and the rest (optimizer, zero_grad), each as [wall, main thread CPU, autograd thread CPU (None: unknown)].
    # The autograd thread's clock is two reads of a /proc file inside the step (~20 us, the same on every side).
    phases = record.setdefault("phase_times_s", [])
    autograd_clock = None

    def spent(a, b):
        return None if a is None or b is None else b - a

    issue = record.setdefault("issue_times_s", [])  # step start -> all work enqueued (the launching thread's time)
    cpu = record.setdefault("cpu_times_s", [])      # the launching thread's CPU time in the step
    threads_before, steal_before, window_start, core_steal_before = {}, None, None, {}
    for step, batch in enumerate(built.batches):
        if step == cfg.warmup:
            if cfg.pin_threads:
                record["pinned_threads"] = pin_threads(cfg.pin_cores, log)
            threads_before = thread_times()
            steal = proc_stat_steal()
            steal_before, core_steal_before = cpu_steal_s(steal), cpu_steal_by_core(steal)
            window_start = time.monotonic()
        if step == 1 or (step == cfg.warmup and autograd_clock is not None and autograd_clock.path is None):
            autograd_clock = ThreadClock("pt_autograd_0")  # the CUDA device's autograd thread, made by step 0
        metering = meter is not None and step < cfg.warmup
        if meter is not None and step == cfg.warmup:
            meter.remove()
        sync()
        a0 = autograd_clock() if autograd_clock else None
        t0 = time.perf_counter()
        c0 = time.thread_time()
        if metering:
            meter.begin_step()
        with attention_backends() if built.uses_sdpa else contextlib.nullcontext():  # a fresh one each step
            loss = built.loss(model, batch, device)
        t1, c1 = time.perf_counter(), time.thread_time()
        a1 = autograd_clock() if autograd_clock else None
        loss.backward()
        t2, c2 = time.perf_counter(), time.thread_time()
        a2 = autograd_clock() if autograd_clock else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3, c3 = time.perf_counter(), time.thread_time()
        a3 = autograd_clock() if autograd_clock else None
        phases.append([[t1 - t0, c1 - c0, spent(a0, a1)], [t2 - t1, c2 - c1, spent(a1, a2)],
                       [t3 - t2, c3 - c2, spent(a2, a3)]])
        if metering:
            meter.end_step()
        issue.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        if on_cuda:
            torch.cuda.current_stream(device).synchronize()
        stream_done = time.perf_counter() - t0
        sync()
        dt = time.perf_counter() - t0
        tails.append(dt - stream_done)
        value = loss.item()
        del loss
        if not math.isfinite(value):
            raise FloatingPointError(f"loss is {value} at step {step + 1}")
        losses.append(value)
        losses_hex.append(float(value).hex())
        times.append(dt)
        log(f"step {step + 1:3d}/{len(built.batches)}  loss {value:.6f}  time {dt:.4f} s")
        if after_step is not None:
            after_step(step)
        if step == 0 and on_cuda:
            record["cublas_workspace_config"] = (
                f"kept {os.environ.get('CUBLAS_WORKSPACE_CONFIG', 'unset')}: --keep-cublas-config"
                if cfg.keep_cublas_config else drop_cublas_config(device))
    warmup = min(cfg.warmup, max(0, len(times) - 1))
    timed = times[warmup:]
    note_timed_window(window_start, time.monotonic())
    if threads_before and len(times) > cfg.warmup:
        # Every thread's CPU over the timed steps: the Python thread, PyTorch's autograd thread, layerswap's.
        record["threads_per_step"] = thread_time_per_step(threads_before, thread_times(), len(times) - cfg.warmup)
        steal = proc_stat_steal()
        steal_after = cpu_steal_s(steal)
        if steal_before is not None and steal_after is not None:
            record["steal_s_per_step"] = (steal_after - steal_before) / (len(times) - cfg.warmup)
        # The steal on the cores of the pinned threads (--pin-threads): the launching threads' own losses.
        core_steal_after = cpu_steal_by_core(steal)
        pinned = record.get("pinned_threads") or {}
        record["steal_s_per_step_by_thread"] = {
            name: (core_steal_after[core] - core_steal_before[core]) / (len(times) - cfg.warmup)
            for name, core in pinned.items() if core in core_steal_before and core in core_steal_after}
    record["warmup"] = warmup
    record["median_step_s"] = statistics.median(timed) if timed else None
    record["median_issue_s"] = statistics.median(issue[warmup:]) if timed else None
    record["median_cpu_s"] = statistics.median(cpu[warmup:]) if timed else None
    record["median_tail_s"] = statistics.median(tails[warmup:]) if timed else None
    if timed:
        record["median_phase_s"] = median_phases(phases[warmup:])
    return record

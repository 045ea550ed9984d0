"""The peers layerswap is measured against in bench/swap.py: hand-written offloaders that need per-model code.

BlockSwapper: a hook-based block swapper, the method of kohya's --blocks_to_swap, diffusers' group offloading
and Axolotl's layer offloading, written here and tuned:

  - The frozen weights of each swapped block live in pinned host memory; the block's parameters point at an
    empty placeholder between uses. Trainable parameters (LoRA adapters) never move.
  - One side stream copies host -> device. A block's device copy is allocated on the compute stream (so the
    caching allocator's stream-ordered reuse covers it) and the side stream waits for the compute stream's
    work issued so far before writing it (Note [Copy after reuse]); the compute stream waits for the copy's
    event before the block runs.
  - One-block prefetch along the step's cyclic schedule forward(0..L-1), backward(L-1..0): when block i starts
    (forward pre-hook) or its backward starts (a hook on the gradient of its output), the next swapped block of
    the schedule is prefetched and every other swapped copy is dropped. At the two turnarounds the block in hand
    is also the next one needed, so it stays (the last forward block serves backward; backward's last block
    serves the next forward).
  - `torch.autograd.graph.saved_tensors_hooks` while the model runs: a saved tensor whose storage is a swapped
    block's device copy (a weight, or a view of it such as weight.t()) is saved as a handle (block, parameter,
    size, stride, offset) and rebuilt from the re-loaded copy in backward. Without this, autograd's saved views
    keep every block's device copy alive until backward and nothing is saved (see ../shared/DESIGN.md, "Peers
    measured").
  - As many blocks as the VRAM cap allows stay resident (the first ones); `keep_resident()` grows that set once
    a measured step shows the headroom.

On a CPU device the same code runs with plain copies and no streams: a check of its logic (bit-identical
losses, copies really freed), not of its speed.

accelerate_offload(): accelerate's `cpu_offload` on the frozen submodules (base Linear layers, MLP, norms) of
each offloaded decoder layer, execution device the GPU; the LoRA adapters stay on the GPU so they train (offloading
the whole layer would overwrite the adapters from accelerate's CPU copy at every forward). The CPU state dict
is pinned, which accelerate allows through its `state_dict` argument (faster copies than pageable memory).
accelerate keeps nothing from autograd's saved tensors, so its device copies live until backward: expect little
memory saved. That is the peer as it is; the harness reports its peak honestly.
"""

import weakref

import torch


class BlockSwapper:
    """Swaps the frozen weights of `blocks[i]` for i in `swapped` between pinned host memory and `device`.

    Install with `attach(model)` before training: it registers the hooks on the blocks and wraps `model`'s
    forward in the saved-tensor hooks. The training loop does not change.
    """

    def __init__(self, blocks, swapped, device):
        self.blocks = list(blocks)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device  # with its index: saved tensors are matched by device
        self.cuda = device.type == "cuda"
        self.swapped = set()
        self.host = {}          # block index -> [(param, pinned host tensor)]
        self.loaded = {}        # block index -> [device tensors], in the order of self.host[i]
        self.inflight = {}      # block index -> ([device tensors], copy-done event or None)
        self.owner = {}         # storage data_ptr of a loaded device copy -> (block index, param position)
        self.schedule = [("f", i) for i in range(len(self.blocks))] + \
                        [("b", i) for i in reversed(range(len(self.blocks)))]
        self.position = {entry: k for k, entry in enumerate(self.schedule)}
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.main = torch.cuda.current_stream(self.device) if self.cuda else None
        self.counters = {"loads": 0, "demand_loads": 0, "bytes_h2d": 0, "saved_handles": 0}
        self._copies = []       # (block, weak reference to a device copy's storage), for live_copies()
        self._handles = []
        self._hooks_ctx = None
        for i in sorted(swapped):
            self._offload(i)

    # --- residency ---------------------------------------------------------------------------------------

    def _frozen(self, i):
        return [p for p in self.blocks[i].parameters() if not p.requires_grad]

    def _placeholder(self, p):
        return torch.empty(0, dtype=p.dtype, device=self.device)

    def _offload(self, i):
        """Block i becomes swapped: a pinned host copy of each frozen weight, the device copy released."""
        pairs = []
        for p in self._frozen(i):
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=self.cuda)
            host.copy_(p.detach())
            pairs.append((p, host))
            p.data = self._placeholder(p)
        self.host[i] = pairs
        self.swapped.add(i)

    def keep_resident(self, indices):
        """Blocks in `indices` stop swapping: their weights are copied to the device for good."""
        for i in sorted(indices):
            if i not in self.swapped:
                continue
            self._use(i, prefetch_next=False)
            tensors = self.loaded.pop(i)
            for (p, _), t in zip(self.host[i], tensors):
                self.owner.pop(t.untyped_storage().data_ptr(), None)
                p.data = t
            del self.host[i]
            self.swapped.discard(i)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def block_bytes(self, i):
        """Bytes of block i's frozen weights (what a swap moves)."""
        return sum(p.numel() * p.element_size() for p in self._frozen(i)) if i not in self.host else \
            sum(h.numel() * h.element_size() for _, h in self.host[i])

    def _prefetch(self, i):
        if i not in self.swapped or i in self.loaded or i in self.inflight:
            return
        hosts = [h for _, h in self.host[i]]
        if self.cuda:
            # Note [Copy after reuse]: the copies are allocated from the compute stream's pool, so they may reuse
            # memory that kernels already issued on the compute stream still read (a block dropped just now).
            # The side stream therefore waits for the compute stream's work issued so far before writing.
            # The backward hooks run on autograd's thread: name the stream. Under use_deterministic_algorithms,
            # torch.empty fills new memory with NaN (a kernel per tensor); the copy overwrites all of it anyway.
            fill = torch.utils.deterministic.fill_uninitialized_memory
            torch.utils.deterministic.fill_uninitialized_memory = False
            try:
                with torch.cuda.stream(self.main):
                    tensors = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in hosts]
            finally:
                torch.utils.deterministic.fill_uninitialized_memory = fill
            self.side.wait_stream(self.main)
            with torch.cuda.stream(self.side):
                for t, h in zip(tensors, hosts):
                    t.copy_(h, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.side)
        else:
            tensors = [h.clone() for h in hosts]
            done = None
        # Weak references to the storages (PyTorch keeps one Python object per storage while anything, a saved
        # view included, holds it): alive exactly as long as the device memory is.
        if len(self._copies) > 4096:
            self.live_copies()  # prunes the dead references
        self._copies += [(i, weakref.ref(t.untyped_storage())) for t in tensors]
        self.counters["loads"] += 1
        self.counters["bytes_h2d"] += sum(h.numel() * h.element_size() for h in hosts)
        self.inflight[i] = (tensors, done)

    def _drop(self, i):
        for (p, _), t in zip(self.host[i], self.loaded.pop(i)):
            self.owner.pop(t.untyped_storage().data_ptr(), None)
            p.data = self._placeholder(p)

    def _next_swapped(self, entry):
        """The next swapped block of the cyclic schedule after `entry` that is not entry's own block."""
        n = len(self.schedule)
        k = self.position[entry]
        for step in range(1, n + 1):
            phase, j = self.schedule[(k + step) % n]
            if j != entry[1] and j in self.swapped:
                return j
        return None

    def _use(self, i, phase="f", prefetch_next=True):
        """Block i is about to run (forward or backward): make it resident, drop the rest, prefetch the next."""
        if i not in self.swapped:
            return
        nxt = self._next_swapped((phase, i)) if prefetch_next else None
        for j in list(self.loaded):
            if j != i and j != nxt:
                self._drop(j)
        if i not in self.loaded:
            if i not in self.inflight:
                self.counters["demand_loads"] += 1
                self._prefetch(i)
            tensors, done = self.inflight.pop(i)
            if done is not None:
                self.main.wait_event(done)
            for k, ((p, _), t) in enumerate(zip(self.host[i], tensors)):
                p.data = t
                self.owner[t.untyped_storage().data_ptr()] = (i, k)
            self.loaded[i] = tensors
        if nxt is not None:
            self._prefetch(nxt)

    def live_copies(self):
        """How many swapped blocks have a device copy alive (a check that drops really free memory)."""
        self._copies = [(i, r) for i, r in self._copies if r() is not None]
        return len({i for i, _ in self._copies if i in self.swapped})

    # --- saved tensors -----------------------------------------------------------------------------------

    def _pack(self, t):
        owner = self.owner.get(t.untyped_storage().data_ptr()) if t.device == self.device else None
        if owner is None:
            return t
        self.counters["saved_handles"] += 1
        return ("block_swapper_handle", owner[0], owner[1], tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] == "block_swapper_handle"):
            return packed
        _, i, k, shape, stride, offset = packed
        if i not in self.loaded:  # backward reached it before its output hook: load it now
            self._use(i, "b")
        base = self.loaded[i][k]
        return base.as_strided(shape, stride, offset)

    # --- hooks -------------------------------------------------------------------------------------------

    def attach(self, model):
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._make_pre_hook(i)))
            self._handles.append(block.register_forward_hook(self._make_post_hook(i)))
        self._handles.append(model.register_forward_pre_hook(self._enter_saved_hooks))
        self._handles.append(model.register_forward_hook(self._exit_saved_hooks))
        return self

    def detach(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _enter_saved_hooks(self, module, args):
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()

    def _exit_saved_hooks(self, module, args, output):
        ctx, self._hooks_ctx = self._hooks_ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _make_pre_hook(self, i):
        def pre_hook(module, args):
            self._use(i, "f")
        return pre_hook

    def _make_post_hook(self, i):
        def on_grad(grad):
            self._use(i, "b")

        def post_hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(out) and out.requires_grad:
                out.register_hook(on_grad)
        return post_hook


def plan_resident_blocks(block_bytes, cap_weight_bytes, in_flight=2):
    """How many blocks to keep resident when `cap_weight_bytes` of device memory is left for the blocks' frozen
    weights: `in_flight` swapped copies (the one in use and the one being prefetched) come first. Returns k with
    k * block_bytes + in_flight * block_bytes <= cap_weight_bytes when at least one block is swapped; all blocks
    when they all fit."""
    n = len(block_bytes)
    if n == 0:
        return 0
    size = max(block_bytes)
    if sum(block_bytes) <= cap_weight_bytes:
        return n
    k = int((cap_weight_bytes - in_flight * size) // size)
    return max(0, min(n - 1, k))


def accelerate_offload(blocks, offloaded, device):
    """accelerate.cpu_offload on every submodule of the offloaded blocks whose own parameters are all frozen.
    Returns the number of submodules hooked."""
    from accelerate import cpu_offload

    hooked = 0
    for i in sorted(offloaded):
        for sub in blocks[i].modules():
            own = list(sub.parameters(recurse=False))
            if not own or any(p.requires_grad for p in own):
                continue
            state = {}
            for name, p in sub.named_parameters(recurse=False):
                host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=torch.device(device).type == "cuda")
                host.copy_(p.detach())
                state[name] = host
            cpu_offload(sub, execution_device=torch.device(device), state_dict=state)
            hooked += 1
    return hooked

"""Device memory of one traced micro-batch: what it saves for backward, and its live peak.

The tracer runs the step on a CPU under fake tensors, so the bytes are those of the real tensors
the step creates. Two meters watch the same run:

- saved for backward (``pack``, a saved-tensors hook): each local storage once, weights
  excluded; summed at the end of the forwards (``end_forward``) it is the activation memory one
  micro-batch keeps alive until its backward, the unit the pipeline schedule multiplies by the
  micro-batches in flight;
- live (``__torch_dispatch__``): every storage an op creates during the micro-batch, from its
  creation until it is freed (a weak reference on the storage; FSDP2 frees and re-allocates its
  unsharded parameters with ``UntypedStorage.resize_``, which is watched too). The peak of the
  live bytes over the forwards and backwards is the micro-batch's peak: saved activations plus the
  working memory of the op at the worst moment (logits and the loss in fp32, the gradients of the
  layer being back-propagated, a recomputed layer, FSDP's gathered parameters).

The allocations and frees also run through a model of PyTorch's caching allocator (``replay``,
two micro-batches in a row): what it reserves beyond the live peak is the fragmentation that
``torch.cuda.max_memory_reserved`` shows on top of ``max_memory_allocated``.

Storages that outlive the micro-batch as part of the rank's state are left out of both: the
parameters and the model's buffers (llama's RoPE tables: the meter is given them, and they are
counted with the parameters, data_parallel.buffer_bytes), the parameters' gradients (Megatron accumulates them into its gradient buffer, FSDP keeps the
reduced shard; data_parallel.memory_model counts them), the cached FP8 weight copies
(fp8.cached_weight_bytes) and, where FSDP2 keeps a pipeline stage gathered for the whole step
(``unsharded_is_state``, fsdp.resident_unsharded), its gathered parameters. Views share their
storage and are counted once; fake tensors' ``wait_tensor`` returns a copy where a GPU returns
its input, so the two count as one buffer.

What a GPU runs differs from the CPU path in these places, and the meter counts what the GPU
keeps (``KERNELS``); each rule applies only where its pattern occurs:

- fused RMSNorm (any module whose class name ends in ``RMSNorm``: torch's, transformers'): on
  CUDA ``F.rms_norm`` is one ``_fused_rms_norm`` kernel that saves its input and one fp32
  reciprocal RMS per row (torch's ``rms_norm_symint`` dispatch; Transformer Engine's RMSNorm and
  Inductor's fused norm save the same); the CPU composite, like transformers' eager
  ``LlamaRMSNorm``, saves an fp32 copy of the input and the fp32 normalized tensor, 4x the bytes.
  Norms that already run a fused op saving their input (echo.training.fused) are left as they are;
- fused SwiGLU: ``silu(gate) * up`` is one kernel in Megatron-Core (``bias_swiglu_impl``),
  Transformer Engine and Inductor (torch.compile); it keeps ``gate`` and ``up`` (the fc1 output)
  and not the silu output that eager PyTorch keeps for the product's backward;
- native GQA (``native_gqa``, Megatron-Core with Transformer Engine / flash-attention): the
  attention kernel reads the kv_heads key and value heads itself, so keys and values expanded to
  every query head before it (``repeat_interleave``) are not in memory; torchtitan's
  ``repeat_kv`` materializes them (eager and compiled alike), so there they count;
- attention output layout: CUDA's attention kernels (flash, cuDNN, memory-efficient, TE) write
  their output as [batch, seq, heads, dim] and return the [batch, heads, seq, dim] view, so the
  ``transpose(1, 2).reshape(b, s, -1)`` before the output projection is a view there; the CPU
  kernel writes [batch, heads, seq, dim] and the reshape copies it (the copy, which the output
  projection saves, is the attention output's own bytes on a GPU);
- value head size (MLA: DeepSeek's query / key heads of 192, value heads of 128): the CPU kernel
  takes one head size, so the tracer pads the values (marked ``echo_head_dim``); Transformer
  Engine's and FlashAttention-3's kernels take the two sizes, so the padded values and the
  kernel's output count at the value head's size.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from echo.trace.recorder import _SHARDING_PROP_DEPTH

KERNELS = ("fused_rmsnorm", "fused_swiglu", "native_gqa", "attention_layout", "value_head")
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_SILU = {F.silu, torch.nn.functional.silu}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_RESHAPE = {torch.Tensor.reshape, torch.reshape, torch.Tensor.contiguous, torch.Tensor.flatten, torch.flatten}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _key(t: torch.Tensor) -> int:
    return _local(t).untyped_storage()._cdata


@dataclass
class _Entry:
    id: int            # in creation order (storage addresses are reused once freed)
    nbytes: int        # the storage's size as allocated
    effective: int     # what the GPU holds for it (the kernel rules may lower it)
    saved: bool = False
    alive: bool = True
    weight: bool = False  # a parameter (FSDP2's gathered unsharded ones): never an activation
    pending: bool = False  # created inside a fused-kernel region that has not ended yet


class MemoryMeter(TorchDispatchMode):
    """Saved-for-backward and live bytes of one micro-batch (see the module docstring).

    ``params``: the rank's parameters as it stores them (their storages are state, not
    activations). ``native_gqa``: the attention kernel takes grouped key/value heads (Megatron /
    TE); ``gqa``: query heads per key/value head of the model. Use as
    ``with meter, meter.functions(): ...`` around the micro-batch, with ``pack`` as the
    saved-tensors hook, ``end_forward()`` between the forwards and the backwards and
    ``finish(exclude)`` after it."""

    def __init__(self, params: Iterable[torch.Tensor], *, native_gqa: bool = False, gqa: int = 1,
                 unsharded_is_state: bool = False, expandable_segments: bool = False, recorder=None):
        super().__init__()
        self.params = {_key(p) for p in params}
        self.native_gqa, self.gqa = native_gqa, max(1, gqa)
        # FSDP2's gathered parameters are state for the whole step (torchtitan under PP:
        # fsdp.resident_unsharded), not working memory
        self.unsharded_is_state = unsharded_is_state
        self.expandable_segments = expandable_segments  # the caching allocator's setting (replay)
        self.recorder = recorder  # the tracer's Recorder, which counts DTensor-level calls
        self.entries: dict[int, _Entry] = {}      # live storages by address
        self.refs: dict[int, weakref.ref] = {}
        self.events: list[tuple[int, int]] = []  # (entry id, change of its effective bytes)
        self.region: list[_Entry] | None = None   # entries created inside a fused-kernel region
        self.silu: dict[int, _Entry] = {}         # silu outputs not yet multiplied, by address
        self.attn_out: dict[int, _Entry] = {}     # attention kernels' outputs, by address
        self.saved_at_end_of_forward: dict[int, int] | None = None  # entry id -> bytes
        self.chunk_saved: list[dict[int, int]] = []  # per chunk, what its forward saved
        self._resize = None
        self._hooks = ()
        self._norm_input = None
        self.refs_made: list[_Entry] = []
        # with the recorder labelling layers (echo.trace.template): each event's (block, layer),
        # and each entry's where it was made
        labelled = recorder is not None and recorder._layer_nodes is not None
        self.event_labels: list[tuple[str, int]] | None = [] if labelled else None
        self.entry_labels: list[tuple[str, int]] | None = [] if labelled else None

    # -- bookkeeping ------------------------------------------------------------------------
    def _emit(self, e: _Entry, delta: int) -> None:
        if delta:
            self.events.append((e.id, delta))
            if self.event_labels is not None:
                self.event_labels.append(self._label())

    def _label(self) -> tuple[str, int]:
        """(block, layer) of what runs now, as the recorder labels ops (Recorder.label_layers);
        block "end": after the backwards (the micro-batch's last references let go)."""
        rec = self.recorder
        if rec.ctx.phase != "forward":
            return "backward", rec._layer_now()
        return ("end" if self.saved_at_end_of_forward is not None else "forward"), rec._layer_now()

    def _track(self, t: torch.Tensor, func=None) -> None:
        local = _local(t)
        if local.device.type == "meta":
            return
        st = local.untyped_storage()
        key = st._cdata
        if key in self.params or key in self.entries or st.nbytes() == 0:
            return
        e = self.entries[key] = _Entry(len(self.refs_made), st.nbytes(), st.nbytes(),
                                       weight=isinstance(t, nn.Parameter))
        self.refs_made.append(e)
        if self.entry_labels is not None:
            self.entry_labels.append(self._label())
        self.refs[key] = weakref.ref(st, lambda _, key=key, e=e: self._freed(key, e))
        if self.region is not None:
            e.pending = True
            self.region.append(e)  # emitted when the region ends, with what the kernel keeps
        else:
            self._emit(e, e.effective)

    def _freed(self, key: int, e: _Entry) -> None:
        if self.entries.get(key) is e:
            del self.entries[key]
            self.refs.pop(key, None)
        if self.silu.get(key) is e:
            del self.silu[key]
        if self.attn_out.get(key) is e:
            del self.attn_out[key]
        if not e.alive:
            return
        e.alive = False
        if e.pending:
            return  # born and dead inside one fused kernel: never in device memory
        self._emit(e, -e.effective)

    def _set_effective(self, e: _Entry, value: int) -> None:
        if e.alive and not e.pending:
            self._emit(e, value - e.effective)
        e.effective = value

    # -- hooks --------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks pack: mark the storage as saved for backward."""
        base = t._base if t._is_view() else t
        e = self.entries.get(_key(t))
        if e is None:
            return t
        if isinstance(base, nn.Parameter):  # weights (FSDP's gathered ones too) are not activations
            e.weight, e.saved = True, False
            if self.unsharded_is_state:
                self._set_effective(e, 0)
        elif not e.weight:
            e.saved = True
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # DTensor runs it as local ops, which come back here. The recorder below never sees
            # the DTensor-level call once this mode has declined it, so it is told here.
            if self.recorder is not None:
                _note_dtensor_call(self.recorder)
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if _SHARDING_PROP_DEPTH[0]:  # DTensor's shape propagation at global shapes allocates nothing
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, func)
        if func is _WAIT and isinstance(args[0], torch.Tensor):
            # on a GPU wait_tensor returns its input; fake tensors return a copy: one buffer
            src, dst = self.entries.get(_key(args[0])), self.entries.get(_key(out))
            if src is not None and dst is not None and src is not dst:
                self._set_effective(src, 0)
        return out

    def __enter__(self):
        meter, original = self, torch.UntypedStorage.resize_

        def resize_(st, size):  # FSDP2 frees (size 0) and re-allocates unsharded parameters
            e = meter.entries.get(st._cdata)
            out = original(st, size)
            if e is not None and e.alive:
                if meter.unsharded_is_state and e.weight:
                    return out
                new = st.nbytes()
                meter._set_effective(e, new)
                e.nbytes = new
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        self._hooks = (nn.modules.module.register_module_forward_pre_hook(self._norm_pre),
                       nn.modules.module.register_module_forward_hook(self._norm_post))
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def functions(self) -> _KernelRules:
        """The torch-function mode that applies the GPU kernel rules (``KERNELS``)."""
        return _KernelRules(self)

    # -- fused RMSNorm: the module's forward is one kernel ---------------------------------------
    def _norm_pre(self, module, args):
        if self.region is None and type(module).__name__.endswith("RMSNorm") and args:
            x = _local(args[0])
            self.region = []
            self._norm_input = (module, x.numel(), x.element_size(), x.shape[-1], self.entries.get(_key(x)))

    def _norm_post(self, module, args, out):
        if self.region is None or self._norm_input is None or self._norm_input[0] is not module:
            return
        (_, numel, size, width, source), region = self._norm_input, self.region
        self.region, self._norm_input = None, None
        keep = _key(out) if isinstance(out, torch.Tensor) else None
        # a fused kernel already (echo::rms_norm) saved its input and its 1/rms: nothing to change
        fused = source is not None and source.saved
        want = numel * size + 4 * (numel // max(1, width))  # the input and fp32 1/rms per row
        for e in region:
            e.pending = False
            if not e.alive:
                continue
            if not fused and (keep is None or self.entries.get(keep) is not e):
                e.effective, want = want, 0  # what the fused kernel saves, on the composite's kept storages
            self._emit(e, e.effective)

    # -- results ------------------------------------------------------------------------------
    def _saved_now(self) -> dict[int, int]:
        return {e.id: e.effective for e in self.entries.values() if e.saved and e.alive and not e.weight}

    def end_chunk(self) -> None:
        """After one chunk's forward: what it saved, beyond the chunks before it."""
        before = set().union(*self.chunk_saved) if self.chunk_saved else set()
        self.chunk_saved.append({k: v for k, v in self._saved_now().items() if k not in before})

    def end_forward(self) -> None:
        """Snapshot what the forwards saved for backward (the activation memory)."""
        self.saved_at_end_of_forward = self._saved_now()

    def _excluded(self, exclude: Iterable[torch.Tensor]) -> set[int]:
        return {self.entries[k].id for t in exclude if (k := _key(t)) in self.entries}

    def labelled(self, exclude: Iterable[torch.Tensor] = ()) -> dict[str, list[dict]]:
        """The events and entries with their (block, layer) labels (``finish``'s inputs), as
        layer templates compose them (echo.trace.memory_template); ``exclude`` as for finish."""
        out = self._excluded(exclude)
        final = self.saved_at_end_of_forward or {}
        chunk = {k: c for c, ids in enumerate(self.chunk_saved) for k in ids}
        events = [{"id": k, "delta": d, "block": b, "layer": lab}
                  for (k, d), (b, lab) in zip(self.events, self.event_labels, strict=True) if k not in out]
        entries = [{"id": i, "block": b, "layer": lab, "final_bytes": final.get(i, 0), "chunk": chunk.get(i, -1),
                    "excluded": i in out} for i, (b, lab) in enumerate(self.entry_labels)]
        return {"mem_events": events, "mem_entries": entries}

    def finish(self, exclude: Iterable[torch.Tensor] = ()) -> MeterResult:
        """Saved and peak bytes, leaving out the storages of ``exclude`` (state kept elsewhere;
        they must still be alive)."""
        out = self._excluded(exclude)
        final = self.saved_at_end_of_forward or {}
        saved = sum(v for k, v in final.items() if k not in out)
        # a chunk's storages as they stand at the end of the forwards (the kernel rules may have
        # changed them since the chunk ended)
        per_chunk = tuple(sum(final.get(k, 0) for k in c if k not in out) for c in self.chunk_saved)
        events = [(k, d) for k, d in self.events if k not in out]
        live = peak = 0
        for _, delta in events:
            live += delta
            peak = max(peak, live)
        cache = replay(events, expandable=self.expandable_segments)
        return MeterResult(saved_bytes=saved, peak_bytes=max(peak, saved), chunk_bytes=per_chunk,
                           reserved_bytes=max(peak, saved) + cache.peak_reserved - cache.peak_allocated)

def _note_dtensor_call(rec) -> None:
    """What Recorder.__torch_dispatch__ does for a top-level DTensor call (it counts the calls a
    kernel stands for, echo.trace.recorder), for the calls this mode declines before it."""
    if rec._depth or rec._muted or _SHARDING_PROP_DEPTH[0]:
        return
    task = (rec.ctx.phase, rec.ctx.chunk)
    if rec._dtensor_calls and rec._dtensor_task != task:
        rec._settle_dtensor_calls()
    rec._dtensor_calls += 1
    rec._dtensor_task = task


@dataclass(frozen=True)
class MeterResult:
    saved_bytes: int  # saved for backward by one micro-batch, all its chunks
    peak_bytes: int   # most bytes the micro-batch held at once (saved + working memory)
    chunk_bytes: tuple[int, ...] = ()  # saved_bytes split by chunk
    reserved_bytes: int = 0  # peak_bytes plus what the caching allocator holds unallocated at its peak


class _KernelRules(TorchFunctionMode):
    """Applies ``KERNELS`` to the meter from the torch-level calls (see the module docstring)."""

    def __init__(self, meter: MemoryMeter):
        super().__init__()
        self.meter = meter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        m = self.meter
        out = func(*args, **kwargs)
        if func in _SILU and isinstance(out, torch.Tensor) and (e := m.entries.get(_key(out))) is not None:
            m.silu[_key(out)] = e
        elif func in _MUL and m.silu:
            for a in args:
                if isinstance(a, torch.Tensor) and (e := m.silu.pop(_key(a), None)) is not None:
                    m._set_effective(e, 0)  # the fused SwiGLU kernel never writes it
        elif func is F.scaled_dot_product_attention:
            if m.native_gqa and m.gqa > 1:
                self._grouped_kv(args, kwargs)
            if isinstance(out, torch.Tensor) and (e := m.entries.get(_key(out))) is not None:
                m.attn_out[_key(out)] = e
                self._value_head(args, kwargs, e)
        elif func in _RESHAPE and m.attn_out and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            src, dst = m.attn_out.get(_key(args[0])), m.entries.get(_key(out))
            if src is not None and dst is not None and dst is not src and dst.nbytes in (src.nbytes, src.effective):
                m._set_effective(dst, 0)  # a view of the kernel's [b, s, h, d] output on a GPU
        return out

    def _value_head(self, args, kwargs, out: _Entry) -> None:
        """MLA's value heads, padded to the query head size for the CPU kernel (``echo_head_dim``:
        their own size): the GPU kernel reads them unpadded and writes outputs of their size."""
        m = self.meter
        v = args[2] if len(args) > 2 else kwargs["value"]
        d_v = getattr(v, "echo_head_dim", None)
        if not d_v or d_v >= v.shape[-1]:
            return
        for e in (m.entries.get(_key(v)), out):
            if e is not None and e.effective == e.nbytes:
                m._set_effective(e, e.nbytes * d_v // v.shape[-1])

    def _grouped_kv(self, args, kwargs):
        m = self.meter
        q = args[0] if args else kwargs["query"]
        k = args[1] if len(args) > 1 else kwargs["key"]
        v = args[2] if len(args) > 2 else kwargs["value"]
        if k.dim() < 3 or k.shape[-3] != q.shape[-3]:
            return  # already grouped: nothing was expanded
        for t in (k, v):
            e = m.entries.get(_key(t))
            if e is not None and e.effective == e.nbytes:
                m._set_effective(e, e.nbytes // m.gqa)


# --- PyTorch's CUDA caching allocator ---------------------------------------------------------
# c10/cuda/CUDACachingAllocator.cpp (expandable_segments off, PyTorch's default): sizes rounded
# to 512 B; requests up to 1 MiB are served from 2 MiB segments, up to 10 MiB from 20 MiB ones,
# larger ones from segments of their size rounded to 2 MiB; a request takes the smallest cached
# free block that holds it (best fit), split when more than 1 MiB (small pool: 512 B) is left;
# freed blocks merge with free neighbours of their segment and stay cached (reserved). With
# expandable_segments:True each pool is one virtual segment that grows by mapping pages (2 MiB for
# the small pool, 20 MiB for the large one) at its end, so that free blocks merge across what
# would have been separate segments and a free tail is extended instead of left behind.
MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER = 512, 1 << 20, 2 << 20
LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE = 20 << 20, 10 << 20, 2 << 20


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocator:
    """Replays allocations and frees through the caching allocator's rules (above) and tracks
    the bytes it reserves from the device (``peak_reserved``) beside those allocated."""

    def __init__(self, expandable: bool = False):
        import bisect

        self._bisect = bisect
        self.expandable = expandable
        self.pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self.by_key: dict[tuple[int, int, int], _Block] = {}
        self.segments = 0
        self.tail: dict[bool, _Block | None] = {True: None, False: None}  # expandable: each pool's last block
        self.reserved = self.peak_reserved = self.allocated = self.peak_allocated = 0

    def _grow(self, size: int, small: bool) -> _Block:
        """A free block of at least ``size`` at the end of the pool's expandable segment."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        last = self.tail[small]
        if last is not None and last.free:
            self._remove(last)
            mapped = page * -(-(size - last.size) // page)
            last.size += mapped
            b = last
        else:
            mapped = page * -(-size // page)
            segment = self.segments if last is None else last.segment
            self.segments += last is None
            b = _Block(segment, 0 if last is None else last.offset + last.size, mapped, small, True, last)
            if last is not None:
                last.next = b
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return b

    @staticmethod
    def round_size(size: int) -> int:
        return MIN_BLOCK * max(1, -(-size // MIN_BLOCK))

    @staticmethod
    def segment_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return ROUND_LARGE * -(-size // ROUND_LARGE)

    def _insert(self, b: _Block) -> None:
        self._bisect.insort(self.pools[b.small], b.key)
        self.by_key[b.key] = b

    def _remove(self, b: _Block) -> None:
        pool = self.pools[b.small]
        del pool[self._bisect.bisect_left(pool, b.key)]
        del self.by_key[b.key]

    def malloc(self, size: int) -> _Block:
        size = self.round_size(size)
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        i = self._bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            b = self.by_key[pool[i]]
            self._remove(b)
        elif self.expandable:
            b = self._grow(size, small)
        else:
            b = _Block(self.segments, 0, self.segment_size(size), small)
            self.segments += 1
            self.reserved += b.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = b.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(b.segment, b.offset + size, rest, small, True, b, b.next)
            if b.next is not None:
                b.next.prev = tail
            elif self.expandable:
                self.tail[small] = tail
            b.next, b.size = tail, size
            self._insert(tail)
        elif self.expandable and b.next is None:
            self.tail[small] = b
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def release(self, b: _Block) -> None:
        self.allocated -= b.size
        b.free = True
        for other in (b.prev, b.next):
            if other is not None and other.free:
                self._remove(other)
                if other is b.prev:
                    b.offset, b.prev = other.offset, other.prev
                    if other.prev is not None:
                        other.prev.next = b
                else:
                    b.next = other.next
                    if other.next is not None:
                        other.next.prev = b
                b.size += other.size
        if self.expandable and b.next is None:
            self.tail[b.small] = b
        self._insert(b)


# the published runs set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: torchtitan's
# run_llama_train.sh, Megatron-Bridge's perf_recipes/*/h100/*.py
EXPANDABLE_SEGMENTS = True


def replay(events: Iterable[tuple[int, int]], repeats: int = 2, expandable: bool = False) -> CachingAllocator:
    """Run one micro-batch's (entry, change of bytes) events ``repeats`` times through the
    caching allocator, as consecutive micro-batches do (the cache warms up on the first)."""
    alloc = CachingAllocator(expandable)
    events = list(events)
    for _ in range(repeats):
        size: dict[int, int] = {}
        held: dict[int, _Block] = {}
        for key, delta in events:
            new = size.get(key, 0) + delta
            if key in held:
                alloc.release(held.pop(key))
            if new > 0:
                held[key] = alloc.malloc(new)
            size[key] = new
        for b in held.values():
            alloc.release(b)
    return alloc

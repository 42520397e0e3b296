"""Per-buffer paged KV cache: allocation and views. Thin: no model import.

G = num_layers / 2 buffers, each ``[2, num_blocks, kv_heads, block_size, head_dim]`` (K half
then V half). Layer pair (2j, 2j+1) shares buffer j through two block tables. With packed
FP8 K the K half is also viewed as ``[num_blocks, kv_heads, block_size // 2, head_dim, 2]``
(logical token t of a block at ``[t // 2, :, t % 2]``); V is never packed.
Block 0 is the null block: never handed to a request, it absorbs padding rows' reads
(block allocation: runtime/kv/blocks.py).
FP8 buffers are passed to compiled graphs as their uint8 bytes (``graph_view``).
The layout and its byte counts live in ``runtime/kv/layout.py`` (torch-free, so ``plan`` sizes pools by it).
With EAGLE3 the draft has a KV group of its own: one more buffer of the same kind
(``draft_buffer_shape``, its own heads), addressed through the full-attention group's
block table, so it needs no block accounting of its own.
"""

from __future__ import annotations

import torch

from neffbuild.errors import StepInputError
from neffbuild.runtime.kv.blocks import NULL_BLOCK  # noqa: F401  (re-exported: block 0 is the null block)
from neffbuild.runtime.kv.layout import KVLayout  # the layout and its bytes (torch-free)


def allocate(layout: KVLayout, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(layout.buffer_shape, dtype=layout.dtype, device=device) for _ in range(layout.num_buffers)]


def allocate_draft(layout: KVLayout, device: str = "cpu") -> torch.Tensor | None:
    """The draft's KV buffer (EAGLE3 bundles), or None."""
    return torch.zeros(layout.draft_buffer_shape, dtype=layout.dtype, device=device) if layout.has_draft else None


def graph_view(buffer: torch.Tensor) -> torch.Tensor:
    """The tensor a compiled graph takes for a KV buffer: FP8 as its uint8 bytes, else itself."""
    return buffer.view(torch.uint8) if buffer.dtype == torch.float8_e4m3fn else buffer


def packed_k_view(buffer: torch.Tensor) -> torch.Tensor:
    _, nb, h, bs, d = buffer.shape
    return buffer[0].view(nb, h, bs // 2, d, 2)


def storage_problem(b: torch.Tensor) -> str | None:
    """Why ``b``'s memory is not what an artifact may write in place (None: torch's own, writable storage).

    The artifact writes KV through the raw pointer: a FakeTensor or another subclass has no real storage, an
    MKLDNN or sparse layout is not the strided memory the artifact indexes, and memory torch did not allocate
    (a numpy array, Python ``bytes``, a file mapping) may be read-only pages (SIGSEGV) or immutable objects
    (written silently). Shared memory torch made (``share_memory_``, ``from_file``) must be writable pages."""
    if type(b) not in (torch.Tensor, torch.nn.Parameter):
        return f"is a {type(b).__name__} (a tensor subclass without real storage of its own)"
    if b.layout != torch.strided:
        return f"has layout {b.layout}, not the strided memory the artifacts write"
    try:
        st = b.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return "has no storage the artifacts can write"
    if st.resizable():  # allocated by torch's own allocator (CPU or device)
        return None
    if not st.is_shared():
        return "is backed by memory torch does not own (a numpy array, Python bytes, a buffer or a file mapping)"
    if b.device.type == "cpu" and not _writable_pages(st.data_ptr(), st.nbytes()):
        return "is backed by read-only memory (a read-only file mapping)"
    return None


def _writable_pages(addr: int, size: int) -> bool:
    """Whether every page of [addr, addr + size) is mapped writable (Linux /proc/self/maps; True elsewhere)."""
    try:
        with open("/proc/self/maps") as fh:
            spans = [line.split()[:2] for line in fh]
    except OSError:
        return True
    end, pos = addr + max(size, 1), addr
    for rng, perms in sorted(((tuple(int(x, 16) for x in r.split("-")), p) for r, p in spans)):
        if rng[1] <= pos or rng[0] > pos:
            continue
        if "w" not in perms:
            return False
        pos = rng[1]
        if pos >= end:
            return True
    return pos >= end


def check_kv_buffers(buffers, layout, device, *, draft: bool = False) -> list[torch.Tensor]:
    """Engine-supplied KV buffers against the bundle's layout, before native code sees them."""
    what = "the draft KV buffer" if draft else "kv_caches"
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, (list, tuple)):
        raise StepInputError(f"{what} must be a list of {layout.num_buffers} tensors, got {type(buffers).__name__}")
    want_n = 1 if draft else layout.num_buffers
    if len(buffers) != want_n:
        raise StepInputError(f"{what}: {len(buffers)} buffers given, the bundle's layout has {want_n}")
    shape = tuple(layout.draft_buffer_shape if draft else layout.buffer_shape)
    want_dev = torch.device(device)
    for j, b in enumerate(buffers):
        w = f"{what}[{j}]"
        if not isinstance(b, torch.Tensor):
            raise StepInputError(f"{w} must be a torch.Tensor, got {type(b).__name__}")
        if b.device.type == "meta" or b.is_meta:
            raise StepInputError(f"{w} is a meta tensor (no memory); allocate it on {want_dev}")
        why = storage_problem(b)
        if why:
            raise StepInputError(f"{w} {why}; allocate it with torch.empty on {want_dev} (runtime.kv.cache.allocate)")
        if tuple(b.shape) != shape:
            raise StepInputError(f"{w} is {list(b.shape)}, the bundle's KV layout is {list(shape)}")
        if b.dtype != layout.dtype:
            raise StepInputError(f"{w} has dtype {b.dtype}, the bundle's KV layout is {layout.dtype}")
        if b.device.type != want_dev.type or (want_dev.index is not None and b.device.index != want_dev.index):
            raise StepInputError(f"{w} is on {b.device}, the artifacts run on {want_dev}")
        if not b.is_contiguous():
            raise StepInputError(f"{w} is not contiguous (a transposed or strided view); pass a contiguous buffer")
    return list(buffers)


class KVGuard:
    """What native code will write, fingerprinted when the stepper took the buffers; ``check`` before each step.

    ``check_kv_buffers`` runs once, at construction. An engine that later releases or swaps a buffer's memory
    (``untyped_storage().resize_(0)``, ``set_``, ``resize_``) would hand the artifact a dangling pointer: the next
    step writes freed memory (SIGSEGV, or silent corruption). The guard keeps each buffer's storage object (the
    same storage the engine resizes) and compares, at every step, the tensor's address, the storage's size and the
    tensor's shape with what they were: three attribute reads per buffer, ~0.3 us (0.1% of the tiny bundle's
    step, tests/test_hostile_serving.py), no walk over the memory."""

    __slots__ = ("rows",)

    def __init__(self, buffers: list[torch.Tensor]):
        self.rows = [(b, b.untyped_storage(), b.data_ptr(), b.untyped_storage().nbytes(), b.shape) for b in buffers]

    def check(self) -> None:
        """StepInputError when a buffer's memory is no longer what the stepper was given."""
        for b, storage, ptr, nbytes, shape in self.rows:
            if b.data_ptr() != ptr or storage.nbytes() != nbytes or b.shape != shape:
                self._refuse()

    def _refuse(self) -> None:
        for j, (b, storage, ptr, nbytes, shape) in enumerate(self.rows):
            now = (b.data_ptr(), storage.nbytes(), b.shape)
            if now != (ptr, nbytes, shape):
                raise StepInputError(
                    f"kv_caches[{j}]: its memory changed after the Stepper took it (now {now[1]} bytes at "
                    f"{now[0]:#x}, shape {list(now[2])}; it had {nbytes} bytes at {ptr:#x}, shape {list(shape)}): "
                    "keep each KV buffer's storage alive and unresized while the Stepper uses it, or build a new "
                    "Stepper")

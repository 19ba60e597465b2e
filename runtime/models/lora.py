"""LoRA adapters in PEFT's format, served batched over one base model.

`read_adapter` reads a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) and checks it against
the base model's shapes and `max_rank`; a bad adapter is a `LoraError` naming the problem. `LoraPool` holds up
to `max_loras` adapters in stacked per-layer buffers (slot s of every buffer is one adapter; rank padded to
`max_rank` with zero rows, so a padded adapter computes exactly its own update), and `install_lora` wraps
each projection (q|k|v, o, gate|up, down) of a loaded `LlamaForCausalLM` in a `LoraLinear`.

A forward runs the base projection once for the whole batch (quantized or not), then, for each adapter
present, its low-rank update `(x_rows @ A^T) @ B^T` on the rows of its requests only. On the CPU this is one
call of the C++ op `radixlm::lora_sgmv_` (csrc/lora_sgmv.cpp) per projection: the batch's adapter rows sorted
by adapter as segments, each segment's weights read once, x and y rows read and written in place. Elsewhere
(or without a C++ compiler) it is torch matmuls: contiguous runs of rows are slices, other rows are gathered
and scattered back, or, for decode over several adapters, two padded batched matmuls. Rows of base requests
cost nothing extra. The scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B when loading.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.models.model_config import ModelConfig

logger = logging.getLogger("radixlm.lora")

# PEFT's names for the projections a Llama-family layer has, and which fused module of ours holds each:
# (module attribute path in the layer, part index inside the fused module)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# fused module -> its parts in order
FUSED_PARTS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_ADAPTER_BYTES = 4 << 30


class LoraError(ValueError):
    """An adapter that cannot be served: the message names the problem (the client's 400)."""


@dataclass
class Adapter:
    """One adapter read from disk: per (layer, PEFT target) its A [r, in] and scaled B [out, r], float32."""

    name: str
    path: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # blake2b of config + weights: the adapter's identity in the cache key

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT target -> (in_features, out_features) of the base model's projection."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def read_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> Adapter:
    """Read and check a PEFT LoRA folder; LoraError naming what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} is missing from {path!r}")
    if not weights_path.is_file():
        raise LoraError(
            f"LoRA adapter {name!r}: {WEIGHTS_FILE} is missing from {path!r} (only safetensors are read)"
        )
    raw_config = config_path.read_bytes()
    try:
        conf = json.loads(raw_config)
    except ValueError as e:
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    rank, alpha = _check_config(name, conf, max_rank)
    if weights_path.stat().st_size > MAX_ADAPTER_BYTES:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is larger than {MAX_ADAPTER_BYTES} bytes")
    raw_weights = weights_path.read_bytes()
    try:
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(raw_weights)
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read ({e})") from None
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    weights = _collect(name, tensors, cfg, rank, scale)
    digest = hashlib.blake2b(raw_config + b"\0" + raw_weights, digest_size=16).hexdigest()
    targets = tuple(sorted({t for _, t in weights}))
    return Adapter(name, str(folder), rank, alpha, targets, weights, digest)


def _check_config(name: str, conf: dict[str, Any], max_rank: int) -> tuple[int, float]:
    def bad(why: str) -> LoraError:
        return LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE}: {why}")

    if conf.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type is {conf.get('peft_type')!r}; only LORA adapters are served")
    rank, alpha = conf.get("r"), conf.get("lora_alpha", conf.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise bad(f"'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise bad(f"rank {rank} is above --max-lora-rank ({max_rank})")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise bad(f"'lora_alpha' must be a number, got {alpha!r}")
    if conf.get("use_dora"):
        raise bad("DoRA (use_dora) is not supported")
    if conf.get("bias", "none") != "none":
        raise bad(f"bias={conf.get('bias')!r} is not supported (only 'none')")
    if conf.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if conf.get(key):
            raise bad(f"'{key}' (a rank or alpha per module) is not supported")
    targets = conf.get("target_modules")
    if isinstance(targets, list):  # (a string is a regex or "all-linear": the tensors' names are checked)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise bad(
                f"target module(s) {unknown} are not projections of this model "
                f"(supported: {', '.join(TARGETS)})"
            )
    if conf.get("modules_to_save"):
        raise bad(f"modules_to_save {conf['modules_to_save']!r} is not supported (only LoRA weights)")
    return rank, float(alpha)


def _collect(
    name: str, tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, scale: float
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's `...layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight` tensors, checked and paired."""
    shapes = projection_shapes(cfg)
    sparse = cfg.moe.sparse_layers if cfg.moe is not None else frozenset()
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        parts = key.split(".")
        try:
            at = parts.index("layers")
            layer, target, which = int(parts[at + 1]), parts[at + 3], parts[at + 4]
        except (ValueError, IndexError):
            raise LoraError(f"LoRA adapter {name!r}: unexpected tensor {key!r}") from None
        if which not in ("lora_A", "lora_B") or parts[-1] != "weight":
            raise LoraError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only lora_A / lora_B)")
        if target not in shapes:
            raise LoraError(
                f"LoRA adapter {name!r}: target {target!r} ({key!r}) is not a projection of this model "
                f"(supported: {', '.join(TARGETS)})"
            )
        if not 0 <= layer < cfg.num_layers:
            raise LoraError(
                f"LoRA adapter {name!r}: {key!r} names layer {layer}; the model has {cfg.num_layers}"
            )
        if layer in sparse and target in ("gate_proj", "up_proj", "down_proj"):
            raise LoraError(f"LoRA adapter {name!r}: {key!r}: layer {layer}'s MLP is mixture-of-experts")
        halves.setdefault((layer, target), {})[which] = tensor
    if not halves:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    out = {}
    for (layer, target), pair in sorted(halves.items()):
        where = f"layer {layer} {target}"
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraError(f"LoRA adapter {name!r}: {where} has only {next(iter(pair))}")
        a, b = pair["lora_A"], pair["lora_B"]
        fan_in, fan_out = shapes[target]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraError(
                f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"expected {(rank, fan_in)} and {(fan_out, rank)} for rank {rank} on this model"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"LoRA adapter {name!r}: {where} holds a NaN or infinite weight")
        out[(layer, target)] = (a.float().contiguous(), (b.float() * scale).contiguous())
    return out


class LoraBatch:
    """Which rows of the current forward belong to which pool slot; shared by every `LoraLinear`.

    `segments` is a list of (slot, rows) where rows is a slice (a contiguous run) or an index tensor: the
    per-adapter path. `grouped`, set when several adapters share the batch and their row counts are close
    (decode), packs every adapter's rows into one [adapters, rows, in] tensor so a projection's updates
    are two batched matmuls whatever the number of adapters (the SGMV shape, padded): (slots or None for
    all slots in order, gather index, rows per adapter, positions of the real rows or None, their rows).

    `sgmv`, set instead of both when `use_kernel` (a float32 CPU pool whose C++ op loaded), is the op's
    view of the same rows: (rows [n] int64 sorted by slot, seg_ptr [k + 1], seg_slot [k]): segment j is
    rows[seg_ptr[j]:seg_ptr[j + 1]], all on slot seg_slot[j]."""

    def __init__(self, num_slots: int = 0, use_kernel: bool = False) -> None:
        self.num_slots = num_slots
        self.use_kernel = use_kernel
        self.segments: list[tuple[int, slice | torch.Tensor]] = []
        self.grouped: tuple | None = None
        self.sgmv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def set_rows(self, slots_per_req: list[int], tokens_per_req: list[int], device: torch.device) -> None:
        """Request i (of `tokens_per_req[i]` rows, in batch order) runs adapter slot `slots_per_req[i]`
        (-1: the base model)."""
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in zip(slots_per_req, tokens_per_req):
            if slot >= 0 and n:
                spans = runs.setdefault(slot, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        if self.use_kernel:
            self.segments, self.grouped = [], None
            self.sgmv = self._sort(runs)
            return
        self.sgmv = None
        segments: list[tuple[int, slice | torch.Tensor]] = []
        for slot, spans in runs.items():
            if len(spans) == 1:
                segments.append((slot, slice(*spans[0])))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
                segments.append((slot, idx))
        self.segments = segments
        self.grouped = self._group(runs, device)

    @staticmethod
    def _sort(runs: dict[int, list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows sorted by slot, segment offsets, segment slots): the op's segments, one per slot present."""
        rows: list[int] = []
        ptr, slots = [0], []
        for slot, spans in sorted(runs.items()):
            for a, b in spans:
                rows.extend(range(a, b))
            ptr.append(len(rows))
            slots.append(slot)
        return tuple(torch.tensor(v, dtype=torch.int64) for v in (rows, ptr, slots))  # type: ignore[return-value]

    def _group(self, runs: dict[int, list[tuple[int, int]]], device: torch.device) -> tuple | None:
        rows = {slot: [r for a, b in spans for r in range(a, b)] for slot, spans in sorted(runs.items())}
        k, n = len(rows), sum(len(r) for r in rows.values())
        m = max((len(r) for r in rows.values()), default=0)
        if k < 2 or k * m > 2 * n:  # one adapter, or padding would double the work: per-adapter path
            return None
        gather, pos, real = [], [], []
        for j, slot_rows in enumerate(rows.values()):
            gather += slot_rows + [slot_rows[0]] * (m - len(slot_rows))
            pos += range(j * m, j * m + len(slot_rows))
            real += slot_rows
        slots = list(rows)
        slot_index = None if slots == list(range(self.num_slots)) else torch.tensor(slots, device=device)
        positions = None if k * m == n else torch.tensor(pos, device=device)
        return (
            slot_index,
            torch.tensor(gather, device=device),
            m,
            positions,
            torch.tensor(real, device=device),
        )

    def clear(self) -> None:
        self.segments = []
        self.grouped = None
        self.sgmv = None


class LoraLinear(nn.Module):
    """A base projection plus the batch's adapters' low-rank updates on their own rows.

    `lora_a` [slots, parts * max_rank, in] and `lora_bt` [slots, max_rank, out] are this projection's slices
    of the pool (`lora_b` [slots, out, max_rank] is `lora_bt` transposed, a view). For a fused module
    (q|k|v, gate|up) part p's rank block of A feeds only its own output rows (`splits`: the parts' output
    sizes), one matmul per part: a block-diagonal B would multiply zeros, which cost a third of the update's
    time."""

    def __init__(
        self,
        base: nn.Module,
        lora_a: torch.Tensor,
        lora_bt: torch.Tensor,
        splits: list[int],
        state: LoraBatch,
    ):
        super().__init__()
        self.base = base
        self.lora_a, self.lora_bt, self.state = lora_a, lora_bt, state
        self.lora_b = lora_bt.transpose(1, 2)
        self.splits, self.rank = splits, lora_bt.shape[1]

    def _add(self, y: torch.Tensor, rows: slice | torch.Tensor, xa: torch.Tensor, b: torch.Tensor) -> None:
        """y[rows] += xa [n, parts * R] x B [out, R]^T, each part into its own output columns (no concat)."""
        r, off = self.rank, 0
        for p, size in enumerate(self.splits):
            part = (xa[:, p * r : (p + 1) * r] @ b[off : off + size].t()).to(y.dtype)
            cols = y[:, off : off + size] if len(self.splits) > 1 else y
            if isinstance(rows, slice):
                cols[rows] += part
            else:
                cols.index_add_(0, rows, part)
            off += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_updates(x, self.base(x))

    def add_updates(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base output of `x`) plus each adapter's update on its own rows, in place."""
        sgmv = self.state.sgmv
        if sgmv is not None:  # a float32 pool on the CPU: one call of the C++ op, y updated in place
            x = x if x.stride(-1) == 1 else x.contiguous()
            torch.ops.radixlm.lora_sgmv_(y, x, self.lora_a, self.lora_bt, *sgmv, self.splits, self.rank)
            return y
        grouped = self.state.grouped
        if grouped is not None:
            slots, gather, m, positions, rows = grouped
            a = self.lora_a if slots is None else self.lora_a.index_select(0, slots)
            b = self.lora_b if slots is None else self.lora_b.index_select(0, slots)
            k = a.shape[0]
            xs = x.index_select(0, gather).to(a.dtype).view(k, m, -1)  # [adapters, rows, in]
            xa = torch.bmm(xs, a.transpose(1, 2))  # [adapters, rows, parts * R]
            r, off, parts = self.rank, 0, []
            for p, size in enumerate(self.splits):
                parts.append(torch.bmm(xa[:, :, p * r : (p + 1) * r], b[:, off : off + size].transpose(1, 2)))
                off += size
            d = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).view(k * m, -1)
            if positions is not None:  # drop the padding rows
                d = d.index_select(0, positions)
            return y.index_add_(
                0, rows, d.to(y.dtype)
            )  # one scatter into contiguous rows (a column view's is slow)
        for slot, rows in self.state.segments:
            a, b = self.lora_a[slot], self.lora_b[slot]
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            self._add(y, rows, xs.to(a.dtype) @ a.t(), b)
        return y

    def decode_call(self) -> tuple:
        """The fused CPU path's (fn, args): the base's own fast call (a quantized op with its blocks bound),
        then the updates."""
        base_call = getattr(self.base, "decode_call", None)
        fn, args = base_call() if base_call is not None else (self.base.forward, ())
        add = self.add_updates

        def call(x: torch.Tensor) -> torch.Tensor:
            return add(x, fn(x, *args))

        return call, ()


class LoraPool:
    """`max_loras` slots of stacked adapter weights over one model, and the batch state its layers read."""

    def __init__(
        self, cfg: ModelConfig, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype
    ):
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        self.device, self.dtype = device, dtype
        on_cpu = device.type == "cpu" and dtype == torch.float32
        self.state = LoraBatch(max_loras, use_kernel=on_cpu and _kernel_loads())
        self.shapes = projection_shapes(cfg)
        # (layer, fused module path) -> (A [S, parts * R, in], B [S, out_total, R]: a view of Bt [S, R, out])
        self.buffers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.slot_names: list[str | None] = [None] * max_loras

    def install(self, model: nn.Module) -> None:
        """Wrap each dense layer's projections in `LoraLinear` (mixture-of-experts MLPs stay as they are)."""
        sparse = self.cfg.moe.sparse_layers if self.cfg.moe is not None else frozenset()
        for i, layer in enumerate(model.layers):
            for path, parts in FUSED_PARTS.items():
                if path.startswith("mlp.") and i in sparse:
                    continue
                owner_path, attr = path.split(".")
                owner = getattr(layer, owner_path)
                fan_in = self.shapes[parts[0]][0]
                out_total = sum(self.shapes[p][1] for p in parts)
                r = len(parts) * self.max_rank
                splits = [self.shapes[p][1] for p in parts]
                s = self.max_loras
                a = torch.zeros(s, r, fan_in, device=self.device, dtype=self.dtype)
                bt = torch.zeros(s, self.max_rank, out_total, device=self.device, dtype=self.dtype)
                self.buffers[(i, path)] = (a, bt.transpose(1, 2))
                setattr(owner, attr, LoraLinear(getattr(owner, attr), a, bt, splits, self.state))

    def load(self, slot: int, adapter: Adapter) -> None:
        """Copy `adapter` into `slot` (all of the slot is rewritten: its old adapter is gone)."""
        r = self.max_rank
        with torch.no_grad():
            for (layer, path), (a_buf, b_buf) in self.buffers.items():
                a_buf[slot].zero_()
                b_buf[slot].zero_()
                row = 0
                for p, target in enumerate(FUSED_PARTS[path]):
                    out = self.shapes[target][1]
                    pair = adapter.weights.get((layer, target))
                    if pair is not None:
                        a, b = pair
                        k = a.shape[0]
                        a_buf[slot, p * r : p * r + k].copy_(a)
                        b_buf[slot, row : row + out, :k].copy_(b)
                    row += out
        self.slot_names[slot] = adapter.name

    def begin(self, slots_per_req: list[int] | None, tokens_per_req: list[int]) -> None:
        if not slots_per_req or all(s < 0 for s in slots_per_req):
            self.state.clear()
        else:
            self.state.set_rows(slots_per_req, tokens_per_req, self.device)

    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.buffers.values()
        )


def _kernel_loads() -> bool:
    """Whether the C++ LoRA op is loaded (built on first use); without it the torch path runs."""
    from runtime.models.native_kernels import LORA_SGMV, KernelUnavailable

    try:
        LORA_SGMV.load()
    except KernelUnavailable as e:
        logger.warning("LoRA updates run as torch matmuls: %s", e)
        return False
    return True

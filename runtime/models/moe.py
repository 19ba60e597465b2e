"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5): top-k routing and the grouped expert op.

The router's logits are float32 (its weight is kept float32 whatever the model's dtype); `Routing` says how
they choose and weigh each token's experts: softmax over all experts (Qwen3-MoE, Qwen2-MoE, Mixtral) or an
independent sigmoid per expert with a learned choice bias and group-limited choice (GLM-4.5, DeepSeek-V3).

On the CPU a layer's experts run as one C++ call (runtime/models/moe_fused.py, csrc/moe_fused.cpp): the
batch's (token, choice) rows grouped by expert, each token's activation quantized to int8 once, every hit
expert's gate|up, SiLU, down and the weighted sum in one OpenMP-parallel op, for GGUF blocks, w4a8 blocks and
float32 / bfloat16 weights. `grouped_moe` (stacked float weights) and `grouped_moe_layers` (one pair of layers
per expert) are the same computation as a Python loop over the experts hit (one gate|up and one down matmul
each, index_select in, index_add_ out): the reference, and the path on other devices or with
$RADIXLM_MOE_FUSED=0. Either way a step reads only the routed experts' weights: at decode batch 1, top-k of
them. Under a quantization `quantize_model` replaces each expert's gate|up and down by two quantized linear
layers (`SparseMoeBlock.quantize_experts`; w4a8's are then stacked for the fused op); a GGUF file's experts
are its stacked blocks (`use_fused_experts`); the router stays float32.

A shared expert (Qwen2-MoE, GLM-4.5) is a dense SiLU-gated MLP every token runs beside its routed experts,
its output added to theirs (`SparseMoeBlock.add_shared_expert`): Qwen2-MoE's scaled by
sigmoid(x . shared_gate_weight) (one float32 logit per token), GLM-4.5's as it is. It is quantized like any
dense MLP.

Under tensor parallelism each rank holds rows [start, stop) of every expert's intermediate features (like
the dense MLP), the router is replicated (so every rank routes alike), and the partial outputs are summed
with one all_reduce; a shared expert is sharded like the dense MLP and its gate replicated (so is the
sigmoid router's choice bias).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models import moe_fused
from runtime.models.native_kernels import KernelUnavailable
from runtime.models.parallel import TensorParallel, split_range

logger = logging.getLogger("radixlm.moe")

# HF checkpoint names of an expert's projections -> (our parameter, part within an expert)
EXPERT_PROJECTIONS = {
    "gate_proj": ("w13", 0),  # Qwen3-MoE
    "up_proj": ("w13", 1),
    "down_proj": ("w2", 0),
    "w1": ("w13", 0),  # Mixtral
    "w3": ("w13", 1),
    "w2": ("w2", 0),
}


SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """How a router's float32 logits [T, E] choose each token's `top_k` experts and weigh them.

    - `softmax` (Qwen3-MoE, Qwen2-MoE, Mixtral): probabilities over all experts; the k largest are chosen
      and are the weights.
    - `sigmoid` (GLM-4.5, DeepSeek-V3): each expert's score is sigmoid(logit) on its own. A learned
      per-expert bias (the checkpoint's e_score_correction_bias, `SparseMoeBlock.score_bias`) is added for
      choosing only, the weights stay the unbiased scores; with `n_group` > 1 the experts form that many
      equal groups and only the `topk_group` groups whose two best biased scores sum highest are eligible.

    `renormalize` scales each token's k weights to sum to 1 (the sigmoid rule adds 1e-20 to the sum, as
    the reference does); `scale` (routed_scaling_factor) multiplies them after."""

    top_k: int
    renormalize: bool
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"expert scoring {self.scoring!r}: expected one of {', '.join(SCORINGS)}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"expert groups: topk_group {self.topk_group} of n_group {self.n_group}")
        if self.n_group > 1 and self.scoring != "sigmoid":
            raise ValueError("group-limited expert choice (n_group > 1) is defined for sigmoid scoring only")


def route(
    x: torch.Tensor, router_weight: torch.Tensor, routing: Routing, score_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router_weight [E, H] (and, for sigmoid scoring, an optional choice bias [E]) -> (weights
    [T, k] float32, expert ids [T, k] int64), by `routing`'s rule, in float32."""
    logits = F.linear(x.float(), router_weight.float())  # [T, E]
    k = routing.top_k
    if routing.scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = torch.sigmoid(logits)
        choice = scores if score_bias is None else scores + score_bias.float()
        if routing.n_group > 1:
            t, e = choice.shape
            best_two = choice.view(t, routing.n_group, e // routing.n_group).topk(2, dim=-1).values.sum(-1)
            groups = torch.topk(best_two, routing.topk_group, dim=-1).indices  # [T, topk_group]
            eligible = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, groups, True)
            choice = choice.masked_fill(~eligible.repeat_interleave(e // routing.n_group, dim=1), -torch.inf)
        ids = torch.topk(choice, k, dim=-1).indices
        weights = scores.gather(1, ids)
        if routing.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return weights, ids


def grouped_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token t, a SiLU-gated expert being
    down(silu(gate(x)) * up(x)).

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, k] (float32);
    topk_ids [T, k] int64 in [0, E). Returns [T, H] in x's dtype, summed in float32. One host sync (the
    per-expert counts); Python work per call is one iteration per expert hit, none per token.
    """
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, rows, weights in _expert_groups(topk_weights, topk_ids, w13.shape[0]):
        gate_up = F.linear(x.index_select(0, rows), w13[e])  # [n, 2I]
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, F.linear(h, w2[e]).float() * weights)
    return out.to(x.dtype)


def grouped_moe_layers(
    x: torch.Tensor,
    experts: Sequence[tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`grouped_moe` over layers instead of stacked weights: experts[e] = (gate|up layer [*, H] -> [*, 2I],
    down layer [*, I] -> [*, H]), e.g. quantized linear layers (float32 activations)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, rows, weights in _expert_groups(topk_weights, topk_ids, len(experts)):
        gate_up, down = experts[e]
        y = gate_up(x.index_select(0, rows))  # [n, 2I]
        inter = y.shape[1] // 2
        out.index_add_(0, rows, down(F.silu(y[:, :inter]) * y[:, inter:]).float() * weights)
    return out.to(x.dtype)


def _expert_groups(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, its token rows [n] int64, their routing weights [n, 1] float32) for each expert hit, in
    expert order; tokens ascending within an expert. One host sync (the per-expert counts)."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, choice) rows grouped by expert, tokens ascending
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k  # [T * k] the token of each grouped row
    weights = topk_weights.reshape(-1).index_select(0, order).float()[:, None]  # [T * k, 1]
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, tokens[start : start + n], weights[start : start + n]
            start += n


def reference_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """`grouped_moe` one token and one choice at a time: the test oracle (slow)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e].float() @ x[t].float()
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, j]) * (w2[e].float() @ h)
    return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer: the router (`gate_weight` [E, H], float32; for sigmoid routing with a
    choice bias also `score_bias` [E], float32) and the experts' fused gate|up (`w13` [E, 2 * I_rank, H]) and
    down (`w2` [E, H, I_rank]) of this rank's intermediate slice, or, once quantized, one pair of layers per
    expert (`experts`) and/or a fused-op module (`fused`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        routing: Routing,
        tp: TensorParallel,
        *,
        score_bias: bool = False,
    ):
        super().__init__()
        if score_bias and routing.scoring != "sigmoid":
            raise ValueError("an expert choice bias (e_score_correction_bias) needs sigmoid scoring")
        if num_experts % routing.n_group or (routing.n_group > 1 and num_experts // routing.n_group < 2):
            raise ValueError(f"{num_experts} experts do not form {routing.n_group} groups of two or more")
        self.num_experts, self.routing, self.tp = num_experts, routing, tp
        self.inter_full = intermediate_size
        self.start, self.stop = split_range(intermediate_size, tp.size, tp.rank)
        inter = self.stop - self.start
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.score_bias = nn.Parameter(torch.empty(num_experts)) if score_bias else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        self.experts: nn.ModuleList | None = None  # set by `quantize_experts` (w13 and w2 then go)
        # (x, topk_weights, topk_ids) -> [T, H] in one C++ call over quantized experts (moe_fused.py)
        self.fused: nn.Module | None = None
        self._expert_calls: list[tuple] = []  # the per-expert loop's (gate|up, down) callables
        self.shared_expert: nn.Module | None = None  # `add_shared_expert` (Qwen2-MoE, GLM-4.5)
        self.shared_gate_weight: nn.Parameter | None = None

    def add_shared_expert(self, mlp: nn.Module, gated: bool) -> None:
        """Run `mlp` (a dense MLP, its output already summed across ranks) on every token beside the routed
        experts; `gated` (Qwen2-MoE): its output scaled by sigmoid(x . shared_gate_weight [1, H], float32)."""
        self.shared_expert = mlp
        if gated:
            self.shared_gate_weight = nn.Parameter(torch.empty(1, self.gate_weight.shape[1]))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) of x [T, H] by this block's router."""
        return route(x, self.gate_weight, self.routing, self.score_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.tp.all_reduce(self.run_experts(x, weights, ids))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_gate_weight is not None:
                shared = (
                    torch.sigmoid(F.linear(x.float(), self.shared_gate_weight.float())).to(out.dtype) * shared
                )
            out = out + shared
        return out

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]): the fused op on the CPU (unless
        $RADIXLM_MOE_FUSED=0), else the per-expert loop."""
        if x.device.type == "cpu" and moe_fused.enabled():
            if self.fused is not None:
                return self.fused(x.contiguous(), weights, ids)
            if not self._expert_calls and _float_op_available():
                return moe_fused.fused_float_moe(x, self.w13, self.w2, weights, ids)
        if self._expert_calls:
            return grouped_moe_layers(x, self._expert_calls, weights, ids)
        return grouped_moe(x, self.w13, self.w2, weights, ids)

    def quantize_experts(self, make: Callable[[torch.Tensor], nn.Module]) -> None:
        """Replace the stacked expert weights by `make(weight [N, K])` layers, two per expert (gate|up, down);
        the router stays float32. Raises what `make` raises (a shape its blocks cannot take), changing
        nothing."""
        self.use_expert_layers(
            [(make(self.w13.data[e]), make(self.w2.data[e])) for e in range(self.num_experts)]
        )

    def use_expert_layers(self, layers: Sequence[tuple[nn.Module, nn.Module]]) -> None:
        """Serve expert e by layers[e] = (gate|up [*, H] -> [*, 2I], down [*, I] -> [*, H]), e.g. quantized
        linear layers; the stacked w13 / w2 go. w4a8 layers are also stacked for the fused op (the layers then
        hold views of the stacks); other kinds run the per-expert loop."""
        if len(layers) != self.num_experts:
            raise ValueError(f"{len(layers)} expert layers for {self.num_experts} experts")
        self.experts = nn.ModuleList(nn.ModuleList([gate_up, down]) for gate_up, down in layers)
        del self.w13, self.w2
        self._expert_calls = [(gate_up.forward, down.forward) for gate_up, down in self.experts]
        from runtime.models.w4a8 import W4A8Linear

        if all(isinstance(m, W4A8Linear) for pair in layers for m in pair):
            try:
                self.fused = moe_fused.W4A8Experts(layers)
            except (ValueError, KernelUnavailable) as e:
                logger.warning("w4a8 experts run the per-expert loop: %s", e)

    def use_fused_experts(self, fused: nn.Module) -> None:
        """Serve the experts by `fused` (e.g. `moe_fused.GGUFExperts`: a GGUF file's stacked blocks); its
        `expert_calls()` give the per-expert loop over the same bytes. The stacked w13 / w2 go."""
        if fused.num_experts != self.num_experts:
            raise ValueError(f"{fused.num_experts} fused experts for {self.num_experts} experts")
        self.fused = fused
        del self.w13, self.w2
        self._expert_calls = fused.expert_calls()

    def load_parts(self, attr: str) -> int:
        """How many checkpoint tensors make up parameter `attr` (for the loader's missing-weight check)."""
        experts = self.num_experts
        return {
            "gate_weight": 1,
            "shared_gate_weight": 1,
            "score_bias": 1,
            "w13": 2 * experts,
            "w2": experts,
        }[attr]

    def load_shard(self, attr: str, full: torch.Tensor, part: int = 0) -> None:
        """Take this rank's slice of one full checkpoint tensor. `part` numbers the tensors of `attr`:
        expert e's gate is w13 part 2e, its up 2e + 1; its down is w2 part e."""
        hidden = self.w13.shape[2]
        if attr in ("gate_weight", "shared_gate_weight", "score_bias"):
            param = getattr(self, attr)
            _check_shape(full, tuple(param.shape))
            # float32 whatever the model's dtype: routing and the shared expert's gate are decided on these
            param.data = full.to(device=param.device, dtype=torch.float32).contiguous()
            return
        inter = self.stop - self.start
        if attr == "w13":
            e, half = divmod(part, 2)
            _check_shape(full, (self.inter_full, hidden))
            self.w13.data[e, half * inter : (half + 1) * inter].copy_(full[self.start : self.stop])
        elif attr == "w2":
            _check_shape(full, (hidden, self.inter_full))
            self.w2.data[part].copy_(full[:, self.start : self.stop])
        else:
            raise ValueError(f"no parameter {attr!r}")


_float_op: list[bool] = []  # [whether the fused op's library loaded], once per process


def _float_op_available() -> bool:
    """Whether the fused op's library is loaded (built on first use); False, logged once, without it."""
    if not _float_op:
        try:
            moe_fused.load_kernels()
            _float_op.append(True)
        except KernelUnavailable as e:
            logger.warning("mixture-of-experts layers run the per-expert loop: %s", e)
            _float_op.append(False)
    return _float_op[0]


def _check_shape(full: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(full.shape) != want:
        raise ValueError(f"has shape {tuple(full.shape)}, expected {want}")


def expert_weight_target(parts: list[str]) -> tuple[list[str], int] | None:
    """Map an HF MoE weight name (split on dots, "model." removed) to (our parameter's name parts, part), or
    None when it is not one:
    layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight (Qwen3-MoE),
    layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight (Mixtral) -> layers.L.mlp.{w13,w2};
    layers.L.{mlp,block_sparse_moe}.gate.weight -> layers.L.mlp.gate_weight;
    layers.L.mlp.shared_expert_gate.weight (Qwen2-MoE) -> layers.L.mlp.shared_gate_weight;
    layers.L.mlp.gate.e_score_correction_bias (GLM-4.5) -> layers.L.mlp.score_bias. The shared expert's own
    projections (layers.L.mlp.shared_expert.*, GLM-4.5's shared_experts.*) are a dense MLP's: see
    `shared_expert_name`."""
    if len(parts) < 4 or parts[0] != "layers" or parts[2] not in ("mlp", "block_sparse_moe"):
        return None
    base = parts[:2] + ["mlp"]
    rest = parts[3:]
    if rest == ["gate", "weight"]:
        return [*base, "gate_weight"], 0
    if rest == ["shared_expert_gate", "weight"]:
        return [*base, "shared_gate_weight"], 0
    if rest == ["gate", "e_score_correction_bias"]:
        return [*base, "score_bias"], 0
    if len(rest) == 4 and rest[0] == "experts" and rest[1].isdigit() and rest[3] == "weight":
        target = EXPERT_PROJECTIONS.get(rest[2])
        if target is not None:
            attr, half = target
            e = int(rest[1])
            return [*base, attr], (2 * e + half if attr == "w13" else e)
    return None


def shared_expert_name(parts: list[str]) -> list[str]:
    """GLM-4.5's shared expert (layers.L.mlp.shared_experts.*) under Qwen2-MoE's module name (shared_expert);
    other names unchanged."""
    if len(parts) > 3 and parts[0] == "layers" and parts[2] == "mlp" and parts[3] == "shared_experts":
        return [*parts[:3], "shared_expert", *parts[4:]]
    return parts

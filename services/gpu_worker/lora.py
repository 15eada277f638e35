"""LoRA adapters in PEFT's format, resident in fixed slots and applied per row of a step.

An adapter adds scaling * B @ A to some of a layer's projections (q/k/v/o, gate/up/down). The worker
keeps up to `max_loras` adapters in slots: for each layer and projection, A [slots, r, in] and B
[slots, r, out] (B^T; the adapter's scaling folded into B, ranks zero-padded to `max_rank`; each
module's stacked over the layers), so that a step may mix rows of several adapters and rows of none.
A step groups its tokens by slot and a batched kernel (kernels/lora.py: Triton on the GPU, C++ on
the CPU, a torch reference elsewhere) multiplies each adapter present by all of its tokens at once:
its A and B are read once per step (`LoraBatch.add`). Adapters are checked against the base model
when loaded, before they serve anything: a module they target that the model has not, or whose
shapes differ, refuses the adapter with a message naming the module.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels import cpu_ops
from kernels.lora import BLOCK_M, group_rows, lora_add_ref, lora_add_triton
from services.gpu_worker.huge_pages import huge_page_zeros

if TYPE_CHECKING:
    from collections.abc import Sequence

    from services.gpu_worker.model import LlamaModel

# The projections an adapter may target, and the merged weight of the model each one is part of.
TARGET_MODULES = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o_proj",
    "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
}  # fmt: skip
# The modules of each merged projection, in its column order (as the model adds their deltas).
PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
MODULE_INDEX = {module: i for i, module in enumerate(TARGET_MODULES)}  # the decode layer's order
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# PEFT's saved names: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
PEFT_WEIGHT_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


# PEFT LoraConfig options that make an adapter compute something other than scaling * B @ A on
# the modules it targets, refused by name when set (not empty and not PEFT's default): their
# tensors still bear ordinary lora_A / lora_B names, so served as plain LoRA they would give other
# output than PEFT's. (Options that only change training or the initial weights, such as VeLoRA,
# MonteCLoRA, EVA or LoftQ, leave the inference forward plain LoRA and are served.) Checked in this
# order so that the option an adapter was made with is named before one PEFT derived from it:
# "all-linear" on a mixture of experts writes target_parameters and, for the experts' fused
# gate_up_proj, a rank_pattern and alpha_pattern of its own.
UNSUPPORTED_OPTIONS = (
    ("target_parameters", "it puts LoRA on parameters (a mixture of experts' expert weights), not on the "
                          "q/k/v/o/gate/up/down modules served"),
    ("alora_invocation_tokens", "activated LoRA applies the deltas only from the invocation tokens on"),
    ("arrow_config", "Arrow routes each token among several LoRA experts"),
    ("use_dora", "DoRA rescales the adapted weight by a learned magnitude"),
    ("kasa_config", "KaSA puts learned singular values between A and B and truncates the base weight"),
    ("use_bdlora", "BD-LoRA's A or B is block-diagonal"),
    ("use_qalora", "QA-LoRA pools the input in groups before A"),
    ("layer_replication", "it repeats the base model's layers, each copy with deltas of its own"),
    ("trainable_token_indices", "it trains the embeddings of chosen tokens"),
    ("lora_bias", "it adds a bias to lora_B"),
    ("bias", "it trains the base layers' biases"),
    ("rank_pattern", "it gives modules ranks other than r"),
    ("alpha_pattern", "it scales modules by alphas other than lora_alpha"),
    ("fan_in_fan_out", "it is for base weights stored (in, out), as GPT-2's Conv1D"),
)  # fmt: skip
# Defaults of UNSUPPORTED_OPTIONS that are not empty or false: such a value is not "set".
PEFT_DEFAULTS = {"bias": "none"}


class AdapterError(ValueError):
    """An adapter that cannot serve on this model; the message names the adapter and the problem."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights in float32: (layer, module) -> (A [r, in], B [out, r] * scaling)."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def lora_scaling(config: dict) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (use_rslora)."""
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def module_shapes(model: LlamaModel, whole: bool = False) -> dict[tuple[int, str], tuple[int, int]]:
    """(in, out) of each projection an adapter may target, per layer: this rank's shard of it
    (the slots' shapes), or with `whole` the full model's (an adapter file's). A sparse (MoE)
    layer's MLP has no dense gate/up/down, so it has none of those."""
    c, sh = model.config, model.shard
    if whole:
        heads, kv_heads, inter = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    else:
        heads, kv_heads, inter = sh.num_heads, sh.num_kv_heads, sh.intermediate_size
    h, q, kv = c.hidden_size, heads * c.head_dim, kv_heads * c.head_dim
    per_layer = {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip
    return {
        (i, module): shape
        for i, layer in enumerate(model.layers)
        for module, shape in per_layer.items()
        if layer.moe is None or module not in MLP_MODULES
    }


def read_peft_adapter(
    name: str, path: Path, model: LlamaModel, max_rank: int
) -> tuple[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]:
    """(rank, (layer, module) -> (A, B * scaling)) of a PEFT adapter directory, whole (not
    sharded), every pair checked against the model's shapes."""
    from safetensors import safe_open

    try:
        config = json.loads((path / "adapter_config.json").read_text())
    # ValueError: not JSON, not UTF-8 or an integer of too many digits; RecursionError: nested
    # too deep. Each an unreadable config, not a worker's crash.
    except (OSError, ValueError, RecursionError) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {path / 'adapter_config.json'}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    check_adapter_config(name, config, max_rank)
    rank, scaling = config["r"], lora_scaling(config)
    shapes = module_shapes(model, whole=True)
    try:
        # The header first: a file whose tensors do not fit is refused before any is read (a
        # valid file of gigabytes would be read whole only to be refused).
        with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as file:
            pairs = adapter_pairs(name, file.keys(), shapes)
            for (layer, module), pair in sorted(pairs.items()):
                where = f"model.layers.{layer}.{module}"
                if set(pair) != {"A", "B"}:
                    raise AdapterError(f"adapter {name!r}: {where} has lora_A or lora_B but not both")
                a_shape, b_shape = (file.get_slice(pair[kind]).get_shape() for kind in ("A", "B"))
                check_pair_shapes(
                    name, where, ("lora_A", "lora_B"), a_shape, b_shape, rank, shapes[(layer, module)]
                )
            tensors = {key: file.get_tensor(key) for pair in pairs.values() for key in pair.values()}
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise AdapterError(f"adapter {name!r}: cannot read adapter_model.safetensors: {exc}") from None
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        for key in pair.values():
            if not tensors[key].dtype.is_floating_point:
                # Cast to float32 it would load: an integer (say, quantized without its scales) or
                # bool tensor is no LoRA weight, and would serve garbage without a word.
                dtype = str(tensors[key].dtype).removeprefix("torch.")
                raise AdapterError(f"adapter {name!r}: {key} is {dtype}: LoRA weights are floating point")
        where = f"model.layers.{layer}.{module}"
        a, b = tensors[pair["A"]], tensors[pair["B"]]
        weights[(layer, module)] = scaled_pair(name, where, ("lora_A", "lora_B"), a, b, scaling)
    if not weights:
        raise AdapterError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    return rank, weights


def adapter_pairs(
    name: str, keys: list[str], shapes: dict[tuple[int, str], tuple[int, int]]
) -> dict[tuple[int, str], dict[str, str]]:
    """The names of each module's lora_A ("A") and lora_B ("B") among a PEFT adapter's weights,
    refused by name where one is no LoRA weight of a module the base model has (`shapes`)."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        match = PEFT_WEIGHT_NAME.fullmatch(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: weight {key} is not a LoRA A/B of a q/k/v/o/gate/up/down")
        layer, module, kind = int(match[1]), match[2], match[3]
        if module not in TARGET_MODULES:
            raise AdapterError(
                f"adapter {name!r}: {key}: {module} is not a supported target: one of {sorted(TARGET_MODULES)}"
            )
        if (layer, module) not in shapes:
            raise AdapterError(f"adapter {name!r}: {key}: the base model has no such module")
        pairs.setdefault((layer, module), {})[kind] = key
    return pairs


def check_pair_shapes(
    name: str,
    where: str,
    kinds: tuple[str, str],
    a_shape: Sequence[int],
    b_shape: Sequence[int],
    rank: int,
    shape: tuple[int, int],
) -> None:
    """Refuse an A [rank, in] / B [out, rank] pair whose shapes do not fit the base model's (in,
    out) `shape`, naming the module (`where`) and its A and B as the file calls them (`kinds`)."""
    in_features, out_features = shape
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if a_shape != (rank, in_features) or b_shape != (out_features, rank):
        raise AdapterError(
            f"adapter {name!r}: {where}: {kinds[0]} {a_shape} / {kinds[1]} {b_shape}, the "
            f"base model needs ({rank}, {in_features}) / ({out_features}, {rank})"
        )


def scaled_pair(
    name: str, where: str, kinds: tuple[str, str], a: torch.Tensor, b: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B * scaling) in float32, refused where either holds a NaN or an infinity, or the
    scaling takes B past float32's range: served, such a pair makes every token of its requests
    NaN, and the sampler picks some token of NaN logits all the same: garbage, not an error."""
    a, b = a.float(), b.float()
    scaled = b * scaling
    # One scan of B on the way in: a finite scaling keeps a NaN or an infinity of B non-finite,
    # and B itself is looked at again only to say which went wrong.
    for kind, tensor in zip(kinds, (a, scaled), strict=True):
        if not torch.isfinite(tensor).all():
            if tensor is scaled and torch.isfinite(b).all():
                raise AdapterError(
                    f"adapter {name!r}: {where}: {kinds[1]} times the scaling {scaling:g} is past float32's range"
                )
            raise AdapterError(f"adapter {name!r}: {where}: {kind} holds NaN or infinite values (in float32)")
    return a, scaled


def shard_pair(
    model: LlamaModel, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part of a whole A / B pair, split as the base weight it adds to
    (LlamaModel.shard_spec): a column-parallel projection (q/k/v, gate/up) keeps B's rows of its
    output shard and all of A; a row-parallel one (o, down) keeps A's columns of its input shard
    and all of B, so each rank's delta is its share of the partial sum the all-reduce adds up, as
    its base output is. With one rank the pair is whole."""
    layer, module = key
    block = "mlp" if module in MLP_MODULES else "self_attn"
    spec = model.shard_spec(f"model.layers.{layer}.{block}.{module}.weight")
    if spec is None:
        return a, b
    dim, start, length = spec
    if dim == 0:
        return a, b.narrow(0, start, length).contiguous()
    return a.narrow(1, start, length).contiguous(), b


def check_adapter_config(name: str, config: dict, max_rank: int) -> None:
    """Refuse, by name, what adapter_config.json asks that these slots do not compute."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}, only LORA is served")
    rank = config.get("r")
    # JSON's true is a Python int: a rank of True would pass as 1.
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be an integer >= 1, got {rank!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} is over lora.max_rank ({max_rank})")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"adapter {name!r}: modules_to_save ({config['modules_to_save']}) is not supported: "
            "only LoRA deltas on q/k/v/o/gate/up/down are"
        )
    targets = config.get("target_modules")
    # PEFT's: a module name or regex, or a list of names (None: its defaults for the architecture).
    # Refused otherwise by name, not a TypeError from the set or sort below.
    if not (
        targets is None
        or isinstance(targets, str)
        or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    ):
        raise AdapterError(
            f"adapter {name!r}: target_modules must be a module name, a regex or a list of module names, "
            f"got {targets!r}"
        )
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise AdapterError(
                f"adapter {name!r}: target module {unknown[0]} is not supported: one of {sorted(TARGET_MODULES)}"
            )
    for option, what in UNSUPPORTED_OPTIONS:
        value = config.get(option)
        if value and value != PEFT_DEFAULTS.get(option):
            raise AdapterError(f"adapter {name!r}: {option} ({value!r}) is not supported: {what}")


class LoraSlots:
    """`max_loras` resident adapter slots of rank up to `max_rank`, per layer and projection, in
    `dtype` (default: the model's; bfloat16 under a float32 CPU model halves the bytes a step
    reads for them)."""

    def __init__(
        self, model: LlamaModel, max_loras: int, max_rank: int, dtype: torch.dtype | None = None
    ) -> None:
        dtype = model.dtype if dtype is None else dtype
        self.dtype = dtype
        if model.is_triton and dtype != model.dtype:
            raise ValueError(
                f"lora.dtype {str(dtype).removeprefix('torch.')}: the Triton backend keeps adapters in the "
                f"model's dtype ({str(model.dtype).removeprefix('torch.')}); use auto"
            )
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.names: list[str | None] = [None] * max_loras
        self.paths: list[str | None] = [None] * max_loras  # where each slot's adapter was read from
        self.ranks = [0] * max_loras
        device = model.device
        # Each module's A and B of all the layers that have it, stacked, so that the one-op decode
        # step takes one tensor per module; a (layer, module)'s own are a view into them.
        shapes = module_shapes(model)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.stacked_a: dict[str, torch.Tensor] = {}
        self.stacked_b: dict[str, torch.Tensor] = {}
        for module in TARGET_MODULES:
            layers = [layer for layer, m in shapes if m == module]
            if not layers:
                continue
            in_features, out_features = shapes[(layers[0], module)]  # module_shapes: one per module
            count = len(layers)
            self.stacked_a[module] = huge_page_zeros((count, max_loras, max_rank, in_features), dtype, device)
            self.stacked_b[module] = huge_page_zeros(
                (count, max_loras, max_rank, out_features), dtype, device
            )
            for i, layer in enumerate(layers):
                self.a[(layer, module)] = self.stacked_a[module][i]
                self.b[(layer, module)] = self.stacked_b[module][i]
        # Each module's rank in each slot, 0 where the slot's adapter does not target it (the
        # kernels skip that work): [layers, modules (TARGET_MODULES' order), slots].
        shape = (len(model.layers), len(MODULE_INDEX), max_loras)
        self.module_ranks = torch.zeros(shape, dtype=torch.int64, device=device)
        # The kernels' arguments of each (layer, projection), made once: views of the tensors above.
        self.projections: dict[tuple[int, tuple[str, ...]], tuple[list, list, torch.Tensor]] = {}
        for layer in range(len(model.layers)):
            for modules in PROJECTIONS:
                if (layer, modules[0]) in self.a:
                    first = MODULE_INDEX[modules[0]]
                    self.projections[(layer, modules)] = (
                        [self.a[(layer, module)] for module in modules],
                        [self.b[(layer, module)] for module in modules],
                        self.module_ranks[layer, first : first + len(modules)],
                    )
        # Every module's stacked A and B in TARGET_MODULES' order, as the one-op decode layers take
        # them (`decode_arguments`); a model with a sparse layer (no dense MLP modules) never takes
        # that op.
        self.decode_modules = (
            (
                [self.stacked_a[m] for m in TARGET_MODULES],
                [self.stacked_b[m] for m in TARGET_MODULES],
            )
            if len(shapes) == len(model.layers) * len(TARGET_MODULES)
            else ([], [])
        )
        # The kernel that applies them (kernels/lora.py's contract): Triton with the Triton
        # backend, C++ on the CPU in float32 where the kernels load, else the torch reference.
        if model.is_triton:
            self.apply, self.tile_rows = lora_add_triton, BLOCK_M
        elif model.has_few_rows_linear:
            self.apply, self.tile_rows = cpu_ops.lora_add, None
        else:
            self.apply, self.tile_rows = lora_add_ref, None

    def load(self, slot: int, adapter: LoraAdapter, path: str) -> None:
        """Put `adapter` (read from `path`) into `slot` (whatever was there is gone: modules it
        does not target are zero)."""
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            self.a[(layer, module)][slot, : adapter.rank] = a
            self.b[(layer, module)][slot, : adapter.rank] = b.T  # kernels/lora.py keeps B's rank rows
            self.module_ranks[layer, MODULE_INDEX[module], slot] = adapter.rank
        self.names[slot], self.paths[slot], self.ranks[slot] = adapter.name, path, adapter.rank

    def clear(self, slot: int) -> None:
        """Empty `slot`: it holds no adapter, and a step that names it is refused."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} out of range [0, {self.max_loras})")
        for stacked in (*self.stacked_a.values(), *self.stacked_b.values()):
            stacked[:, slot].zero_()
        self.module_ranks[:, :, slot] = 0
        self.names[slot], self.paths[slot], self.ranks[slot] = None, None, 0

    def batch(self, token_slots: np.ndarray) -> LoraBatch | None:
        """The step's tokens grouped by slot (token_slots[t] = the slot of token t, -1 = none);
        None when no token has an adapter."""
        rows, segments = group_rows(token_slots, self.tile_rows)
        if not len(rows):
            return None
        device = self.model.device
        return LoraBatch(self, torch.from_numpy(rows).to(device), torch.from_numpy(segments).to(device))


@dataclass(frozen=True)
class LoraBatch:
    """One step's adapters: the tokens that use one, grouped by slot, and each slot's run of
    them (kernels/lora.py's rows and segments)."""

    slots: LoraSlots
    rows: torch.Tensor
    segments: torch.Tensor

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, modules: tuple[str, ...]) -> None:
        """out[t] += B @ (A @ x[t]) of each token's adapter for `modules` (one of PROJECTIONS: the
        parts of one merged projection, in its column order), in place."""
        projection = self.slots.projections.get((layer, modules))
        if projection is not None:  # None: a sparse (MoE) layer's MLP, which adapters do not reach
            self.slots.apply(out, x, *projection, self.rows, self.segments)

    def decode_arguments(self) -> tuple:
        """Every layer's deltas as cpu_ops.few_rows_decode_layers takes them (`lora`)."""
        return *self.slots.decode_modules, self.slots.module_ranks, self.rows, self.segments

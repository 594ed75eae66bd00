"""The frozen target LLM: loading, its decoder layers, and feature capture from the chosen layers.

Layer id `i` means "the output of decoder layer i", which is `hidden_states[i + 1]` of the HF tuple
(index 0 is the embedding output); a target whose residual is several hyper-connection streams
(DeepSeek-V4) gives their mean (`layer_state`). Features are read by forward hooks on the chosen
layers while the target runs its own forward, so every family's masks per layer type, rotary per
layer type, embedding scaling, attention sinks and recurrent mixers are the target's own; no decoder
loop is written here.
Training stops that forward after the last needed layer (an exception raised by the hook), so the
layers after it and the LM head never run; distillation (objective.labels=target) runs every layer
(`features_and_final_hidden`) and computes the target's logits chunk by chunk inside the loss.
"""
import datetime
import functools
import os
import weakref
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, Qwen3Config, Qwen3ForCausalLM,
                          masking_utils)

from drafter.errors import UserError, model_path_problem
from drafter.infra.cpu_dtype import bf16_speed, say_once, slow_bf16_warning


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "float16": torch.float16}


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The target's dtype, which is also the drafter's compute dtype: `name` from DTYPES, or "auto":
    bf16 on GPUs; on the CPU bf16 where this CPU's probe measures it faster than fp32, else fp32
    (drafter/infra/cpu_dtype.py; the probe's verdict is said once on stderr). An explicit bf16 on a CPU
    that the probe finds slow is warned about once, and kept."""
    kind = torch.device(device).type
    on_cpu = kind == "cpu"
    if name == "auto":
        if not on_cpu:
            return torch.bfloat16 if kind == "cuda" else torch.float32
        speed = bf16_speed()
        if speed.ratio is not None:  # measured here (DRAFTER_CPU_BF16 unset)
            say_once(f"dtype auto: {speed.reason}")
        return torch.bfloat16 if speed.fast else torch.float32
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and on_cpu and not (speed := bf16_speed()).fast:
        say_once(slow_bf16_warning(name, speed))
    return dtype


class TargetError(UserError, ValueError):
    """A target whose structure this code cannot read (no decoder layers it can find, ...)."""


class TargetFetchError(TargetError):
    """A hub target whose files could not be fetched: raised on every rank, as one line."""


def load_target(path: str, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Load a HF causal LM frozen: eval mode, no grad, in `dtype` on `device`. On a GPU the weights
    are read straight onto it (a device map of one device: no whole copy in host memory); on the CPU
    they load there. A multimodal checkpoint that transformers maps to image-text-to-text only
    (Kimi-K2.5) loads as that model: its decoder, embedding and LM head are found the same way."""
    check_target_path(path)
    device = torch.device(device)
    placed = {"device_map": {"": device}} if device.type == "cuda" else {}
    try:
        target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **placed)
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
        target = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **placed)
    decoder_layers(target)  # an unreadable structure stops here, before any training or decoding
    return freeze(target.to(device))


# what a target reads from its hub repository: config, tokenizer (chat template included), safetensors
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def hub_snapshot(hub_id: str, local_files_only: bool = False) -> str:
    """The directory of `hub_id`'s files a target reads (HUB_FILES; its .bin weights where it has no
    safetensors) in the hub cache, downloaded there unless `local_files_only`."""
    from huggingface_hub import snapshot_download
    local = snapshot_download(hub_id, allow_patterns=HUB_FILES, local_files_only=local_files_only)
    if not any(Path(local).glob("*.safetensors")):
        local = snapshot_download(hub_id, allow_patterns=[*HUB_FILES, "*.bin"], local_files_only=local_files_only)
    return local


def fetch_target(path: str | None) -> str | None:
    """Where the target's files are read from: `path` itself, or for a hub id (`model_path_problem`)
    its snapshot in the hub cache, fetched once per node. Under torch.distributed (a collective) each
    node's local rank 0 fetches while its other ranks wait, every rank learns whether every fetch
    worked before any reads the files, and a failed one stops every rank with one TargetFetchError."""
    if path is None or model_path_problem(path) or Path(path).exists():
        return path
    world = dist.is_initialized()
    first = not world or int(os.environ.get("LOCAL_RANK", "0")) == 0
    local, failure = _attempt(hub_snapshot, path) if first else (None, None)
    _stop_on_failure(path, failure)  # also the barrier the node's other ranks wait at
    if world:  # the others find what their node's first rank fetched
        if local is None:
            local, failure = _attempt(hub_snapshot, path, local_files_only=True)
        _stop_on_failure(path, failure)
    return local


def _attempt(fetch, *args, **kwargs) -> tuple[str | None, str | None]:
    """(fetch's result, None), or (None, why it failed in one line)."""
    try:
        return fetch(*args, **kwargs), None
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return None, f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


# How long a node's other ranks wait for its first rank's download: hours for a large target, where the
# default group's timeout (train.dist_timeout_minutes) would have NCCL's watchdog end the job
FETCH_WAIT = datetime.timedelta(hours=12)


@functools.cache
def _fetch_group():
    """A gloo group over every rank for the fetch's agreement: CPU objects, FETCH_WAIT's timeout."""
    return dist.new_group(backend="gloo", timeout=FETCH_WAIT)


def _stop_on_failure(path: str, failure: str | None) -> None:
    """Raise TargetFetchError on every rank when a rank's fetch failed (the first rank's reason)."""
    if dist.is_initialized():
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure, group=_fetch_group())
        failure = next((f for f in failures if f), None)
    if failure:
        raise TargetFetchError(f"target {path}: could not fetch its files from the hub ({failure})")


def freeze(target: nn.Module) -> nn.Module:
    """Eval mode, no grad, and its looped layers probed (`looped_layers`: one one-token forward)
    before any feature hook is placed on it."""
    target.eval()
    target.requires_grad_(False)
    looped_layers(target)
    return target


# over six: one keyword per Qwen3Config size it defaults (tests and benches name the ones they change)
def random_qwen3_config(vocab_size: int = 256, hidden_size: int = 64, num_hidden_layers: int = 6,
                        num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
                        intermediate_size: int = 128, **config_kwargs) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                       num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                       head_dim=head_dim, intermediate_size=intermediate_size, tie_word_embeddings=False,
                       attn_implementation="sdpa", **config_kwargs)


def random_qwen3(seed: int = 0, **config_kwargs) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 target (fp32, frozen) of `random_qwen3_config(**config_kwargs)`:
    the tests' and the GPU check's target."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = Qwen3ForCausalLM(random_qwen3_config(**config_kwargs))
    return freeze(target)


def target_config(path: str | None, random: dict | None):
    """The target's (text) config without loading its weights."""
    if path is None:
        return random_qwen3_config(**{k: v for k, v in (random or {}).items() if k != "seed"})
    from transformers import AutoConfig
    check_target_path(path)
    return AutoConfig.from_pretrained(path).get_text_config()


def check_target_path(path: str) -> None:
    """A TargetError for a local target path that cannot load (`model_path_problem`)."""
    if problem := model_path_problem(path):
        raise TargetError(f"target {path}: {problem}")


def model_type(target: nn.Module) -> str:
    return getattr(target.config, "model_type", type(target).__name__)


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The target's decoder layers in order (layer id i is the output of element i): the first
    ModuleList named `layers` (else any ModuleList) as long as the config's num_hidden_layers, the
    decoder's own first. Raises TargetError naming the model type when there is none."""
    num_layers = target.config.get_text_config().num_hidden_layers
    body = target.get_decoder() if hasattr(target, "get_decoder") else target
    candidates = [(name, module) for root in (body, target) for name, module in root.named_modules()
                  if isinstance(module, nn.ModuleList) and len(module) == num_layers]
    named = [module for name, module in candidates if name.rsplit(".", 1)[-1] == "layers"]
    if named or candidates:
        return (named or [module for _, module in candidates])[0]
    raise TargetError(f"target {model_type(target)} ({type(target).__name__}): no list of its "
                      f"{num_layers} decoder layers in {type(body).__name__}; features cannot be read")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from 1 to L-3 (one draft layer: L//2), as the DFlash reference chooses."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def feature_layer_problem(layer_ids: list[int], num_layers: int) -> str | None:
    """What is wrong with reading features from `layer_ids` (None: nothing): every id must be one of
    the target's layers but the last. HF's hidden_states[L] is the last layer's output after the
    final norm, which is what serving loops read; training reads the raw output, and serving stacks
    differ on which one they capture, so that layer is refused rather than trained on features the
    drafter will not be served. Checked when a drafter is configured and wherever features are read
    (checkpoints made elsewhere)."""
    if all(0 <= i < num_layers - 1 for i in layer_ids):
        return None
    return (f"target_layer_ids {list(layer_ids)}: serving stacks read the target's last layer "
            f"({num_layers - 1}) after the final norm and training before it, and a target of "
            f"{num_layers} layers has none past it; use layers 0..{num_layers - 2}")


def check_feature_layers(layer_ids: list[int], num_layers: int) -> None:
    """Raise ValueError where `feature_layer_problem` finds one."""
    problem = feature_layer_problem(layer_ids, num_layers)
    if problem:
        raise ValueError(problem)


def layer_state(output: torch.Tensor, family: str) -> torch.Tensor:
    """A decoder layer's output as one state per position, [b, T, H]. A target with manifold-
    constrained hyper-connections (DeepSeek-V4) carries its residual as streams [b, T, streams, H];
    their mixing matrices are (Sinkhorn-)doubly stochastic, so the streams' mean is an ordinary
    residual stream (each layer adds its output to it), and that mean is the state. Any other shape
    is refused."""
    if output.dim() == 4:
        return output.mean(dim=2)
    if output.dim() != 3:
        raise TargetError(f"target {family}: a decoder layer's output has shape {tuple(output.shape)}, "
                          "neither [batch, positions, hidden] nor [batch, positions, streams, hidden]")
    return output


def select_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the states (`layer_state`) of `layer_ids` from a full forward's `hidden_states`
    tuple: [b, T, K*H]."""
    check_feature_layers(layer_ids, len(hidden_states) - 1)
    return torch.cat([layer_state(hidden_states[i + 1], "target") for i in layer_ids], dim=-1)


_LOOPED = weakref.WeakKeyDictionary()  # target -> its looped decoder layers


@torch.no_grad()
def looped_layers(target: nn.Module) -> list[int]:
    """The decoder layers that run more than once in one forward (a looped section: Dory,
    Inkling-2-Loop), probed once per target on a one-token forward."""
    if target not in _LOOPED:
        calls = Counter()
        handles = [layer.register_forward_hook(lambda *args, index=index: calls.update([index]))
                   for index, layer in enumerate(decoder_layers(target))]
        try:
            target(input_ids=torch.zeros((1, 1), dtype=torch.long, device=target.device), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        _LOOPED[target] = sorted(index for index, count in calls.items() if count > 1)
    return _LOOPED[target]


def check_unlooped(target: nn.Module, layer_ids: list[int]) -> None:
    """Raise TargetError naming the family unless every layer of `layer_ids` runs once per forward:
    a looped layer has one output per pass, and a features-only forward stops at its first."""
    looped = sorted(set(layer_ids) & set(looped_layers(target)))
    if looped:
        raise TargetError(f"target {model_type(target)}: target_layer_ids {looped} run several times per forward "
                          f"(its looped layers are {looped_layers(target)}), so a layer id names no single output; "
                          "choose layers outside the loop")


class _StopForward(Exception):
    """Raised by the hook on the last needed layer to end a features-only forward there."""


class FeatureTap:
    """Forward hooks on the chosen decoder layers: after each target forward, `features()` is the
    concatenation of their states (`layer_state`) [b, n, K*H] for that forward. With
    `stop_after_last`, the forward is ended by an exception once the last needed layer has run
    (`run_until_features`)."""

    def __init__(self, target: nn.Module, layer_ids: list[int], stop_after_last: bool = False):
        layers = decoder_layers(target)
        check_feature_layers(layer_ids, len(layers))
        check_unlooped(target, layer_ids)
        self.layer_ids = [int(i) for i in layer_ids]
        self.family = model_type(target)
        self.captured: dict[int, torch.Tensor] = {}
        last = max(self.layer_ids)
        self.handles = [layers[i].register_forward_hook(self._hook(i, stop_after_last and i == last))
                        for i in sorted(set(self.layer_ids))]

    def _hook(self, layer_id: int, stop: bool):
        def hook(module, args, output):
            output = output[0] if isinstance(output, (tuple, list)) else output
            self.captured[layer_id] = layer_state(output, self.family)
            if stop:
                raise _StopForward
        return hook

    def features(self) -> torch.Tensor:
        missing = [i for i in self.layer_ids if i not in self.captured]
        if missing:
            raise TargetError(f"the target's forward did not run decoder layers {missing}")
        features = torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)
        self.captured.clear()
        return features

    def remove(self):
        for handle in self.handles:
            handle.remove()


@contextmanager
def feature_tap(target: nn.Module, layer_ids: list[int], stop_after_last: bool = False):
    tap = FeatureTap(target, layer_ids, stop_after_last)
    try:
        yield tap
    finally:
        tap.remove()


def _rows_are_single_sequences():
    """Without a cache, transformers looks for packed sequences in the position ids, which reads the
    device (a host sync per forward); every row here is one sequence, so the answer is known."""
    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


@torch.no_grad()
def context_features(target: nn.Module, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Features of `layer_ids` for every position, [b, T, K*H]: the target's own forward, stopped
    after layer max(layer_ids) (no later layer and no LM head runs).

    Sequences are right-padded; with a causal mask the real positions never see the padding, so no
    padding mask is needed (features at padded positions are garbage and must not be read). No
    position_ids: every row is one sequence at 0..T-1.
    """
    with feature_tap(target, layer_ids, stop_after_last=True) as tap, _rows_are_single_sequences():
        try:
            target(input_ids=input_ids, use_cache=False)
        except _StopForward:
            pass
        return tap.features()


@torch.no_grad()
def features_and_final_hidden(target: nn.Module, input_ids: torch.Tensor,
                              layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features of `layer_ids` [b, T, K*H], the final-normed last hidden state [b, T, H]): what
    distillation needs, the target's LM-head input at every position, from one whole forward of the
    target's decoder with the same hooks as `context_features` (its LM head does not run)."""
    with feature_tap(target, layer_ids) as tap, _rows_are_single_sequences():
        final = target.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        return tap.features(), final


def input_embedding_scale(target: nn.Module) -> float:
    """The factor the target applies to its token embeddings (Gemma: sqrt(hidden), Granite: its
    embedding_multiplier; 1 for most families). The drafter's block is embedded as the raw embedding
    rows times this factor, which is how the public loader embeds it (dflash_config.input_embedding_scale)."""
    scale = getattr(target.get_input_embeddings(), "embed_scale", None)
    if scale is None:
        scale = getattr(target.config.get_text_config(), "embedding_multiplier", None)
    return 1.0 if scale is None else float(scale)

"""The peer baseline: vLLM speculators 0.9.0's own DFlash drafter, trained by its own code and recipe on this
repo's feature store, then exported to the public `dflash` format that this repo's evals read.

    make peer-env   # once: speculators 0.9.0 and its package's pure-python imports into .peer/
    PYTHONPATH=.peer OMP_NUM_THREADS=1 .venv/bin/python bench/peer_speculators.py \\
        --store artifacts/features/smollm2_bf16_train_data --out runs/peer_speculators_s0 --steps 300 --seed 0 \\
        --resume --max-minutes 38 [--export runs/peer_speculators_s0/export]

The same command continues the run from its newest checkpoint (`--resume`: speculators' own checkpointer
and mid-epoch resume, below) until `--steps` optimizer steps are done; `--max-minutes` / `--piece-steps`
end a process early after a checkpoint, so a long run goes in pieces. `--export DIR` writes the weights
this process ends with (the run's end, or a piece's; with `--resume --export-now`, the newest
checkpoint's, training no further: a point of the curve) as a dflash checkpoint (config.json + model.safetensors) and checks it: on held-out rows
(`--check-data`), this repo's `load_drafter` of the export and the peer model give the same block states
and logits at the same anchors, to fp32 tolerance, in the training forward and the serving path; an
export that fails is not kept. A layout dflash cannot express is refused in one line.

Needs speculators 0.9.0 importable (not in the venv: PYTHONPATH=.peer after `make peer-env`, the wheel with the
pure-python imports its package __init__ pulls in: openai, hs_connectors, pydantic_settings + dotenv, loguru;
none of them is called here). CPU only.

What is speculators' and what is glue. Speculators' code: the model (`DFlashDraftModel` built by its CLI's
`build_draft_model` from its `TrainConfig` defaults), its forward and loss, its optimizers and LR schedule
(`Trainer.setup_optimizer` -> `build_optimizers`), its training step (`Trainer.train_epoch`, which does
autocast, zero_grad, backward, clip, step, schedule), its packing sampler and collate (`_setup_dataloader`:
`MultipackDistributedBatchSamplerV2` + `CollateFn`), its checkpointer and its resume (`Trainer.__init__`).
Glue here: `StoreDataset` (rows from this repo's store instead of its vLLM hidden-state files; ~20 lines),
the target's last-layer states its loss reads (`verifier_last_hidden`: the store holds no target labels),
five CPU shims (`cpu_shims`: its trainer assumes an accelerator), the step callback (checkpoints, pieces,
metrics.jsonl) and the export. `Trainer.run_training` is not used: its per-epoch checkpoints are bf16
(a resume would not continue the same run) and it ends on epochs, not steps.

Settings (S = speculators/ in the 0.9.0 wheel; "ours" = matched to this repo's recipe run
runs/smollm2_recipe_full_s0/config.yaml and its store; everything else is speculators' default):

| setting | value | from |
|---|---|---|
| speculator_type | dflash | (the peer we train) |
| draft layers | 2 (default 5) | ours: drafter.num_layers |
| hidden / heads / kv heads / head dim / MLP | 576 / 9 / 3 / 64 / 1536, silu | from the target config, S/train/cli.py:113 (create_transformer_layer_config); = ours |
| draft arch | qwen3 layers (Qwen3DFlashDecoderLayer) | S/train/config/schema.py:98 default, S/models/dflash/model_definitions.py |
| target layers | speculators ids [2, 28] = dflash ids [1, 27] (the store's) | ours; id convention S/convert/dflash/converter.py:125 |
| block size | 16 | ours = S/train/config/schema.py:638 default for dflash |
| mask token id | 3 | ours (speculators would take the tokenizer's: S/train/utils.py:16) |
| tokens per step | one packed sequence of 2048 (total_seq_len; default 8192): ~1,930 real tokens | ours: 2,048 a step (2 ranks x 1,024, or 1 rank x 2,048), ~1,976 real |
| anchors per step | max_anchors 128 (default 512) per packed sequence: ~126 with a supervised slot | ours: 128 a step, min(16, 128 // rows) per row, ~115 blocks trained |
| steps, seed | --steps, --seed (seed default 42) | ours |
| rows | every row of the store's dataset (data.eval_path is set in our recipe: the train split is all of data.path) | ours |
| packing / data order | Multipack LPT packing into 2048-token sequences, reshuffled per epoch with seed+epoch | S/train/distributed_batch_sampler.py:165, :241; S/train/dataloader.py:55 |
| position ids | restart at 0 in each packed row | S/train/data.py:132 |
| attention layout | every layer sliding_attention, window 2048 (full_attention_indices []), causal inside the block (sliding_window_non_causal False for dflash); context before the anchor, same document | S/train/config/schema.py:172, :177, :184; S/train/cli.py:211; S/models/dflash/attention.py:43, :77, :97 |
| attention kernel | sdpa on a materialized mask (default simple_flex_attention, a compiled block mask: a CUDA path) | S/train/config/schema.py:190 (its option for hardware without flex); same mask_mod |
| anchors | uniform without replacement among loss-mask positions, not the last 16 of the packed row | S/models/dflash/utils.py:21, :45, :61 |
| labels | the target's argmax: CE against argmax(verifier_lm_head(verifier_norm(target last-layer states))) | S/models/dflash/core.py:443; S/losses/eager.py:106 |
| loss | ce (loss_fn default for dflash), slot 0 (anchor) masked | S/train/config/schema.py:635; S/models/dflash/core.py:484 |
| loss implementation | eager (default fused needs Triton, absent on CPU; same math) | S/train/config/schema.py:304; S/losses/utils.py:115 |
| position weights | D-PACE (default for dflash), alpha 0.5 | S/train/config/schema.py:473, :478, :803; S/losses/utils.py:64 |
| gamma | 4.0 (unused under D-PACE) | S/train/config/schema.py:470 |
| reduction | sum of weighted CE / count of supervised slots | S/losses/utils.py:301 |
| noise | none: speculators 0.9.0 has no input noise | (no such setting in S/) |
| optimizer | Muon on 2-D weights (not embed/lm_head), AdamW on the rest | S/train/config/schema.py:339; S/train/optimizers.py:27, :69 |
| Muon | lr 1e-3 (muon_lr unset -> lr), momentum 0.95, weight decay 0.1, 5 Newton-Schulz steps, adjust_lr match_rms_adamw | S/train/config/schema.py:350, :355, :358, :361, :364, :798 |
| AdamW | lr 1e-3, weight decay 0.01, torch defaults betas (0.9, 0.999), eps 1e-8 | S/train/config/schema.py:344, :345; S/train/optimizers.py:108 |
| LR schedule | linear, warmup total//100 steps (3 of 300), to 0 at --steps (max_steps) | S/train/config/schema.py:371; S/train/trainer.py:184, :206, :418 |
| grad clip | 1.0 | S/train/trainer.py:551 |
| precision | fp32 master weights, bf16 autocast (hidden_states_dtype bfloat16), bf16 features | S/train/config/schema.py:218; S/train/trainer.py:539 |
| frozen | embedding, LM head (the target's), verifier norm | S/model.py:63, :71; S/train/config/schema.py:149 |
| init | speculators' own (HF init, initializer_range 0.02 of the target config) | S/models/dflash/core.py (post_init) |

CPU shims (`cpu_shims`, device placement only): the trainer's local rank is "cpu" (its `model.to(0)`
means cuda:0) and its autocast device "cpu" (it falls back to "cuda", which on a CPU disables autocast:
the run would be fp32, not its bf16 recipe); the checkpointer loads to "cpu" (it defaults to "cuda:0");
`torch.accelerator.synchronize` is a no-op without an accelerator (its step timer calls it); the progress
bar is off.

Checkpoints: `<out>/checkpoints/<epoch>/` as speculators' SingleGPUCheckpointer writes them
(model.safetensors + config.json, optimizer_state_dict.pt, scheduler_state_dict.pt) and its trainer's
training_state.json ({epoch, local_step, global_step}: its mid-epoch resume), saved in fp32 (its default
float_dtype is bf16, which would not resume to the same run), plus rng_state.pt (the torch RNG that draws
the anchors: its checkpointer saves none). Written to `<epoch>.tmp` and renamed; the newest two kept.
"""
import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # drafter.* when run as a script

try:
    from speculators.models.dflash import DFlashDraftModel as PeerDFlash
    from speculators.train import checkpointer as spec_checkpointer
    from speculators.train import trainer as spec_trainer
    from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
    from speculators.train.config import TrainConfig
    from speculators.train.data import BaseDataset
    from speculators.train.dataloader import _setup_dataloader
    from speculators.version import version as SPECULATORS_VERSION
except ImportError as error:
    raise ImportError(f"speculators 0.9.0 is not importable ({error}): PYTHONPATH=.peer after `make peer-env`") from error
if SPECULATORS_VERSION != "0.9.0":
    print(f"warning: speculators {SPECULATORS_VERSION}: the settings table and shims are for 0.9.0", file=sys.stderr)

RUN_FILE = "peer_run.json"          # the run-defining settings, checked on resume
KEEP_CHECKPOINTS = 2
CHECK_TOLERANCE = {"hidden": 1e-4, "logits": 1e-3}  # max |difference|, fp32 (values: hidden ~1, logits ~10)
# the draft body, by its (identical) names in the peer and in dflash's DFlashDraftModel
BODY_WEIGHTS = ("fc.weight", "hidden_norm.weight", "norm.weight")
LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


class PeerError(RuntimeError):
    """A run or export this script refuses, in one line."""


# ----------------------------------------------------------------------------------------------- setup

def cpu_shims() -> None:
    """Speculators' trainer and checkpointer on a CPU (device placement only; see the module docstring)."""
    spec_trainer.get_local_rank = lambda: "cpu"
    spec_trainer.tqdm = lambda iterable, **_: iterable
    spec_checkpointer.get_current_device = lambda: "cpu"
    if not torch.accelerator.is_available() and not getattr(torch.accelerator.synchronize, "_peer_shim", False):
        def synchronize(*_args, **_kwargs):
            return None
        synchronize._peer_shim = True
        torch.accelerator.synchronize = synchronize


def load_rows(store_dir: str, data_path: str, num_rows: int | None):
    """(store, target path, input_ids list, loss_mask list): the prepared dataset the store was dumped
    from (checked by its fingerprint), its first `num_rows` rows (None: all)."""
    from drafter.pipeline.datasets import load_prepared
    from drafter.pipeline.feature_store import FeatureStore, store_model_config
    from drafter.pipeline.feature_store_format import dataset_fingerprint, target_file_identity

    store = FeatureStore(store_dir)
    identity = store.identity
    target_path = identity["target.path"]
    if target_path is None:
        raise PeerError(f"{store_dir}: a store of a random target; the peer needs the target's files")
    dataset = load_prepared(data_path, store_model_config(store_dir).vocab_size)
    if dataset_fingerprint(dataset) != identity["dataset"] or len(dataset) != identity["dataset_rows"]:
        raise PeerError(f"--data {data_path} is not the dataset {store_dir} was dumped from "
                        f"(fingerprint {dataset_fingerprint(dataset)}, the store's {identity['dataset']})")
    files = target_file_identity(target_path, None)
    for key, value in files.items():
        if value is not None and identity.get(key) not in (None, value):
            raise PeerError(f"the target at {target_path} is not the one {store_dir} was dumped from ({key})")
    dataset = dataset.select_columns(["input_ids", "loss_mask"]).with_format("torch")
    rows = range(len(dataset) if num_rows is None else min(num_rows, len(dataset)))
    ids = [dataset[i]["input_ids"].long() for i in rows]
    masks = [dataset[i]["loss_mask"].long() for i in rows]
    return store, target_path, ids, masks


@torch.no_grad()
def verifier_last_hidden(target_path: str, ids: list[torch.Tensor], cache: Path) -> list[torch.Tensor]:
    """The target's last decoder layer output (before its final norm) at every position of each row, bf16:
    what speculators' loss reads as `verifier_last_hidden_states` (its vLLM data holds it beside the aux
    layers; this store holds no target labels). The target runs in bf16 (the store's dtype), each row
    alone; computed once per run and kept in `cache` (keyed by the rows' tokens, the target and the dtype)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from drafter.pipeline.feature_store_format import row_key
    from drafter.target_model.model import load_target

    keys = torch.tensor([row_key(row.numpy()) for row in ids], dtype=torch.int64)
    source = {"target": str(Path(target_path).resolve()), "dtype": "bf16"}
    if cache.is_file() and safe_open(str(cache), "pt").metadata() == source:
        saved = load_file(str(cache))
        if torch.equal(saved["keys"], keys):
            offsets = saved["offsets"].tolist()
            return [saved["states"][offsets[i]:offsets[i + 1]] for i in range(len(ids))]
    start = time.perf_counter()
    target = load_target(target_path, "cpu", torch.bfloat16)
    captured = []
    hook = target.get_decoder().norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0][0]))
    try:
        for row in ids:
            target.get_decoder()(input_ids=row[None], use_cache=False)
    finally:
        hook.remove()
    del target
    offsets = torch.tensor([0, *torch.tensor([len(r) for r in ids]).cumsum(0).tolist()], dtype=torch.int64)
    cache.parent.mkdir(parents=True, exist_ok=True)
    save_file({"states": torch.cat(captured).contiguous(), "offsets": offsets, "keys": keys}, str(cache), metadata=source)
    print(f"target last-layer states: {len(ids)} rows, {int(offsets[-1])} tokens, "
          f"{time.perf_counter() - start:.0f} s -> {cache}", flush=True)
    return [state.clone() for state in captured]


class StoreDataset(BaseDataset):
    """Glue: speculators' dataset interface (its ArrowDataset's `_get_raw_data` dict) over rows whose
    aux-layer features come from this repo's store, found by their tokens."""

    def __init__(self, store, ids, masks, last_hidden, max_len: int):
        from drafter.pipeline.feature_store_format import row_key
        self.store, self.ids, self.masks, self.last_hidden = store, ids, masks, last_hidden
        self.keys = [row_key(row.numpy()) for row in ids]
        super().__init__(max_len, torch.bfloat16)

    def __len__(self):
        return len(self.ids)

    def _compute_approx_lengths(self):
        return [len(row) for row in self.ids]

    def _get_raw_data(self, index: int):
        found = self.store.row(self.keys[index], len(self.ids[index]))
        if found is None:
            raise PeerError(f"{self.store.directory}: no row {index} ({len(self.ids[index])} tokens)")
        return {"hidden_states": found[0], "input_ids": self.ids[index],
                "verifier_last_hidden_states": self.last_hidden[index], "loss_mask": self.masks[index]}


def peer_train_config(args, target_path: str, layer_ids: list[int], checkpoints: Path) -> TrainConfig:
    """Speculators' TrainConfig: its defaults for dflash, with only the matched settings set."""
    return TrainConfig(
        speculator_type="dflash", seed=args.seed,
        verifier={"verifier_name_or_path": target_path},
        draft={"num_layers": args.num_layers, "target_layer_ids": [i + 1 for i in layer_ids],
               "mask_token_id": args.mask_token_id, "draft_attn_impl": "sdpa"},
        data={"total_seq_len": args.tokens_per_step, "max_anchors": args.anchors_per_step, "num_workers": 0},
        loss={"loss_implementation": "eager"},
        dflash={"block_size": args.block_size},
        trainer={"max_steps": args.steps, "save_path": str(checkpoints), "epochs": 10**6,
                 "no_resume_from_checkpoint": not args.resume})


def trainer_config(flat: dict, train_call_kwargs: dict, val_call_kwargs: dict) -> spec_trainer.TrainerConfig:
    """TrainerConfig exactly as speculators' CLI fills it (S/train/cli.py:742)."""
    return spec_trainer.TrainerConfig(
        num_epochs=flat["epochs"], save_path=flat["save_path"], lr=flat["lr"],
        resume_from_checkpoint=not flat["no_resume_from_checkpoint"], train_call_kwargs=train_call_kwargs,
        val_call_kwargs=val_call_kwargs, optimizer=flat["optimizer"], weight_decay=flat["weight_decay"],
        muon_lr=flat["muon_lr"], muon_momentum=flat["muon_momentum"], muon_weight_decay=flat["muon_weight_decay"],
        muon_ns_steps=flat["muon_ns_steps"], muon_adjust_lr_fn=flat["muon_adjust_lr_fn"],
        scheduler_type=flat["scheduler_type"], scheduler_warmup_steps=flat["scheduler_warmup_steps"],
        scheduler_warmup_ratio=flat["scheduler_warmup_ratio"], scheduler_total_steps=flat["scheduler_total_steps"],
        scheduler_num_cosine_cycles=flat["scheduler_num_cosine_cycles"], checkpoint_freq=flat["checkpoint_freq"],
        save_best=flat["save_best"], hidden_states_dtype=getattr(torch, flat["hidden_states_dtype"]),
        log_freq=flat["log_freq"], fsdp_shard=flat["fsdp_shard"],
        gradient_checkpointing=flat["gradient_checkpointing"], max_steps=flat["max_steps"])


def run_settings(args, store, target_path: str) -> dict:
    return {"speculators": SPECULATORS_VERSION, "store": str(Path(args.store).resolve()),
            "store_dataset": store.identity["dataset"], "target": target_path, "rows": args.rows,
            "steps": args.steps, "seed": args.seed, "tokens_per_step": args.tokens_per_step,
            "anchors_per_step": args.anchors_per_step, "num_layers": args.num_layers,
            "block_size": args.block_size, "mask_token_id": args.mask_token_id}


def check_run_dir(out: Path, settings: dict, resume: bool) -> None:
    """The run dir holds this run or nothing; a run's settings may not change across its pieces."""
    saved_path, checkpoints = out / RUN_FILE, out / "checkpoints"
    has_run = saved_path.exists() or (checkpoints.exists() and any(checkpoints.iterdir()))
    if has_run and not resume:
        raise PeerError(f"{out} holds a run: --resume continues it, or use a new --out")
    if saved_path.exists():
        saved = json.loads(saved_path.read_text())
        changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in settings.items() if saved.get(k) != v]
        if changed:
            raise PeerError(f"{out} was another run ({'; '.join(changed)}): use a new --out")
    out.mkdir(parents=True, exist_ok=True)
    saved_path.write_text(json.dumps(settings, indent=1))


# -------------------------------------------------------------------------------------------- training

class MetricCapture(logging.Handler):
    """Speculators' trainer logs each step's metrics as a dict to the "speculators.metrics" logger."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.last = None

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.last = record.msg


class PieceDone(Exception):
    pass


def save_checkpoint(trainer, epoch: int, local_step: int) -> Path:
    """Speculators' checkpointer (fp32) + its trainer's training_state.json + the torch RNG, into
    <epoch>.tmp, renamed to <epoch>; the newest KEEP_CHECKPOINTS kept."""
    ckpt = trainer.checkpointer
    tmp, final, old = ckpt.path / f"{epoch}.tmp", ckpt.path / str(epoch), ckpt.path / f"{epoch}.old"
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    ckpt.save_checkpoint(trainer.model, trainer.optimizers, tmp.name, float_dtype=torch.float32)
    ckpt.save_scheduler_state_dict(trainer.schedulers, tmp.name)
    (tmp / "training_state.json").write_text(json.dumps(
        {"epoch": epoch, "local_step": local_step, "global_step": trainer.global_step}))
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng_state.pt")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
    numbered = sorted((int(p.name) for p in ckpt.path.iterdir() if p.is_dir() and p.name.isdigit()))
    for stale in numbered[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(ckpt.path / str(stale))
    return final


def build(args, out: Path):
    """(trainer, loader, settings): speculators' model, loader and trainer, resumed from the run dir's
    newest checkpoint where there is one and --resume."""
    store, target_path, ids, masks = load_rows(args.store, args.data, args.rows)
    settings = run_settings(args, store, target_path)
    check_run_dir(out, settings, args.resume)
    last_hidden = verifier_last_hidden(target_path, ids, Path(args.verifier_cache or out / "verifier_last_hidden.safetensors"))
    cfg = peer_train_config(args, target_path, store.layer_ids, out / "checkpoints")
    flat = argparse.Namespace(**cfg.flatten())
    (out / "peer_config.json").write_text(json.dumps(vars(flat), indent=1, default=str))  # every setting, resolved
    print(f"peer: speculators {SPECULATORS_VERSION} {flat.speculator_type}, {flat.num_layers} layers, block "
          f"{flat.block_size}, aux layers {flat.target_layer_ids}, mask {flat.mask_token_id}, {flat.total_seq_len} "
          f"tokens x {flat.max_anchors} anchors a step, {flat.optimizer} (muon lr {flat.muon_lr}, wd "
          f"{flat.muon_weight_decay}; adamw lr {flat.lr}, wd {flat.weight_decay}), {flat.scheduler_type} schedule over "
          f"{flat.max_steps} steps, loss {flat.loss_fn} x {flat.per_position_loss_weight} (alpha {flat.dpace_alpha}), "
          f"sliding window {flat.sliding_window} (non-causal: {flat.sliding_window_non_causal}), seed {flat.seed}",
          flush=True)
    set_seed(flat.seed)  # as speculators' CLI main (S/train/cli.py:603-): seed, vocab (the full one), model
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(flat)
    model = build_draft_model(flat, PeerDFlash, t2d, d2t, draft_vocab_size)
    dataset = StoreDataset(store, ids, masks, last_hidden, flat.total_seq_len)
    loader = _setup_dataloader(dataset, flat.total_seq_len, model.config.transformer_layer_config.hidden_size,
                               num_workers=0, num_target_layers=len(model.target_layer_ids), prefetch_factor=None,
                               seed=flat.seed)
    train_kwargs, val_kwargs = PeerDFlash.get_trainer_kwargs(**vars(flat))
    loader = ResumedRng(loader)
    trainer = spec_trainer.Trainer(model, trainer_config(vars(flat), train_kwargs, val_kwargs), loader, None)
    trainer.device_type = "cpu"  # see cpu_shims
    if args.resume and trainer.checkpointer.prev_path is not None:
        loader.rng = torch.load(trainer.checkpointer.prev_path / "rng_state.pt")["torch"]
        loader.mid_epoch = trainer._resume_local_step > 0
    return trainer, loader, settings


class ResumedRng:
    """Speculators' DataLoader, restoring the saved torch RNG where a run that had not stopped would be:
    a new epoch's iterator draws its base seed from the torch RNG before the epoch's first step, so a
    checkpoint at an epoch's end restores before that draw and one mid-epoch after it."""

    def __init__(self, loader):
        self.loader, self.batch_sampler = loader, loader.batch_sampler
        self.rng, self.mid_epoch = None, False

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        if self.rng is not None and not self.mid_epoch:
            torch.set_rng_state(self.rng)
        iterator = iter(self.loader)
        if self.rng is not None and self.mid_epoch:
            torch.set_rng_state(self.rng)
        self.rng = None
        return iterator


def append_metrics(path: Path, record: dict, keep_up_to: int | None = None) -> None:
    """Append `record` to metrics.jsonl; `keep_up_to`: first drop lines past that step (a piece killed
    after its last checkpoint logged steps the next piece runs again)."""
    if keep_up_to is not None and path.exists():
        lines = [line for line in path.read_text().splitlines() if json.loads(line).get("step", 0) <= keep_up_to]
        path.write_text("".join(line + "\n" for line in lines))
    if record:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def train(args, trainer, loader, out: Path, started: float) -> list[float]:
    """Drive speculators' `Trainer.train_epoch` epoch by epoch until --steps, checkpointing from its
    step callback (and ending the process early for --piece-steps / --max-minutes counted from
    `started`); returns this process's losses."""
    capture = MetricCapture()
    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.addHandler(capture)
    metric_logger.setLevel(logging.INFO)
    metric_logger.propagate = False
    metrics_path = out / "metrics.jsonl"
    append_metrics(metrics_path, {}, keep_up_to=trainer.global_step)
    losses = []
    epoch = trainer.current_epoch
    position = {"local": getattr(trainer, "_resume_local_step", 0), "epoch_len": 0, "clock": time.perf_counter(),
                "done": 0, "slowest": 0.0}

    def on_step():
        now = time.perf_counter()
        seconds, position["clock"] = now - position["clock"], now
        position["local"] += 1
        position["done"] += 1
        position["slowest"] = max(position["slowest"], seconds)
        step, record = trainer.global_step, capture.last
        train_metrics = record["train"]
        losses.append(train_metrics["loss"])
        lrs = record["lr"] if isinstance(record["lr"], dict) else {"lr": record["lr"]}
        append_metrics(metrics_path, {"step": step, "epoch": epoch, "loss": train_metrics["loss"],
                                      "full_acc": train_metrics.get("full_acc"), "eal": train_metrics.get("eal"),
                                      "tokens": round(record["profile"]["tokens_per_s"] * record["profile"]["step_ms"] / 1000)
                                      if record.get("profile") else None,
                                      "lr": lrs, "seconds": round(seconds, 3)})
        print(f"step {step}/{args.steps} epoch {epoch} loss {train_metrics['loss']:.4f} "
              f"acc {train_metrics.get('full_acc', float('nan')):.3f} lr "
              + " ".join(f"{v:.2e}" for v in lrs.values()) + f" {seconds:.2f} s/step", flush=True)
        end_of_epoch = position["local"] == position["epoch_len"]
        elapsed = now - started
        stop = (args.piece_steps is not None and position["done"] >= args.piece_steps) or \
               (args.max_minutes is not None and elapsed + 1.5 * position["slowest"] + 30 > args.max_minutes * 60)
        if step % args.save_every == 0 or step >= args.steps or stop:
            saved = save_checkpoint(trainer, epoch, 0 if end_of_epoch else position["local"])
            print(f"checkpoint {saved} (step {step})", flush=True)
        if stop and step < args.steps:
            raise PieceDone

    try:
        while trainer.global_step < args.steps:
            loader.batch_sampler.set_epoch(epoch)
            position["epoch_len"] = len(loader.batch_sampler)
            if epoch != trainer.current_epoch:
                position["local"] = 0
            trainer.train_epoch(epoch, step_callback=on_step)
            epoch += 1
    except PieceDone:
        print(f"piece done at step {trainer.global_step}/{args.steps}: run the same command to continue", flush=True)
    finally:
        metric_logger.removeHandler(capture)
    return losses


# ---------------------------------------------------------------------------------------------- export

def dflash_layout(tl_config, sliding_window_non_causal: bool, block_size: int, tokens_per_step: int):
    """(layer_types, sliding_window, causal) of a dflash config giving the peer's attention, or PeerError.

    The peer (S/models/dflash/attention.py): a full layer sees the context before the anchor and its whole
    block; a sliding layer of window W sees context positions [anchor - W, anchor) and, unless
    sliding_window_non_causal, only the slots of its block up to its own. dflash 0.1.0: a full layer the
    same; a sliding layer of window W sees positions in (query - W, query], so its context starts W - 1 - k
    positions before the anchor for slot k, and it is causal unless is_causal=False. The two agree exactly
    wherever neither window cuts the context: for anchors up to W - block_size. The peer's training anchors
    lie below tokens_per_step - block_size (its packed row's last block_size positions are never anchors),
    so a run whose packed rows are longer than W + 1 trained where they differ: refused."""
    types = list(getattr(tl_config, "layer_types", None) or ["full_attention"] * tl_config.num_hidden_layers)
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise PeerError(f"export refused: layer types {sorted(unknown)} have no dflash equivalent")
    if "sliding_attention" not in types:
        return types, None, None
    if tl_config.sliding_window is None:
        raise PeerError("export refused: sliding layers without a window (the peer makes them causal and unwindowed)")
    window = int(tl_config.sliding_window)
    if window < block_size:
        raise PeerError(f"export refused: sliding window {window} < block size {block_size}: the peer's sliding "
                        "layers see their whole block (up to the slot), dflash's would cut it")
    if tokens_per_step > window + 1:
        raise PeerError(f"export refused: the peer trained on packed rows of {tokens_per_step} tokens, whose anchors "
                        f"pass {window - block_size}, where its window (counted from the anchor) and dflash's "
                        "(counted from each slot) differ")
    return types, window, (False if sliding_window_non_causal else None)


def weight_mapping(num_layers: int) -> dict[str, str]:
    """dflash export name -> peer state-dict name: the draft body, one to one."""
    names = list(BODY_WEIGHTS) + [f"layers.{i}.{name}" for i in range(num_layers) for name in LAYER_WEIGHTS]
    return {name: name for name in names}


def export_config(peer, target_path: str, chat_template_kwargs, step: int, tokens_per_step: int):
    """This repo's dflash config for the peer's shape and layout, refused where a width differs."""
    from transformers import AutoConfig
    from drafter.config import DrafterVariant
    from drafter.models.configure import drafter_config

    tl = peer.config.transformer_layer_config
    layer_types, window, causal = dflash_layout(tl, peer.config.sliding_window_non_causal, peer.block_size,
                                                tokens_per_step)
    config = drafter_config(
        AutoConfig.from_pretrained(target_path), num_layers=tl.num_hidden_layers, block_size=peer.block_size,
        mask_token_id=peer.mask_token_id, target_layer_ids=[i - 1 for i in peer.target_layer_ids],
        variant=DrafterVariant(layer_types=layer_types, sliding_window=window, causal=causal),
        target_path=target_path, chat_template_kwargs=chat_template_kwargs,
        trained_by={"speculators": SPECULATORS_VERSION, "model": "DFlashDraftModel", "step": step})
    mine, theirs = config.to_dict(), tl.to_dict()
    differing = [f"{key} {theirs.get(key)!r} vs {mine.get(key)!r}" for key in
                 ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "hidden_act", "rms_norm_eps", "attention_bias", "vocab_size", "rope_parameters")
                 if theirs.get(key) != mine.get(key)]
    if peer.config.sample_from_anchor or peer.use_draft_vocab:
        differing.append("sample_from_anchor / a draft vocabulary")
    if differing:
        raise PeerError(f"export refused: the peer's {', '.join(differing)} (dflash config)")
    return config


@torch.no_grad()
def check_export(peer, directory: Path, data_path: str, num_rows: int = 3, num_anchors: int = 8) -> dict:
    """Max |difference| between the peer and `load_drafter(directory)`, both fp32, on the first rows of
    `data_path` with the target's features (as bench/held_out_replay.py reads them): block states and
    logits of the same anchors (the first and last anchorable supervised position and evenly between),
    in the all-anchors training forward and in the serving path (`draft_hidden`, one block on a cache).
    Each model reads the target layers its own config names, each in its own convention, so a wrong
    layer id in the export shows too.
    Raises PeerError past CHECK_TOLERANCE."""
    import datasets
    from drafter.models import load_drafter
    from drafter.models.blocks import build_blocks, drafter_hidden
    from drafter.models.layers import DraftCache
    from drafter.target_model.model import context_features, load_target

    ours = load_drafter(str(directory), dtype=torch.float32).eval()
    target = load_target(ours.config.dflash_config["target_path"], "cpu", torch.float32)
    peer_dtype, peer_training = next(peer.parameters()).dtype, peer.training
    peer.float().eval()
    block, mask_id = ours.block_size, ours.mask_token_id
    rows = datasets.load_from_disk(data_path).with_format("torch")
    worst = {"hidden": 0.0, "logits": 0.0, "serving_hidden": 0.0, "argmax_agree": 1.0}
    checked = 0
    try:
        for row in rows.select(range(min(num_rows, len(rows)))):
            ids, loss_mask = row["input_ids"].long(), row["loss_mask"].long()
            length = len(ids)
            candidates = torch.nonzero(loss_mask[: length - block].bool()).flatten()  # the peer's anchorable
            if len(candidates) == 0:
                continue
            pick = torch.linspace(0, len(candidates) - 1, min(num_anchors, len(candidates))).round().long().unique()
            anchors = candidates[pick]
            # each model's features by its own convention: the export's dflash ids through this repo's feature
            # pass; the peer's speculators ids as transformers' hidden_states indices (0: the embedding)
            features = context_features(target, ids[None], ours.target_layer_ids).float()
            states = target.get_decoder()(input_ids=ids[None], output_hidden_states=True, use_cache=False).hidden_states
            peer_features = torch.cat([states[i] for i in peer.target_layer_ids], dim=-1).float()
            only_anchors = torch.zeros(1, length, dtype=torch.long)
            only_anchors[0, anchors] = 1  # the peer draws its anchors from the loss mask: exactly these
            hidden_peer, logits_peer, _, _, indices = peer._backbone_forward(
                peer_features, ids[None], only_anchors, torch.zeros(1, length, peer.hidden_size),
                torch.zeros(1, length, dtype=torch.long), torch.arange(length)[None], max_anchors=len(anchors))
            if not torch.equal(indices.view(-1, block)[:, 0], anchors):
                raise PeerError("export check: the peer drafted other anchors than asked")
            hidden_peer = hidden_peer.view(len(anchors), block, -1)
            logits_peer = logits_peer.view(len(anchors), block, -1).float()
            blocks = build_blocks(ids[None], loss_mask[None], anchors[None], torch.ones(1, len(anchors), dtype=torch.bool),
                                  block, mask_id, 1.0)
            hidden_ours = drafter_hidden(ours, target, features, blocks, "dense")[0]
            logits_ours = ours.head_logits(target, hidden_ours)
            worst["hidden"] = max(worst["hidden"], (hidden_ours - hidden_peer).abs().max().item())
            worst["logits"] = max(worst["logits"], (logits_ours - logits_peer).abs().max().item())
            agree = (logits_ours[:, 1:].argmax(-1) == logits_peer[:, 1:].argmax(-1)).float().mean().item()
            worst["argmax_agree"] = min(worst["argmax_agree"], agree)
            for i, anchor in enumerate(anchors.tolist()):
                block_ids = torch.full((1, block), mask_id, dtype=torch.long)
                block_ids[0, 0] = ids[anchor]
                served = ours.draft_hidden(target, features[:, :anchor], block_ids, DraftCache())[0]
                worst["serving_hidden"] = max(worst["serving_hidden"], (served - hidden_peer[i]).abs().max().item())
            checked += len(anchors)
    finally:
        peer.to(peer_dtype).train(peer_training)
    if checked == 0:
        raise PeerError(f"export check: no anchorable row in the first {num_rows} rows of {data_path}")
    worst["anchors"] = checked
    bad = [f"{key} {worst[key]:.2e} > {CHECK_TOLERANCE['hidden' if 'hidden' in key else 'logits']:.0e}"
           for key in ("hidden", "serving_hidden", "logits")
           if worst[key] > CHECK_TOLERANCE["hidden" if "hidden" in key else "logits"]]
    if bad:
        raise PeerError(f"export check failed: the export is not the peer ({'; '.join(bad)}; {checked} anchors)")
    return worst


def export(peer, directory: Path, step: int, tokens_per_step: int, check_data: str, chat_template_kwargs=None) -> dict:
    """Write the peer as a dflash checkpoint at `directory` (via this repo's `export_drafter`), check it
    (`check_export`) and keep it only if it passes; returns the check's differences."""
    from drafter.training.checkpoint import export_drafter

    target_path = peer.config.speculators_config.verifier.name_or_path
    config = export_config(peer, target_path, chat_template_kwargs, step, tokens_per_step)
    state = peer.state_dict()
    for name in TARGET_OWNED:  # dflash reads these from the target: they must still be the target's
        if name in state and peer.get_parameter(name).requires_grad:
            raise PeerError(f"export refused: the peer trains {name}, which dflash takes from the target")
    mapping = weight_mapping(config.num_hidden_layers)
    trained = {name for name, p in peer.named_parameters() if p.requires_grad}
    unmapped = sorted(trained - set(mapping.values()))
    if unmapped:
        raise PeerError(f"export refused: trained peer weights with no dflash place: {unmapped}")
    weights = {ours: state[theirs].detach().float().clone() for ours, theirs in mapping.items()}
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    export_drafter(weights, config, tmp, torch.float32)
    try:
        worst = check_export(peer, tmp, check_data)
    except Exception:
        shutil.rmtree(tmp)
        raise
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    (directory / "export_check.json").write_text(json.dumps(worst, indent=1))
    return worst


# ------------------------------------------------------------------------------------------------ main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True, help="this repo's feature store of the training rows")
    p.add_argument("--data", default="artifacts/smollm2/train_data", help="the prepared dataset the store was dumped from")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of the whole run (its LR schedule's length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens-per-step", type=int, default=2048, help="the packed row (speculators' total_seq_len)")
    p.add_argument("--anchors-per-step", type=int, default=128, help="speculators' max_anchors")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=3)
    p.add_argument("--rows", type=int, default=None, help="only the dataset's first N rows (smoke tests)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--piece-steps", type=int, default=None, help="end this process after N steps (checkpointed)")
    p.add_argument("--max-minutes", type=float, default=None, help="end this process before N minutes (checkpointed)")
    p.add_argument("--export", default=None, help="write the run's weights here as a dflash checkpoint, checked")
    p.add_argument("--export-now", action="store_true", help="with --resume and --export: export the newest "
                   "checkpoint without training on (a point of the curve before --steps)")
    p.add_argument("--check-data", default="artifacts/smollm2/bench_chat_data", help="held-out rows for the export check")
    p.add_argument("--verifier-cache", default=None, help="where the target's last-layer states are kept "
                                                          "(default <out>/verifier_last_hidden.safetensors)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    started = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("speculators").setLevel(logging.WARNING)
    cpu_shims()
    out = Path(args.out)
    try:
        if args.export_now and not (args.resume and args.export):
            raise PeerError("--export-now exports a run's newest checkpoint: give --resume and --export")
        if args.export_now and not any((out / "checkpoints").glob("*")):
            raise PeerError(f"--export-now: {out} holds no checkpoint to export")
        trainer, loader, settings = build(args, out)
        start_step = trainer.global_step
        go_on = trainer.global_step < args.steps and not args.export_now
        losses = train(args, trainer, loader, out, started) if go_on else []
        result = {"start_step": start_step, "step": trainer.global_step, "losses": losses}
        if args.export:
            from drafter.pipeline.feature_store import FeatureStore
            chat = FeatureStore(args.store).identity.get("target.chat_template_kwargs")
            if trainer.global_step < args.steps:
                print(f"note: exporting step {trainer.global_step} of {args.steps}", flush=True)
            worst = export(trainer.model, Path(args.export), trainer.global_step, args.tokens_per_step,
                           args.check_data, chat)
            print(f"exported step {trainer.global_step} to {args.export}; check on {worst['anchors']} held-out anchors: "
                  f"max |diff| hidden {worst['hidden']:.1e}, serving hidden {worst['serving_hidden']:.1e}, "
                  f"logits {worst['logits']:.1e}, argmax agreement {worst['argmax_agree']:.4f}", flush=True)
            result["export_check"] = worst
        return result
    except PeerError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()

"""Served speed at the CPU's limit: what this machine can do, the floor that sets for each serving
stage, and how far our stages are from it, in one run.

    OMP_NUM_THREADS=2 python bench/cpu_limits.py --target artifacts/smollm2/target --threads 2 \\
        --dtype fp32 --out runs/cpu_limits.json          # or --dtype bf16 | auto

Method.
1. The machine. Memory bandwidth: the sum of an fp32 tensor 4x the last-level cache (`--bandwidth-mib`)
   (bytes read / time) and a copy of it into another (bytes read + written / time). Matmul throughput
   for fp32 and bf16: decode-shaped x [k, H] @ W.T, W [4H, H] (as nn.Linear computes it; k in
   `--mm-rows`, H the target's) and a square `--square`^3 one (2 m n k FLOPs / time). Both at 1 and
   2 threads. Every time is `torch.utils.benchmark.Timer.blocked_autorange`: median and IQR of its
   runs; the rates are also given at the best run, and the floors use the best (a floor is a bound).
2. The floors, from the target's config (its modules built on the meta device, so every parameter is
   counted as it is, tied weights once): a stage's floor is max(bytes it must read / bandwidth,
   FLOPs / square-matmul throughput) at `--threads` and `--dtype`; the larger term names the bound.
   - target forward over k new tokens after c cached ones: every weight read once (the input
     embedding is a gather of k rows, unless tied to the LM head, which is read whole), the past
     keys and values read once (layers x 2 x KV heads x head dim x c), 2 x k FLOPs per matmul weight
     and 4 x heads x head dim FLOPs per query-key pair (causal: token i sees c + i + 1 keys).
     "forward 1 token" is k = 1 at c = 0; "verify k" is k in `--ks` at c = `--context`.
   - drafter step (drafter/models/dflash.py, config from drafter/models/configure.py, `--drafter-layers`
     layers, block of `--slots`): its own weights read once, one new context position through fc and
     every layer's k/v projections, the block's `--slots` rows through every layer, attention over its
     cache of `--context` positions plus the block, and the target's LM head over the slots read
     (slots 1..B-1, as `draft_states` reads them) with the full vocabulary V or a draft vocabulary
     of K rows (`--draft-vocab`).
   Every attention layer is taken as full attention (a sliding layer reads less).
3. Ours, measured: the repo's target (`load_target`) through `TargetCache(target).forward` in
   `--dtype` at `--threads` under torch.inference_mode, one token on an empty cache and k tokens
   after a `--context`-token prefix, `TargetCache.rollback` after each (inside the timed call); and,
   in the same run on the same model, transformers' own forward on its own DynamicCache
   (`model(ids, past_key_values=cache, use_cache=True)`, `cache.crop` after each). The drafter step
   is a randomly initialised DFlash drafter's `draft_states` over its cached context (the weights do
   not change its time), cropped back after each.
Output: a markdown table on stdout and everything as JSON at `--out`.
"""
import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.models import DFlashDraftModel, DraftCache  # noqa: E402
from drafter.models.configure import drafter_config  # noqa: E402
from drafter.models.draft_vocab import DraftVocab  # noqa: E402
from drafter.target_model.cache import TargetCache  # noqa: E402
from drafter.infra.cpu_layout import serve_column_major_, serving_layout  # noqa: E402
from drafter.target_model.model import compute_dtype, load_target  # noqa: E402

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ------------------------------------------------------------------ the machine

def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def llc_bytes() -> int:
    """The last-level cache's size as the kernel reports it (0 when it does not)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


def timed(fn, threads: int, min_run_time: float) -> dict:
    """fn's time per call in ms over `Timer.blocked_autorange`'s runs at `threads` threads: median,
    IQR, best and the number of runs."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return {"median_ms": m.median * 1e3, "iqr_ms": m.iqr * 1e3, "best_ms": min(m.times) * 1e3,
            "runs": len(m.times)}


def with_rate(timing: dict, amount: float) -> dict:
    """timing plus amount / time (per second, in units of 1e9) at its median and at its best run."""
    return {**timing, "median_rate": amount / timing["median_ms"] * 1e-6,
            "best_rate": amount / timing["best_ms"] * 1e-6}


def measure_bandwidth(mib: int, threads: int, min_run_time: float) -> dict:
    """GB/s of a reduction over `mib` MiB of fp32 (bytes read) and of a copy of it (read + written)."""
    n = mib * (1 << 20) // 4
    src, dst = torch.full((n,), 1.0), torch.empty(n)
    dst.fill_(0.0)  # touch every page before timing
    nbytes = src.numel() * src.element_size()
    read = with_rate(timed(lambda: src.sum(), threads, min_run_time), nbytes)
    copy = with_rate(timed(lambda: dst.copy_(src), threads, min_run_time), 2 * nbytes)
    return {"read": read, "copy": copy, "bytes": nbytes}


def measure_matmul(rows: int, inner: int, cols: int, dtype: torch.dtype, threads: int, min_run_time: float) -> dict:
    """GFLOPS of x [rows, inner] @ W.T with W [cols, inner] (nn.Linear's layout)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inner, generator=gen).to(dtype)
    w = torch.randn(cols, inner, generator=gen).to(dtype)
    with torch.inference_mode():
        timing = timed(lambda: F.linear(x, w), threads, min_run_time)
    return with_rate(timing, 2.0 * rows * inner * cols)


def measure_machine(hidden: int, threads_list: list[int], mib: int, mm_rows: list[int], square: int,
                    min_run_time: float) -> dict:
    """{threads: {"bandwidth": ..., "matmul": {dtype: {shape: ...}}}} for each thread count."""
    out = {}
    for threads in threads_list:
        matmul = {}
        for name, dtype in DTYPE_NAMES.items():
            shapes = {f"[{k},{hidden}]x[{hidden},{4 * hidden}]": (k, hidden, 4 * hidden) for k in mm_rows}
            shapes[f"[{square}]^3"] = (square, square, square)
            matmul[name] = {label: measure_matmul(*shape, dtype, threads, min_run_time)
                            for label, shape in shapes.items()}
            matmul[name]["peak_gflops"] = matmul[name][f"[{square}]^3"]["best_rate"]
        out[threads] = {"bandwidth": measure_bandwidth(mib, threads, min_run_time), "matmul": matmul}
    return out


# ------------------------------------------------------------------ the floors

@dataclass
class Cost:
    """What a stage must do: bytes read from memory and FLOPs."""
    weight_bytes: float
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


def floor_ms(cost: Cost, bandwidth_gbps: float, gflops: float) -> tuple[float, str]:
    """(floor in ms, "memory" or "compute"): the larger of bytes / bandwidth and FLOPs / throughput."""
    memory_ms = cost.bytes / (bandwidth_gbps * 1e9) * 1e3
    compute_ms = cost.flops / (gflops * 1e9) * 1e3
    return (memory_ms, "memory") if memory_ms >= compute_ms else (compute_ms, "compute")


@dataclass
class Shapes:
    """A model's parameter counts by role, from its modules (tied weights counted once)."""
    params: int            # every parameter, once
    linear: dict           # {module name: weight numel} of every nn.Linear
    embedding_rows: int    # the input embedding's rows and width
    embedding_width: int
    tied: bool             # the input embedding is the LM head


def model_shapes(model: nn.Module, head: nn.Module | None, embedding: nn.Module | None) -> Shapes:
    linear = {name: m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    rows, width = embedding.weight.shape if embedding is not None else (0, 0)
    return Shapes(sum(p.numel() for p in model.parameters()), linear, rows, width, tied)


def target_shapes(config) -> Shapes:
    """The target's Shapes, built from `config` on the meta device (no weights read)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model_shapes(model, model.get_output_embeddings(), model.get_input_embeddings())


def attention_dims(text_config) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head dim)."""
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return (text_config.num_hidden_layers, heads, getattr(text_config, "num_key_value_heads", None) or heads,
            head_dim)


def attention_pairs(k: int, context: int) -> int:
    """Query-key pairs of k causal queries after `context` cached keys."""
    return k * context + k * (k + 1) // 2


def target_cost(shapes: Shapes, text_config, k: int, context: int, elem: int) -> Cost:
    """One target forward over k tokens after `context` cached ones (module docstring)."""
    layers, heads, kv_heads, head_dim = attention_dims(text_config)
    embedding = shapes.embedding_rows * shapes.embedding_width
    gathered = 0 if shapes.tied else k * shapes.embedding_width  # rows of an untied embedding
    weight_bytes = (shapes.params - (0 if shapes.tied else embedding) + gathered) * elem
    kv_bytes = layers * 2 * kv_heads * head_dim * context * elem
    flops = 2 * k * sum(shapes.linear.values()) + 4 * layers * heads * head_dim * attention_pairs(k, context)
    return Cost(weight_bytes, kv_bytes, flops)


def build_drafter(target_config, layers: int, slots: int, vocab_rows: int | None) -> DFlashDraftModel:
    """The repo's DFlash drafter of `layers` layers and block `slots` for this target, on the current
    default device, with a draft vocabulary of `vocab_rows` words (None: the full head)."""
    config = drafter_config(target_config, num_layers=layers, block_size=slots, mask_token_id=0,
                            draft_vocab_size=vocab_rows)
    return DFlashDraftModel(config)


def drafter_cost(target_config, layers: int, slots: int, vocab_rows: int | None, context: int, elem: int,
                 new_context: int = 1) -> Cost:
    """One draft step (module docstring): `new_context` context positions join the drafter's cache
    of `context`, the block of `slots` rows runs through its layers, and the LM head of `vocab_rows`
    (None: the target's V) rows reads slots 1..slots-1."""
    with torch.device("meta"):
        drafter = build_drafter(target_config, layers, slots, vocab_rows)
    config = drafter.config
    _, heads, kv_heads, head_dim = attention_dims(config)
    hidden = config.hidden_size
    head_rows = vocab_rows or config.vocab_size
    own = sum(p.numel() for p in drafter.parameters())
    weight_bytes = (own + head_rows * hidden + slots * hidden) * elem  # + the block's embedding rows
    kv_bytes = layers * 2 * kv_heads * head_dim * context * elem
    flops = 0
    for name, m in drafter.named_modules():
        if isinstance(m, nn.Linear):
            rows = new_context if name == "fc" else (
                new_context + slots if name.endswith(("k_proj", "v_proj")) else slots)
            flops += 2 * rows * m.weight.numel()
    flops += 4 * layers * heads * head_dim * slots * (context + new_context + slots)  # the block sees it all
    flops += 2 * (slots - 1) * head_rows * hidden
    return Cost(weight_bytes, kv_bytes, flops)


# ------------------------------------------------------------------ ours and HF's, measured

def token_ids(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def ours_forward(target, ids: torch.Tensor, context: int, threads: int, min_run_time: float) -> dict:
    """TargetCache.forward over ids after `context` cached positions, rolled back after each call."""
    cache = TargetCache(target)
    if context:
        cache.forward(token_ids(target.config.get_text_config().vocab_size, context, seed=1))

    def step():
        cache.forward(ids)
        cache.rollback(context)
    return timed(step, threads, min_run_time)


def hf_forward(target, ids: torch.Tensor, context: int, threads: int, min_run_time: float) -> dict:
    """transformers' forward on its own DynamicCache at the same shapes, cropped back after each call."""
    from transformers import DynamicCache
    cache = DynamicCache(config=target.config)
    if context:
        target(token_ids(target.config.get_text_config().vocab_size, context, seed=1),
               past_key_values=cache, use_cache=True)

    def step():
        if context:
            target(ids, past_key_values=cache, use_cache=True)
            cache.crop(-ids.shape[1])  # transformers 5: the number of positions to drop
        else:  # an empty cache: a new one each call
            target(ids, past_key_values=DynamicCache(config=target.config), use_cache=True)
    return timed(step, threads, min_run_time)


def drafter_step(target, layers: int, slots: int, vocab_rows: int | None, context: int, threads: int,
                 min_run_time: float, column_major: bool) -> dict:
    """A random DFlash drafter's `draft_states` after `context` cached positions, cropped back."""
    text = target.config.get_text_config()
    with torch.inference_mode(False):  # its buffers' versions are read by `head_weight`
        drafter = build_drafter(target.config, layers, slots, vocab_rows).to(target.dtype).eval()
        if column_major:
            serve_column_major_(drafter)
        if vocab_rows:
            drafter.set_draft_vocab(DraftVocab.of(torch.arange(vocab_rows), text.vocab_size))
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, context + 1, len(drafter.target_layer_ids) * text.hidden_size, generator=gen)
    block = token_ids(text.vocab_size, slots, seed=3)
    cache = DraftCache()
    drafter.draft_hidden(target, features[:, :context], block, cache)

    def step():
        drafter.draft_states(target, features[:, context:], block, cache)
        cache.crop(context, drafter.layer_attention)
    return timed(step, threads, min_run_time)


# ------------------------------------------------------------------ rows, table, JSON

def row(what: str, threads: int, dtype: str, cost: Cost, floor: tuple[float, str], measured: dict | None,
        hf: dict | None = None) -> dict:
    out = {"what": what, "threads": threads, "dtype": dtype, **asdict(cost), "floor_ms": floor[0],
           "bound": floor[1], "measured": measured}
    if measured:
        out["ratio_to_floor"] = measured["median_ms"] / floor[0]
    if measured and hf:
        out["ratio_to_hf"] = measured["median_ms"] / hf["median_ms"]
    return out


def floor_rows(target_config, args, dtype_name: str, bandwidth: float, gflops: float) -> list[dict]:
    """Every stage's row with its floor and no measurement (the measurements fill them in later)."""
    elem = torch.empty((), dtype=DTYPE_NAMES[dtype_name]).element_size()
    text = target_config.get_text_config()
    shapes = target_shapes(target_config)
    stages = [("target forward, 1 token", target_cost(shapes, text, 1, 0, elem))]
    stages += [(f"target verify, k={k} at ctx {args.context}", target_cost(shapes, text, k, args.context, elem))
               for k in args.ks]
    for rows in [None, *args.draft_vocab]:
        label = f"V={text.vocab_size}" if rows is None else f"K={rows}"
        cost = drafter_cost(target_config, args.drafter_layers, args.slots, rows, args.context, elem)
        stages.append((f"drafter step, {label}", cost))
    return [row(what, args.threads, dtype_name, cost, floor_ms(cost, bandwidth, gflops), None)
            for what, cost in stages]


def measure_rows(rows: list[dict], target, args) -> list[dict]:
    """Ours (and HF's, as its own rows) measured for each row of `floor_rows`."""
    vocab = target.config.get_text_config().vocab_size
    out = []
    for r in rows:
        floor, cost = (r["floor_ms"], r["bound"]), Cost(r["weight_bytes"], r["kv_bytes"], r["flops"])
        if r["what"].startswith("target"):
            k = 1 if "1 token" in r["what"] else int(r["what"].split("k=")[1].split()[0])
            context = 0 if "1 token" in r["what"] else args.context
            ids = token_ids(vocab, k, seed=4)
            hf = hf_forward(target, ids, context, args.threads, args.min_run_time)
            ours = ours_forward(target, ids, context, args.threads, args.min_run_time)
            out.append(row(r["what"], r["threads"], r["dtype"], cost, floor, ours, hf))
            out.append(row("  HF " + r["what"], r["threads"], r["dtype"], cost, floor, hf))
        else:
            rows_k = None if "V=" in r["what"] else int(r["what"].split("K=")[1])
            ours = drafter_step(target, args.drafter_layers, args.slots, rows_k, args.context, args.threads,
                                args.min_run_time, args.weight_layout == "column")
            out.append(row(r["what"], r["threads"], r["dtype"], cost, floor, ours))
    return out


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def machine_table(machine: dict) -> str:
    lines = ["| measure | threads | dtype | median ms | IQR ms | median | best |", "|---|---:|---|---:|---:|---:|---:|"]
    for threads, m in machine.items():
        for kind, b in m["bandwidth"].items():
            if kind != "bytes":
                lines.append(f"| bandwidth, {kind} | {threads} | fp32 | {b['median_ms']:.1f} | {b['iqr_ms']:.1f} | "
                             f"{b['median_rate']:.1f} GB/s | {b['best_rate']:.1f} GB/s |")
        for dtype, shapes in m["matmul"].items():
            for label, t in shapes.items():
                if label != "peak_gflops":
                    lines.append(f"| matmul {label} | {threads} | {dtype} | {t['median_ms']:.3f} | "
                                 f"{t['iqr_ms']:.3f} | {t['median_rate']:.1f} GFLOPS | {t['best_rate']:.1f} GFLOPS |")
    return "\n".join(lines)


def stage_table(rows: list[dict]) -> str:
    lines = ["| what | threads | dtype | measured ms (median) | IQR ms | floor ms | bound | x floor | x HF |",
             "|---|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        m = r["measured"] or {}
        lines.append(f"| {r['what']} | {r['threads']} | {r['dtype']} | {fmt(m.get('median_ms'))} | "
                     f"{fmt(m.get('iqr_ms'))} | {r['floor_ms']:.2f} | {r['bound']} | "
                     f"{fmt(r.get('ratio_to_floor'), '.1f')} | {fmt(r.get('ratio_to_hf'))} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="artifacts/smollm2/target", help="a HF model directory")
    p.add_argument("--dtype", default="auto", choices=["fp32", "bf16", "auto"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 5, 9, 17, 33])
    p.add_argument("--drafter-layers", type=int, default=2)
    p.add_argument("--slots", type=int, default=16, help="the drafter's block size")
    p.add_argument("--draft-vocab", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--bandwidth-mib", type=int, default=None, help="default: 4x the last-level cache")
    p.add_argument("--mm-rows", type=int, nargs="+", default=[1, 9, 33])
    p.add_argument("--square", type=int, default=1024)
    p.add_argument("--min-run-time", type=float, default=1.0, help="seconds per Timer.blocked_autorange")
    p.add_argument("--weight-layout", default="auto", choices=["auto", "row", "column"],
                   help="the served weights' layout (drafter/infra/cpu_layout.py); auto: the probe's")
    p.add_argument("--no-measure", action="store_true", help="machine and floors only, no forwards")
    p.add_argument("--out", default="runs/cpu_limits.json")
    return p.parse_args(argv)


def resolve_dtype(name: str) -> str:
    if name != "auto":
        return name
    return "bf16" if compute_dtype("auto", torch.device("cpu")) == torch.bfloat16 else "fp32"


def run(args) -> dict:
    from transformers import AutoConfig
    dtype_name = resolve_dtype(args.dtype)
    target_config = AutoConfig.from_pretrained(args.target)
    hidden = target_config.get_text_config().hidden_size
    mib = args.bandwidth_mib or max(64, 4 * llc_bytes() >> 20)
    loadavg_start = Path("/proc/loadavg").read_text().split()[:3]
    started = time.time()
    thread_counts = sorted({1, 2, args.threads})
    machine = measure_machine(hidden, thread_counts, mib, args.mm_rows, args.square, args.min_run_time)
    at = machine[args.threads]
    bandwidth, gflops = at["bandwidth"]["read"]["best_rate"], at["matmul"][dtype_name]["peak_gflops"]
    rows = floor_rows(target_config, args, dtype_name, bandwidth, gflops)
    if not args.no_measure:
        target = load_target(args.target, "cpu", DTYPE_NAMES[dtype_name])
        if args.weight_layout == "auto":
            layout = serving_layout(target, target.dtype)
            print(f"serving {layout.reason}", flush=True)
            args.weight_layout = "column" if layout.column else "row"
        if args.weight_layout == "column":
            serve_column_major_(target)
        with torch.inference_mode():
            rows = measure_rows(rows, target, args)
    return {"cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cores": len(os.sched_getaffinity(0)),
            "llc_bytes": llc_bytes(), "torch": torch.__version__, "threads": args.threads, "dtype": dtype_name,
            "args": vars(args), "bandwidth_mib": mib, "loadavg_start": loadavg_start,
            "loadavg_end": Path("/proc/loadavg").read_text().split()[:3], "seconds": time.time() - started,
            "floor_inputs": {"bandwidth_gbps": bandwidth, "gflops": gflops},
            "machine": machine, "rows": rows}


def report(result: dict) -> str:
    head = (f"CPU {result['cpu_model']}, capability {result['cpu_capability']}, {result['cores']} cores, "
            f"LLC {result['llc_bytes'] >> 20} MiB; torch {result['torch']}; threads {result['threads']}, "
            f"dtype {result['dtype']}; load average {' '.join(result['loadavg_start'])} at the start\n"
            f"floors from {result['floor_inputs']['bandwidth_gbps']:.1f} GB/s (read, best) and "
            f"{result['floor_inputs']['gflops']:.1f} GFLOPS ({result['dtype']} square matmul, best) "
            f"at {result['threads']} thread(s)")
    return f"{head}\n\n{machine_table(result['machine'])}\n\n{stage_table(result['rows'])}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(report(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()

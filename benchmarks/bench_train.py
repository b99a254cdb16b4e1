"""Training throughput: pairsim (1 Ray Train worker, DeepSpeed ZeRO-0) against open_clip's own
training script (``open_clip_train``) on the same model, data and batch size, in one run; on a
GPU also against pairsim's own step on pre-made device tensors (its ceiling).

    python benchmarks/bench_train.py [--images 6400] [--batch-size 64] [--threads 2] [--repeats 3]
    python benchmarks/bench_train.py --device cuda --model ViT-B-32 --image-size 224 --precision bf16 \
        --batch-size 256 --images 12800 --threads 6 --data-workers 6 --synthetic \
        [--variants train.zero_stage=3 train.precision=amp_bf16 train.compile=true optim.grad_clip=0] \
        [--real-variants train.precision=amp_bf16] [--plain] [--profile-steps 5]

The shapes data is generated once, then exported to the tab-separated CSV + image files that
``open_clip_train`` reads. Both tools get the same compute threads and data workers (open_clip's
DataLoader workers, Ray Data's CPUs), each in its own process tree started from here, and both
log every 5 steps. Steady-state samples/s is the median, over the 5-step logging windows that
start after step 10, of the window's samples over its time — each tool's own figure for it:
pairsim's ``train/samples_per_s``, open_clip_train's batch size over its "Batch (t)" (the mean
step time since its last log line; its "/s" figure is the last step's alone). Both windows hold
the data waits and the logging of the previous line. With ``--repeats N`` each tool runs N times,
the two in turn, and each figure is its median over the N runs. Start-up is the time from launching the
tool until its first training step has finished (open_clip_train's first log line; pairsim's
``perf/startup_s``, logged then). Where the machine's CPU went in each run's steady windows is
sampled for every process (:mod:`machine_cpu`): the training process, the data workers, the other
processes a tool starts (Ray's, for pairsim), this script and the rest of the machine. Both clip the gradients' global norm at pairsim's default
``optim.grad_clip`` (open_clip_train's ``--grad-clip-norm``). open_clip_train runs bf16 as ``amp_bf16`` (float32 weights,
bf16 autocast); pairsim runs ``--precision bf16`` as DeepSpeed's bf16 (bf16 weights, float32
master copy in the optimizer) and ``amp_bf16`` as open_clip does. Peak GPU memory is torch's allocator peak in the training process.

``--synthetic``: pairsim's step (the worker's: normalise, forward, loss, backward, optimizer,
temperature clamp) on uint8 pixels and tokens made once on the device, timed over the same
5-step windows (the device synchronised at each window's ends) of as many steps as the real
run's epoch (at least two windows after the warm-up), in this process, one engine
after another: the real run's config (its ceiling), then that config with each of
``--variants`` (comma-separated overrides each: ``train.zero_stage=3``,
``train.precision=amp_bf16``, ``train.compile=true`` — whose first window holds the compilation —
``optim.grad_clip=0``, …), then with ``--plain`` the same model and objective in a plain PyTorch
loop (no DeepSpeed). With ``--repeats N`` the steps are measured in N rounds, each in turn in
every round, and each figure is the median over the rounds (``--repeats 0``: no real runs, one
round). ``--profile-steps K`` profiles K more steps of each in the last round (torch.profiler:
kernel time against wall time, launches, the host's waits on the device, the operators with
the most host time). ``--real-variants`` adds pairsim real-data runs with overrides, each
taken in turn with the others. Results go to ``bench_train.json`` on the CPU,
``bench_train_gpu.json`` on a GPU.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import psutil
import pyarrow.parquet as pq
import torch

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results
from machine_cpu import MachineCpu, Process, ray_data_task

from pairsim.config import ConfigError, RunConfig, load_config
from pairsim.data import shards, synth
from pairsim.models import clip

WARMUP_STEPS = 10
LOG_EVERY = 5
STARTUP_PREFIX = "perf/startup/"  # the run's start-up phases (pairsim.train.worker.StartupClock)
PLAIN = "plain PyTorch loop (no DeepSpeed)"
CPU_GROUPS = ("training", "data", "others", "script", "rest")  # see cpu_use
OPEN_CLIP_PRECISION = {"fp32": "fp32", "bf16": "amp_bf16", "amp_bf16": "amp_bf16"}  # pairsim's → open_clip's


def export_csv(dataset: Path, out: Path) -> Path:
    """open_clip's CSV form of the train split: one row per image with its first caption."""
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    table = out / "train.csv"
    with table.open("w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title"])
        for shard in shards.split_files(dataset, "train"):
            for row in pq.read_table(shard, columns=["image", "image_id", "captions"]).to_pylist():
                path = images / f"{row['image_id']}.png"
                path.write_bytes(row["image"])
                writer.writerow([str(path), row["captions"][0]])
    return table


def run_open_clip_train(table: Path, out: Path, args, cpu: MachineCpu) -> dict[str, Any]:
    """Run ``open_clip_train.main`` (pairsim's tiny architecture registered); parse its log, each
    line stamped as it arrives; the CPU used in its steady windows (:func:`cpu_use`)."""
    argv = ["--train-data", str(table), "--dataset-type", "csv", "--csv-img-key", "filepath",
            "--csv-caption-key", "title", "--model", args.model, "--batch-size", str(args.batch_size),
            "--epochs", "1", "--workers", str(args.data_workers), "--device", args.device,
            "--precision", OPEN_CLIP_PRECISION[args.precision], "--lr", "1e-3", "--warmup", "10", "--wd", "0.1",
            "--grad-clip-norm", str(load_config(None).optim.grad_clip),  # pairsim's default clipping
            "--log-every-n-steps", str(LOG_EVERY), "--save-frequency", "0", "--zeroshot-frequency", "0",
            "--val-frequency", "0", "--logs", str(out / "open_clip_logs"),
            "--name", datetime.now().strftime("bench-%H%M%S"), "--train-num-samples", str(args.images)]
    code = ("import sys, torch, pairsim.models.clip; from open_clip_train.main import main; main(sys.argv[1:]); "
            "print('peak GPU bytes', torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"} | (
        {"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {})
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = [(time.time(), line) for line in proc.stdout]  # each stamped as it arrives
    wall = time.time() - start
    log = "".join(line for _, line in lines)
    if proc.wait() != 0:
        raise RuntimeError(f"open_clip_train failed:\n{log[-6000:]}")
    pattern = re.compile(r"\| INFO \| Train Epoch: \d+ \[\s*(\d+)/.*?Batch \(t\): ([\d.]+),")
    windows = [(t, int(found[1]) // args.batch_size, args.batch_size / float(found[2]))
               for t, line in lines if (found := pattern.search(line))]
    steady = [(t, rate) for t, end, rate in windows if end - LOG_EVERY + 1 > WARMUP_STEPS]
    if not steady:
        raise RuntimeError(f"open_clip_train logged {len(windows)} windows:\n{log[-3000:]}")
    peak = int(re.findall(r"peak GPU bytes (\d+)", log)[-1])
    samples = len(steady) * LOG_EVERY * args.batch_size
    used = cpu_use(cpu, window_start(windows, steady), steady[-1][0], samples,
                   training=lambda p: p.pid == proc.pid, data=lambda p: p.parent == proc.pid)
    return {"rate": statistics.median(rate for _, rate in steady), "startup": windows[0][0] - start, "wall": wall,
            "peak_gib": peak / 2**30 if args.device == "cuda" else None, "cpu": used}


def window_start(logged: list[tuple], steady: list[tuple]) -> float:
    """When the first steady window began: the instant of the log line before it (each line's
    instant first in its tuple)."""
    return logged[[t for t, *_ in logged].index(steady[0][0]) - 1][0]


def pairsim_config(dataset: Path, out: Path, args, *overrides: str) -> RunConfig:
    gpu = args.device == "cuda"
    return load_config(None, [
        f"data.path={dataset}", f"model.arch={args.model}", "train.num_workers=1",
        f"train.cpus_per_worker={args.threads}", f"ray.data_cpus={args.data_workers}", "train.zero_stage=0",
        f"train.precision={args.precision}", f"train.use_gpu={str(gpu).lower()}",
        f"train.micro_batch_size={args.batch_size}", "train.epochs=1", f"train.log_every_n_steps={LOG_EVERY}",
        "optim.lr=1e-3", "optim.warmup_steps=10", "optim.weight_decay=0.1",
        f"tracking.tracking_uri=sqlite:///{out}/mlflow.db", f"ray.storage_path={out}/ray", *overrides])


def run_pairsim(cfg: RunConfig, cpu: MachineCpu) -> dict[str, Any]:
    import ray
    from mlflow.tracking import MlflowClient

    from pairsim.train import driver

    start = time.time()
    result = driver.fit(cfg)
    wall = time.time() - start
    ray.shutdown()  # the next run starts Ray again, as open_clip_train starts afresh every run
    client = MlflowClient(result.tracking_uri)

    def history(key):
        return client.get_metric_history(result.mlflow_run_id, key)

    windows = [(m.timestamp / 1000, m.step, m.value) for m in sorted(history("train/samples_per_s"), key=lambda m: m.step)]
    steady = [(t, rate) for t, step, rate in windows if step - LOG_EVERY + 1 > WARMUP_STEPS]
    samples = len(steady) * LOG_EVERY * cfg.train.micro_batch_size
    used = cpu_use(cpu, window_start(windows, steady), steady[-1][0], samples,
                   training=lambda p: p.name == "ray::RayTrainWorker",
                   data=ray_data_task)
    peak = history("perf/gpu_peak_memory_gib")
    phases = {key.removeprefix(STARTUP_PREFIX).removesuffix("_s"): value
              for key, value in client.get_run(result.mlflow_run_id).data.metrics.items()
              if key.startswith(STARTUP_PREFIX)}
    return {"rate": statistics.median(rate for _, rate in steady),
            "startup": history("perf/startup_s")[0].timestamp / 1000 - start, "wall": wall,
            "peak_gib": max(m.value for m in peak) if peak else None,
            "val_share": history("perf/val_share")[-1].value, "phases": phases, "cpu": used}


def cpu_use(cpu: MachineCpu, start: float, end: float, samples: int, training: Callable[[Process], bool],
            data: Callable[[Process], bool]) -> dict[str, Any]:
    """The machine's CPU time in ``[start, end]`` (a run's steady windows), as % of all its
    cores, by group: the ``training`` process, the ``data`` workers, the other processes this
    script started (Ray's, for pairsim), this script (pairsim's Ray driver; the sampler) and the
    rest of the machine; the training and data CPU ms per sample; each of Ray's processes' %."""
    group = cpu.classify(training=training, data=data)
    capacity = (end - start) * psutil.cpu_count() / 100
    seconds = cpu.by_group([(start, end)], group)
    others = cpu.by_group([(start, end)], lambda process: process.name if group(process) == "others" else "")
    return {"window_s": end - start} | {g: seconds.get(g, 0.0) / capacity for g in ("busy", *CPU_GROUPS)} | {
        "training_ms": seconds.get("training", 0.0) * 1e3 / samples, "data_ms": seconds.get("data", 0.0) * 1e3 / samples,
        "others_by_name": {name: s / capacity for name, s in others.items() if name not in ("", "busy")}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def synthetic_inputs(cfg: RunConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """A batch made once on ``device``: random uint8 pixels at the model's input size, tokens, group ids."""
    batch, size = cfg.train.micro_batch_size, clip.preprocess_cfg(cfg.model).size
    height, width = (size, size) if isinstance(size, int) else size
    return {"pixels": torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8, device=device),
            "tokens": clip.tokenizer(cfg.model.arch)([f"a synthetic caption {i}" for i in range(batch)]).to(device),
            "group_ids": torch.arange(batch, device=device)}


def time_steps(step: Callable[[], None], steps: int, batch: int, device: torch.device,
               profile_steps: int = 0) -> dict[str, Any]:
    """``step()`` run ``steps`` times in 5-step windows (the device synchronised at each window's
    ends): steady samples/s after the warm-up, the first window's seconds and the allocator's
    peak; then, with ``profile_steps``, that many more under torch.profiler (:func:`step_profile`)."""
    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(steps // LOG_EVERY):
        synchronize()
        began = time.perf_counter()
        for _ in range(LOG_EVERY):
            step()
        synchronize()
        seconds.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    timed = {"rate": statistics.median(LOG_EVERY * batch / s for s in seconds[WARMUP_STEPS // LOG_EVERY:]),
             "first_window_s": seconds[0], "peak_gib": peak}
    return timed | ({"profile": step_profile(step, profile_steps, device)} if profile_steps else {})


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def step_profile(step: Callable[[], None], steps: int, device: torch.device, top: int = 12) -> dict[str, Any]:
    """Where a step's time goes, over ``steps`` steps under torch.profiler: its wall ms, the ms
    the GPU ran kernels in it (None on the CPU), the host's blocking waits on the device per step (the
    :data:`SYNC_CALLS`: a cudaMemcpy from pageable memory waits too), and the ``top`` operators
    by self CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall_ms = (time.perf_counter() - began) * 1e3 / steps
    events = prof.key_averages()
    on_host = [e for e in events if e.device_type.name == "CPU"]
    on_device = [e for e in events if e.device_type.name == "CUDA"]  # kernels and copies, as the GPU ran them
    kernels_ms = (sum(e.self_device_time_total for e in on_device or on_host) / 1e3 / steps
                  if device.type == "cuda" else None)
    syncs = {e.key: e.count / steps for e in events if e.key in SYNC_CALLS}
    ops = sorted(on_host, key=lambda e: -e.self_cpu_time_total)[:top]
    return {"wall_ms": wall_ms, "kernels_ms": kernels_ms, "syncs_per_step": syncs,
            "launches_per_step": sum(e.count for e in events if e.key.startswith(("cudaLaunch", "cuLaunch"))) / steps,
            "ops": [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3 / steps, "calls": e.count / steps,
                     "self_gpu_ms": e.self_device_time_total / 1e3 / steps} for e in ops]}


def run_synthetic(cfg: RunConfig, steps: int, profile_steps: int = 0) -> dict[str, Any]:
    """pairsim's training step on inputs made once on the device: :func:`time_steps` of
    ``accumulation.train_step`` and the temperature clamp, as the recipe runs them."""
    import deepspeed

    from pairsim.train import accumulation
    from pairsim.train import engine as engines

    if not torch.distributed.is_initialized():  # one rank, as DeepSpeed wants it
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        deepspeed.init_distributed(dist_backend="nccl" if cfg.train.use_gpu else "gloo")
    engine = engines.create_engine(cfg, engines.deepspeed_config(cfg.train, cfg.optim, steps + profile_steps))
    dtype, inputs, normalize = engines.DTYPES[cfg.train.precision], synthetic_inputs(cfg, engine.device), \
        clip.PixelNormalizer(cfg.model)

    def step():
        accumulation.train_step(engine, [{"image": normalize(inputs["pixels"], dtype), "text": inputs["tokens"],
                                          "group_ids": inputs["group_ids"]}])
        engines.clamp_temperatures(engine)

    measured = time_steps(step, steps, cfg.train.micro_batch_size, engine.device, profile_steps)
    engine.destroy()
    del engine
    if cfg.train.use_gpu:
        torch.cuda.empty_cache()
    return measured


def run_plain_synthetic(cfg: RunConfig, steps: int, profile_steps: int = 0) -> dict[str, Any]:
    """The same model and objective in a plain PyTorch loop, open_clip_train's arithmetic
    (float32 weights, bf16 autocast when ``cfg`` asks for bf16, torch's fused AdamW, its
    global-norm clipping): the step without DeepSpeed, as a ceiling for pairsim's."""
    from pairsim.build import build_objective
    from pairsim.models import retrieval
    from pairsim.train.engine import parameter_groups

    device = torch.device("cuda" if cfg.train.use_gpu else "cpu")
    objective = build_objective(cfg.loss, 0, 1)
    torch.manual_seed(cfg.train.seed)
    model = retrieval.create_retrieval_model(cfg.model, fused="fused" in objective.needs).to(device)
    objective.to(device)
    params = parameter_groups(torch.nn.ModuleList([model, objective]), cfg.optim.weight_decay)
    trained = [param for group in params for param in group["params"]]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps, fused=True)
    inputs, normalize = synthetic_inputs(cfg, device), clip.PixelNormalizer(cfg.model)
    autocast = cfg.train.precision in ("bf16", "amp_bf16")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            features = model(image=normalize(inputs["pixels"]), text=inputs["tokens"])
            loss = objective(**features, group_ids=inputs["group_ids"])["loss"]
        loss.backward()
        if cfg.optim.grad_clip:  # every trained parameter, the temperatures too, as DeepSpeed clips
            torch.nn.utils.clip_grad_norm_(trained, cfg.optim.grad_clip)
        optimizer.step()

    measured = time_steps(step, steps, cfg.train.micro_batch_size, device, profile_steps)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=6400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="compute threads for each tool")
    parser.add_argument("--data-workers", type=int, default=1, help="data workers (CPUs) for each tool")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", default="pairsim-tiny", help="an open_clip architecture")
    parser.add_argument("--image-size", type=int, help="of the generated images (default: the model's input)")
    parser.add_argument("--precision", choices=list(OPEN_CLIP_PRECISION), default="fp32")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each tool, taken in turn; the table gives each figure's median over them "
                             "(0: none, the --synthetic steps alone)")
    parser.add_argument("--synthetic", action="store_true", help="also pairsim's step on pre-made device tensors")
    parser.add_argument("--variants", nargs="*", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="with --synthetic: also the step with these config overrides, one variant each")
    parser.add_argument("--real-variants", nargs="*", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="also pairsim's real-data run with these config overrides, one run each")
    parser.add_argument("--plain", action="store_true",
                        help="with --synthetic: also the model and objective in a plain PyTorch loop (no DeepSpeed)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="with --synthetic: profile this many more steps of each (torch.profiler)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/train"))
    results.add_results_argument(parser)
    args = parser.parse_args()
    for variant in args.variants + args.real_variants:  # a bad key fails here, before any run
        try:
            pairsim_config(Path("."), Path("."), args, *variant.split(","))
        except ConfigError as exc:
            parser.error(f"--variants {variant}: {exc}")
    started = time.perf_counter()
    out = args.out.resolve()
    size = args.image_size or clip.preprocess_cfg(load_config(None, [f"model.arch={args.model}"]).model).size
    size = size if isinstance(size, int) else max(size)
    dataset = out / f"shapes-{size}px-{args.images}"
    if not (dataset / shards.MANIFEST).exists():
        synth.generate(dataset, num_train=args.images, num_val=200, num_test=0, image_size=size)
    table = dataset.with_name(dataset.name + "-csv") / "train.csv"
    if not table.exists():
        export_csv(dataset, table.parent)

    real = f"pairsim (1 worker, ZeRO-0, {args.precision})"
    pairsim_runs = {real: ()} | {f"pairsim, {variant}": tuple(variant.split(",")) for variant in args.real_variants}
    runs: dict[str, list[dict[str, float]]] = {"open_clip_train (baseline)": []} | {name: [] for name in pairsim_runs}
    with MachineCpu() as cpu:
        for _ in range(args.repeats):  # in turn, so a slow spell of the machine falls on both
            runs["open_clip_train (baseline)"].append(run_open_clip_train(table, out, args, cpu))
            for name, overrides in pairsim_runs.items():
                runs[name].append(run_pairsim(pairsim_config(dataset, out, args, *overrides), cpu))
    measured = {name: median_run(tool_runs) for name, tool_runs in runs.items() if tool_runs}
    synthetic: dict[str, dict[str, Any] | str] = {}  # a failure's message in place of its figures

    def publish() -> None:  # after each measurement: a run stopped at its time limit keeps what it measured
        results.publish("bench_train", tables(args, size, measured, real, synthetic), args.results,
                        time.perf_counter() - started, on_gpu=args.device == "cuda")

    publish()
    steps = max(args.images // args.batch_size, WARMUP_STEPS + 2 * LOG_EVERY)
    variants = {real: ()} | {variant: tuple(variant.split(",")) for variant in args.variants}
    runners = {name: functools.partial(run_synthetic, pairsim_config(dataset, out, args, *overrides))
               for name, overrides in variants.items()}
    if args.plain:
        runners[PLAIN] = functools.partial(run_plain_synthetic, pairsim_config(dataset, out, args))
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    last_round = max(args.repeats, 1) - 1
    for round_ in range(last_round + 1 if args.synthetic else 0):  # every step in turn in each, as the runs
        for name, runner in runners.items():
            if isinstance(synthetic.get(name), str):  # failed in an earlier round
                continue
            try:
                rounds[name].append(runner(steps, args.profile_steps if round_ == last_round else 0))
            except Exception as exc:  # the other rows still count; the failure is the row's finding
                traceback.print_exc()
                synthetic[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                continue
            synthetic[name] = median_run(rounds[name])
            publish()


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over a tool's runs (None where the tool has none; start-up ``phases``
    and ``cpu`` each entry's median; a step's ``profile``, the last run's); ``rates``: every
    run's steady rate."""
    nested = ("phases", "cpu", "profile")
    figures = {key: None if runs[0][key] is None else statistics.median(run[key] for run in runs)
               for key in runs[0] if key not in nested}
    phases = {phase: statistics.median(run["phases"][phase] for run in runs) for phase in runs[0].get("phases", {})}
    return figures | {"rates": [run["rate"] for run in runs]} | ({"phases": phases} if phases else {}) | (
        {"cpu": median_cpu([run["cpu"] for run in runs])} if "cpu" in runs[0] else {}) | (
        {"profile": runs[-1]["profile"]} if "profile" in runs[-1] else {})


def median_cpu(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`cpu_use`'s figures, each the median over runs (a process a run lacks: 0 there)."""
    names = dict.fromkeys(name for run in runs for name in run["others_by_name"])
    return {key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "others_by_name"} | {
        "others_by_name": {name: statistics.median(run["others_by_name"].get(name, 0.0) for run in runs)
                           for name in names}}


def tables(args, size: int, measured: dict[str, dict[str, float]], real: str,
           synthetic: dict[str, dict[str, float] | str]) -> list[results.Table]:
    where = (f"{torch.cuda.get_device_name()}, {args.precision}" if args.device == "cuda" else
             f"{args.threads} compute threads")
    throughput = results.Table(
        f"Training throughput: {args.model}, {size} px, batch {args.batch_size}, {args.images} images, 1 epoch, "
        f"{where}, {args.data_workers} data worker(s) each",
        ["tool", "steady samples/s", "ratio", "start-up s", "wall s", "peak GPU GiB", "val s / train s", "runs' rates"],
        ["", ".1f", ".2f", ".1f", ".1f", ".2f", ".3f", ""])
    baseline = measured["open_clip_train (baseline)"]["rate"] if measured else None
    for name, m in measured.items():
        throughput.add(name, m["rate"], m["rate"] / baseline, m["startup"], m["wall"], m["peak_gib"], m.get("val_share"),
                       ", ".join(f"{rate:.1f}" for rate in m["rates"]))
    throughput.notes.append(f"Steady: the median rate over the {LOG_EVERY}-step logging windows after step "
                            f"{WARMUP_STEPS}; each figure the median over {args.repeats} run(s) of each tool, "
                            "taken in turn (the last column: each run's steady rate). pairsim's wall time also holds "
                            "Ray's start, a val evaluation (its seconds over the epoch's training seconds: val s / "
                            "train s) and a checkpoint, which the baseline was told to skip; its peak memory holds "
                            "the validation.")
    tables_ = [throughput] if measured else []
    phased = {name: m["phases"] for name, m in measured.items() if "phases" in m}
    if phased:
        phases = list(dict.fromkeys(phase for p in phased.values() for phase in p))
        startup = results.Table("pairsim's start-up by phase (perf/startup/<phase>_s, median over runs), s",
                                ["run", *phases, "sum"], ["", *[".1f"] * len(phases), ".1f"])
        for name, p in phased.items():
            startup.add(name, *[p.get(phase) for phase in phases], sum(p.values()))
        startup.notes.append("Phases in order (pairsim.train.worker.StartupClock): the driver's checks, Ray's "
                             "start, MLflow, the datasets; the worker group (Train's controller, workers, process "
                             "group); on rank 0 the engine, restore, MLflow; the first batch and the first step.")
        tables_.append(startup)
    with_cpu = {name: m["cpu"] for name, m in measured.items() if "cpu" in m}
    if with_cpu:
        tables_ += cpu_tables(with_cpu)
    if not synthetic:
        return tables_
    step = results.Table(
        f"pairsim's step on pre-made device tensors (synthetic) against the real run, {args.model}, batch "
        f"{args.batch_size}, {args.precision}",
        ["pairsim step", "synthetic samples/s", "real data / synthetic", f"first {LOG_EVERY} steps s", "peak GPU GiB",
         "rounds' rates"],
        ["", ".1f", ".2f", ".1f", ".2f", ""])
    for name, m in synthetic.items():
        if isinstance(m, str):
            step.add(name, None, None, None, None, "")
            step.notes.append(f"{name} failed: {m}")
        else:
            step.add(name, m["rate"], measured[real]["rate"] / m["rate"] if name == real and measured else None,
                     m["first_window_s"], m["peak_gib"], ", ".join(f"{rate:.1f}" for rate in m["rates"]))
    step.notes.append("real data / synthetic: the real run's steady rate over its own step's (its ceiling). Each "
                      f"figure the median over {max(args.repeats, 1)} round(s), every step measured in turn in each; "
                      "the profiles are the last round's.")
    profiled = {name: m["profile"] for name, m in synthetic.items() if not isinstance(m, str) and "profile" in m}
    return tables_ + [step] + ([profile_table(args, profiled)] if profiled else []) + [
        op_table(name, profile) for name, profile in profiled.items()]


def cpu_tables(with_cpu: dict[str, dict[str, Any]]) -> list[results.Table]:
    cores = psutil.cpu_count()
    groups = results.Table(
        f"Where the machine's CPU went in the steady windows: % of its {cores} cores' time (median over runs)",
        ["tool", "window s", "busy", "training process", "data workers", "other processes started",
         "this script", "rest of the machine", "training CPU ms / sample", "data CPU ms / sample"],
        ["", ".1f", ".1f", ".1f", ".1f", ".1f", ".1f", ".1f", ".2f", ".2f"])
    for name, c in with_cpu.items():
        groups.add(name, c["window_s"], c["busy"], *(c[group] for group in CPU_GROUPS), c["training_ms"], c["data_ms"])
    groups.notes.append(
        "Every process's CPU time (user + system, sampled every 0.5 s) over the span of the steady windows. "
        "Data workers: open_clip_train's DataLoader workers, Ray Data's tasks. Other processes started: by "
        "this script, what neither tool's training nor data needs of them: Ray's (the raylet, the GCS, the "
        "dashboard and its agents, Ray Train's and Ray Data's actors) for pairsim, none for open_clip_train. "
        "This script: pairsim's Ray driver, and the sampler in both (alone in open_clip_train's row).")
    others = {name: c["others_by_name"] for name, c in with_cpu.items() if c["others"] > 0}
    if not others:
        return [groups]
    names = sorted({n for by_name in others.values() for n in by_name},
                   key=lambda n: -max(by_name.get(n, 0.0) for by_name in others.values()))
    listed = results.Table("The other processes started, by name: % of the machine's CPU in the steady windows",
                           ["process", *others], ["", *[".2f"] * len(others)])
    for process in names:
        listed.add(process, *(by_name.get(process, 0.0) for by_name in others.values()))
    return [groups, listed]


def profile_table(args, profiled: dict[str, dict[str, Any]]) -> results.Table:
    summary = results.Table(
        f"Where a step goes, {args.profile_steps} steps under torch.profiler (per step)",
        ["step", "wall ms", "GPU kernels ms", "kernels / wall", "kernel launches", "host waits on the device"],
        ["", ".1f", ".1f", ".2f", ".0f", ""])
    for name, p in profiled.items():
        on_gpu = p["kernels_ms"] is not None
        summary.add(name, p["wall_ms"], p["kernels_ms"], p["kernels_ms"] / p["wall_ms"] if on_gpu else None,
                    p["launches_per_step"] if on_gpu else None,
                    (", ".join(f"{k} {v:g}" for k, v in p["syncs_per_step"].items()) or "none") if on_gpu else None)
    summary.notes.append("GPU kernels ms: the time kernels ran; kernels / wall under 1 is the GPU waiting on the "
                         "host (launches, Python, host waits). The profiler's own cost is in the wall ms.")
    return summary


def op_table(name: str, profile: dict[str, Any]) -> results.Table:
    ops = results.Table(f"{name}: the operators with the most host time, per step",
                        ["operator", "self CPU ms", "calls", "self GPU ms"], ["", ".2f", ".1f", ".2f"])
    for op in profile["ops"]:
        ops.add(op["op"], op["self_cpu_ms"], op["calls"], op["self_gpu_ms"])
    return ops


if __name__ == "__main__":
    main()

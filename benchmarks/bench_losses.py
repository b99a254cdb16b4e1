"""Benchmark: forward + backward time and peak extra memory of pairsim's losses vs open_clip's ClipLoss
(and its SigLipLoss), on one process and, for the sigmoid loss, on 2 gloo ranks.

    python benchmarks/bench_losses.py                    # B = 256, 1024, 4096; d = 512; this machine's device
    python benchmarks/bench_losses.py --sizes 256 1024 --repeats 3

Every loss gets the same random features (d = 512; teacher features d = 384 for CUSA) and the
baseline, open_clip's ``ClipLoss``, is measured in the same run, in the same process, timed the
same way: the median of ``--repeats`` forward + backward passes (``time.perf_counter``, the device
synchronised around each) after one untimed warm-up pass. Each loss is timed twice: bare (its
module called directly, as ``ClipLoss`` is) and through :class:`~pairsim.losses.Objective`, what
training runs (one gather for every term, the finite check, the detached parts).
Peak extra memory (beyond the inputs, through ``Objective``)
comes from CUDA's allocator statistics or, on CPU, from ``torch.profiler``'s record of every
allocation; it is reported in units of one B×B float32 matrix, beside the similarity matrices
each loss must hold ("sims") and those plus the gradients autograd must hold for them
("+grads", the floor for any autograd implementation: ClipLoss itself peaks at 1.5× of it).

Targets (issue 3): InfoNCE, Unified, Triplet-HN ≤ 1.3× ClipLoss time; GCL ≤ 10× (its 3N×3N
matrix is 9× the logits); CUSA with teacher features given ≤ 4×; peak extra memory within 2×
of the similarity matrices the loss must hold. The sigmoid loss: ≤ 1.3× open_clip's SigLipLoss.

Distributed (issue 56): the global batch B split over 2 gloo ranks on this machine's CPUs, each
rank's median forward + backward and its peak extra memory (torch.profiler, as above) in units of
one B_local × B_local float32 block: pairsim's sigmoid loss with ``loss.local_loss`` (the ring,
each block recomputed in the backward, none kept: a peak that grows with B_local², not with
B_local × B), open_clip's
SigLipLoss with each ``dist_impl``, and pairsim scoring every row (``local_loss`` off: the global
B × B matrix on every rank).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss, SigLipLoss

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results
from pairsim.losses import CUSALoss, GCLLoss, ImageTextLoss, InfoNCE, Objective, Sigmoid, TripletHN, Unified

DIM, TEACHER_DIM = 512, 384

# name → (what it reads, similarity matrices it must hold and how many of them need a gradient
# [B×B each], target time ratio, the baseline it is timed against: a row of its own, measured
# first). CUSA: i2t, t2i, uni image, uni text (with gradients) and the two teacher matrices
# (without). GCL: one 3N×3N matrix = 9. The sigmoid loss: one image→text matrix.
CLIP, SIGLIP = "ClipLoss (open_clip)", "SigLipLoss (open_clip)"
LOSSES = {
    CLIP: (("image", "text"), (2, 2), None, None),
    "InfoNCE": (("image", "text"), (2, 2), 1.3, CLIP),
    "Unified": (("image", "text"), (2, 2), 1.3, CLIP),
    "Triplet-HN": (("image", "text"), (2, 2), 1.3, CLIP),
    "GCL (InfoNCE)": (("image", "text", "fused"), (9, 9), 10.0, CLIP),
    "CUSA (Unified + CSA + USA)": (("image", "text", "image_unimodal", "text_unimodal", "teacher_image",
                                    "teacher_text"), (6, 4), 4.0, CLIP),
    SIGLIP: (("image", "text"), (1, 1), None, None),
    "Sigmoid (SigLIP)": (("image", "text"), (1, 1), 1.3, SIGLIP),
}


def build(name: str, device: torch.device, wrapped: bool):
    """A callable features → scalar loss: the loss module called directly (``wrapped`` False),
    or through the :class:`Objective` that training runs (one gather, finite check, parts)."""
    if name == CLIP:
        clip, scale = ClipLoss(), torch.tensor(20.0, device=device)
        return lambda f: clip(F.normalize(f["image"], dim=-1), F.normalize(f["text"], dim=-1), scale)
    if name == SIGLIP:
        return siglip(SigLipLoss(), device)
    structure = {"InfoNCE": lambda: ImageTextLoss(InfoNCE()), "Unified": lambda: ImageTextLoss(Unified()),
                 "Triplet-HN": lambda: ImageTextLoss(TripletHN()), "Sigmoid (SigLIP)": lambda: ImageTextLoss(Sigmoid()),
                 "GCL (InfoNCE)": lambda: GCLLoss(InfoNCE()),
                 "CUSA (Unified + CSA + USA)": lambda: ImageTextLoss(Unified())}[name]().to(device)
    cusa = CUSALoss().to(device) if name.startswith("CUSA") else None
    if wrapped:
        objective = Objective(structure, cusa)
        return lambda f: objective(**f)["loss"]
    if cusa is None:
        return lambda f: structure(**{k: f[k] for k in structure.inputs})

    def bare_cusa(f):
        csa, usa = cusa(**f)
        return structure(image=f["image"], text=f["text"]) + 0.1 * csa + 0.5 * usa
    return bare_cusa


def siglip(loss: SigLipLoss, device: torch.device):
    """open_clip's SigLipLoss at the paper's initial scale (10) and bias (−10), pairsim's defaults."""
    scale, bias = torch.tensor(10.0, device=device), torch.tensor(-10.0, device=device)
    return lambda f: loss(F.normalize(f["image"], dim=-1), F.normalize(f["text"], dim=-1), scale, bias)


def features(name: str, b: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for key in LOSSES[name][0]:
        dim = TEACHER_DIM if key.startswith("teacher") else DIM
        out[key] = torch.randn(b, dim, generator=g).to(device).requires_grad_(not key.startswith("teacher"))
    return out


def step(loss_fn, feats) -> None:
    loss_fn(feats).backward()
    for v in feats.values():
        v.grad = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_it(name: str, b: int, device: torch.device, repeats: int, wrapped: bool) -> float:
    loss_fn, feats = build(name, device, wrapped), features(name, b, device)
    step(loss_fn, feats)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step(loss_fn, feats)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_extra_bytes(name: str, b: int, device: torch.device) -> int:
    """Peak bytes allocated beyond the inputs during one forward + backward through ``Objective``."""
    return peak_bytes(build(name, device, wrapped=True), features(name, b, device), device)


def peak_bytes(loss_fn, feats: dict[str, torch.Tensor], device: torch.device) -> int:
    """Peak bytes allocated beyond ``feats`` during one forward + backward of ``loss_fn``: CUDA's
    allocator statistics, or on CPU the running sum of every op's allocations and frees as
    recorded by ``torch.profiler`` (``profile_memory=True``), in time order."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(loss_fn, feats)
        sync(device)
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(loss_fn, feats)
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


DISTRIBUTED = ["pairsim Sigmoid, local_loss (ring)", "SigLipLoss shift", "SigLipLoss bidir", "SigLipLoss gather",
               "pairsim Sigmoid, every row"]


def distributed_rank(rank: int, world: int, port: int, sizes: list[int], repeats: int, out) -> None:
    """On one of ``world`` gloo ranks: each :data:`DISTRIBUTED` loss's median forward + backward
    time and peak extra bytes on this rank's share of each global batch size."""
    import torch.distributed as dist

    from pairsim.build import build_objective
    from pairsim.config import load_config

    torch.set_num_threads(1)  # one CPU a rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cpu = torch.device("cpu")
    measured = {}
    for b in sizes:
        for name in DISTRIBUTED:
            if name.startswith("pairsim"):
                local = "ring" in name
                objective = build_objective(load_config(None, ["loss.base=sigmoid", f"loss.local_loss={local}"]).loss,
                                            rank, world)
                loss_fn = lambda f, objective=objective: objective(**f)["loss"]  # noqa: E731
            else:
                loss_fn = siglip(SigLipLoss(rank=rank, world_size=world, dist_impl=name.split()[-1]), cpu)
            feats = features("Sigmoid (SigLIP)", b // world, cpu)
            step(loss_fn, feats)
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                step(loss_fn, feats)
                times.append(time.perf_counter() - start)
            dist.barrier()
            measured[b, name] = (statistics.median(times), peak_bytes(loss_fn, feats, cpu))
    out.put((rank, measured))
    dist.barrier()
    dist.destroy_process_group()


def distributed_tables(sizes: list[int], repeats: int, world: int = 2) -> list[results.Table]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=distributed_rank, args=(rank, world, port, sizes, repeats, out)) for rank in range(world)]
    for proc in procs:
        proc.start()
    measured = dict(out.get(timeout=3600) for _ in procs)
    for proc in procs:
        proc.join()
    tables = []
    for b in sizes:
        table = results.Table(
            f"B = {b} over {world} gloo ranks (B_local = {b // world}, one CPU thread each): the sigmoid loss, "
            f"forward + backward, median of {repeats} after one warm-up",
            ["loss", "ms (rank 0)", "× SigLipLoss shift", "peak extra (rank 0)", "peak extra (max over ranks)"],
            ["", ".1f", ".2f", ".2f", ".2f"])
        block = (b // world) ** 2 * 4
        shift = measured[0][b, "SigLipLoss shift"][0]
        for name in DISTRIBUTED:
            seconds, peak = measured[0][b, name]
            table.add(name, seconds * 1e3, seconds / shift, peak / block,
                      max(measured[r][b, name][1] for r in measured) / block)
        tables.append(table)
    tables[-1].notes.append("Peak extra: in B_local × B_local float32 blocks, the largest memory allocated on a rank "
                           "during one pass beyond its features (torch.profiler's record of every allocation).")
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="+", metavar="LOSS", help="losses to run beside the baselines (name prefixes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--distributed-sizes", type=int, nargs="*", default=[1024, 4096],
                        help="global batch sizes of the sigmoid loss on 2 gloo ranks (none: skip)")
    results.add_results_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    tables = []
    for b in args.sizes:
        table = results.Table(
            f"B = {b}: forward + backward on {device} ({torch.get_num_threads()} threads), d = {DIM}, "
            f"teacher d = {TEACHER_DIM}, median of {args.repeats} after one warm-up",
            ["loss", "bare ms", "× baseline", "via Objective ms", "× baseline", "target", "peak extra", "sims",
             "+grads", "peak/(sims+grads)"],
            ["", ".1f", ".2f", ".1f", ".2f", "", ".1f", "d", "d", ".2f"])
        matrix = b * b * 4
        bare_ms = {}
        for name, (_, (sims, grads), target, against) in LOSSES.items():
            if args.only and target is not None and not any(name.startswith(o) for o in args.only):
                continue
            if against is not None and against not in bare_ms:
                continue  # its baseline was left out
            bare = bare_ms[name] = time_it(name, b, device, args.repeats, wrapped=False)
            wrapped = None if target is None else time_it(name, b, device, args.repeats, wrapped=True)
            baseline = bare_ms[against or name]
            extra = peak_extra_bytes(name, b, device) / matrix
            table.add(name, bare * 1e3, bare / baseline, None if wrapped is None else wrapped * 1e3,
                      None if wrapped is None else wrapped / baseline,
                      f"{target}× {against.split()[0]}" if target else None,
                      extra, sims, sims + grads, extra / (sims + grads))
        tables.append(table)
    tables[-1].notes.append("Peak extra: the largest memory allocated during one pass through `Objective` beyond the "
                           "inputs, in B×B float32 matrices (CUDA's allocator peak, or on CPU torch.profiler's record of "
                           "every allocation); sims: the similarity matrices the loss must hold, +grads: with their "
                           "gradients (the floor for any autograd implementation).")
    if args.distributed_sizes:
        tables += distributed_tables(args.distributed_sizes, args.repeats)
    results.publish("bench_losses", tables, args.results, time.perf_counter() - started,
                    on_gpu=args.device.startswith("cuda"))


if __name__ == "__main__":
    main()

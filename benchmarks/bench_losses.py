"""Benchmark: forward + backward time and peak extra memory of pairsim's losses vs open_clip's ClipLoss.

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
of the similarity matrices the loss must hold.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results
from pairsim.losses import CUSALoss, GCLLoss, ImageTextLoss, InfoNCE, Objective, TripletHN, Unified

DIM, TEACHER_DIM = 512, 384

# name → (what it reads, similarity matrices it must hold and how many of them need a gradient
# [B×B each], target time ratio). CUSA: i2t, t2i, uni image, uni text (with gradients) and the
# two teacher matrices (without). GCL: one 3N×3N matrix = 9.
LOSSES = {
    "ClipLoss (open_clip)": (("image", "text"), (2, 2), None),
    "InfoNCE": (("image", "text"), (2, 2), 1.3),
    "Unified": (("image", "text"), (2, 2), 1.3),
    "Triplet-HN": (("image", "text"), (2, 2), 1.3),
    "GCL (InfoNCE)": (("image", "text", "fused"), (9, 9), 10.0),
    "CUSA (Unified + CSA + USA)": (("image", "text", "image_unimodal", "text_unimodal", "teacher_image",
                                    "teacher_text"), (6, 4), 4.0),
}


def build(name: str, device: torch.device, wrapped: bool):
    """A callable features → scalar loss: the loss module called directly (``wrapped`` False),
    or through the :class:`Objective` that training runs (one gather, finite check, parts)."""
    if name == "ClipLoss (open_clip)":
        clip, scale = ClipLoss(), torch.tensor(20.0, device=device)
        return lambda f: clip(F.normalize(f["image"], dim=-1), F.normalize(f["text"], dim=-1), scale)
    structure = {"InfoNCE": lambda: ImageTextLoss(InfoNCE()), "Unified": lambda: ImageTextLoss(Unified()),
                 "Triplet-HN": lambda: ImageTextLoss(TripletHN()), "GCL (InfoNCE)": lambda: GCLLoss(InfoNCE()),
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
    """Peak bytes allocated beyond the inputs during one forward + backward: CUDA's allocator
    statistics, or on CPU the running sum of every op's allocations and frees as recorded by
    ``torch.profiler`` (``profile_memory=True``), in time order."""
    loss_fn, feats = build(name, device, wrapped=True), features(name, b, device)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="+", metavar="LOSS", help="losses to run beside ClipLoss (name prefixes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    results.add_results_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    tables = []
    for b in args.sizes:
        table = results.Table(
            f"B = {b}: forward + backward on {device} ({torch.get_num_threads()} threads), d = {DIM}, "
            f"teacher d = {TEACHER_DIM}, median of {args.repeats} after one warm-up",
            ["loss", "bare ms", "× ClipLoss", "via Objective ms", "× ClipLoss", "target", "peak extra", "sims",
             "+grads", "peak/(sims+grads)"],
            ["", ".1f", ".2f", ".1f", ".2f", "", ".1f", "d", "d", ".2f"])
        matrix = b * b * 4
        baseline = None
        for name, (_, (sims, grads), target) in LOSSES.items():
            if args.only and target is not None and not any(name.startswith(o) for o in args.only):
                continue
            bare = time_it(name, b, device, args.repeats, wrapped=False)
            wrapped = None if target is None else time_it(name, b, device, args.repeats, wrapped=True)
            baseline = baseline or bare
            extra = peak_extra_bytes(name, b, device) / matrix
            table.add(name, bare * 1e3, bare / baseline, None if wrapped is None else wrapped * 1e3,
                      None if wrapped is None else wrapped / baseline, f"{target}×" if target else None,
                      extra, sims, sims + grads, extra / (sims + grads))
        tables.append(table)
    tables[-1].notes.append("Peak extra: the largest memory allocated during one pass through `Objective` beyond the "
                           "inputs, in B×B float32 matrices (CUDA's allocator peak, or on CPU torch.profiler's record of "
                           "every allocation); sims: the similarity matrices the loss must hold, +grads: with their "
                           "gradients (the floor for any autograd implementation).")
    results.publish("bench_losses", tables, args.results, time.perf_counter() - started,
                    on_gpu=args.device.startswith("cuda"))


if __name__ == "__main__":
    main()

"""Benchmark: forward + backward time and peak extra memory of pairsim's losses vs open_clip's ClipLoss.

    python benchmarks/bench_losses.py                    # B = 256, 1024, 4096; d = 512; this machine's device
    python benchmarks/bench_losses.py --sizes 256 1024 --repeats 3

Every loss gets the same random features (d = 512; teacher features d = 384 for CUSA) and the
baseline, open_clip's ``ClipLoss``, is measured in the same run. Time is the median of
``--repeats`` forward + backward passes after one warm-up. Peak extra memory (beyond the inputs)
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


def build(name: str, device: torch.device):
    """A callable features → scalar loss."""
    if name == "ClipLoss (open_clip)":
        clip, scale = ClipLoss(), torch.tensor(20.0, device=device)
        return lambda f: clip(F.normalize(f["image"], dim=-1), F.normalize(f["text"], dim=-1), scale)
    module = {
        "InfoNCE": lambda: ImageTextLoss(InfoNCE()),
        "Unified": lambda: ImageTextLoss(Unified()),
        "Triplet-HN": lambda: ImageTextLoss(TripletHN()),
        "GCL (InfoNCE)": lambda: GCLLoss(InfoNCE()),
        "CUSA (Unified + CSA + USA)": lambda: Objective(ImageTextLoss(Unified()), CUSALoss()),
    }[name]().to(device)
    if isinstance(module, Objective):
        return lambda f: module(**f)["loss"]
    return lambda f: module(**f)


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


def time_it(name: str, b: int, device: torch.device, repeats: int) -> float:
    loss_fn, feats = build(name, device), features(name, b, device)
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
    loss_fn, feats = build(name, device), features(name, b, device)
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
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device} ({torch.get_num_threads()} threads), d = {DIM}, teacher d = {TEACHER_DIM}, "
          f"median of {args.repeats}")
    header = (f"{'loss':<28}{'B':>6}{'fwd+bwd ms':>12}{'× ClipLoss':>12}{'target':>8}"
              f"{'peak extra':>12}{'sims':>6}{'+grads':>8}{'peak/(sims+grads)':>19}")
    print(header)
    print("-" * len(header))
    for b in args.sizes:
        matrix = b * b * 4
        baseline = None
        for name, (_, (sims, grads), target) in LOSSES.items():
            if args.only and target is not None and not any(name.startswith(o) for o in args.only):
                continue
            seconds = time_it(name, b, device, args.repeats)
            baseline = baseline or seconds
            extra = peak_extra_bytes(name, b, device) / matrix
            ratio = seconds / baseline
            flag = "" if target is None or ratio <= target else "  over target"
            print(f"{name:<28}{b:>6}{seconds * 1e3:>12.1f}{ratio:>11.2f}×{(f'{target}×' if target else '—'):>8}"
                  f"{extra:>12.1f}{sims:>6}{sims + grads:>8}{extra / (sims + grads):>19.2f}{flag}")
        print()


if __name__ == "__main__":
    main()

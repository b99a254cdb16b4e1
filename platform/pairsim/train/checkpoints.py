"""pairsim checkpoints: save, verify, resume, export.

A checkpoint is a Ray Train checkpoint directory holding a DeepSpeed checkpoint (tag
``deepspeed``, files from every rank, :func:`save_checkpoint`), the model card
(``pairsim_model.json``, written by rank 0) that rebuilds the model, and one checksum file per
rank (``pairsim_checksums/rank_N.json``: SHA-256 of every file that rank wrote).

Loading never runs code from a checkpoint nor reads a file outside it: every file must stay
inside the checkpoint directory (a link leading elsewhere is refused), and every ``.pt`` file is
opened with ``weights_only=True`` (:func:`verify_checkpoint_files`) before DeepSpeed's own
loader, which unpickles freely. :func:`verify_checkpoint` checks those, the model card
(:class:`~pairsim.models.saved.ModelCard`), checksums and that every rank's part is there; on
resume the newest checkpoint that passes is used and newer ones that fail are reported and
skipped (:func:`resume_point`); export and ``model.init_from`` take only one that passes
(:func:`verified_card`); ``pairsim checkpoints list|verify`` shows the same. A directory is
taken for a checkpoint by its expected names only (:func:`is_checkpoint`), before anything in it
is walked: a path that is neither a checkpoint nor a run directory is refused at once.
:func:`export_checkpoint` consolidates a checkpoint — ZeRO-1/2/3 partitions merged into fp32
weights with DeepSpeed's ``zero_to_fp32`` — into ``model.pt`` (open_clip weights),
``model.heads.pt`` and ``model.json``. A run starts from either form with ``model.init_from``
(:func:`check_init_from` on the driver, :func:`load_initial_weights` in the worker).
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray.train
import torch
from pydantic import Field

from pairsim import compat, dist, log, storage, untrusted
from pairsim.config import ConfigError, Int, ModelConfig, Section
from pairsim.errors import InputError
from pairsim.models import clip, retrieval, saved
from pairsim.models.saved import MetadataError, ModelCard, Sha256, UnsafeCheckpointError

logger = log.get_logger("train")
CHECKPOINT_TAG = "deepspeed"
CARD_FILE = "pairsim_model.json"
CHECKSUMS_DIR = "pairsim_checksums"
MODEL_PREFIX = "model."  # the RetrievalModel inside the engine's TrainingModule
NO_CHECKSUMS = f"no {CHECKSUMS_DIR}/: written before pairsim kept checksums, cannot be verified"
NOT_A_CHECKPOINT = f"not a pairsim checkpoint (neither {CARD_FILE} nor {CHECKPOINT_TAG}/ in it)"


class RankChecksums(Section):
    """``pairsim_checksums/rank_N.json``: what one rank wrote into a checkpoint."""

    world_size: Int = Field(ge=1, description="the ranks that wrote the checkpoint")
    files: dict[str, Sha256] = Field(description="the SHA-256 of each file the rank wrote, by its path in it")


def load_checkpoint_file(path: str | Path, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` that also accepts DeepSpeed's own state classes:
    a file that would run code when unpickled is refused (:class:`UnsafeCheckpointError`),
    naming it, with nothing executed."""
    try:
        with torch.serialization.safe_globals(compat.deepspeed.checkpoint_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError) as exc:  # RuntimeError: not torch's zip format
        reason = str(exc).strip().splitlines()[0]
        raise UnsafeCheckpointError(f"{path}: refused to load, it is not only tensors and DeepSpeed states "
                                    f"({reason}); nothing in it was run") from None


def links_outside(ckpt_dir: Path) -> list[str]:
    """A problem for each file or folder in a checkpoint that leads outside it (:func:`saved.outside`)."""
    return saved.outside(ckpt_dir, [Path(folder, name) for folder, folders, files in os.walk(ckpt_dir)
                                    for name in folders + files])  # os.walk does not follow links


def verify_checkpoint_files(ckpt_dir: str | Path) -> None:
    """Refuse a checkpoint with a file that leads outside it (:func:`links_outside`), then open
    every ``.pt`` file with :func:`load_checkpoint_file` (memory-mapped, so tensors are not read)
    before DeepSpeed's loader, which unpickles with ``weights_only=False``, touches any."""
    if problems := links_outside(Path(ckpt_dir)):
        raise UnsafeCheckpointError(f"{ckpt_dir}: refused: {'; '.join(problems)}")
    for path in sorted(Path(ckpt_dir).rglob("*.pt")):
        load_checkpoint_file(path, mmap=True)


def write_checksums(ckpt_dir: str | Path, rank: int, world_size: int) -> None:
    """``pairsim_checksums/rank_<rank>.json``: the SHA-256 of every file this rank wrote into
    ``ckpt_dir`` (Ray Train merges the ranks' directories into one checkpoint)."""
    root = Path(ckpt_dir)
    files = {p.relative_to(root).as_posix(): untrusted.sha256(p) for p in sorted(root.rglob("*"))
             if p.is_file() and CHECKSUMS_DIR not in p.relative_to(root).parts}
    (root / CHECKSUMS_DIR).mkdir(exist_ok=True)
    (root / CHECKSUMS_DIR / f"rank_{rank}.json").write_text(
        RankChecksums(world_size=world_size, files=files).model_dump_json())


def is_checkpoint(location: storage.LocationLike) -> bool:
    """Whether ``location`` is a checkpoint directory, told by its model card or its DeepSpeed
    checkpoint (``deepspeed/``); nothing else in it is looked at."""
    location = storage.Location.of(location)
    return (location / CARD_FILE).is_file() or \
        (location / CHECKPOINT_TAG).info().type == pyarrow.fs.FileType.Directory


def inspect_checkpoint(ckpt_dir: str | Path) -> tuple[ModelCard | None, list[str]]:
    """(its model card, or None when it has none that reads; what is wrong with it, [] when
    nothing) of a checkpoint directory, in the order checked: not one at all (alone:
    :data:`NOT_A_CHECKPOINT`), a file or folder leading outside it, no model card or one that is
    not what pairsim writes, no checksum files (alone: :data:`NO_CHECKSUMS`), one that is not what
    pairsim writes or a rank's missing, a file missing or not matching its checksum, or a ``.pt``
    file that is not only tensors and DeepSpeed states. Nothing is read before the first two
    checks pass."""
    root = Path(ckpt_dir)
    if not is_checkpoint(root):
        return None, [NOT_A_CHECKPOINT]
    if problems := links_outside(root):
        return None, problems
    if not (root / CARD_FILE).is_file():
        return None, [f"no {CARD_FILE}: not a complete pairsim checkpoint"]
    try:
        card = saved.read_card(root / CARD_FILE)
    except MetadataError as exc:
        return None, [str(exc)]
    sum_files = sorted((root / CHECKSUMS_DIR).glob("rank_*.json"))
    if not sum_files:
        return card, [NO_CHECKSUMS]
    try:
        ranks = [saved.read_metadata(path, RankChecksums) for path in sum_files]
    except MetadataError as exc:
        return card, [str(exc)]
    problems = [] if len(ranks) == ranks[0].world_size else [
        f"{len(ranks)} of {ranks[0].world_size} ranks' checksum files"]
    for rank in ranks:
        problems += saved.checksum_problems(root, rank.files)
    if not problems:
        try:
            verify_checkpoint_files(root)
        except UnsafeCheckpointError as exc:
            problems.append(str(exc))
    return card, problems


def verify_checkpoint(ckpt_dir: str | Path) -> list[str]:
    """What is wrong with a checkpoint directory, [] when nothing (:func:`inspect_checkpoint`)."""
    return inspect_checkpoint(ckpt_dir)[1]


def verified_card(checkpoint: str | Path, predating_checksums: bool = False) -> ModelCard:
    """The model card of ``checkpoint`` when it verifies (:func:`inspect_checkpoint`; with
    ``predating_checksums``, also when its only problem is :data:`NO_CHECKSUMS`), read before any
    of its weights is; :class:`~pairsim.models.saved.UnsafeCheckpointError` listing what is
    wrong otherwise."""
    card, problems = inspect_checkpoint(checkpoint)
    if problems and not (predating_checksums and problems == [NO_CHECKSUMS]):
        raise UnsafeCheckpointError(f"{checkpoint}: the checkpoint does not verify: {'; '.join(problems)}")
    return card


def checkpoints_in(run: storage.Location) -> list[storage.Location]:
    """The checkpoints of a run directory, newest first (Ray Train names them ``checkpoint_<time>``)."""
    infos = run.fs.get_file_info(pyarrow.fs.FileSelector(run.path))
    return [run / name for name in sorted((i.base_name for i in infos if i.type == pyarrow.fs.FileType.Directory
                                           and i.base_name.startswith("checkpoint_")), reverse=True)]


def inventory(path: str | Path) -> list[tuple[storage.Location, ModelCard | None, list[str]]]:
    """(checkpoint, :func:`inspect_checkpoint`'s card and problems) for ``path`` — a checkpoint,
    or a run directory's every checkpoint, newest first (``pairsim checkpoints``);
    :class:`~pairsim.errors.InputError` naming it when it is neither."""
    location = storage.Location.of(path)
    if is_checkpoint(location):
        found = [location]
    else:
        found = checkpoints_in(location) if location.info().type == pyarrow.fs.FileType.Directory else []
    if not found:
        raise InputError(f"{location}: neither a checkpoint nor a run directory holding checkpoint_* directories")
    out = []
    for checkpoint in found:
        with checkpoint.local_copy() as local:
            out.append((checkpoint, *inspect_checkpoint(local)))
    return out


def set_aside_stale_snapshot(run: storage.Location) -> None:
    """Ray Train refuses a run directory whose record of its checkpoints names one that is gone
    (deleted by hand to free space or drop a bad epoch), or that is not a record it wrote
    (garbled, cut short, another tool's file: read as untrusted input,
    :func:`pairsim.compat.ray.train_record_checkpoints`). Such a record of ``run`` is renamed
    ``<name>.stale-<time>``, kept, with a warning naming what is wrong; Ray Train then starts a
    new record (checkpoints saved before are not ranked in it) and :func:`restore` resumes from
    the newest checkpoint left that verifies — the run stays resumable and loses no checkpoint."""
    try:
        listed = compat.ray.train_record_checkpoints(run)
    except untrusted.UntrustedFileError as exc:
        aside = compat.ray.set_aside_train_record(run)
        logger.warning("%s: Ray Train's record of the run is not one it wrote (%s); it is set aside as %s",
                       run, " ".join(str(exc).split()), aside.name)
        return
    gone = [name for name in listed if (run / name).info().type != pyarrow.fs.FileType.Directory]
    if gone:
        aside = compat.ray.set_aside_train_record(run)
        logger.warning("%s: Ray Train's record of the run names checkpoints that are gone (%s); it is set aside "
                       "as %s", run, ", ".join(gone), aside.name)


def trusted(checkpoint: storage.Location, problems: list[str], registered_through: str) -> bool:
    """Whether a checkpoint with :func:`verify_checkpoint`'s ``problems`` may be loaded: none, or
    only that it predates checksums and Ray Train registered it (``registered_through`` is the
    newest checkpoint it registered; names sort by time) — a newer one is a save that failed."""
    return not problems or (checkpoint.name <= registered_through and problems == [NO_CHECKSUMS])


def resume_point(run: storage.Location, registered_through: str = "") -> storage.Location | None:
    """The checkpoint of ``run`` to resume from: the newest that passes :func:`verify_checkpoint`
    (newer ones that fail are reported and skipped), or None — start at step 0 — when there is
    none or every one is a save that failed part way: not registered by Ray Train (a worker lost
    while Ray copied its files, a full disk). Ray Train's record is not what decides: a worker
    lost after its checkpoint was written but before Ray Train registered it (or a record set
    aside by :func:`set_aside_stale_snapshot`) would send the run back to an older one.

    A checkpoint at or before ``registered_through`` (see :func:`trusted`) was finished work: when
    such ones exist and none passes, the run is refused rather than redone from the start."""
    damaged = []
    for candidate in checkpoints_in(run):
        with candidate.local_copy() as ckpt_dir:
            problems = verify_checkpoint(ckpt_dir)
        if trusted(candidate, problems, registered_through):
            return candidate
        logger.warning("checkpoint %s is skipped: %s", candidate, "; ".join(problems))
        if candidate.name <= registered_through:
            damaged.append(candidate.name)
    if damaged:
        raise RuntimeError(f"no checkpoint of {run} passes verification, and Ray Train had registered "
                           f"{', '.join(damaged)} (each is listed above); move the run directory aside to start over")
    return None


def val_scores(run: storage.Location, metric: str) -> list[tuple[float | None, storage.Location]]:
    """Each checkpoint of ``run``, newest first, with its model card's val ``metric``: None when
    it has no card, no finite value, or a card that does not read (a save cut short, or not
    pairsim's: reported)."""
    scores = []
    for candidate in checkpoints_in(run):
        card, value = candidate / CARD_FILE, None
        try:
            value = saved.read_card(card).val.get(metric) if card.is_file() else None
        except MetadataError as exc:
            logger.warning("checkpoint %s has no model card to rank it by: %s", candidate, exc)
        scores.append((value if isinstance(value, (int, float)) and math.isfinite(value) else None, candidate))
    return scores


@contextlib.contextmanager
def best_checkpoint(run: storage.Location, metric: str, mode: str,
                    registered_through: str = "") -> Iterator[tuple[storage.Location, Path]]:
    """(checkpoint, local copy) of ``run``'s checkpoint whose model card has the best val
    ``metric`` (``mode``: max or min; the newest among ties) and that is :func:`trusted`; better
    ones that are not are reported and skipped. Every checkpoint in the run directory competes,
    not only those Ray Train's record ranks (a record set aside by
    :func:`set_aside_stale_snapshot` starts empty)."""
    scored = [(value, candidate) for value, candidate in val_scores(run, metric) if value is not None]
    for value, candidate in sorted(scored, key=lambda scored: scored[0], reverse=mode == "max"):  # ties: newest first
        with candidate.local_copy() as local:
            problems = verify_checkpoint(local)
            if trusted(candidate, problems, registered_through):
                yield candidate, local
                return
        logger.warning("checkpoint %s (%s = %.2f) is skipped: %s", candidate, metric, value, "; ".join(problems))
    raise FileNotFoundError(f"no checkpoint of {run} with a finite {metric} passes verification")


def restore(engine, run_dir: str, in_process: bool = False) -> tuple[int, int]:
    """Load ``engine`` from :func:`resume_point` (rank 0 chooses, every rank loads its choice) and
    return (first epoch to run, global step), or (0, 0) when there is nothing to resume. A run
    trained in the calling process (``in_process``) has no Ray Train record to ask: only
    checkpoints that verify are taken."""
    latest = None if in_process else ray.train.get_checkpoint()
    run = storage.Location.of(run_dir)
    choice: list[str | None] = [None]  # the checkpoint's name, or "!" + why the run cannot resume
    if dist.rank() == 0:
        try:
            point = resume_point(run, Path(latest.path).name if latest else "")
            choice = [point and point.name]
        except RuntimeError as exc:
            choice = [f"!{exc}"]
    if dist.world_size() > 1:
        torch.distributed.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return 0, 0
    if choice[0].startswith("!"):
        raise RuntimeError(choice[0][1:])
    with (run / choice[0]).local_copy() as ckpt_dir:
        verify_checkpoint_files(ckpt_dir)
        _, client_state = engine.load_checkpoint(ckpt_dir, tag=CHECKPOINT_TAG)
        dist.barrier()
    if engine.global_steps != client_state["global_step"]:
        raise RuntimeError(f"checkpoint is inconsistent: DeepSpeed step {engine.global_steps}, "
                           f"pairsim step {client_state['global_step']}")
    return client_state["epoch"] + 1, client_state["global_step"]


@dataclass(frozen=True)
class Keeping:
    """Which checkpoints of a run stay: the latest and the ``num_to_keep`` best by the val
    ``metric`` (``mode``: max or min) — the run's Ray Train ``CheckpointConfig``, which
    :func:`keep_checkpoint` applies itself to a run trained in the calling process (Ray Train's
    local mode keeps only the last checkpoint, in memory)."""

    metric: str
    mode: str
    num_to_keep: int


def keep_checkpoint(ckpt_dir: str | Path, run: storage.Location, keeping: Keeping) -> storage.Location:
    """Copy the checkpoint ``ckpt_dir`` into ``run`` under a name as Ray Train gives one
    (``checkpoint_<time>``, copied under a hidden name first, then renamed) and delete the
    run's checkpoints ``keeping`` lets go. Returns where it is."""
    name = f"checkpoint_{datetime.now().strftime('%Y-%m-%d_%H-%M-%S.%f')}"
    partial = run / f".{name}.partial"
    run.fs.create_dir(partial.path, recursive=True)
    pyarrow.fs.copy_files(str(ckpt_dir), partial.path, source_filesystem=pyarrow.fs.LocalFileSystem(),
                          destination_filesystem=run.fs)
    run.fs.move(partial.path, (run / name).path)
    worst = -math.inf if keeping.mode == "max" else math.inf  # an unscored checkpoint goes first
    scored = [(worst if value is None else value, candidate) for value, candidate in val_scores(run, keeping.metric)]
    # newest first, and sorted() keeps that order among ties: the one just kept leads
    ranked = sorted(scored, key=lambda item: item[0], reverse=keeping.mode == "max")
    for _, candidate in ranked[keeping.num_to_keep:]:
        if candidate.name != name:  # the latest stays, as Ray Train keeps it
            candidate.fs.delete_dir(candidate.path)
    return run / name


def save_checkpoint(engine, epoch: int, step: int, card: ModelCard | None, report: dict[str, Any],
                    keep_in: tuple[storage.Location, Keeping] | None = None) -> str | None:
    """Save the engine on every rank (rank 0 adds the model ``card``) and each rank's checksums
    beside its files; then ``ray.train.report`` the merged checkpoint with ``report`` (Ray Train
    keeps it), or, for a run trained in the calling process (``keep_in``: its run directory and
    :class:`Keeping`), keep it there (:func:`keep_checkpoint`) and return where: inside a Tune
    trial Ray Train's report is not to be called, the trial reports to Tune itself."""
    with tempfile.TemporaryDirectory() as ckpt_dir:
        engine.save_checkpoint(ckpt_dir, tag=CHECKPOINT_TAG, client_state={"epoch": epoch, "global_step": step})
        if card is not None:
            (Path(ckpt_dir) / CARD_FILE).write_text(card.model_dump_json(indent=2))
        write_checksums(ckpt_dir, dist.rank(), dist.world_size())
        dist.barrier()
        if keep_in is not None:
            return keep_checkpoint(ckpt_dir, *keep_in).uri
        ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(ckpt_dir))
        return None


def checkpoint_card(checkpoint: str | Path) -> ModelCard:
    """The model card of a checkpoint (:func:`~pairsim.models.saved.read_card`), unverified."""
    card_file = Path(checkpoint) / CARD_FILE
    if not card_file.is_file():
        raise FileNotFoundError(f"{checkpoint}: not a pairsim checkpoint (no {CARD_FILE})")
    return saved.read_card(card_file)


def checkpoint_state_dict(checkpoint: str | Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """The fp32 weights of a checkpoint's RetrievalModel (the objective's temperatures left out).

    With ZeRO (``zero_stage`` ≥ 1, from its card) they come from the optimizer's fp32 partitions
    of every rank, merged by DeepSpeed's ``zero_to_fp32`` (the only complete copy under ZeRO-3,
    and the unrounded one under bf16); without, from the engine's module states.
    """
    ds_dir = Path(checkpoint) / CHECKPOINT_TAG
    if not ds_dir.is_dir():
        raise FileNotFoundError(f"{checkpoint}: no DeepSpeed checkpoint ({CHECKPOINT_TAG}/)")
    verify_checkpoint_files(ds_dir)
    if zero_stage >= 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=CHECKPOINT_TAG)
    else:
        state = load_checkpoint_file(ds_dir / "mp_rank_00_model_states.pt")["module"]
    return {k[len(MODEL_PREFIX):]: v.float() for k, v in state.items() if k.startswith(MODEL_PREFIX)}


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> list[Path]:
    """Consolidate ``checkpoint``, once it verifies (:func:`verified_card`; one saved before
    pairsim kept checksums too), and write ``out`` (open_clip weights) with its side files, whose
    places are checked first (:func:`~pairsim.models.retrieval.claim_export`)."""
    retrieval.claim_export(out)
    card = verified_card(checkpoint, predating_checksums=True)
    return retrieval.write_exported(card, checkpoint_state_dict(checkpoint, card.zero_stage), out)


def _export_card(path: Path) -> ModelCard:
    """The card of an export whose files pass :func:`~pairsim.models.retrieval.verified_export_card`;
    ValueError when there is none beside the weights file."""
    card_file = retrieval.exported_files(path)[2]
    if not card_file.is_file():
        raise ValueError(f"{path}: no model card ({card_file.name}) beside it, so not a pairsim export; a plain "
                         "open_clip weights file goes in model.pretrained")
    return retrieval.verified_export_card(path)


def init_from_source(path: str | Path) -> tuple[Path, str]:
    """(where ``model.init_from`` ``path`` leads, what a message about it starts with): ``path``
    itself and nothing, or through symbolic links the file or directory they lead to (an
    export's card and heads file lie beside it, not beside a link to it) and ``<path> leads to
    <target>: ``, so that the path the config gives is named too. ValueError naming ``path`` for
    a loop of links."""
    path = Path(path)
    try:
        source = path.resolve()
    except (RuntimeError, OSError):  # Path.resolve's word for a loop
        raise ValueError(f"{path}: a loop of links") from None
    return source, "" if source == Path(os.path.abspath(path)) else f"{path} leads to {source}: "


def initial_state(path: str | Path) -> tuple[ModelCard, dict[str, torch.Tensor]]:
    """(model card, :class:`~pairsim.models.retrieval.RetrievalModel` state dict) of what
    ``model.init_from`` names (:func:`init_from_source`): a checkpoint directory (verified, then
    consolidated as :func:`checkpoint_state_dict` does) or an export (``model.pt`` with its card
    and heads file beside it, :func:`~pairsim.models.retrieval.write_exported`, its files checked
    first). Every file is opened with :func:`load_checkpoint_file`: a pickle that would run code is
    refused, nothing in it run."""
    path, _ = init_from_source(path)
    if path.is_dir():
        card = verified_card(path)
        return card, checkpoint_state_dict(path, card.zero_stage)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or directory")
    card = _export_card(path)
    state = {f"clip.{k}": v.reshape(1) if k in clip.SCALAR_PARAMS else v  # the shape create_model gives them
             for k, v in load_checkpoint_file(path).items()}
    if (heads_file := retrieval.exported_files(path)[1]).is_file():
        state |= load_checkpoint_file(heads_file)
    return card, state


def check_init_from(cfg: ModelConfig) -> None:
    """Driver-side check of ``model.init_from``: it exists, is a pairsim export or a checkpoint that
    verifies, holds only tensors, and was trained as the configured ``model.arch`` (an export's
    weights are also matched, name and shape, against that architecture; memory-mapped, on the
    meta device). :class:`ConfigError` naming the key and the path as the config gives it (and,
    through a link, where it leads: :func:`init_from_source`) otherwise."""
    if cfg.init_from is None:
        return
    try:
        path, through = init_from_source(cfg.init_from)
    except ValueError as exc:
        raise ConfigError(f"model.init_from: {exc}") from None
    try:
        if path.is_dir():
            card = verified_card(path)
        elif not path.is_file():
            raise FileNotFoundError(f"{path}: no such file or directory")
        else:
            card = _export_card(path)
            weights = load_checkpoint_file(path, mmap=True)
            if (heads_file := retrieval.exported_files(path)[1]).is_file():
                load_checkpoint_file(heads_file, mmap=True)
        trained_as = card.model.arch
        if trained_as != cfg.arch:
            raise ValueError(f"{path} holds a {trained_as} model, not the configured model.arch {cfg.arch!r}")
        if not path.is_dir():
            import open_clip

            expected = {k: v.shape for k, v in open_clip.create_model(cfg.arch, device="meta").state_dict().items()}
            wrong = sorted(k for k in expected.keys() | weights.keys()
                           if k not in weights or k not in expected or weights[k].shape != expected[k])
            if wrong:
                raise ValueError(f"{path}: its open_clip weights do not fit {cfg.arch} ({len(wrong)} tensors missing, "
                                 f"unexpected or of another shape, e.g. {', '.join(wrong[:3])})")
    except (OSError, ValueError) as exc:  # UnsafeCheckpointError and MetadataError are ValueErrors
        raise ConfigError(f"model.init_from: {through}{exc}") from None


def load_initial_weights(model: retrieval.RetrievalModel, path: str | Path) -> None:
    """Load ``model.init_from`` (:func:`initial_state`) into ``model``: every open_clip weight must
    fit; heads the model has and the source lacks keep their fresh initialisation, heads the
    source has and the model lacks are left out (both said once)."""
    card, state = initial_state(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if clip_missing := [k for k in missing if k.startswith("clip.")]:
        raise ValueError(f"model.init_from: {path} lacks open_clip weights of the model: {', '.join(clip_missing[:5])}")
    if dist.rank() == 0:
        fresh, unused = (sorted({key.split(".")[0] for key in keys}) for keys in (missing, unexpected))
        logger.info("model.init_from: the weights of %s (%s, epoch %s)%s%s", path, card.model.arch,
                    card.epoch, f"; initialised fresh: {', '.join(fresh)}" if fresh else "",
                    f"; in the source, not in this model: {', '.join(unused)}" if unused else "")

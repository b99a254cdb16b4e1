"""Compositional "shapes" scenes: a built-in image-caption dataset that needs no download.

Each scene holds 1–3 objects with a shape, a colour and a size on a 3×3 layout; the first two
objects of a multi-object scene stand in a left-of / right-of / above / below relation. Every
image gets 5 distinct captions drawn from varied templates and synonyms, and a class label
(the shape and colour of its first object, 30 classes) for uni-modal evaluation. Captions of
different scenes often differ in one colour or one relation only, so fine-grained alignment
matters and the choice of loss shows.

Hard negatives (``hard_negatives=("test",)``): a split built of *families* — a scene of two or
three objects and three variants of it, each its own image differing in exactly one attribute:
one object's colour, one object's shape, or objects 1 and 2 swapped (their relation inverted,
"left of" → "right of"). A family's images share their background and jitter, and their
captions share templates and synonym draws (only templates that state the relation), so each
caption has near-duplicates in the split that differ in the changed attribute's words alone.

With ``captions="object_labels"`` each image gets one text instead: its objects' colours and
shapes, sorted ("blue square, red circle") — labels, not captions (no sizes, relations or
templates), for training an image encoder on labels (``benchmarks/reproduce.py``'s CUSA teacher).

Deterministic: scene ``i`` of split ``s`` depends only on ``(seed, s, i)``, and the shards are
byte-identical for the same arguments.
"""

from __future__ import annotations

import io
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from PIL import Image, ImageDraw
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from pairsim import locks, outputs
from pairsim.data import shards
from pairsim.data.builder import BUILD_LOCK
from pairsim.errors import InputError
from pairsim.storage import LocationLike

SHAPES = {
    "circle": ["circle", "disc", "round shape"],
    "square": ["square", "box", "block"],
    "triangle": ["triangle", "triangular shape"],
    "diamond": ["diamond", "rhombus"],
    "cross": ["cross", "plus sign"],
}
COLOURS = {
    "red": ((220, 30, 30), ["red", "scarlet"]),
    "green": ((30, 170, 50), ["green"]),
    "blue": ((30, 60, 220), ["blue"]),
    "yellow": ((235, 205, 20), ["yellow"]),
    "purple": ((140, 40, 180), ["purple", "violet"]),
    "orange": ((245, 130, 20), ["orange"]),
}
SIZES = {"small": (0.45, ["small", "little", "tiny"]), "large": (0.9, ["large", "big"])}
# relation of object 1 to object 2: (grid step from 1 to 2, phrases, inverse relation)
RELATIONS = {
    "left": ((1, 0), ["to the left of", "left of", "on the left of"], "right"),
    "right": ((-1, 0), ["to the right of", "right of", "on the right of"], "left"),
    "above": ((0, 1), ["above", "over", "on top of"], "below"),
    "below": ((0, -1), ["below", "under", "beneath"], "above"),
}
LABELS = [f"{c} {s}" for s in SHAPES for c in COLOURS]  # class = first object's colour + shape

TEMPLATES = {
    1: [
        "{a1} {o1}",
        "{a1} {o1} on a plain background",
        "a picture of {a1} {o1}",
        "there is {a1} {o1}",
        "one {o1} alone",
        "an image showing {a1} {o1}",
        "a single {o1}",
    ],
    2: [
        "{a1} {o1} {rel} {a2} {o2}",
        "{a2} {o2} {inv} {a1} {o1}",
        "{a1} {o1} and {a2} {o2}; the first is {rel} the second",
        "two shapes: {a1} {o1} {rel} {a2} {o2}",
        "there is {a1} {o1} {rel} {a2} {o2}",
        "a picture with {a2} {o2} {inv} {a1} {o1}",
        "{a1} {o1} next to {a2} {o2}",
    ],
    3: [
        "{a1} {o1} {rel} {a2} {o2}, and {a3} {o3}",
        "three shapes: {a1} {o1}, {a2} {o2} and {a3} {o3}",
        "{a2} {o2} {inv} {a1} {o1}, plus {a3} {o3}",
        "{a3} {o3} near {a1} {o1} that is {rel} {a2} {o2}",
        "there are three objects: {a1} {o1} {rel} {a2} {o2}, and {a3} {o3}",
        "{a1} {o1}, {a2} {o2} and {a3} {o3}, the first {rel} the second",
    ],
}


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str
    cell: tuple[int, int]  # (column, row) on the 3×3 grid


MIN_IMAGE_SIZE = 24  # pixels a side: the smallest that draws a 3×3 scene
MAX_IMAGE_SIZE = 1024  # pixels a side: the shard builder's default max_side; each image is drawn in memory
MAX_SPLIT_IMAGES = 10**7  # images a split, each drawn in turn by this process: a typo's 10^20 would never end


class SynthError(InputError):
    """Arguments :func:`generate` cannot make a dataset from."""


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def sample_scene(rng: random.Random) -> tuple[list[SceneObject], str | None]:
    """1–3 objects on distinct grid cells; objects 1 and 2 stand in the returned relation."""
    n = rng.choice((1, 2, 3))
    relation = rng.choice(list(RELATIONS)) if n > 1 else None
    if relation is None:
        cells = [(rng.randrange(3), rng.randrange(3))]
    else:
        (dx, dy), _, _ = RELATIONS[relation]
        while True:  # object 2 is 1-2 cells from object 1 along the relation's axis
            step = rng.choice((1, 2))
            c1 = (rng.randrange(3), rng.randrange(3))
            c2 = (c1[0] + dx * step, c1[1] + dy * step)
            if 0 <= c2[0] < 3 and 0 <= c2[1] < 3:
                break
        cells = [c1, c2]
        if n == 3:
            free = [(x, y) for x in range(3) for y in range(3) if (x, y) not in cells]
            cells.append(rng.choice(free))
    objects = [
        SceneObject(rng.choice(list(SHAPES)), rng.choice(list(COLOURS)), rng.choice(list(SIZES)), cell)
        for cell in cells
    ]
    return objects, relation


def render(objects: list[SceneObject], size: int, rng: random.Random) -> Image.Image:
    """Draw the scene on a lightly tinted background, with small jitter of position and colour."""
    bg = tuple(rng.randint(215, 250) for _ in range(3))
    image = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(image)
    cell = size / 3
    for obj in objects:
        scale, _ = SIZES[obj.size]
        r = 0.5 * cell * scale
        cx = (obj.cell[0] + 0.5) * cell + rng.uniform(-0.1, 0.1) * cell
        cy = (obj.cell[1] + 0.5) * cell + rng.uniform(-0.1, 0.1) * cell
        rgb, _ = COLOURS[obj.colour]
        fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in rgb)
        if obj.shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif obj.shape == "square":
            h = r * 0.85
            draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=fill)
        elif obj.shape == "triangle":
            pts = [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
            draw.polygon(pts, fill=fill)
        elif obj.shape == "diamond":
            draw.polygon([(cx, cy - r), (cx + r * 0.75, cy), (cx, cy + r), (cx - r * 0.75, cy)], fill=fill)
        else:  # cross
            w = r * 0.35
            draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
            draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    return image


def _phrase(obj: SceneObject, rng: random.Random, pick) -> str:
    words = []
    if rng.random() < 0.7:
        words.append(pick(SIZES[obj.size][1]))
    words.append(pick(COLOURS[obj.colour][1]))
    words.append(pick(SHAPES[obj.shape]))
    return " ".join(words)


def captions_for(objects: list[SceneObject], relation: str | None, rng: random.Random, n: int = 5,
                 aligned: bool = False) -> list[str]:
    """``n`` distinct captions, each from a different template where there are enough.

    ``aligned``: every draw takes one ``rng.random()`` whatever the attribute (a synonym list's
    length included), and only templates that state the relation are used, so scenes that
    differ in one attribute, captioned from equal RNG states, get captions that differ in that
    attribute's words alone (a hard-negative family)."""
    templates = TEMPLATES[len(objects)]
    pick = rng.choice
    if aligned:
        templates = [t for t in templates if "{rel}" in t or "{inv}" in t]
        pick = lambda options: options[int(rng.random() * len(options))]  # noqa: E731
    order = rng.sample(templates, len(templates))
    captions: list[str] = []
    attempts = 0
    while len(captions) < n:
        template = order[len(captions) % len(order)] if attempts < 4 * n else pick(templates)
        attempts += 1
        fields = {}
        for k, obj in enumerate(objects, start=1):
            phrase = _phrase(obj, rng, pick)
            fields[f"o{k}"], fields[f"a{k}"] = phrase, _article(phrase)
        if relation is not None:
            _, phrases, inverse = RELATIONS[relation]
            fields["rel"] = pick(phrases)
            fields["inv"] = pick(RELATIONS[inverse][1])
        caption = template.format(**fields)
        if caption not in captions:
            captions.append(caption)
    return captions


CAPTION_STYLES = ("scene", "object_labels")


def object_labels(objects: list[SceneObject]) -> str:
    """The objects' colour and shape, sorted and without repeats: ``"blue square, red circle"``."""
    return ", ".join(sorted({f"{obj.colour} {obj.shape}" for obj in objects}))


def _record(objects: list[SceneObject], image: Image.Image, captions: list[str], image_id: str, source: str) -> dict:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    label_name = f"{objects[0].colour} {objects[0].shape}"
    return {"image": buf.getvalue(), "image_id": image_id, "captions": captions, "label": LABELS.index(label_name),
            "label_name": label_name, "width": image.width, "height": image.height, "source": source}


def make_record(seed: int, split: str, index: int, image_size: int, captions: str = "scene") -> dict:
    rng = random.Random(f"pairsim-shapes/{seed}/{split}/{index}")
    objects, relation = sample_scene(rng)
    image = render(objects, image_size, rng)
    texts = [object_labels(objects)] if captions == "object_labels" else captions_for(objects, relation, rng)
    return _record(objects, image, texts, f"{split}-{index:07d}", f"pairsim-shapes/seed={seed}")


MARKER = ".pairsim-synth.json"  # in a dataset generate() wrote: its arguments, written before any shard


class SynthArguments(BaseModel):
    """:data:`MARKER`: the arguments a dataset was generated with."""

    model_config = ConfigDict(extra="forbid", strict=True)
    num_train: int = Field(ge=0, le=MAX_SPLIT_IMAGES)
    num_val: int = Field(ge=0, le=MAX_SPLIT_IMAGES)
    num_test: int = Field(ge=0, le=MAX_SPLIT_IMAGES)
    image_size: int = Field(ge=MIN_IMAGE_SIZE, le=MAX_IMAGE_SIZE)
    seed: int
    rows_per_shard: int = Field(ge=1)
    captions: str = "scene"
    hard_negatives: list[str] = []


VARIANTS = ("colour", "shape", "relation")  # what each member after a family's first changes
FAMILIES_VERSION = 2  # 2: a family's objects 1 and 2 are never same_kind (1 drew them as they came)


def vary(objects: list[SceneObject], relation: str, variant: str,
         rng: random.Random) -> tuple[list[SceneObject], str]:
    """The scene with one attribute changed: one object's ``colour`` or ``shape`` (to another),
    or the ``relation`` of objects 1 and 2 inverted by swapping their cells."""
    objects = list(objects)
    if variant == "relation":
        objects[0], objects[1] = replace(objects[0], cell=objects[1].cell), replace(objects[1], cell=objects[0].cell)
        return objects, RELATIONS[relation][2]
    k = rng.randrange(len(objects))
    values = [v for v in (COLOURS if variant == "colour" else SHAPES) if v != getattr(objects[k], variant)]
    objects[k] = replace(objects[k], **{variant: rng.choice(values)})
    return objects, relation


def same_kind(a: SceneObject, b: SceneObject) -> bool:
    """Objects a caption may name alike ("a red circle"): same shape and colour, whatever their size
    (captions leave the size out 30 % of the time). Swapping two such objects gives an image that
    the base's relation captions describe as well as the variant's."""
    return (a.shape, a.colour) == (b.shape, b.colour)


def family_scene(rng: random.Random) -> tuple[list[SceneObject], str]:
    """A family's base scene: two or three objects whose first two are not :func:`same_kind`
    (drawn again until so), so the relation variant's captions are false of the base image and
    the base's of the variant."""
    objects, relation = sample_scene(rng)
    while relation is None or same_kind(objects[0], objects[1]):
        objects, relation = sample_scene(rng)
    return objects, relation


def family_records(seed: int, split: str, family: int, first_index: int, image_size: int) -> list[dict]:
    """A hard-negative family: a scene with a relation and its :data:`VARIANTS`, rendered with one
    background and jitter and captioned from one aligned RNG state (:func:`captions_for`). The base
    is :func:`family_scene`'s."""
    key = f"pairsim-shapes/{seed}/{split}/family-{family}"
    rng = random.Random(key)
    objects, relation = family_scene(rng)
    members = [("base", objects, relation)] + [(v, *vary(objects, relation, v, rng)) for v in VARIANTS]
    return [_record(scene, render(scene, image_size, random.Random(f"{key}/render")),
                    captions_for(scene, rel, random.Random(f"{key}/captions"), aligned=True),
                    f"{split}-{first_index + i:07d}", f"pairsim-shapes/seed={seed}/family={family}/{variant}")
            for i, (variant, scene, rel) in enumerate(members)]


def split_records(seed: int, split: str, n: int, image_size: int, captions: str, hard: bool):
    """The ``n`` records of a split: independent scenes, or hard-negative families (the last one cut)."""
    if not hard:
        yield from (make_record(seed, split, i, image_size, captions) for i in range(n))
        return
    for family in range(math.ceil(n / (1 + len(VARIANTS)))):
        yield from family_records(seed, split, family, family * (1 + len(VARIANTS)), image_size)[:n - family * (1 + len(VARIANTS))]


def generate(out: LocationLike, num_train: int = 10_000, num_val: int = 500, num_test: int = 500,
             image_size: int = 64, seed: int = 0, rows_per_shard: int = 2_000,
             progress: bool = True, captions: str = "scene", hard_negatives: Sequence[str] = ()) -> shards.Manifest:
    """Write the train/val/test splits as Parquet shards under ``out`` plus ``manifest.json``.
    ``out`` is new, empty, or a dataset this function wrote (its :data:`MARKER`), which is
    replaced whole; anything else is refused (:class:`pairsim.outputs.OutputRefused`) before a
    file is written, and a second writer by the lock (:class:`pairsim.locks.NameInUse`).
    ``captions``: ``scene`` (5 captions an image) or ``object_labels`` (one label text);
    ``hard_negatives``: the val/test splits built of hard-negative families (train never is)."""
    if not MIN_IMAGE_SIZE <= image_size <= MAX_IMAGE_SIZE:
        raise SynthError(f"image_size must be between {MIN_IMAGE_SIZE} (a 3×3 scene) and {MAX_IMAGE_SIZE}, "
                         f"got {image_size:,}")
    if captions not in CAPTION_STYLES:
        raise SynthError(f"captions must be one of {', '.join(CAPTION_STYLES)}, got {captions!r}")
    if unknown := set(hard_negatives) - {"val", "test"}:
        raise SynthError(f"hard_negatives: only the val and test splits can be hard, not {', '.join(sorted(unknown))}")
    sizes = {"train": num_train, "val": num_val, "test": num_test}
    if wrong := [f"num_{split}={n:,}" for split, n in sizes.items() if not 0 <= n <= MAX_SPLIT_IMAGES]:
        raise SynthError(f"split sizes must be between 0 (no such split) and {MAX_SPLIT_IMAGES:,}, got "
                         f"{', '.join(wrong)}")
    if not any(sizes.values()):
        raise SynthError("num_train, num_val and num_test are all 0: no split to write")
    if rows_per_shard < 1:
        raise SynthError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    arguments = {"num_train": num_train, "num_val": num_val, "num_test": num_test, "image_size": image_size,
                 "seed": seed, "rows_per_shard": rows_per_shard, "captions": captions,
                 "hard_negatives": sorted(hard_negatives)}
    out = outputs.claim_directory(out, "--out", owned_by=[outputs.Marker(MARKER, SynthArguments)],
                                  ignored=[BUILD_LOCK])
    with locks.hold(out / BUILD_LOCK, f"--out {out}"):
        (out / MARKER).write_text(SynthArguments(**arguments).model_dump_json())  # first: the directory is this command's output
        (out / shards.MANIFEST).delete()  # a run never reads a half-written dataset
        for split in sizes:  # an earlier, larger dataset's shards would stay beside the new ones
            for shard in (out / split).files(".parquet"):
                if re.fullmatch(r"part-\d{5}\.parquet", shard.name):
                    shard.delete()
        counts = {}
        for split, n in sizes.items():
            if n == 0:
                continue
            rows = split_records(seed, split, n, image_size, captions, split in hard_negatives)
            if progress:
                rows = tqdm(rows, total=n, desc=f"synth {split}", unit="img")
            counts[split] = shards.write_split(rows, out / split, rows_per_shard)
        return shards.write_manifest(
            out, source="pairsim-shapes", splits=counts,
            generator={"seed": seed, "image_size": image_size, "labels": LABELS}
            | ({"captions": captions} if captions != "scene" else {})  # plain manifests as they were
            | ({"hard_negatives": {"splits": sorted(hard_negatives), "family": ["base", *VARIANTS],
                                   "version": FAMILIES_VERSION}}
               if hard_negatives else {}),
        )


def ensure(out: LocationLike, **sizes) -> LocationLike:
    """The shapes dataset at ``out`` (returned): left as it is when it has a manifest, else
    generated with :func:`generate`'s ``sizes``."""
    try:
        shards.read_manifest(out)
    except FileNotFoundError:
        generate(out, **sizes)
    return out

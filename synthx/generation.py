"""SynthX generation: paint conditioned synthetic tumors into healthy training scans and write a synthetic cohort.

For each requested (sex, age band, phase) case (see :mod:`synthx.targeting`):

1. Pick a canvas: a healthy (``tumor == 0``) real case of the TRAINING split whose phase is the
   requested phase. SynthX paints a tumor, it does not re-enhance a whole scan, so a synthetic
   case's phase is always its canvas' own phase. Among those, canvases of the requested sex and
   age band are preferred; when none exists, any canvas of that phase is used and the requested
   sex and age band are only the generator's conditions (the metadata records the conditions in
   ``sex``/``age`` and the canvas' own values in ``canvas_sex``/``canvas_age``).
2. Draw a tumor mask inside the canvas' pancreas with the mask prior (size class drawn from
   ``size_classes``; when a class does not fit the organ, the next smaller class is tried and the
   class used is recorded in ``synthx_size_class``).
3. Crop a patch around the tumor, resample it to the generator's voxel size when the canvas'
   differs, run :class:`synthx.pipeline.SynthXPipeline`, resample back and paste the repainted
   region (the tumor plus the pipeline's inpainting margin) into the canvas.
4. Write the case in layout A with :func:`lightning_modules.data.cohort.write_case` (atomic): the new CT,
   every canvas mask, ``pancreatic_lesion`` and the pancreas mask grown to include the lesion
   (AbdomenAtlas convention); then rewrite ``metadata.csv`` atomically.

Metadata of a synthetic case: ``synthetic=1``, ``tumor=1``, ``source_case_id`` (the canvas),
``patient_id`` = the canvas' patient (so a split audit tracks it), ``cohort``/``race``/``phase``
of the canvas, ``sex`` = the requested sex, ``age`` = the canvas' age when it lies in the requested
band, else the band's representative age (:data:`REPRESENTATIVE_AGE`; the generator itself is
conditioned on the band), ``tumor_diameter_mm``, ``tumor_location`` (pancreas head/body/tail, see
:func:`lightning_modules.data.lesions.pancreas_location`), ``generator_run_id`` (the MLflow run that trained the generator, when
known) and ``synthesis_run_id`` (the MLflow run of this generation).

Synthetic cases are training data only. The output cohort gets no split file: splits hold real
cases only (:mod:`lightning_modules.data.splits`), and the mixing code
(:mod:`lightning_modules.data.mixing`) treats every ``synthetic=1`` row as training data and
checks that its canvas is a real training case of the split in use.

Determinism and resumption: a request is identified by its cell and its index within the cell;
its case id (``SX<seed>_<sex>_<age band>_<phase>_<index>``) and its random state (canvas, size,
mask, diffusion noise) derive from (seed, cell, index) only. A rerun skips cases already complete
and valid, so after a kill it does only the remainder, and raising one cell's count later only adds
cases. The generation settings are kept in ``synthx_generation.json`` and a rerun with different
settings is refused. A case that fails is reported, its error kept in ``.quarantine/<case_id>.json``,
and nothing of it is written.

Run::

    benchx synthesize --root data/phantom --split splits/phantom.csv --pipeline runs:/<run id>/pipeline \
        --out data/synthetic --target min_positives:4 [--seed 0 --steps 20 --scheduler ddim --tracking-uri ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import nibabel as nib
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from scipy import ndimage

from lightning_modules.data.cohort import (
    CT_FILE,
    METADATA_FILE,
    SEGMENTATION_DIR,
    Cohort,
    atomic_write_bytes,
    file_sha256,
    load_cohort,
    write_case,
    write_metadata,
)
from lightning_modules.data.metadata import (
    AGE_BAND_NAMES,
    PHASES,
    SEXES,
    STANDARD_COLUMNS,
    UNKNOWN,
    age_band,
    normalize_phase,
)
from lightning_modules.data.splits import load_split
from synthx.config import SAMPLING_SCHEDULERS
from lightning_modules.data.lesions import SIZE_CLASS_NAMES, largest_extent_mm, pancreas_location
from synthx.mask_prior import TumorDoesNotFitError, sample_tumor_mask
from synthx.targeting import (
    CELL_COLUMNS,
    compute_targets,
    labelled_cases,
    log_targets,
    requests_from_targets,
)

MANIFEST_FILE = "synthx_generation.json"
QUARANTINE_DIR = ".quarantine"
LESION_CLASS = "pancreatic_lesion"
ORGAN_CLASS = "pancreas"
# The generator is conditioned on the age band; the metadata needs an age in years. A canvas whose
# age lies in the requested band keeps it; otherwise the band's middle (open bands: a typical age).
REPRESENTATIVE_AGE = {"le20": 15.0, "20-40": 30.0, "40-60": 50.0, "60-80": 70.0, "gt80": 85.0}
DEFAULT_SIZE_CLASSES = {"tiny": 1.0, "small": 2.0, "medium": 1.0}  # recipes/generator/synthx.yaml mask_prior
SCHEDULERS = SAMPLING_SCHEDULERS
# Settings that change what a case id produces: a rerun into the same folder must repeat them.
_MANIFEST_KEYS = (
    "seed",
    "pipeline",
    "generator_run_id",
    "scheduler",
    "num_inference_steps",
    "guidance_scale",
    "size_classes",
    "erosion_mm",
    "cohort_root",
    "split_sha256",
)
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


class GenerationError(ValueError):
    """Generation cannot start or a case cannot be made; the message names the case and the problem."""


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthetic case to make: its cell and its index within the cell."""

    sex: str
    age_band: str
    phase: str
    index: int

    def case_id(self, seed: int) -> str:
        return f"SX{seed}_{self.sex}_{self.age_band}_{self.phase}_{self.index:04d}"

    @property
    def key(self) -> str:
        return f"{self.sex}/{self.age_band}/{self.phase}#{self.index}"

    def rng(self, seed: int) -> np.random.Generator:
        """The request's own random stream: a function of (seed, cell, index) only."""
        cell = (SEXES.index(self.sex), AGE_BAND_NAMES.index(self.age_band), PHASES.index(self.phase))
        return np.random.default_rng(np.random.SeedSequence([int(seed), *cell, int(self.index)]))


@dataclass
class SynthesisSummary:
    """What a :func:`synthesize` call did."""

    out_root: Path
    requested: int
    generated: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    not_reached: int = 0
    seconds_per_case: float = math.nan
    generator_run_id: str = ""
    synthesis_run_id: str = ""
    per_cell: pd.DataFrame | None = None

    @property
    def complete(self) -> bool:
        return not self.failed and self.not_reached == 0


# ----------------------------------------------------------------------------------------------
# Loading the generator.


def resolve_pipeline_source(source: str) -> tuple[str, str]:
    """Classify a ``--pipeline`` value: ``(local folder or MLflow artifact URI, generator run id)``.

    Accepts a folder saved with ``save_pretrained``, an MLflow artifact URI (``runs:/<id>/pipeline``)
    or a plain run id (its ``pipeline`` artifact).
    """
    text = str(source).strip()
    if Path(text).is_dir():
        return text, ""
    if text.startswith("runs:/"):
        parts = text[len("runs:/"):].split("/", 1)
        return text, parts[0]
    if _RUN_ID.match(text):
        return f"runs:/{text}/pipeline", text
    if "://" in text or text.startswith(("models:/", "mlflow-artifacts:")):
        return text, ""
    raise GenerationError(
        f"pipeline {source!r} is neither a folder (save_pretrained), an MLflow URI (runs:/<run id>/pipeline) nor a run id"
    )


def load_pipeline(source: str, scheduler: str = "ddim", tracking_uri: str | None = None, device: str = "cpu"):
    """Load a :class:`SynthXPipeline` and swap in the sampling scheduler.

    Args:
        source: see :func:`resolve_pipeline_source`.
        scheduler: ``ddpm``, ``ddim`` or ``dpm_solver`` (built from the saved scheduler's config, so the
            training noise schedule and prediction type carry over).
        tracking_uri: MLflow tracking URI for run ids and ``runs:/`` URIs.
        device: torch device for the denoiser.

    Returns:
        (pipeline, generator run id or ``""`` for a plain folder).
    """
    from synthx.pipeline import SynthXPipeline

    location, run_id = resolve_pipeline_source(source)
    if not Path(location).is_dir():
        import mlflow

        try:
            location = mlflow.artifacts.download_artifacts(artifact_uri=location, tracking_uri=tracking_uri)
        except Exception as error:  # MLflow raises several types for a missing run or artifact
            raise GenerationError(f"cannot download the generator {location}: {error}") from error
    if not (Path(location) / "model_index.json").is_file():
        raise GenerationError(f"{location} holds no saved pipeline (model_index.json is missing)")
    pipeline = SynthXPipeline.from_pretrained(location)
    _set_scheduler(pipeline, scheduler)
    return pipeline.to(device), run_id


def _set_scheduler(pipeline, name: str) -> None:
    """Swap in a sampling scheduler built from the saved one's config (same betas and prediction type)."""
    from synthx.training import sampling_scheduler

    if name not in SCHEDULERS:
        raise GenerationError(f"unknown scheduler {name!r} (expected one of {', '.join(SCHEDULERS)})")
    pipeline.scheduler = sampling_scheduler(name, pipeline.scheduler)
    pipeline.set_progress_bar_config(disable=True)


# ----------------------------------------------------------------------------------------------
# Canvases and requests.


def canvas_table(cohort: Cohort, split: pd.DataFrame, canvas_ids: Sequence[str] | None = None) -> pd.DataFrame:
    """Healthy real training cases with a known phase: the candidate canvases.

    Args:
        cohort: the real cohort.
        split: its split table (checked against the cohort).
        canvas_ids: restrict to these cases; each must be a healthy real training case, else a
            :class:`GenerationError` names it and says why (val/test canvases are refused).
    """
    cases = labelled_cases(cohort, split, LESION_CLASS)
    if canvas_ids is not None:
        by_id = cases.set_index("case_id")
        for case_id in canvas_ids:
            if case_id not in by_id.index:
                raise GenerationError(f"canvas {case_id} is not in cohort {cohort.root}")
            row = by_id.loc[case_id]
            if row["split"] != "train":
                where = f"the {row['split']} split" if row["split"] else "no split"
                raise GenerationError(
                    f"canvas {case_id} is in {where}: only real TRAINING cases may serve as canvases (DESIGN.md section 2)"
                )
            if int(row["synthetic"]) == 1:
                raise GenerationError(f"canvas {case_id} is synthetic: canvases must be real cases")
            if int(row["tumor"]) != 0:
                raise GenerationError(f"canvas {case_id} has a tumor (tumor={int(row['tumor'])}): canvases must be healthy")
            if row["phase"] == UNKNOWN:
                raise GenerationError(f"canvas {case_id} has an Unknown phase: a synthetic case takes its canvas' phase")
        cases = cases[cases["case_id"].isin(list(canvas_ids))]
    chosen = cases[(cases["split"] == "train") & (cases["tumor"] == 0) & (cases["synthetic"] == 0) & (cases["phase"] != UNKNOWN)]
    return chosen.sort_values("case_id").reset_index(drop=True)


def as_requests(requests) -> list[SynthesisRequest]:
    """Requests from a targeting table, a ``{(sex, age band, phase): count}`` mapping or a list of requests."""
    if isinstance(requests, pd.DataFrame):
        return [SynthesisRequest(**r) for r in requests_from_targets(requests)]
    if isinstance(requests, Mapping):
        table = pd.DataFrame(
            [{"sex": k[0], "age_band": k[1], "phase": k[2], "requested": int(v)} for k, v in requests.items()]
        )
        return [SynthesisRequest(**r) for r in requests_from_targets(table)] if len(table) else []
    result = [r if isinstance(r, SynthesisRequest) else SynthesisRequest(**r) for r in requests]
    keys = [r.key for r in result]
    if len(set(keys)) != len(keys):
        raise GenerationError("the request list names the same (cell, index) twice")
    return result


def choose_canvas(canvases: pd.DataFrame, request: SynthesisRequest, rng: np.random.Generator) -> tuple[dict, bool]:
    """A canvas of the requested phase, preferring the requested sex and age band.

    Returns:
        (the canvas' metadata row, whether its sex and age band match the request).
    """
    same_phase = canvases[canvases["phase"] == request.phase]
    if same_phase.empty:
        raise GenerationError(f"no healthy training canvas has phase {request.phase}")
    exact = same_phase[(same_phase["sex"] == request.sex) & (same_phase["age_band"] == request.age_band)]
    pool = exact if len(exact) else same_phase
    return pool.iloc[int(rng.integers(len(pool)))].to_dict(), bool(len(exact))


# ----------------------------------------------------------------------------------------------
# One case.


@dataclass
class GeneratedCase:
    case_id: str
    ct: np.ndarray
    affine: np.ndarray
    masks: dict[str, np.ndarray]
    row: dict


def generate_case(
    cohort: Cohort,
    canvas: Mapping,
    request: SynthesisRequest,
    rng: np.random.Generator,
    pipeline,
    seed: int,
    num_inference_steps: int,
    guidance_scale: float,
    size_classes: Mapping[str, float],
    erosion_mm: float,
    exact_canvas: bool,
) -> GeneratedCase:
    """Paint one synthetic tumor into one canvas (steps 2-3 of the module docstring) and build its metadata row."""
    from synthx.pipeline import inpainting_region

    case_id = request.case_id(seed)
    canvas_id = str(canvas["case_id"])
    case = cohort.case(canvas_id)
    image = nib.load(case.ct_path)
    # The generator was trained on RAS-oriented patches (synthx.training reads with MONAI, orientation
    # RAS): the work is done in RAS and the result turned back to the canvas' own orientation.
    orientation = nib.orientations.io_orientation(image.affine)
    back_to_canvas = nib.orientations.ornt_transform(nib.orientations.axcodes2ornt(("R", "A", "S")), orientation)
    zooms = [float(s) for s in image.header.get_zooms()[:3]]
    canvas_spacing = np.empty(3)
    for axis, (target, _) in enumerate(orientation):
        canvas_spacing[int(target)] = zooms[axis]
    ct = _reorient(np.asarray(image.dataobj, dtype=np.float32), orientation)
    masks = {name: _reorient(mask, orientation) for name, mask in _read_canvas_masks(case, image.shape[:3]).items()}
    if ORGAN_CLASS not in masks or not masks[ORGAN_CLASS].any():
        raise GenerationError(f"canvas {canvas_id}: {case.mask_path(ORGAN_CLASS)} is missing or empty")
    if LESION_CLASS in masks and masks[LESION_CLASS].any():
        raise GenerationError(f"canvas {canvas_id}: {case.mask_path(LESION_CLASS)} has voxels but the case is recorded healthy")

    tumor, size_class = _draw_tumor(masks[ORGAN_CLASS], canvas_spacing, rng, size_classes, erosion_mm, canvas_id)
    diameter_mm = largest_extent_mm(tumor, canvas_spacing)

    config = pipeline.unet.config
    model_spacing = np.array([float(s) for s in config.spacing])
    factor = pipeline.unet.downsampling_factor * (pipeline.vae.downsampling_factor if pipeline.vae is not None else 1)
    # The patch holds the tumor, the inpainting margin and blending on each side, and at least the training patch.
    corners = np.argwhere(tumor)
    extent_mm = (corners.max(axis=0) - corners.min(axis=0) + 1) * canvas_spacing
    needed_mm = extent_mm + 2 * (float(config.inpaint_margin_mm) + 3 * float(config.blend_sigma_mm)) + 2 * model_spacing
    model_shape = np.maximum(np.array(config.patch_size), np.ceil(needed_mm / model_spacing)).astype(int)
    model_shape = (np.ceil(model_shape / factor) * factor).astype(int)
    crop_shape = np.maximum(np.round(model_shape * model_spacing / canvas_spacing).astype(int), 1)
    centre = np.round((corners.min(axis=0) + corners.max(axis=0)) / 2).astype(int)
    start = centre - crop_shape // 2

    crop_ct = _crop(ct, start, crop_shape, mode="edge")
    crop_organ = _crop(masks[ORGAN_CLASS], start, crop_shape, mode="constant")
    crop_tumor = _crop(tumor, start, crop_shape, mode="constant")
    resample = not np.allclose(canvas_spacing, model_spacing, rtol=1e-3, atol=1e-4)
    if resample:
        model_ct = _resize(crop_ct, model_shape, "trilinear")
        model_organ = _resize(crop_organ.astype(np.float32), model_shape, "trilinear") > 0.5
        model_tumor = _resize(crop_tumor.astype(np.float32), model_shape, "trilinear") > 0.5
        if not model_tumor.any():
            model_tumor = _resize(crop_tumor.astype(np.float32), model_shape, "nearest") > 0.5
        if not model_tumor.any():
            raise GenerationError(
                f"{case_id}: the {size_class} tumor drawn in canvas {canvas_id} vanishes at the generator's "
                f"voxel size {model_spacing.tolist()} mm"
            )
    else:
        model_ct, model_organ, model_tumor = crop_ct, crop_organ, crop_tumor

    generator = torch.Generator(device="cpu").manual_seed(int(rng.integers(0, 2**31 - 1)))
    output = pipeline(
        image=model_ct,
        organ_mask=model_organ,
        tumor_mask=model_tumor,
        sex=request.sex,
        age=request.age_band,  # the generator is conditioned on the band itself
        phase=request.phase,
        organ=ORGAN_CLASS,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        generator=generator,
    )
    painted = np.asarray(output.images[0], dtype=np.float32)
    if not np.isfinite(painted).all():
        raise GenerationError(f"{case_id}: the generator returned non-finite values (canvas {canvas_id})")

    if resample:
        region = inpainting_region(model_tumor, model_spacing, float(config.inpaint_margin_mm))
        back = _resize(painted, crop_shape, "trilinear")
        # Nearest-neighbour region plus one canvas voxel, so the blended border is pasted whole;
        # outside it the pipeline left the patch as given and the canvas keeps its own voxels.
        region_back = _resize(region.astype(np.float32), crop_shape, "nearest") > 0.5
        region_back = _dilate(region_back | crop_tumor)
        new_crop = np.where(region_back, back, crop_ct)
    else:
        new_crop = painted
    new_ct = ct.copy()
    _paste(new_ct, new_crop, start)
    new_ct = np.clip(np.round(new_ct), np.iinfo(np.int16).min, np.iinfo(np.int16).max)

    new_masks = dict(masks)
    new_masks[LESION_CLASS] = tumor
    # AbdomenAtlas convention: the organ mask includes its lesion.
    new_masks[ORGAN_CLASS] = masks[ORGAN_CLASS] | tumor
    new_ct = _reorient(new_ct, back_to_canvas)
    new_masks = {name: _reorient(mask, back_to_canvas) for name, mask in new_masks.items()}
    tumor = new_masks[LESION_CLASS]
    canvas_age = float(canvas["age"]) if canvas.get("age") is not None and not pd.isna(canvas["age"]) else math.nan
    age = canvas_age if age_band(canvas_age) == request.age_band else REPRESENTATIVE_AGE[request.age_band]
    row = {
        "case_id": case_id,
        "patient_id": str(canvas["patient_id"]),
        "cohort": str(canvas.get("cohort", UNKNOWN)),
        "age": age,
        "sex": request.sex,
        "race": str(canvas.get("race", UNKNOWN)),
        "phase": str(canvas["phase"]),
        "tumor": 1,
        "synthetic": 1,
        "source_case_id": canvas_id,
        "tumor_diameter_mm": round(diameter_mm, 2),
        "tumor_location": pancreas_location(new_masks[ORGAN_CLASS], tumor, image.affine),
        "spacing": "x".join(f"{s:g}" for s in canvas_spacing),
        "canvas_sex": str(canvas.get("sex", UNKNOWN)),
        "canvas_age": canvas_age,
        "canvas_matches_condition": int(exact_canvas),
        "synthx_request": request.key,
        "synthx_size_class": size_class,
        "synthx_seed": int(seed),
    }
    return GeneratedCase(case_id=case_id, ct=new_ct, affine=image.affine, masks=new_masks, row=row)


# ----------------------------------------------------------------------------------------------
# The whole run.


def synthesize(
    cohort_root: Path | str,
    split_path: Path | str,
    pipeline,
    out_root: Path | str,
    requests,
    seed: int = 0,
    num_inference_steps: int = 20,
    scheduler: str = "ddim",
    guidance_scale: float = 1.0,
    budget: int | None = None,
    size_classes: Mapping[str, float] | None = None,
    erosion_mm: float = 1.5,
    canvas_ids: Sequence[str] | None = None,
    max_cases: int | None = None,
    generator_run_id: str | None = None,
    tracking_uri: str | None = None,
    experiment: str = "synthx",
    log_to_mlflow: bool = True,
    device: str = "cpu",
    progress: bool = True,
) -> SynthesisSummary:
    """Generate the requested synthetic cases into ``out_root`` (layout A + ``metadata.csv``), resumably.

    Args:
        cohort_root: the real cohort (canvases come from its healthy training cases).
        split_path: its split CSV.
        pipeline: a folder saved with ``save_pretrained``, ``runs:/<id>/pipeline``, a run id, or a
            loaded :class:`SynthXPipeline` (then ``scheduler`` is still swapped in).
        out_root: the synthetic cohort folder (created; an existing one is resumed).
        requests: a targeting table (:func:`synthx.targeting.compute_targets`), a rule string such as
            ``min_positives:4`` (computed on the real cohort), a ``{(sex, age band, phase): n}``
            mapping, or a list of :class:`SynthesisRequest`.
        seed: fixes every case id's canvas, tumor mask and diffusion noise.
        num_inference_steps: denoising steps.
        scheduler: ``ddpm``, ``ddim`` or ``dpm_solver``.
        guidance_scale: classifier-free guidance weight (1 = none).
        budget: total synthetic budget for ``match`` rules.
        size_classes: relative weights of the tumor size classes (default :data:`DEFAULT_SIZE_CLASSES`).
        erosion_mm: tumors keep this distance from the pancreas border.
        canvas_ids: restrict canvases to these cases (each must be a healthy real training case).
        max_cases: generate at most this many new cases in this call (the rest on a rerun).
        generator_run_id: the MLflow run that trained the generator, when ``pipeline`` is a folder.
        tracking_uri: MLflow tracking URI (default: ``MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``).
        experiment: MLflow experiment of the generation run.
        log_to_mlflow: log the generation run (targets, per-cell counts, timings) to MLflow.
        device: torch device of the denoiser.
        progress: show a tqdm progress bar.
    """
    from tqdm.auto import tqdm

    from lightning_modules.tracking import experiment_id, git_commit
    from lightning_modules.tracking import tracking_uri as resolve_uri

    if scheduler not in SCHEDULERS:
        raise GenerationError(f"unknown scheduler {scheduler!r} (expected one of {', '.join(SCHEDULERS)})")
    size_classes = dict(DEFAULT_SIZE_CLASSES if size_classes is None else size_classes)
    _check_size_classes(size_classes)
    uri = resolve_uri(tracking_uri)
    cohort = load_cohort(cohort_root)
    split = load_split(split_path, cohort)
    canvases = canvas_table(cohort, split, canvas_ids)

    targets = None
    if isinstance(requests, str):
        targets = compute_targets(cohort, split_path, requests, budget=budget)
        requests = targets
    elif isinstance(requests, pd.DataFrame):
        targets = requests
    request_list = as_requests(requests)
    _check_canvases_cover(request_list, canvases)

    if isinstance(pipeline, (str, Path)):
        pipeline_source = str(pipeline)
        pipe, resolved_run_id = load_pipeline(pipeline_source, scheduler, uri, device)
    else:
        pipe, resolved_run_id = pipeline, ""
        _set_scheduler(pipe, scheduler)
        pipeline_source = getattr(pipe, "name_or_path", "") or "<in-memory pipeline>"
    generator_run_id = generator_run_id or resolved_run_id

    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    settings = {
        "seed": int(seed),
        "pipeline": pipeline_source,
        "generator_run_id": generator_run_id,
        "scheduler": scheduler,
        "num_inference_steps": int(num_inference_steps),
        "guidance_scale": float(guidance_scale),
        "size_classes": {k: float(v) for k, v in sorted(size_classes.items())},
        "erosion_mm": float(erosion_mm),
        "cohort_root": str(Path(cohort_root).resolve()),
        "split_sha256": file_sha256(split_path),
    }
    _check_manifest(out_root, settings)
    rows = _read_existing_rows(out_root)
    _remove_stale_staging(out_root)

    summary = SynthesisSummary(out_root=out_root, requested=len(request_list), generator_run_id=generator_run_id)
    client = run_id = None
    if log_to_mlflow:
        import mlflow

        mlflow.set_tracking_uri(uri)
        client = mlflow.MlflowClient(uri)
        run_id = client.create_run(
            experiment_id(experiment, uri),
            run_name="synthesize",
            tags={"generator_run_id": generator_run_id, "synthetic_cohort": str(out_root.resolve()), "git_commit": git_commit()},
        ).info.run_id
        summary.synthesis_run_id = run_id
        for key, value in settings.items():
            client.log_param(run_id, key, json.dumps(value) if isinstance(value, dict) else value)
        if targets is not None:
            log_targets(targets, run_id=run_id)

    seconds: list[float] = []
    status = "FINISHED"
    try:
        bar = tqdm(request_list, desc="synthesize", unit="case", disable=not progress)
        for request in bar:
            case_id = request.case_id(seed)
            if case_id in rows and _case_is_complete(out_root, case_id, rows[case_id], request):
                summary.skipped.append(case_id)
                continue
            if max_cases is not None and len(summary.generated) + len(summary.failed) >= max_cases:
                summary.not_reached += 1
                continue
            started = time.perf_counter()
            rng = request.rng(seed)
            try:
                canvas, exact = choose_canvas(canvases, request, rng)
                generated = generate_case(
                    cohort, canvas, request, rng, pipe, seed, num_inference_steps, guidance_scale, size_classes, erosion_mm, exact
                )
                generated.row["generator_run_id"] = generator_run_id
                generated.row["synthesis_run_id"] = run_id or ""
                write_case(out_root, case_id, generated.ct, generated.affine, generated.masks)
            except Exception as error:  # one bad case must not stop the others; it is reported and kept aside
                summary.failed[case_id] = f"{type(error).__name__}: {error}"
                _quarantine(out_root, case_id, request, error)
                if rows.pop(case_id, None) is not None:
                    write_metadata(out_root, _metadata_table(rows))
                continue
            rows[case_id] = generated.row
            write_metadata(out_root, _metadata_table(rows))
            _clear_quarantine(out_root, case_id)
            summary.generated.append(case_id)
            seconds.append(time.perf_counter() - started)
            bar.set_postfix(done=len(summary.generated) + len(summary.skipped), failed=len(summary.failed))
    except BaseException:
        status = "KILLED"
        raise
    finally:
        summary.seconds_per_case = float(np.mean(seconds)) if seconds else math.nan
        summary.per_cell = _per_cell(request_list, summary, seed)
        if client is not None:
            _log_summary(client, run_id, summary, rows)
            client.set_terminated(run_id, status=status if status == "KILLED" else ("FAILED" if summary.failed else "FINISHED"))
    return summary


# ----------------------------------------------------------------------------------------------
# Command line.


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchx synthesize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="the real cohort (canvases: its healthy training cases)")
    parser.add_argument("--split", required=True, help="its split CSV")
    parser.add_argument("--pipeline", required=True, help="saved pipeline folder, runs:/<run id>/pipeline, or a run id")
    parser.add_argument("--out", required=True, help="the synthetic cohort folder (resumed when it exists)")
    parser.add_argument(
        "--target",
        required=True,
        help="min_positives:k | match:test|val|uniform|<table> (with --budget) | counts:<csv/yaml> | a csv/yaml path",
    )
    parser.add_argument("--budget", type=int, default=None, help="total synthetic cases for match rules")
    parser.add_argument("--phases", nargs="+", default=None, help="restrict the targeted cells to these phases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20, help="denoising steps")
    parser.add_argument("--scheduler", default="ddim", choices=SCHEDULERS)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--size-classes", default=None, help="weights, e.g. tiny=1,small=2,medium=1 (default as the recipe)")
    parser.add_argument("--erosion-mm", type=float, default=1.5)
    parser.add_argument("--max-cases", type=int, default=None, help="make at most this many new cases now")
    parser.add_argument("--generator-run-id", default=None, help="the generator's training run, when --pipeline is a folder")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--experiment", default="synthx")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    sizes = None
    if args.size_classes:
        try:
            sizes = {k.strip(): float(v) for k, v in (item.split("=") for item in args.size_classes.split(","))}
        except ValueError:
            parser.error(f"--size-classes {args.size_classes!r}: expected name=weight,name=weight")
    phases = [p for p in PHASES if args.phases is None or p in {normalize_phase(x) for x in args.phases}]
    targets = compute_targets(args.root, args.split, args.target, budget=args.budget, phases=phases)
    summary = synthesize(
        args.root,
        args.split,
        args.pipeline,
        args.out,
        targets,
        seed=args.seed,
        num_inference_steps=args.steps,
        scheduler=args.scheduler,
        guidance_scale=args.guidance_scale,
        size_classes=sizes,
        erosion_mm=args.erosion_mm,
        max_cases=args.max_cases,
        generator_run_id=args.generator_run_id,
        tracking_uri=args.tracking_uri,
        experiment=args.experiment,
        device=args.device,
    )
    print(
        f"{len(summary.generated)} generated, {len(summary.skipped)} already complete, {len(summary.failed)} failed, "
        f"{summary.not_reached} left for a rerun, of {summary.requested} requested "
        f"({summary.seconds_per_case:.1f} s per case) -> {summary.out_root}"
    )
    for case_id, error in summary.failed.items():
        print(f"  FAILED {case_id}: {error} (details in {summary.out_root / QUARANTINE_DIR / (case_id + '.json')})", file=sys.stderr)
    if summary.synthesis_run_id:
        print(f"MLflow run {summary.synthesis_run_id}")
    return 0 if summary.complete else 1


# ----------------------------------------------------------------------------------------------
# Helpers.


def _check_size_classes(size_classes: Mapping[str, float]) -> None:
    unknown = [k for k in size_classes if k not in SIZE_CLASS_NAMES]
    if unknown:
        raise GenerationError(f"unknown tumor size class(es) {unknown}; expected {', '.join(SIZE_CLASS_NAMES)}")
    if any(v < 0 for v in size_classes.values()) or sum(size_classes.values()) <= 0:
        raise GenerationError(f"size class weights must be non-negative with a positive sum, got {dict(size_classes)}")


def _check_canvases_cover(requests: Sequence[SynthesisRequest], canvases: pd.DataFrame) -> None:
    """Refuse, before generating anything, requests whose phase has no canvas."""
    available = set(canvases["phase"])
    missing: dict[str, int] = {}
    for request in requests:
        if request.phase not in available:
            missing[request.phase] = missing.get(request.phase, 0) + 1
    if missing:
        listing = ", ".join(f"{phase} ({n} requested)" for phase, n in missing.items())
        raise GenerationError(
            f"no healthy real training case (canvas) has phase {listing}; a synthetic case takes its canvas' phase. "
            "Restrict the target to the phases that have canvases (--phases) or add such scans"
        )


def _draw_tumor(organ, spacing, rng, size_classes, erosion_mm, canvas_id) -> tuple[np.ndarray, str]:
    names = [n for n in SIZE_CLASS_NAMES if size_classes.get(n, 0) > 0]
    weights = np.array([size_classes[n] for n in names], dtype=float)
    size_class = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    errors = []
    # A class that does not fit this pancreas falls back to the next smaller one (recorded in the metadata).
    for fallback in reversed(SIZE_CLASS_NAMES[: SIZE_CLASS_NAMES.index(size_class) + 1]):
        try:
            mask = sample_tumor_mask(organ, fallback, rng, spacing=spacing, erosion_mm=erosion_mm, where=f"canvas {canvas_id} pancreas")
            return mask, fallback
        except TumorDoesNotFitError as error:
            errors.append(str(error))
    raise GenerationError("; ".join(errors))


def _read_canvas_masks(case, shape) -> dict[str, np.ndarray]:
    masks = {}
    for name in case.available_classes():
        path = case.mask_path(name)
        mask = np.asarray(nib.load(path).dataobj)
        if mask.shape != tuple(shape):
            raise GenerationError(f"canvas {case.case_id}: mask {path} has shape {mask.shape}, its CT has {tuple(shape)}")
        masks[name] = mask > 0
    return masks


def _reorient(volume: np.ndarray, orientation: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(nib.orientations.apply_orientation(volume, orientation))


def _crop(volume: np.ndarray, start: np.ndarray, shape: np.ndarray, mode: str) -> np.ndarray:
    """``volume[start:start+shape]``, padded (edge values or zeros) where the box leaves the volume."""
    before = np.maximum(-start, 0)
    after = np.maximum(start + shape - np.array(volume.shape), 0)
    padded = np.pad(volume, list(zip(before, after)), mode=mode)
    offset = start + before
    return padded[tuple(slice(int(o), int(o + s)) for o, s in zip(offset, shape))].copy()


def _paste(volume: np.ndarray, patch: np.ndarray, start: np.ndarray) -> None:
    """Write ``patch`` into ``volume`` at ``start``, dropping what falls outside the volume."""
    lower = np.maximum(start, 0)
    upper = np.minimum(start + np.array(patch.shape), volume.shape)
    target = tuple(slice(int(a), int(b)) for a, b in zip(lower, upper))
    source = tuple(slice(int(a - s), int(b - s)) for a, b, s in zip(lower, upper, start))
    volume[target] = patch[source]


def _resize(volume: np.ndarray, shape, mode: str) -> np.ndarray:
    tensor = torch.from_numpy(np.ascontiguousarray(volume, dtype=np.float32))[None, None]
    kwargs = {"align_corners": False} if mode == "trilinear" else {}
    return F.interpolate(tensor, size=tuple(int(s) for s in shape), mode=mode, **kwargs)[0, 0].numpy()


def _dilate(mask: np.ndarray) -> np.ndarray:
    return ndimage.binary_dilation(mask, iterations=1)


def _metadata_table(rows: Mapping[str, dict]) -> pd.DataFrame:
    table = pd.DataFrame([rows[k] for k in sorted(rows)])
    ordered = [c for c in STANDARD_COLUMNS if c in table.columns]
    return table[ordered + [c for c in table.columns if c not in ordered]]


def _read_existing_rows(out_root: Path) -> dict[str, dict]:
    path = out_root / METADATA_FILE
    if not path.exists():
        return {}
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    if "case_id" not in table.columns or "synthx_request" not in table.columns:
        raise GenerationError(f"{path} exists but was not written by SynthX generation (no case_id/synthx_request column)")
    real = table[table["synthetic"] != "1"] if "synthetic" in table.columns else table
    if len(real):
        raise GenerationError(f"{path}: case {real.iloc[0]['case_id']} is not synthetic; write synthetic cases to their own folder")
    return {row["case_id"]: row for row in table.to_dict("records")}


def _case_is_complete(out_root: Path, case_id: str, row: Mapping, request: SynthesisRequest) -> bool:
    """A case counts as done when its metadata row matches the request and its files are all present and readable."""
    if str(row.get("synthx_request", "")) != request.key:
        return False
    folder = out_root / case_id
    ct_path = folder / CT_FILE
    lesion = folder / SEGMENTATION_DIR / f"{LESION_CLASS}.nii.gz"
    organ = folder / SEGMENTATION_DIR / f"{ORGAN_CLASS}.nii.gz"
    if not (ct_path.is_file() and lesion.is_file() and organ.is_file()):
        return False
    try:
        shape = nib.load(ct_path).shape
        return all(nib.load(p).shape == shape for p in (folder / SEGMENTATION_DIR).glob("*.nii.gz"))
    except Exception:  # an unreadable header means the case must be made again
        return False


def _check_manifest(out_root: Path, settings: dict) -> None:
    path = out_root / MANIFEST_FILE
    if path.exists():
        previous = json.loads(path.read_text())
        changed = [k for k in _MANIFEST_KEYS if previous.get(k) != settings.get(k)]
        if changed:
            details = "; ".join(f"{k}: {previous.get(k)!r} before, {settings.get(k)!r} now" for k in changed)
            raise GenerationError(
                f"{out_root} was generated with other settings ({details}); resume with the same settings or write to a new --out"
            )
        return
    atomic_write_bytes(path, json.dumps(settings, indent=2).encode())


def _remove_stale_staging(out_root: Path) -> None:
    """Hidden staging folders a killed ``write_case`` left behind (``.SX<seed>_...``) hold nothing valid."""
    for path in out_root.glob(".SX*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _quarantine(out_root: Path, case_id: str, request: SynthesisRequest, error: BaseException) -> None:
    """Keep the error (and an earlier, incomplete folder of the case) under ``.quarantine``, out of the cohort."""
    folder = out_root / case_id
    if folder.exists():
        kept = out_root / QUARANTINE_DIR / f"{case_id}.incomplete"
        shutil.rmtree(kept, ignore_errors=True)
        kept.parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder, kept)
    record = {
        "case_id": case_id,
        "request": request.key,
        "error": f"{type(error).__name__}: {error}",
        "traceback": traceback.format_exception(type(error), error, error.__traceback__),
    }
    atomic_write_bytes(out_root / QUARANTINE_DIR / f"{case_id}.json", json.dumps(record, indent=2).encode())


def _clear_quarantine(out_root: Path, case_id: str) -> None:
    path = out_root / QUARANTINE_DIR / f"{case_id}.json"
    if path.exists():
        path.unlink()


def _per_cell(requests: Sequence[SynthesisRequest], summary: SynthesisSummary, seed: int) -> pd.DataFrame:
    status = {c: "generated" for c in summary.generated}
    status.update({c: "skipped" for c in summary.skipped})
    status.update({c: "failed" for c in summary.failed})
    rows: dict[tuple[str, str, str], dict] = {}
    for request in requests:
        cell = (request.sex, request.age_band, request.phase)
        row = rows.setdefault(cell, dict(zip(CELL_COLUMNS, cell), requested=0, generated=0, skipped=0, failed=0, pending=0))
        row["requested"] += 1
        row[status.get(request.case_id(seed), "pending")] += 1
    return pd.DataFrame(list(rows.values()), columns=[*CELL_COLUMNS, "requested", "generated", "skipped", "failed", "pending"])


def _log_summary(client, run_id: str, summary: SynthesisSummary, rows: Mapping[str, dict]) -> None:
    client.log_table(run_id, data=summary.per_cell, artifact_file="synthx/per_cell.json")
    client.log_text(run_id, summary.per_cell.to_csv(index=False), "synthx/per_cell.csv")
    if rows:
        client.log_text(run_id, _metadata_table(rows).to_csv(index=False), "synthx/metadata.csv")
    if summary.failed:
        client.log_dict(run_id, summary.failed, "synthx/failed.json")
    metrics = {
        "synthx/cases_requested": summary.requested,
        "synthx/cases_generated": len(summary.generated),
        "synthx/cases_skipped": len(summary.skipped),
        "synthx/cases_failed": len(summary.failed),
        "synthx/cases_pending": summary.not_reached,
    }
    if np.isfinite(summary.seconds_per_case):
        metrics["synthx/seconds_per_case"] = summary.seconds_per_case
    for key, value in metrics.items():
        client.log_metric(run_id, key, float(value))
    client.set_tag(run_id, "generator_run_id", summary.generator_run_id)


if __name__ == "__main__":
    sys.exit(main())

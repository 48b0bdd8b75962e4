"""The resumable generation run: requests -> canvases of their cell -> painted cases -> a synthetic cohort.

Steps of :func:`synthesize`: check the settings; read the cohort, split and canvases; turn the
requests into cases and set aside the unfillable cells (no healthy training scan of that sex, age
band and phase: reported, counted, logged, never relabeled); load the generator and check its
provenance (:mod:`synthx.generator.provenance`) and guidance; open the output folder (manifest, finished
cases); open the MLflow run; paint each missing case; log the summary.

Determinism and resumption: a request is identified by its cell and its index within the cell;
its case id (``SX<seed>_<sex>_<age band>_<phase>_<index>``) and its random state (canvas, size,
mask, diffusion noise) derive from (seed, cell, index) only. A rerun skips cases already complete
and valid, so after a kill it does only the remainder, and raising one cell's count later only adds
cases. A case that fails is reported and quarantined, and nothing of it is written.

Synthetic cases are training data only: the output cohort gets no split file, and the mixing code
(:mod:`lightning_modules.data.mixing`) checks that each canvas is a real training case of the split
in use. The generator's provenance is copied into the cohort (``synthx_provenance.json``; the
phantom painter's says it learned from no case, the copy-paste painter's lists the training tumors it may copy), so that mixing, the audit and evaluation check
what the generator learned from against their own split
(:mod:`lightning_modules.data.synthetic_provenance`). Metadata: ``synthetic=1``, ``tumor=1``, ``source_case_id`` (the canvas), the canvas'
``patient_id``, ``cohort``, ``sex``, ``age``, ``race`` and ``phase``, ``tumor_diameter_mm``,
``tumor_location``, ``generator_run_id`` and ``synthesis_run_id``.

Example::

    recipe = load_synthx_recipe("recipes/generator/synthx.yaml", ["profile=cpu"])
    settings = SynthesisSettings.from_recipe(recipe, "data/phantom", "splits/phantom.csv", "runs:/<id>/pipeline", "data/synthetic")
    summary = synthesize(settings, "min_positives:4")
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from omegaconf import DictConfig
from tqdm.auto import tqdm

from lightning_modules.data.cohort import load_cohort, write_case, write_metadata
from lightning_modules.data.lesions import SIZE_CLASS_NAMES
from lightning_modules.data.metadata import normalize_phase, PHASES
from lightning_modules.data.splits import load_split
from lightning_modules.infrastructure.files import atomic_write_bytes, file_sha256
from lightning_modules.infrastructure.process import git_commit, terminating_signals
from lightning_modules.infrastructure.run_folder import RunFolderLock
from lightning_modules.tracking import experiment_id, tracking_uri as resolve_uri
from lightning_modules.tracking.recorder import MlflowRunRecorder
from synthx.config import MaskPriorConfig, SamplingConfig
from synthx.generation.canvases import (
    as_requests,
    canvas_table,
    choose_canvas,
    GenerationError,
    partition_requests,
    SynthesisRequest,
    training_tumor_diameters,
)
from synthx.generation.copy_paste import CopyPastePainter
from synthx.generation.painting import generate_case, PaintSettings
from synthx.generation.phantom_painter import PhantomPainter
from synthx.generation.source import load_pipeline, set_scheduler
from synthx.generation.writing import (
    case_is_complete,
    check_manifest,
    clear_quarantine,
    log_summary,
    metadata_table,
    per_cell_table,
    quarantine,
    QUARANTINE_DIR,
    read_existing_rows,
    remove_stale_staging,
)
from synthx.generator.mask_prior import size_class_weights
from synthx.painters import COPY_PASTE_PAINTER, PAINTERS, PHANTOM_PAINTER, SYNTHX_PAINTER
from synthx.generator.provenance import check_provenance, GeneratorProvenance, read_provenance
from synthx.generator.schedulers import SAMPLING_SCHEDULERS
from synthx.generation.targeting import resolve_targets


log = logging.getLogger(__name__)


@dataclass
class SynthesisSettings:
    """Everything a generation run needs besides its requests.

    Args:
        cohort_root: the real cohort (canvases come from its healthy training cases).
        split_path: its split CSV.
        pipeline: a folder saved with ``save_pretrained``, ``runs:/<id>/pipeline``, a run id, or a
            loaded :class:`synthx.generator.pipeline.SynthXPipeline` (then ``provenance`` is required); None
            with the phantom painter.
        out_root: the synthetic cohort folder (created; an existing one is resumed).
        seed: fixes every case id's canvas, tumor mask and diffusion noise.
        scheduler / num_inference_steps / guidance_scale: the recipe's ``sampling`` section.
        size_classes / erosion_mm / rim_mm / clip_to_organ: the recipe's ``mask_prior`` section (size
            class weights, border distance, the parenchymal rim grown around each mass, whether a
            drawn tumor is clipped to the eroded gland or may bulge out of it).
            ``size_classes=None`` (the recipe's default, ``mask_prior.size_source: training``) draws
            the classes in proportion to the real training tumors (:func:`synthx.generation.canvases.training_tumor_diameters`); the weights
            used are logged and kept in the manifest.
        budget: total synthetic budget for ``match`` rules given as a string.
        phases: restrict the targeted cells of a rule string to these phases.
        baseline_records: the baseline's validation records, for a ``need`` rule given as a string.
        need_threshold: the baseline's operating point for those records (default: the fixed m).
        canvas_ids: restrict canvases to these cases (each must be a healthy real training case).
        max_cases: generate at most this many new cases in this call (the rest on a rerun).
        generator_run_id: the MLflow run that trained the generator (default: from its provenance).
        provenance: the generator's provenance when ``pipeline`` is an in-memory object.
        tracking_uri / experiment: MLflow tracking URI and experiment of the generation run.
        log_to_mlflow: log the generation run (targets, per-cell counts, timings) to MLflow.
        device: torch device of the denoiser.
        progress: show a tqdm progress bar.
        painter: ``synthx`` (the diffusion generator in ``pipeline``) or ``phantom`` (the phantom's
            own renderer paints real-appearance tumors into phantom canvases: the study's positive
            control, :mod:`synthx.generation.phantom_painter`; sampling settings do not apply) or
            ``copy_paste`` (real training tumors pasted at the sites SynthX paints: the same seed, mask
            prior and canvases give the same sites; :mod:`synthx.generation.copy_paste`; sampling
            settings do not apply).
        copy_paste_scale / copy_paste_feather_mm: the copy-paste painter's zoom of each source tumor
            to the site's size, and its blended edge (mm inside the mask; 0: a hard paste).
    """

    cohort_root: Path | str
    split_path: Path | str
    pipeline: Any
    out_root: Path | str
    seed: int = 0
    scheduler: str = SamplingConfig.scheduler
    num_inference_steps: int = SamplingConfig.num_inference_steps
    guidance_scale: float = SamplingConfig.guidance_scale
    size_classes: Mapping[str, float] | None = None
    erosion_mm: float = MaskPriorConfig.erosion_mm
    rim_mm: float = MaskPriorConfig.rim_mm
    clip_to_organ: bool = MaskPriorConfig.clip_to_organ
    budget: int | None = None
    phases: Sequence[str] | None = None
    baseline_records: pd.DataFrame | None = None
    need_threshold: float | None = None
    canvas_ids: Sequence[str] | None = None
    max_cases: int | None = None
    generator_run_id: str | None = None
    provenance: GeneratorProvenance | None = None
    tracking_uri: str | None = None
    experiment: str = "synthx"
    log_to_mlflow: bool = True
    device: str = "cpu"
    progress: bool = True
    painter: str = SYNTHX_PAINTER
    copy_paste_scale: bool = True
    copy_paste_feather_mm: float = 0.0

    @classmethod
    def from_recipe(cls, recipe: DictConfig, cohort_root, split_path, pipeline, out_root, **values) -> "SynthesisSettings":
        """Settings whose sampling, mask prior, seed and tracking come from a SynthX recipe; ``values`` override."""
        sampling, prior = recipe.sampling, recipe.mask_prior
        from_recipe = dict(
            seed=int(recipe.seed),
            scheduler=str(sampling.scheduler),
            num_inference_steps=int(sampling.num_inference_steps),
            guidance_scale=float(sampling.guidance_scale),
            size_classes=None if prior.size_source == "training" else {str(k): float(v) for k, v in prior.size_class_weights.items()},
            erosion_mm=float(prior.erosion_mm),
            rim_mm=float(prior.rim_mm),
            clip_to_organ=bool(prior.clip_to_organ),
            tracking_uri=recipe.tracking.uri,
            experiment=str(recipe.tracking.experiment),
        )
        return cls(cohort_root, split_path, pipeline, out_root, **{**from_recipe, **values})

    def paint_settings(self) -> PaintSettings:
        return PaintSettings(int(self.seed), int(self.num_inference_steps), float(self.guidance_scale), dict(self.size_classes or {}), float(self.erosion_mm),
                             float(self.rim_mm), bool(self.clip_to_organ))


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
    generator_split_sha256: str = ""
    synthesis_run_id: str = ""
    unfillable: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["sex", "age_band", "phase", "requested"]))
    per_cell: pd.DataFrame | None = None

    @property
    def unfillable_cases(self) -> int:
        return int(self.unfillable["requested"].sum()) if len(self.unfillable) else 0

    @property
    def complete(self) -> bool:
        """Every fillable request is made (unfillable cells are reported, not failures)."""
        return not self.failed and self.not_reached == 0


def check_settings(settings: SynthesisSettings) -> None:
    if settings.painter not in PAINTERS:
        raise GenerationError(f"unknown painter {settings.painter!r} (expected one of {', '.join(PAINTERS)})")
    if settings.painter != SYNTHX_PAINTER and settings.pipeline is not None:
        raise GenerationError(f"the {settings.painter} painter uses no generator, but pipeline {settings.pipeline!r} was given")
    if settings.copy_paste_feather_mm < 0:
        raise GenerationError(f"the copy-paste feather must be >= 0 mm, got {settings.copy_paste_feather_mm}")
    if settings.scheduler not in SAMPLING_SCHEDULERS:
        raise GenerationError(f"unknown scheduler {settings.scheduler!r} (expected one of {', '.join(SAMPLING_SCHEDULERS)})")
    if settings.size_classes is not None:
        unknown = [k for k in settings.size_classes if k not in SIZE_CLASS_NAMES]
        if unknown:
            raise GenerationError(f"unknown tumor size class(es) {unknown}; expected {', '.join(SIZE_CLASS_NAMES)}")
        weights = list(settings.size_classes.values())
        if any(v < 0 for v in weights) or sum(weights) <= 0:
            raise GenerationError(f"size class weights must be non-negative with a positive sum, got {dict(settings.size_classes)}")
    if settings.guidance_scale < 1.0 or settings.num_inference_steps < 1:
        raise GenerationError(f"guidance scale must be >= 1 and inference steps >= 1, got {settings.guidance_scale}, {settings.num_inference_steps}")


def training_size_classes(cohort, split: pd.DataFrame) -> dict[str, float]:
    """Mask-prior weights from the real training tumors' sizes (the default ``mask_prior``), logged."""
    diameters = training_tumor_diameters(cohort, split)
    weights = size_class_weights(diameters)
    log.info("mask prior: tumor sizes as the %d real training tumors (median %.1f mm): %s", len(diameters),
             float(diameters.median()), ", ".join(f"{name} {int(n)}" for name, n in weights.items()))
    return weights


def _targets(settings: SynthesisSettings, cohort, requests) -> pd.DataFrame | None:
    """The targeting table when ``requests`` is a rule or a table (to log it), else None."""
    if isinstance(requests, str):
        phases = [p for p in PHASES if settings.phases is None or p in {normalize_phase(x) for x in settings.phases}]
        return resolve_targets(
            cohort, settings.split_path, requests, budget=settings.budget, phases=phases,
            baseline_records=settings.baseline_records, threshold=settings.need_threshold,
        )
    return requests if isinstance(requests, pd.DataFrame) else None


def _generator(settings: SynthesisSettings, split: pd.DataFrame, split_hash: str, uri: str):
    """The pipeline with the sampling scheduler, its run id and provenance, checked against this split."""
    if isinstance(settings.pipeline, (str, Path)):
        source = str(settings.pipeline)
        pipeline, run_id, provenance = load_pipeline(source, settings.scheduler, uri, settings.device)
    else:
        pipeline, run_id, provenance = settings.pipeline, "", settings.provenance
        set_scheduler(pipeline, settings.scheduler)
        source = getattr(pipeline, "name_or_path", "") or "<in-memory pipeline>"
        provenance = provenance or (read_provenance(source) if Path(source).is_dir() else None)
    check_provenance(provenance, split, split_hash, source=f"generator {source}")
    if settings.guidance_scale > 1.0 and provenance.condition_dropout_all <= 0.0:
        raise GenerationError(
            f"guidance scale {settings.guidance_scale} needs a generator trained with condition_dropout.all > 0; "
            f"generator {source} never saw the null condition: set sampling.guidance_scale=1"
        )
    run_id = settings.generator_run_id or run_id or provenance.generator_run_id
    return pipeline, source, run_id, provenance


def _manifest(settings: SynthesisSettings, source: str, run_id: str, provenance: GeneratorProvenance | None, split_hash: str) -> dict:
    return {
        "seed": int(settings.seed),
        "pipeline": source,
        "generator_run_id": run_id,
        "generator_split_sha256": provenance.split_sha256 if provenance is not None else "",
        "scheduler": settings.scheduler,
        "num_inference_steps": int(settings.num_inference_steps),
        "guidance_scale": float(settings.guidance_scale),
        "size_classes": None if settings.size_classes is None else {k: float(v) for k, v in sorted(settings.size_classes.items())},
        "erosion_mm": float(settings.erosion_mm),
        # Only a manifest with a rim has the key, so folders painted without one keep resuming.
        **({"rim_mm": float(settings.rim_mm)} if settings.rim_mm > 0 else {}),
        **({"clip_to_organ": False} if not settings.clip_to_organ else {}),
        "cohort_root": str(Path(settings.cohort_root).resolve()),
        "split_sha256": split_hash,
        # Only the copy-paste painter's manifest has the key, so earlier folders keep resuming.
        **({"copy_paste": {"scale_to_site": bool(settings.copy_paste_scale), "feather_mm": float(settings.copy_paste_feather_mm)}}
           if settings.painter == COPY_PASTE_PAINTER else {}),
    }


def _cohort_provenance(provenance: GeneratorProvenance | None, run_id: str) -> GeneratorProvenance:
    """What the synthetic cohort records of its generator, so that mixing, the audit and evaluation
    can check it against the split they use: the generator's provenance with its resolved run id,
    or, for the phantom painter (provenance None), a painter that learned from no case."""
    if provenance is None:
        return GeneratorProvenance(trained=False)
    return replace(provenance, generator_run_id=run_id or provenance.generator_run_id)


SYNTHESIS_RUN_FILE = "synthesis_run.json"


def _open_run(settings: SynthesisSettings, uri: str, manifest: dict, out_root: Path, targets) -> tuple[Any, str]:
    """Continue the folder's synthesis run (an interrupted or extended synthesis) or start one.

    The run id is kept in ``synthesis_run.json`` beside the manifest; the manifest check has
    already refused other settings, so the run's parameters stay the same.
    """
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    record_path = out_root / SYNTHESIS_RUN_FILE
    run_id = None
    if record_path.exists():
        recorded = json.loads(record_path.read_text()).get("run_id")
        try:
            client.get_run(recorded)
            run_id = recorded
        except MlflowException:
            log.warning("%s names run %s, which %s does not hold: starting a new synthesis run", record_path, recorded, uri)
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
        log.info("continuing synthesis run %s", run_id)
    else:
        tags = {
            "generator_run_id": manifest["generator_run_id"],
            "generator_split_sha256": manifest["generator_split_sha256"],
            "split_sha256": manifest["split_sha256"],
            "synthetic_cohort": str(out_root.resolve()),
            "painter": settings.painter,
            "git_commit": git_commit(),
        }
        run_id = client.create_run(experiment_id(settings.experiment, uri), run_name="synthesize", tags=tags).info.run_id
        for key, value in manifest.items():
            client.log_param(run_id, key, json.dumps(value) if isinstance(value, dict) else value)
        atomic_write_bytes(record_path, json.dumps({"run_id": run_id, "tracking_uri": uri}).encode())
    if targets is not None:
        log_targets(client, run_id, targets)
    return client, run_id


def log_targets(client: mlflow.MlflowClient, run_id: str, targets: pd.DataFrame) -> None:
    """The targeting table (:func:`synthx.generation.targeting.resolve_targets`) on a synthesis run:
    ``synthx/targets.json`` for the UI, its CSV twin, and the total requested."""
    recorder = MlflowRunRecorder(client, run_id)
    recorder.log_table(targets, "synthx/targets.csv", ui=True)
    recorder.log_metrics({"synthx/requested_total": float(targets["requested"].sum())})


def _make_case(context: dict, request: SynthesisRequest, rows: dict, summary: SynthesisSummary, seconds: list) -> None:
    """Paint, write and record one request; a failure is quarantined and reported, never raised."""
    settings, out_root = context["settings"], context["out_root"]
    case_id = request.case_id(settings.seed)
    started = time.perf_counter()
    rng = request.rng(settings.seed)
    try:
        canvas = choose_canvas(context["canvases"], request, rng)
        if context["painter"] is not None:
            generated = context["painter"].paint(canvas, request, rng, settings.seed)
        else:
            generated = generate_case(context["cohort"], canvas, request, rng, context["pipeline"], context["paint"])
        generated.row["generator_run_id"] = summary.generator_run_id
        generated.row["synthesis_run_id"] = summary.synthesis_run_id
        write_case(out_root, case_id, generated.ct, generated.affine, generated.masks)
    except Exception as error:  # one bad case must not stop the others; it is reported and kept aside
        summary.failed[case_id] = f"{type(error).__name__}: {error}"
        quarantine(out_root, case_id, request, error)
        if rows.pop(case_id, None) is not None:
            write_metadata(out_root, metadata_table(rows))
        return
    rows[case_id] = generated.row
    write_metadata(out_root, metadata_table(rows))
    clear_quarantine(out_root, case_id)
    summary.generated.append(case_id)
    seconds.append(time.perf_counter() - started)


def _paint_all(context: dict, requests: Sequence[SynthesisRequest], rows: dict, summary: SynthesisSummary, seconds: list) -> None:
    settings = context["settings"]
    bar = tqdm(requests, desc="synthesize", unit="case", disable=not settings.progress)
    for request in bar:
        case_id = request.case_id(settings.seed)
        if case_id in rows and case_is_complete(context["out_root"], case_id, rows[case_id], request):
            summary.skipped.append(case_id)
        elif settings.max_cases is not None and len(summary.generated) + len(summary.failed) >= settings.max_cases:
            summary.not_reached += 1
        else:
            _make_case(context, request, rows, summary, seconds)
            bar.set_postfix(done=len(summary.generated) + len(summary.skipped), failed=len(summary.failed))


def synthesize(settings: SynthesisSettings, requests) -> SynthesisSummary:
    """Generate the requested synthetic cases into ``settings.out_root`` (layout A + ``metadata.csv``), resumably.

    Args:
        settings: see :class:`SynthesisSettings` (usually :meth:`SynthesisSettings.from_recipe`).
        requests: a targeting table (:func:`synthx.generation.targeting.compute_targets`), a rule string such as
            ``min_positives:4`` or ``need:40`` (computed on the real cohort), a ``{(sex, age band,
            phase): n}`` mapping, or a list of :class:`SynthesisRequest`.
    """
    check_settings(settings)
    uri = resolve_uri(settings.tracking_uri)
    cohort = load_cohort(settings.cohort_root)
    split = load_split(settings.split_path, cohort)
    split_hash = file_sha256(settings.split_path)
    canvases = canvas_table(cohort, split, settings.canvas_ids)
    if settings.painter in (SYNTHX_PAINTER, COPY_PASTE_PAINTER) and settings.size_classes is None:
        settings = replace(settings, size_classes=training_size_classes(cohort, split))
    targets = _targets(settings, cohort, requests)
    fillable, unfillable = partition_requests(as_requests(targets if targets is not None else requests), canvases)
    for cell in unfillable.to_dict("records"):
        log.warning("unfillable: no healthy training scan is %s, %s, %s; %d requested case(s) not made",
                    cell["sex"], cell["age_band"], cell["phase"], cell["requested"])
    if settings.painter == PHANTOM_PAINTER:
        painter, pipeline, source, generator_run_id, provenance = PhantomPainter(settings.cohort_root), None, PHANTOM_PAINTER, "", None
    elif settings.painter == COPY_PASTE_PAINTER:
        painter = CopyPastePainter(cohort, split, settings.paint_settings(), settings.copy_paste_scale, settings.copy_paste_feather_mm)
        pipeline, source, generator_run_id = None, COPY_PASTE_PAINTER, ""
        # It copies real tumors: the cohort's provenance lists them, checked against the split wherever it is used.
        provenance = GeneratorProvenance(training_cases=painter.source_case_ids, split_sha256=split_hash)
    else:
        painter = None
        pipeline, source, generator_run_id, provenance = _generator(settings, split, split_hash, uri)

    out_root = Path(settings.out_root)
    # One process per output folder for the synthesis's life (a second one is refused, naming this one).
    with RunFolderLock(out_root, "benchx synthesize") as lock:
        if lock.takeover_note:
            log.warning(lock.takeover_note)
        out_root.mkdir(parents=True, exist_ok=True)
        manifest = _manifest(settings, source, generator_run_id, provenance, split_hash)
        check_manifest(out_root, manifest)
        _cohort_provenance(provenance, generator_run_id).write(out_root)
        rows = read_existing_rows(out_root)
        remove_stale_staging(out_root)
        summary = SynthesisSummary(out_root, len(fillable), generator_run_id=generator_run_id,
                                   generator_split_sha256=manifest["generator_split_sha256"], unfillable=unfillable)
        client = None
        if settings.log_to_mlflow:
            client, summary.synthesis_run_id = _open_run(settings, uri, manifest, out_root, targets)
        context = dict(settings=settings, out_root=out_root, canvases=canvases, cohort=cohort, pipeline=pipeline,
                       painter=painter, paint=settings.paint_settings())
        status, seconds = "FINISHED", []
        try:
            # SIGTERM/SIGINT become an exception here, so the run is ended KILLED and a rerun continues it.
            with terminating_signals():
                _paint_all(context, fillable, rows, summary, seconds)
        except BaseException:
            status = "KILLED"
            raise
        finally:
            summary.seconds_per_case = float(np.mean(seconds)) if seconds else math.nan
            marks = {**{c: "generated" for c in summary.generated}, **{c: "skipped" for c in summary.skipped}, **{c: "failed" for c in summary.failed}}
            summary.per_cell = per_cell_table(fillable, marks, unfillable, settings.seed)
            if client is not None:
                log_summary(MlflowRunRecorder(client, summary.synthesis_run_id), summary, rows)
                client.set_terminated(summary.synthesis_run_id, status if status == "KILLED" else ("FAILED" if summary.failed else "FINISHED"))
        return summary


__all__ = ["QUARANTINE_DIR", "SynthesisSettings", "SynthesisSummary", "check_settings", "synthesize"]

"""Loading the SynthX generator for generation: from a folder, an MLflow URI or a run id, with its provenance.

Example::

    pipeline, run_id, provenance = load_pipeline("runs:/<run id>/pipeline", scheduler="ddim")
"""

from __future__ import annotations

import re
from pathlib import Path

from synthx.generation.canvases import GenerationError
from synthx.generator.provenance import GeneratorProvenance, read_provenance
from synthx.generator.schedulers import SAMPLING_SCHEDULERS, sampling_scheduler

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


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


def set_scheduler(pipeline, name: str) -> None:
    """Swap in a sampling scheduler built from the saved one's config (same betas and prediction type)."""
    if name not in SAMPLING_SCHEDULERS:
        raise GenerationError(f"unknown scheduler {name!r} (expected one of {', '.join(SAMPLING_SCHEDULERS)})")
    pipeline.scheduler = sampling_scheduler(name, pipeline.scheduler)
    pipeline.set_progress_bar_config(disable=True)


def load_pipeline(
    source: str, scheduler: str = "ddim", tracking_uri: str | None = None, device: str = "cpu"
) -> tuple[object, str, GeneratorProvenance | None]:
    """Load a :class:`synthx.generator.pipeline.SynthXPipeline`, swap in the sampling scheduler, read its provenance.

    Args:
        source: see :func:`resolve_pipeline_source`.
        scheduler: ``ddpm``, ``ddim`` or ``dpm_solver``.
        tracking_uri: MLflow tracking URI for run ids and ``runs:/`` URIs.
        device: torch device for the denoiser.

    Returns:
        (pipeline, generator run id or ``""`` for a plain folder, provenance or None when not saved).
    """
    from synthx.generator.pipeline import SynthXPipeline

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
    set_scheduler(pipeline, scheduler)
    return pipeline.to(device), run_id, read_provenance(location)

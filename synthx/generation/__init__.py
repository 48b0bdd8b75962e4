"""SynthX generation: paint conditioned synthetic tumors into healthy training scans and write a synthetic cohort.

Parts: :mod:`.cells` (the sex x age band x phase grid and what is counted in it), :mod:`.targeting`
(how many tumors each cell gets), :mod:`.canvases` (which scan each request is painted into; unfillable cells), :mod:`.source`
(loading the generator), :mod:`.painting` (one case), :mod:`.phantom_painter` (real-appearance
tumors rendered by the phantom itself: the study's positive control), :mod:`.copy_paste` (real
training tumors pasted at SynthX's sites: its placement without its content), :mod:`.writing` (the cohort
on disk and the MLflow summary) and :mod:`.run` (the resumable run, :func:`synthesize`). The command is
``benchx synthesize`` (:mod:`synthx.commands.synthesize`).
"""

from synthx.generation.canvases import (
    GenerationError,
    SynthesisRequest,
    as_requests,
    canvas_table,
    choose_canvas,
    partition_requests,
)
from synthx.generation.copy_paste import CopyPastePainter
from synthx.generation.painting import PaintSettings, generate_case
from synthx.generation.phantom_painter import PhantomPainter
from synthx.generation.run import SynthesisSettings, SynthesisSummary, synthesize
from synthx.generation.source import load_pipeline, resolve_pipeline_source
from synthx.generation.writing import MANIFEST_FILE, QUARANTINE_DIR
from synthx.painters import COPY_PASTE_PAINTER, PAINTERS, PHANTOM_PAINTER

__all__ = [
    "COPY_PASTE_PAINTER",
    "CopyPastePainter",
    "GenerationError",
    "MANIFEST_FILE",
    "PAINTERS",
    "PHANTOM_PAINTER",
    "PaintSettings",
    "PhantomPainter",
    "QUARANTINE_DIR",
    "SynthesisRequest",
    "SynthesisSettings",
    "SynthesisSummary",
    "as_requests",
    "canvas_table",
    "choose_canvas",
    "generate_case",
    "load_pipeline",
    "partition_requests",
    "resolve_pipeline_source",
    "synthesize",
]

"""SynthX's workflows: what its commands do, above the generator's libraries and the base's tracking adapter.

- :mod:`~synthx.workflows.study`: the whole study (baseline, sham, SynthX and their evaluations on
  the locked test cohort) as child runs of one parent, each step resumable;
- :mod:`~synthx.workflows.replicates`: a study as K paired replicates (one seed each), run and pooled;
- :mod:`~synthx.workflows.report`: the study's HTML report and results pages, read back from its runs,
  and what a finished study publishes;
- :mod:`~synthx.workflows.sweep`: Optuna trials over the synthesis ratio as child runs.

The generator's own runs stay beside their libraries (:mod:`synthx.training.run`,
:mod:`synthx.generation.run`). Workflows may import MLflow, Optuna and
:mod:`lightning_modules.tracking`; the libraries below them import none of these
(``tests/test_layout.py``).
"""

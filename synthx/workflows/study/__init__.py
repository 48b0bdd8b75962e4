"""The baseline / sham / SynthX study, the project's main job (``benchx study``, MLproject ``main``).

Before any step, the pre-specified primary endpoint is logged on the parent run
(:mod:`synthx.analysis.endpoint`, ``docs/explanation/study.md "The primary endpoint"``). Steps, each an MLflow child
run of one parent run (``mlflow.parentRunId``):

1. ``data``: the cohort (the embedded phantom is generated when absent) and its split (the
   committed ``splits/phantom.csv`` for the phantom; made once otherwise), validated;
2. ``locked_cohort`` (phantom cohorts): the locked test cohort, a phantom of another seed that no
   design decision has seen, viewed together with the development validation split
   (``docs/explanation/study.md "The locked test cohort"``);
3. ``baseline``: the backbone trained on real data, on the exposure-matched schedule's real draws
   (``synthx.real_steps``, ``docs/explanation/synthx.md "Arms with equal real exposure"``);
4. ``evaluate_baseline``: subgroup evaluation on validation and the development test split
   (operating point chosen on validation when the recipe says so, ``docs/explanation/detection-and-statistics.md "Scan-level detection"``);
5. ``targeting``: how many synthetic tumors per (sex, age band, phase) cell. The default rule
   ``need:B`` spends a budget of B cases where the baseline's VALIDATION sensitivity falls short
   (``synthx.generation.targeting``); it reads the baseline's validation records only, never test labels;
6. ``synthesize_copy_paste``: the targets with the copy-paste painter, the ``synthesize`` step's seed
   and the SynthX recipe's mask prior: real training tumors pasted at the sites SynthX paints in the canvases it paints
   (no generator, so it runs before ``synthx_train`` and a new generator reuses it);
7. ``synthx_train``: the SynthX generator trained on the training split's tumors;
8. ``synthesize``: the targeted cases painted into matching healthy training scans, then the
   realism of SynthX's and the copy-pasted tumors against the real training tumors, logged on its
   run (``synthx_quality/realism.csv``);
9. ``sham``: the augmented schedule (real_steps x (1 + r) steps, the baseline's real draws) with each
   synthetic slot filled by a real training positive of the synthetic case's cell;
10. ``augmented``: the same schedule with the synthetic cases;
11. ``copy_paste``: SynthX's recipe variant with the copy-paste cohort instead of SynthX's;
12. ``evaluate_locked_baseline``, ``evaluate_sham``, ``evaluate_synthx``, ``evaluate_copy_paste``: the
    arms on the study's test set (the locked cohort; the split's test set for other cohorts),
    operating points chosen on the development validation split;
13. ``compare``: the BenchX table-6 comparison with paired bootstrap differences against the sham
    arm: SynthX minus sham (the primary endpoint and the secondary family), copy-paste minus sham
    (placement) and baseline minus sham (what the schedule alone does). Then, on the parent run, the
    decomposition of SynthX minus sham into placement and content (:mod:`synthx.analysis.decomposition`,
    ``synthx/decomposition.csv``) at the primary endpoint's operating point.

The positive control (``painter="phantom"``, ``benchx study --painter phantom``): on the embedded
phantom, the phantom's own renderer paints the targeted tumors instead of SynthX (no
``synthx_train`` step), with the same targeting, canvases, ratio and training; it shows what the
study can detect when the added tumors are as real as the phantom's
(:mod:`synthx.generation.phantom_painter`). It has no copy-paste arm: the phantom plans its own
sites (:func:`~synthx.workflows.study.settings.copy_paste_skipped`); its decomposition is the
ceiling, phantom minus sham.

Resumable: a step is skipped when an identical finished run exists (same step, parameters and code
version: the key is a hash of the three, stored as the tag ``study_step_key``), so rerunning the
same command after a failure only does what is missing; an interrupted training resumes from its
``last.ckpt`` into its MLflow run.

The package, by job:

- :mod:`~synthx.workflows.study.settings`: :class:`StudySettings`, the constants and the recipes of the arms;
- :mod:`~synthx.workflows.study.runner`: the step runner (:class:`StudyRunner`) and its locks;
- :mod:`~synthx.workflows.study.steps`: what each step does (one MLflow run each);
- :mod:`~synthx.workflows.study.run`: :func:`run_study`, the steps in order;
- :mod:`~synthx.workflows.study.publish`: the comparison, the primary endpoint and the verdict on the parent run.

Example::

    benchx study --recipe recipes/unet.yaml --profile cpu
    mlflow run . --env-manager local                       # the same, as MLproject `main`
"""

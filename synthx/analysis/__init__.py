"""The study's statistics, above the generator and below the workflows: the pre-specified primary
endpoint (:mod:`.endpoint`), the verdict (:mod:`.verdict`), the power of the locked cohort
(:mod:`.power`), the decomposition of SynthX's difference to sham (:mod:`.decomposition`), how arms,
subgroups and operating points are named (:mod:`.labels`), and the realism of painted tumors
against real ones (:mod:`.realism`, :mod:`.realism_encoder`, :mod:`.quality`). No MLflow: the
workflows read runs and hand these functions tables.
"""

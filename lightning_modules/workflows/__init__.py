"""Workflows: what a command does, above the pure libraries and through the tracking adapter.

- :mod:`~lightning_modules.workflows.train`: one training run (recipe -> data -> model -> trainer),
  its checkpoints, registered model and logged inputs;
- :mod:`~lightning_modules.workflows.evaluate`: a trained model on the validation/test cases into a
  linked evaluation run, and the paired comparison of two such runs.

Workflows import the libraries (:mod:`lightning_modules.config`, :mod:`~lightning_modules.data`,
:mod:`~lightning_modules.models`, :mod:`~lightning_modules.evaluation`) and
:mod:`lightning_modules.tracking`; the libraries import neither (``tests/test_layout.py``).
"""

"""Evaluation of trained models as scan-level tumor detectors, overall and per subgroup.

Pure metrics (``records``, ``detection``, ``thresholds``, ``subgroups``, ``bootstrap``,
``subgroup_intervals``, ``paired_comparison``, ``multiplicity``, ``small_counts``, ``seed_pooling``,
``metric_keys``), the thin Lightning adapter (``callback``),
what an evaluation leaves in its run, read back through a given client (``artifacts``), and figures
(``figures``); see docs/explanation/detection-and-statistics.md "Scan-level detection".
The evaluate and compare runs are :mod:`lightning_modules.workflows.evaluate`; the training-time
Dice of the SegmentationModule is :mod:`lightning_modules.models.segmentation_metrics`.
"""

"""Evaluation of trained models as scan-level tumor detectors, overall and per subgroup.

Pure metrics (``records``, ``detection``, ``thresholds``, ``subgroups``, ``bootstrap``,
``metric_keys``, ``segmentation_metrics``), the thin Lightning adapter (``callback``), what goes to
MLflow (``artifacts``, ``figures``, ``provenance``) and the evaluate/compare runs (``runs``); see
docs/design.md "Scan-level detection".
"""

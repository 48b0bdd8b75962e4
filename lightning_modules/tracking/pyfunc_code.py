"""Models-from-code entry of the segmentation pyfunc: MLflow stores and runs this file to build the
model (instead of pickling an object); the class lives in :mod:`lightning_modules.tracking.pyfunc`."""

import mlflow.models

from lightning_modules.tracking.pyfunc import SegmentationModel

mlflow.models.set_model(SegmentationModel())

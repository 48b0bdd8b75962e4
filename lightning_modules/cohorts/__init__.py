"""Tools that prepare cohorts, apart from the training data layer (:mod:`lightning_modules.data`).

- :mod:`~lightning_modules.cohorts.phantom`: the embedded phantom cohort with designed gaps;
- :mod:`~lightning_modules.cohorts.importers`: DICOM, MSD, nnU-Net and TotalSegmentator data into
  the AbdomenAtlas layout, de-identified;
- :mod:`~lightning_modules.cohorts.audit`: the leakage audit of a cohort and its split;
- :mod:`~lightning_modules.cohorts.example_ct`: the real example CT.

They read and write cohorts with the data layer (cohort layout, metadata, splits); the data
layer imports nothing from here.
"""

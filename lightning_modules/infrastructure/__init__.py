"""Shared infrastructure, below every layer that uses it, each module standing alone: atomic file
writes and hashes (:mod:`.files`), run folders (locks, recipe fingerprints, resumable checkpoints:
:mod:`.run_folder`, which writes through :mod:`.files`), the process around a run (the code
version, SIGTERM/SIGINT, worker lifetimes: :mod:`.process`), resource monitoring
(:mod:`.monitoring`) and the warnings filter (:mod:`.warnings_filter`). None imports MLflow or any
other layer of the project.
"""

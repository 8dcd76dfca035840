"""Watching a run: experiment trackers and failure signatures.

    trackers.py     a job's records (steps, validations, buffer counts, samples) to W&B, TensorBoard,
                    MLflow and SwanLab, each optional (the `trackers` extra), on one worker thread
    backends.py     the four backends, each imported only when enabled
    series.py       a step's metrics split into scalars and per-member series; a series' summary keys
    signatures.py   pure detectors of known failure signatures over the recent step metrics

The coordinator's run folder (services/coordinator/run_folder.py) feeds both.
"""

"""What several jobs use: YAML configs with ``--set`` overrides (:mod:`.config`), the run checkpoint format
(:mod:`.checkpoint`), a run's ownership of its output folder (:mod:`.run_folder`: lock, job marker, what
``--overwrite`` removes), model cards (:mod:`.cards`), model folders and their strict checks (:mod:`.folders`) and
parallelism (:mod:`.parallel`: DDP, FSDP2, FSDP2 + expert parallelism, the consolidated export, their checks).

This layer sits between the jobs (``kdamoe.training``, ``kdamoe.posttraining``, ``kdamoe.hub``) and the model
(``kdamoe.model``): it imports the model, never a job (the import-linter contracts in ``.importlinter``).
"""

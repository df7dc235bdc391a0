"""What several jobs use: YAML configs with ``--set`` overrides (:mod:`.config`), the run checkpoint format
(:mod:`.checkpoint`), model cards (:mod:`.cards`), model folders (:mod:`.folders`) and parallelism (:mod:`.parallel`:
DDP, FSDP2, FSDP2 + expert parallelism, the consolidated export, their checks).

This layer sits between the jobs (``kdamoe.training``, ``kdamoe.posttraining``, ``kdamoe.hub``) and the model
(``kdamoe.model``): it imports the model, never a job (the import-linter contracts in ``.importlinter``).
"""

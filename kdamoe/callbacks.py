"""``transformers.Trainer`` (and TRL trainer) integration of the router-bias update.

TRL and the Trainer never touch router biases (DESIGN.md §5), so this callback applies the Quantile
Balancing (or sign-rule) update once per optimizer step and reports the per-layer expert load.
"""

import torch
from transformers import TrainerCallback


def find_kdamoe_model(model):
    """The outermost ``KDAMoEPreTrainedModel`` inside ``model`` (PEFT / DDP / FSDP wrappers included).

    Raises:
        ValueError: when ``model`` contains no module with ``update_router_biases``.
    """
    for module in model.modules():
        if callable(getattr(module, "update_router_biases", None)) and hasattr(module, "expert_load"):
            return module
    raise ValueError(f"{type(model).__name__} contains no KDAMoE model (nothing has `update_router_biases`)")


class RouterBiasUpdateCallback(TrainerCallback):
    """Calls ``model.update_router_biases()`` after every optimizer step.

    ``on_step_end`` fires once per optimizer step, after all gradient-accumulation micro-batches, so the
    statistics of every micro-batch enter one update. Before the update it reads the expert load,
    appends the per-MoE-layer max/mean load to ``self.history``, warns when the worst layer passes
    ``warn_threshold``, and adds ``expert_load/max_over_mean`` (worst layer) and
    ``expert_load/max_over_mean/layer_{i}`` (i = decoder layer index) to the ``logs`` of the next
    ``on_log`` — seen by the console printer and by reporters that run after this callback (the
    Trainer calls ``report_to`` integrations first, so they do not see them).
    """

    def __init__(self, warn_threshold: float = 2.0):
        self.warn_threshold = warn_threshold
        self.history: list[list[float]] = []
        self._imbalance = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        kdamoe_model = find_kdamoe_model(model)
        load = kdamoe_model.expert_load()
        if load.numel() and float(load.sum()) > 0:
            self._imbalance = (load.max(-1).values / load.mean(-1).clamp(min=1e-9)).tolist()
            self.history.append(self._imbalance)
            worst = max(self._imbalance)
            if worst > self.warn_threshold:
                import warnings

                warnings.warn(f"expert load imbalance max/mean = {worst:.2f} > {self.warn_threshold} at step {state.global_step}")
        kdamoe_model.update_router_biases()
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self._imbalance:
            logs["expert_load/max_over_mean"] = max(self._imbalance)
            first_sparse = find_kdamoe_model(kwargs["model"]).config.first_k_dense_replace if "model" in kwargs else 0
            for i, value in enumerate(self._imbalance):
                logs[f"expert_load/max_over_mean/layer_{first_sparse + i}"] = value
        return control


# Backwards-friendly alias under the name of the method it drives.
QuantileBalancingCallback = RouterBiasUpdateCallback

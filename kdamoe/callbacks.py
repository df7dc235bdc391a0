"""``transformers.Trainer`` (and TRL trainer) integration of the router-bias update.

The Trainer and TRL never touch router biases (they are buffers, not parameters), so
:class:`RouterBiasUpdateCallback` applies the Quantile Balancing (or sign-rule) update once per
optimizer step to every trainable KDAMoE model the trainer holds and reports the per-layer expert
load (docs/architecture.md §4 and §8).

Use :func:`add_router_bias_callback` to attach it: it puts the callback first in the trainer's
callback list, so its expert-load metrics are in the ``logs`` every ``report_to`` integration
receives (the Trainer lists reporters before user callbacks and calls ``on_log`` in list order).
"""

from __future__ import annotations

import logging
import math
import warnings

from torch import nn
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

# why a model's router biases do not move during a run (RouterBiasUpdateCallback._warn_once, said once per model)
_FROZEN = ("stay frozen: its router weights do not require grad (PEFT adapter or frozen reference model). A PEFT "
           "adapter saves no buffers, so moving the base's biases would make the adapter reproduce a different model "
           "on the published base; statistics are still reset every step.")
# balancing was asked for (router_biases: update) but the model's own rule is "none", as a loaded or converted Kimi
# Linear release has it (docs/checkpoints.md)
_RULE_NONE = ("stay as the base has them: its config says router_bias_update='none' (as a loaded or converted Kimi "
              "Linear release does). To balance them, set router_bias_update to 'quantile' or 'sign' in the base "
              "folder's config.json.")


def _is_kdamoe_model(module: nn.Module) -> bool:
    return callable(getattr(module, "update_router_biases", None)) and callable(getattr(module, "expert_load", None))


def find_kdamoe_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every outermost KDAMoE model inside ``model``, as ``(module path, module)`` in module order.

    A KDAMoE model is a module with ``update_router_biases`` and ``expert_load`` (``KDAMoEPreTrainedModel``).
    PEFT / DDP / FSDP wrappers and multi-model wrappers (e.g. TRL's policy + value wrapper, a trainer
    holding a frozen reference model) are searched; a module reached twice (shared) is listed once, and a
    KDAMoE model nested inside another (``KDAMoEForCausalLM.model``) is not listed, since the outer one's
    ``update_router_biases`` already covers its routers. ``model`` itself may be a KDAMoE model (path ``""``).

    Raises:
        ValueError: when ``model`` contains no KDAMoE model.
    """
    found, seen = [], set()

    def visit(module: nn.Module, path: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if _is_kdamoe_model(module):
            found.append((path, module))
            # Nested KDAMoE modules belong to this one, also where a wrapper lists one again as its own child
            # (TRL's PPO wrapper holds the value model and, as `critic_backbone`, its backbone).
            seen.update(id(m) for m in module.modules())
            return
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    if not found:
        raise ValueError(f"{type(model).__name__} contains no KDAMoE model (nothing has `update_router_biases`)")
    return found


def find_kdamoe_model(model: nn.Module) -> nn.Module:
    """The first outermost KDAMoE model inside ``model`` (see :func:`find_kdamoe_models`).

    Raises:
        ValueError: when ``model`` contains no KDAMoE model.
    """
    return find_kdamoe_models(model)[0][1]


def routers_trainable(model: nn.Module) -> bool:
    """True if any router weight of the KDAMoE ``model`` requires grad (full fine-tuning / pretraining).

    False under PEFT (LoRA freezes the base, routers included) and for frozen reference models.
    """
    return any(router.weight.requires_grad for router in model._routers())


class RouterBiasUpdateCallback(TrainerCallback):
    """Applies the router-bias rule after every optimizer step to each trainable KDAMoE model.

    ``on_step_end`` fires once per optimizer step, after all gradient-accumulation micro-batches, so the
    statistics of every micro-batch enter one update. For every outermost KDAMoE model inside the
    trainer's ``model`` (:func:`find_kdamoe_models`) it reads the expert load, then

    * if the model's router weights require grad, calls ``update_router_biases()`` (which also resets
      the statistics);
    * otherwise — or always with ``freeze_biases=True`` (post-training's ``router_biases: freeze``: full
      fine-tuning that keeps the base's balance) — leaves the biases where they are and only resets the
      statistics, so the next step's load is that step's alone. Quantile Balancing is
      frozen under PEFT by design: an adapter must reproduce the trained model on the published base
      alone, and PEFT's adapter format carries no buffers (docs/pretraining.md, "Router biases under
      PEFT"). A frozen reference model must not move either. This is said once per model via
      ``logger.warning``.

    Metrics: ``expert_load/max_over_mean`` (worst MoE layer) and ``expert_load/max_over_mean/layer_{i}``
    (``i`` = decoder layer index) of the first model found; further models get their module path
    inserted, ``expert_load/<path>/max_over_mean``. Each optimizer step's values are added once, to the
    next ``on_log``'s ``logs`` and to the matching ``state.log_history`` row (the Trainer stores the row
    before calling ``on_log``). ``report_to`` integrations see them only if this callback runs before
    them: attach it with :func:`add_router_bias_callback`.

    Args:
        warn_threshold: warn (``UserWarning``) when the worst layer's max/mean load exceeds it.
        freeze_biases: never move the biases, even when the routers are trainable.
    Attributes:
        history: per optimizer step, the per-MoE-layer max/mean load of the first model found.
    """

    def __init__(self, warn_threshold: float = 2.0, freeze_biases: bool = False):
        self.warn_threshold = warn_threshold
        self.freeze_biases = freeze_biases
        self.history: list[list[float]] = []
        self._pending: dict[str, float] = {}
        self._frozen_warned: set[int] = set()
        self.first_in_callbacks = False  # set by add_router_bias_callback

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.first_in_callbacks and getattr(args, "report_to", None):
            logger.warning("RouterBiasUpdateCallback was passed in `callbacks=`, after the report_to integrations "
                           f"{args.report_to}: they will not receive expert_load/* metrics (log_history and the "
                           "console do). Attach it with kdamoe.callbacks.add_router_bias_callback(trainer).")
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        metrics = {}
        for index, (path, kdamoe_model) in enumerate(find_kdamoe_models(model)):
            load = kdamoe_model.expert_load()
            if load.numel() and float(load.sum()) > 0:
                imbalance = (load.max(-1).values / load.mean(-1).clamp(min=1e-9)).tolist()
                if index == 0:
                    self.history.append(imbalance)
                prefix = "expert_load" if index == 0 else f"expert_load/{path}"
                metrics[f"{prefix}/max_over_mean"] = max(imbalance)
                # expert_load() has one row per sparse layer, in layer order; name each by its layer index
                sparse_layers = [i for i, t in enumerate(kdamoe_model.config.mlp_layer_types) if t == "sparse"]
                for layer, value in zip(sparse_layers, imbalance, strict=True):
                    metrics[f"{prefix}/max_over_mean/layer_{layer}"] = value
                if max(imbalance) > self.warn_threshold:
                    warnings.warn(f"expert load imbalance max/mean = {max(imbalance):.2f} > {self.warn_threshold} "
                                  f"at step {state.global_step}" + (f" in {path}" if path else ""),
                                  stacklevel=1)  # about the run's state, not about a caller's line
            if routers_trainable(kdamoe_model) and not self.freeze_biases:
                if getattr(kdamoe_model.config, "router_bias_update", None) == "none":
                    self._warn_once(path, kdamoe_model, _RULE_NONE)
                kdamoe_model.update_router_biases()
            else:
                if not self.freeze_biases:
                    self._warn_once(path, kdamoe_model, _FROZEN)
                for router in kdamoe_model._routers():
                    router.reset_statistics()
        self._pending = metrics
        return control

    def _warn_once(self, path: str, kdamoe_model: nn.Module, why: str) -> None:
        """Say once per model that its router biases do not move during this run, and why."""
        if id(kdamoe_model) in self._frozen_warned:
            return
        self._frozen_warned.add(id(kdamoe_model))
        logger.warning(f"router biases of {type(kdamoe_model).__name__}{f' at {path!r}' if path else ''} {why}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self._pending:
            return control
        row = state.log_history[-1] if state.log_history else None
        if (row is not None and row.get("step") == state.global_step
                and all(_same(row.get(k), v) for k, v in logs.items())):
            row.update(self._pending)  # the row Trainer.log stored for these logs
        logs.update(self._pending)
        self._pending = {}
        return control


def _same(a, b) -> bool:
    """Equal, or both NaN (a NaN metric, e.g. a variance over one value, would otherwise never match its row)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def add_router_bias_callback(trainer, callback: RouterBiasUpdateCallback | None = None) -> RouterBiasUpdateCallback:
    """Attach ``callback`` (default: a new :class:`RouterBiasUpdateCallback`) as the FIRST callback of ``trainer``.

    ``Trainer.__init__`` lists ``DefaultFlowCallback``, then the ``report_to`` integrations, then the
    ``callbacks=`` argument, and ``CallbackHandler.call_event`` calls them in that order; ``on_log``
    receives one shared ``logs`` dict. Being first, this callback adds its metrics to that dict before
    any reporter reads it. Any instance already attached (e.g. passed in ``callbacks=``) is removed first.

    Returns:
        The attached callback.
    """
    callback = callback or RouterBiasUpdateCallback()
    handler = trainer.callback_handler
    handler.callbacks = [cb for cb in handler.callbacks if not isinstance(cb, RouterBiasUpdateCallback)]
    handler.callbacks.insert(0, callback)
    callback.first_in_callbacks = True
    return callback


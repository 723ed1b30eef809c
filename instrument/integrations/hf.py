"""probewire for the transformers ``Trainer``: a ``TrainerCallback``.

    from probewire.instrument.integrations.hf import watch
    trainer = Trainer(model=model, args=args, train_dataset=data)
    watch(trainer, config=ProbeConfig(), run_config=args.to_dict())  # adds the callback
    trainer.train()

``watch`` adds ``ProbewireCallback`` and lets it measure the gradients inside the Trainer's
clipping call, before clipping (G2 and the clip indicator, as ``s.clip_grad_norm_``). A
bare ``ProbewireCallback`` in ``Trainer(callbacks=[...])`` works too; with
``max_grad_norm > 0`` it then sees only clipped gradients and does not report them (it says
so once).

The loss: a forward hook on the model reads the micro-batch's ``labels`` and the output
logits and records the per-token losses with their valid mask (labels != -100), computed
as the model's own loss does: logits upcast to float32, for a causal LM shifted by one
(``causal_lm``). That is one extra cross-entropy over the logits per training micro-batch,
without autograd. The stream's L is then Σ token losses / Σ valid tokens over the step's
micro-batches and ranks: what the Trainer logs as ``loss`` with ``logging_steps=1`` and
``average_tokens_across_devices`` (its default), there summed in float32. (transformers
5.17 counts that denominator on the labels before the model's shift, so a row's first label
counts unless it is -100, as at a BOS position.) With label smoothing or a
``compute_loss_func`` the Trainer takes the labels out of the model's inputs; the callback
then sees none and records no loss.

Identity and transport come from the environment by default (``probewire run``), as with
``attach``; the step is the Trainer's ``global_step`` at the step's start (0-based).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from ..config import ProbeConfig
from ..export import Transport
from ..monitor import attach
from ..wire import RankIdentity

__all__ = ["ProbewireCallback", "watch"]

log = logging.getLogger(__name__)
IGNORE = -100


def token_losses(
    logits: torch.Tensor, labels: torch.Tensor, causal_lm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses and the valid mask, as transformers' ForCausalLMLoss /
    ForMaskedLMLoss compute them (float32 logits; causal: position t predicts label t+1)."""
    logits = logits.detach().float()
    if causal_lm:
        labels = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    ).view(labels.shape)
    return losses, labels != IGNORE


class ProbewireCallback(TrainerCallback):
    """Attaches at ``on_train_begin``; one step context per optimizer step."""

    def __init__(
        self,
        config: ProbeConfig | None = None,
        *,
        run_config: Mapping[str, Any] | None = None,
        identity: RankIdentity | None = None,
        transport: Transport | None = None,
        runs: Transport | None = None,
        causal_lm: bool = True,
    ) -> None:
        self.config, self.run_config = config, run_config
        self.identity, self.transport, self.runs = identity, transport, runs
        self.causal_lm = causal_lm
        self.monitor: Any = None
        self.ctx: Any = None
        self.wraps_clipping = False
        self.scaler: Any = None  # the Trainer's GradScaler (``watch``), if any
        self._hook: Any = None
        self._excepthook: Any = None
        self._said = False

    # -- training ---------------------------------------------------------------------------
    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        run_config = self.run_config if self.run_config is not None else _args_config(args)
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps it
        self.monitor = attach(
            model,
            optimizer,
            identity=self.identity,
            config=self.config,
            transport=self.transport,
            runs=self.runs,
            run_config=run_config,
        )
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        self._max_grad_norm = float(getattr(args, "max_grad_norm", 0.0) or 0.0)
        # the Trainer has no exception callback: an exception that leaves the script
        # marks the run crashed on its way out (the previous hook still runs)
        self._excepthook = sys.excepthook
        sys.excepthook = self._uncaught

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and self.ctx is None:
            self.ctx = self.monitor.step(state.global_step).__enter__()

    def _on_forward(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        ctx = self.ctx
        if ctx is None or not module.training:
            return
        labels = kwargs.get("labels")
        logits = getattr(output, "logits", None)
        if labels is None or logits is None:
            return
        losses, mask = token_losses(logits, labels, self.causal_lm)
        ids = kwargs.get("input_ids")
        ctx.micro_batch(tokens=ids if ids is not None else labels, mask=mask)
        ctx.loss(losses)

    def clip_grad_norm(
        self, clip: Any, parameters: Any, max_norm: float, *args: Any, **kwargs: Any
    ) -> Any:
        """Around the Trainer's clipping call (``watch``): measure, then clip."""
        parameters = list(parameters)
        if self.ctx is not None:  # an AMP loss scale is removed by the probe, not unscale_
            self.ctx.gradients(scaler=self.scaler)
        norm = clip(parameters, max_norm, *args, **kwargs)
        if self.ctx is not None:
            self.ctx.clipped(norm)
        return norm

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ctx is None or self.wraps_clipping:
            return
        if self._max_grad_norm > 0:
            if not self._said:
                log.warning(
                    "probewire: the Trainer clipped the gradients before any callback "
                    "sees them; G2 is not reported (use probewire.instrument."
                    "integrations.hf.watch(trainer) to measure before clipping)"
                )
                self._said = True
            return
        self.ctx.gradients()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def _uncaught(self, kind: Any, value: Any, tb: Any) -> None:
        previous = self._excepthook
        ctx, self.ctx = self.ctx, None
        if ctx is not None:  # the step it left: not emitted, and the run crashed
            ctx.__exit__(kind, value, tb)
        if self.monitor is not None:
            self.monitor.crashed(value)
            self.close()
        (previous or sys.__excepthook__)(kind, value, tb)

    def close(self) -> None:
        if self._excepthook is not None and sys.excepthook == self._uncaught:
            sys.excepthook = self._excepthook
        self._excepthook = None
        if self.ctx is not None:  # training stopped inside a step
            ctx, self.ctx = self.ctx, None
            ctx.__exit__(None, None, None)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


def watch(trainer: Any, config: ProbeConfig | None = None, **kwargs: Any) -> ProbewireCallback:
    """Add ``ProbewireCallback`` to ``trainer`` and measure gradients inside its clipping
    call, before clipping. Keyword arguments go to the callback."""
    callback = ProbewireCallback(config, **kwargs)
    trainer.add_callback(callback)
    accelerator = trainer.accelerator
    clip = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kw: Any) -> Any:
        return callback.clip_grad_norm(clip, parameters, max_norm, *args, **kw)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    callback.wraps_clipping = True
    callback.scaler = getattr(accelerator, "scaler", None)
    return callback


def _args_config(args: Any) -> dict[str, Any]:
    """The hyper-parameters worth keeping from ``TrainingArguments`` (JSON-able)."""
    keys = (
        "learning_rate",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "max_grad_norm",
        "num_train_epochs",
        "max_steps",
        "lr_scheduler_type",
        "warmup_steps",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "seed",
        "bf16",
        "fp16",
    )
    return {k: getattr(args, k) for k in keys if hasattr(args, k)}

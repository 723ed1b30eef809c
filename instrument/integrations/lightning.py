"""probewire for PyTorch Lightning: a ``Callback``.

    trainer = pl.Trainer(callbacks=[ProbewireCallback(ProbeConfig(), run_config=hparams)])

The monitor attaches at ``on_fit_start`` (the model and its first optimizer are set up by
then) and one step context spans each optimizer step — every micro-batch of gradient
accumulation — numbered by ``trainer.global_step`` at its start. The loss comes from the
``training_step``'s output: return a dict with the mean ``loss`` Lightning optimises and the
detached per-token ``token_losses`` with their valid ``mask`` (same shape)::

    def training_step(self, batch, batch_idx):
        losses = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100,
                                 reduction="none")
        mask = targets != -100
        return {"loss": losses.sum() / mask.sum(), "token_losses": losses.detach(), "mask": mask}

A step without ``token_losses`` records no loss. The gradients are measured in
``on_before_optimizer_step``: accumulated, unscaled by Lightning's precision plugin, before
Lightning clips them. An exception (``on_exception``) marks the run crashed; the end of
``fit`` closes the monitor and marks it finished. Identity and transport come from the
environment by default (``probewire run``), as with ``attach``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone distribution
    import pytorch_lightning as pl

from ..config import ProbeConfig
from ..export import Transport
from ..monitor import attach
from ..wire import RankIdentity

__all__ = ["ProbewireCallback"]


class ProbewireCallback(pl.Callback):
    """See the module docstring."""

    def __init__(
        self,
        config: ProbeConfig | None = None,
        *,
        run_config: Mapping[str, Any] | None = None,
        identity: RankIdentity | None = None,
        transport: Transport | None = None,
        runs: Transport | None = None,
    ) -> None:
        super().__init__()
        self.config, self.run_config = config, run_config
        self.identity, self.transport, self.runs = identity, transport, runs
        self.monitor: Any = None
        self.ctx: Any = None
        self._step: int | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = trainer.optimizers
        run_config = (
            self.run_config
            if self.run_config is not None
            else dict(getattr(pl_module, "hparams", {}) or {})
        )
        self.monitor = attach(
            pl_module,
            optimizers[0] if optimizers else None,
            identity=self.identity,
            config=self.config,
            transport=self.transport,
            runs=self.runs,
            run_config=run_config,
        )

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is not None and self.ctx is None:
            self._step = trainer.global_step
            self.ctx = self.monitor.step(self._step).__enter__()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.ctx is not None:
            self.ctx.gradients()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        if isinstance(outputs, Mapping) and outputs.get("token_losses") is not None:
            mask = outputs.get("mask")
            ctx.micro_batch(mask=mask)
            ctx.loss(outputs["token_losses"], mask)
        if trainer.global_step != self._step:  # the optimizer stepped: the step is complete
            self.ctx = None
            ctx.__exit__(None, None, None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.monitor is not None:
            self.monitor.crashed(exception)
        self._close()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self.ctx is not None:
            ctx, self.ctx = self.ctx, None
            ctx.__exit__(None, None, None)
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

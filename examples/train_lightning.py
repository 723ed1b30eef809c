"""PyTorch Lightning with probewire: a tiny language model on 2 gloo ranks (DDP), on CPU.

    probewire run --store ./probewire-data -- torchrun --nproc-per-node 2 examples/train_lightning.py

The ``training_step`` returns the mean loss Lightning optimises plus the per-token losses
and their mask, which ``ProbewireCallback`` records. Every row has 12 valid targets out of
16 positions (padding at the end), so every rank sees the same valid-token count and
Lightning's ``sync_dist`` mean of the ranks' means is the global token mean L. The model
runs in float64. ``--trace DIR`` makes every rank write, per step, its own loss sum and
valid tokens (float64), and rank 0 what Lightning logged as ``train_loss``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from probewire.instrument import ProbeConfig
from probewire.instrument.integrations.lightning import ProbewireCallback

IGNORE, LENGTH, VALID = -100, 16, 12


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 256, (n, LENGTH), generator=g)
        self.targets = torch.roll(self.tokens, -1, dims=1)
        self.targets[:, VALID:] = IGNORE

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i], self.targets[i]


class TinyLM(pl.LightningModule):
    def __init__(self, lr: float = 3e-3, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(256, width)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
        self.lm_head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.lm_head(x + self.mlp(x))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        losses = F.cross_entropy(
            self(tokens).transpose(1, 2), targets, ignore_index=IGNORE, reduction="none"
        )
        mask = targets != IGNORE
        loss = losses.sum() / mask.sum()
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        return {"loss": loss, "token_losses": losses.detach(), "mask": mask}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Trace(pl.Callback):
    """Each rank: its own loss sum and valid tokens per step; rank 0: Lightning's value."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        losses, mask = outputs["token_losses"], outputs["mask"]
        row = {
            "step": trainer.global_step - 1,
            "loss_sum": losses[mask].double().sum().item(),
            "tokens": int(mask.sum()),
            "loss": outputs["loss"].item(),
        }
        if trainer.is_global_zero:
            row["logged"] = trainer.callback_metrics["train_loss"].item()
        with open(self.directory / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--trace")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    pl.seed_everything(0, verbose=False)
    model = TinyLM()
    callbacks = [ProbewireCallback(ProbeConfig(clip_threshold=1.0))]
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        callbacks.append(Trace(args.trace))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy="ddp",
        max_steps=args.steps,
        gradient_clip_val=1.0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(Rows(8 * args.steps), batch_size=4))


if __name__ == "__main__":
    main()

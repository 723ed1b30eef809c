"""The transformers Trainer with probewire: a tiny GPT-2 built from its config, 2 gloo ranks.

    probewire run --store ./probewire-data -- torchrun --nproc-per-node 2 examples/train_hf_trainer.py

``watch(trainer)`` adds probewire's ``TrainerCallback``. Rows are random bytes with
random valid lengths (padding labelled -100), so ranks see unequal valid-token counts.
The model runs in float64. ``--trace FILE`` makes rank 0 write, per step, what the Trainer
logs (``logging_steps=1``): its loss, its pre-clipping gradient norm and learning rate.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from probewire.instrument import ProbeConfig
from probewire.instrument.integrations.hf import watch


class Rows(torch.utils.data.Dataset):
    """Random rows of bytes; labels are the inputs (the model shifts), -100 past the end and
    at position 0: no logit predicts the first token, and the Trainer (transformers 5.17)
    counts its loss denominator on the labels before the model's shift."""

    def __init__(self, n: int, length: int = 24, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, length), generator=g)
        valid = torch.randint(6, length + 1, (n,), generator=g)
        self.labels = self.ids.clone()
        self.labels[torch.arange(length)[None, :] >= valid[:, None]] = -100
        self.labels[:, 0] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class FailAt(TrainerCallback):
    """Raises in the middle of one step, as a diverging or broken run would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"failing on purpose at step {self.step}")


class Trace(TrainerCallback):
    """Rank 0 writes what the Trainer logged at each step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "step": state.global_step - 1,
                            "loss": logs["loss"],
                            "grad_norm": logs.get("grad_norm"),
                            "lr": logs.get("learning_rate"),
                        }
                    )
                    + "\n"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--output-dir", default="hf-trainer-out")
    p.add_argument("--trace")
    p.add_argument("--fail-at", type=int, help="raise inside this step (a crashed run)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).double()
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=5,
        logging_steps=1,
        max_grad_norm=1.0,
        use_cpu=True,
        ddp_backend="gloo",
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Rows(8 * args.steps),
        callbacks=([Trace(args.trace)] if args.trace else [])
        + ([FailAt(args.fail_at)] if args.fail_at is not None else []),
    )
    watch(trainer, config=ProbeConfig(clip_threshold=training.max_grad_norm))
    trainer.train()


if __name__ == "__main__":
    main()

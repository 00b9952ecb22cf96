"""A Hugging Face-style fine-tune on ddpkit: ``examples/originals/hf_finetune.py`` (the
single-device program, as ``run_glue_no_trainer.py`` writes it) ported in a hand-written loop. The
same on 1 or N processes; snapshots in shared memory and on disk, resumed bit for bit after a kill:

    ddpkit run --nproc 2 --max-restarts 3 examples/hf_finetune.py --per-device-train-batch-size 4
    python examples/hf_finetune.py

A small ``BertForSequenceClassification`` (torch.nn, attention dropout through
``scaled_dot_product_attention(dropout_p=0.1)``) on generated sentences (no download), dict batches
padded per batch by a collate function, AdamW with weight-decay groups, a linear warm-up from lr 0,
4 batches of gradient accumulation, clipping. What the port changed (``diff`` the two files):

- ``ddpkit.init()`` and ``ddpkit.seed_everything``; the model in ``ddpkit.prepare_model``;
- ``ddpkit.build_loader`` (this rank's slice of each global batch, seeded) and
  ``ddpkit.build_eval_loader`` (every sample once) with the same collate function;
- ``ddpkit.Snapshots(memory=True)``: ``resume()``, ``step()`` after each optimizer step,
  ``close()``; the loops count from ``loader.epoch`` and ``loader.batch_in_epoch`` (``len(loader)``
  stays the epoch's, so the epoch's last, partial step comes at the same batch after a resume);
- the forward inside ``ddpkit.nn.global_batch(loader, accumulation)``: every dropout's mask (the
  attention's too) is the sample's whatever the world size and each rank's padding, so N ranks train
  what one process trains; the accumulating backwards under ``ddpkit.no_sync``;
- ``ddpkit.evaluate`` (exact over ranks), ``ddpkit.print0``, the weights saved by rank 0.

With a per-rank batch of B/N, N ranks train the 1-process model within rounding.
"""

import argparse
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit

PAD, CLS, SEP = 0, 1, 2
POSITIVE, NEGATIVE = range(3, 13), range(13, 23)  # the other word ids up to 63 are neutral


def sentences(n: int, seed: int) -> list[dict]:
    """``n`` tokenized sentences (``[CLS] words [SEP]``, 4 to 28 words) and their labels: 1 when
    positive words outnumber negative ones. Unpadded, as a tokenizer's ``map`` leaves a dataset."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 29, (), generator=g))
        words = torch.randint(23, 64, (length,), generator=g)
        label = int(torch.randint(0, 2, (), generator=g))
        strong, weak = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        k = int(torch.randint(1, length // 2 + 1, (), generator=g))  # sentiment words, k > j
        j = int(torch.randint(0, k, (), generator=g))
        at = torch.randperm(length, generator=g)[: k + j]
        words[at[:k]] = torch.randint(strong.start, strong.stop, (k,), generator=g)
        words[at[k:]] = torch.randint(weak.start, weak.stop, (j,), generator=g)
        ids = torch.cat([torch.tensor([CLS]), words, torch.tensor([SEP])])
        out.append({"input_ids": ids, "labels": torch.tensor(label)})
    return out


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Pads to the longest sentence of the batch, as ``DataCollatorWithPadding`` does."""
    ids = nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], True, PAD)
    return {
        "input_ids": ids,
        "attention_mask": (ids != PAD).long(),
        "labels": torch.stack([s["labels"] for s in samples]),
    }


@dataclass
class BertConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 64
    max_position_embeddings: int = 32
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    num_labels: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12


class BertLayer(nn.Module):
    """Self-attention, then the feed-forward block, each added to its input and layer-normed."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads, self.p = c.num_attention_heads, c.attention_probs_dropout_prob
        self.query, self.key, self.value = (nn.Linear(c.hidden_size, c.hidden_size) for _ in "qkv")
        self.attention_output = nn.Linear(c.hidden_size, c.hidden_size)
        self.attention_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.intermediate = nn.Linear(c.hidden_size, c.intermediate_size)
        self.output = nn.Linear(c.intermediate_size, c.hidden_size)
        self.output_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, width = h.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, t, self.heads, width // self.heads).transpose(1, 2)

        q, k, v = heads(self.query(h)), heads(self.key(h)), heads(self.value(h))
        keys = attention_mask[:, None, None, :].bool()  # the padding is never attended to
        p = self.p if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys, dropout_p=p)
        a = a.transpose(1, 2).reshape(b, t, width)
        h = self.attention_norm(h + self.dropout(self.attention_output(a)))
        out = self.output(F.gelu(self.intermediate(h)))
        return self.output_norm(h + self.dropout(out))


class BertForSequenceClassification(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=PAD)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.embeddings_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))
        self.pooler = nn.Linear(c.hidden_size, c.hidden_size)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels)
        for m in self.modules():  # as BertPreTrainedModel._init_weights
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=c.initializer_range)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
        nn.init.zeros_(self.word_embeddings.weight[PAD])

    def forward(self, input_ids, attention_mask, labels=None) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        h = self.dropout(self.embeddings_norm(h))
        for layer in self.layers:
            h = layer(h, attention_mask)
        pooled = torch.tanh(self.pooler(h[:, 0]))  # the [CLS] token
        logits = self.classifier(self.dropout(pooled))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    """transformers' schedule: from 0 up to the optimizer's lr over the warm-up, then down to 0."""

    def lr_lambda(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-train-epochs", type=int, default=4)
    parser.add_argument("--per-device-train-batch-size", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--num-warmup-steps", type=int, default=10)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--train-samples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpointing-steps", type=int, default=10)
    parser.add_argument("--output-dir", default="runs/hf_finetune")
    args = parser.parse_args()

    rt = ddpkit.init()
    ddpkit.seed_everything(args.seed)
    device = rt.device
    train_dataset, eval_dataset = sentences(args.train_samples, 1), sentences(200, 2)
    model = ddpkit.prepare_model(BertForSequenceClassification(BertConfig()))
    train_dataloader = ddpkit.build_loader(
        train_dataset, seed=args.seed, collate_fn=collate, num_workers=0,
        batch_size=args.per_device_train_batch_size,
    )  # fmt: skip
    eval_dataloader = ddpkit.build_eval_loader(
        eval_dataset, collate_fn=collate, batch_size=64, num_workers=0
    )

    no_decay = ["bias", "norm.weight"]  # no weight decay for biases and LayerNorm weights
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(d in n for d in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(d in n for d in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=args.num_warmup_steps, num_training_steps=max_train_steps
    )

    snapshots = ddpkit.Snapshots(
        args.output_dir, model=model, optimizer=optimizer, scheduler=lr_scheduler,
        loader=train_dataloader, memory=True, every_steps=args.checkpointing_steps,
    )  # fmt: skip
    snapshots.resume()  # from the newest snapshot in memory or on disk, if any

    for epoch in range(train_dataloader.epoch, args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader, start=train_dataloader.batch_in_epoch):
            batch = {k: v.to(device) for k, v in batch.items()}
            last = (
                step % args.gradient_accumulation_steps == args.gradient_accumulation_steps - 1
                or step == len(train_dataloader) - 1
            )
            accumulating = ddpkit.no_sync(model) if not last else nullcontext()
            with ddpkit.nn.global_batch(train_dataloader, args.gradient_accumulation_steps):
                with accumulating:
                    outputs = model(**batch)
                    loss = outputs["loss"] / args.gradient_accumulation_steps
                    loss.backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                snapshots.step()

        accuracy = ddpkit.evaluate(model, eval_dataloader, correct)["accuracy"]
        ddpkit.print0(f"epoch {epoch}: eval accuracy {accuracy:.4f} after {snapshots.steps} steps")

    ddpkit.print0(f"eval accuracy: {accuracy:.4f} ({len(eval_dataset)} samples)")
    if rt.is_main:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        torch.save(ddpkit.unwrap(model).state_dict(), Path(args.output_dir) / "model.pt")
    snapshots.close()
    ddpkit.shutdown()


def correct(model, batch):
    """Per sample: 1.0 where the prediction is the label."""
    return {"accuracy": (model(**batch)["logits"].argmax(dim=-1) == batch["labels"]).float()}


if __name__ == "__main__":
    main()

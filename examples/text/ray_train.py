"""A text classifier on dict batches: main.py is the plain script, loop.py its port to
elastic-train's ctx, ray_train.py its port to Ray Train (examples/README.md).

Written for elastic-train in the style of the usual Hugging Face fine-tuning scripts (not
a copy of any): a Dataset of dicts (input_ids, attention_mask, labels), a model whose
forward returns an output object with .logits, AdamW. The tokenizer is a hashing one
written here and the corpus is synthetic, drawn from ``--seed``: nothing is downloaded."""

import argparse
import random
import zlib
from dataclasses import dataclass

import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

TOPICS = {
    0: "goal match team score league coach player season striker keeper",
    1: "market price stock bank trade profit share investor rate fund",
    2: "planet star orbit telescope galaxy rocket moon comet space probe",
    3: "recipe oven flour butter sugar bake dough salt pepper sauce",
}
FILLER = "the a of and to in is was it for on with as by this that"


def synthetic_corpus(size, seed):
    rng = random.Random(seed)
    corpus = []
    for _ in range(size):
        label = rng.randrange(len(TOPICS))
        words = rng.choices(TOPICS[label].split(), k=rng.randint(3, 8))
        words += rng.choices(FILLER.split(), k=rng.randint(3, 10))
        rng.shuffle(words)
        corpus.append((" ".join(words), label))
    return corpus


class HashingTokenizer:
    """Words to ids by a hash: no vocabulary to download. Id 0 pads, 1 starts."""

    def __init__(self, vocab_size=4096, max_length=32):
        self.vocab_size, self.max_length = vocab_size, max_length

    def __call__(self, text):
        ids = [1] + [2 + zlib.crc32(w.encode()) % (self.vocab_size - 2) for w in text.split()]
        ids = ids[: self.max_length]
        pad = self.max_length - len(ids)
        return {"input_ids": ids + [0] * pad, "attention_mask": [1] * len(ids) + [0] * pad}


class TextDataset(Dataset):
    def __init__(self, corpus, tokenizer):
        self.corpus, self.tokenizer = corpus, tokenizer

    def __len__(self):
        return len(self.corpus)

    def __getitem__(self, i):
        text, label = self.corpus[i]
        item = {k: torch.tensor(v) for k, v in self.tokenizer(text).items()}
        item["labels"] = torch.tensor(label)
        return item


@dataclass
class ClassifierOutput:
    logits: torch.Tensor


class MeanPoolClassifier(nn.Module):
    def __init__(self, vocab_size, dim, num_labels):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.hidden = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(0.1))
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return ClassifierOutput(logits=self.classifier(self.hidden(pooled)))


def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            correct += (out.logits.argmax(-1) == batch["labels"]).sum().item()
            total += len(batch["labels"])
    model.train()
    return correct / total


def make_parser():
    parser = argparse.ArgumentParser(description="a text classifier on dict batches")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--eval-size", type=int, default=400)
    parser.add_argument("--logging-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    return parser


def train_func(args):
    device = ray.train.torch.get_device()
    context = ray.train.get_context()
    torch.manual_seed(args.seed)

    tokenizer = HashingTokenizer()
    train_set = TextDataset(synthetic_corpus(args.train_size, args.seed), tokenizer)
    eval_set = TextDataset(synthetic_corpus(args.eval_size, args.seed + 1), tokenizer)
    eval_loader = DataLoader(eval_set, batch_size=128)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    train_loader = ray.train.torch.prepare_data_loader(train_loader)

    model = MeanPoolClassifier(tokenizer.vocab_size, args.dim, len(TOPICS)).to(device)
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), args.lr, weight_decay=args.weight_decay)
    model.train()
    global_step = 0
    for epoch in range(args.epochs):
        if context.get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            loss = F.cross_entropy(out.logits, batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
            if global_step % args.logging_steps == 0 and context.get_world_rank() == 0:
                print(f"step {global_step} epoch {epoch} loss {loss:.4f}")
        print(f"epoch {epoch} eval_accuracy {evaluate(model, eval_loader, device):.4f}")
        ray.train.report({"epoch": epoch, "step": global_step})
    print(f"Done: {global_step} steps")


def main():
    parser = make_parser()
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers")
    args = parser.parse_args()
    scaling = ray.train.ScalingConfig(num_workers=args.workers, use_gpu=torch.cuda.is_available())
    ray.train.torch.TorchTrainer(train_func, train_loop_config=args, scaling_config=scaling).fit()


if __name__ == "__main__":
    main()

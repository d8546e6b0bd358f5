"""A training loop around a running Conveyor stack: generate, train one step, push, generate.

    conveyor up --model ~/.cache/conveyor/models/smollm2-135m --stages 2 --scheduler-port 50060 &
    python -m services.client.rl_example --model ~/.cache/conveyor/models/smollm2-135m

The "training" is one SGD step of the Hugging Face model on one sentence, enough to change
what the served model says. Each update prints its seconds end to end (pause → weights in →
resume) and the share the trainer spent broadcasting.
"""

from __future__ import annotations

import argparse
import time

import torch

from services.client import ConveyorClient
from services.client.rl import EngineControl


def train_step(model, tokenizer, text: str, lr: float) -> float:
    """One SGD step of next-token loss on `text`; returns the loss."""
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.add_(param.grad, alpha=-lr)
                param.grad = None
    model.eval()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the model directory the stack serves")
    parser.add_argument("--router", default="localhost:50051")
    parser.add_argument("--scheduler", default="localhost:50060")
    parser.add_argument("--master-addr", default="127.0.0.1", help="this host, as workers see it")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    prompt, target = "The capital of France is", "The capital of France is a city called Lyon."
    with EngineControl(args.scheduler) as engine, ConveyorClient(args.router) as client:
        world_size = engine.init_weight_transfer(args.master_addr)
        print(f"weight-transfer group formed: {world_size} ranks")
        print("before:", repr(client.complete(prompt, max_tokens=12).text))
        for step in range(args.steps):
            loss = train_step(model, tokenizer, target, args.lr)
            t0 = time.perf_counter()
            update = engine.push_weights(model.state_dict())
            wall_s = time.perf_counter() - t0
            print(
                f"step {step}: loss {loss:.3f}; weights v{update.weight_version} "
                f"({update.num_tensors} tensors, {update.num_bytes / 2**20:.0f} MiB sent) in "
                f"{wall_s:.2f} s end to end: pause {update.pause_s:.2f} s, staging "
                f"{update.stage_s:.2f} s of which broadcast {update.broadcast_s:.2f} s "
                f"({update.broadcast_s / wall_s:.0%} of the whole), commit {update.commit_s:.2f} s"
            )
            print("after: ", repr(client.complete(prompt, max_tokens=12).text))


if __name__ == "__main__":
    main()

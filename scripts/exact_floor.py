"""How close the exact world's GPT-2 can get to pi* at all: descent on the exact KL(pi‖pi*).

The exact-world study (configs/compare_exact.yaml) reports each run's final KL(pi‖pi*). This
script separates the model's capacity from the training method: it starts from the reference,
as every run does, and minimises ``KL(pi‖pi*) = sum_y pi(y) (log pi(y) - log pi*(y))`` by
Adam with the exact gradient (a sum over all responses, no sampling). What is left is what the
model cannot represent; a run that ends far above it ends there because of how it trained.

    python scripts/exact_floor.py                # beta 0.5, the study's
    python scripts/exact_floor.py --beta 0.3 --steps 1000
"""

from __future__ import annotations

import argparse

import torch

from rlkl_lightning.kl import optimum as opt
from rlkl_lightning.world.exact import ExactWorld


def main() -> None:
    """Descend on the exact KL from the reference and print how far it gets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    world = ExactWorld()
    target = world.optimum(args.beta).logprobs
    model = AutoModelForCausalLM.from_pretrained(world.model_dir, weights_only=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    ids = torch.cat([world.prompt_ids.expand(len(world.responses), 1), world.responses], dim=1)
    print(f"start (the reference): KL(pi‖pi*) = {opt.kl(world.ref_logprobs, target):.4f} nats")
    for step in range(1, args.steps + 1):
        logits = model(input_ids=ids).logits[:, :-1].double()
        logp = torch.log_softmax(logits, -1).gather(-1, world.responses[..., None])
        logp = logp.squeeze(-1).sum(-1)
        loss = (logp.exp() * (logp - target)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == args.steps:
            print(f"step {step}: KL(pi‖pi*) = {float(loss.detach()):.4f} nats")
    final = world.policy_metrics(world.logprobs(model), args.beta)
    print(
        f"final: KL(pi‖pi*) = {final['kl_to_optimum']:.4f}, KL(pi‖ref) = {final['kl_to_ref']:.4f}"
    )


if __name__ == "__main__":
    main()

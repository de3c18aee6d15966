"""Train a small model on random data for N steps, inside the gpumgr grant: an example of a real job.

    python train.py [--steps 200] [--batch 256] [--width 4096] [--depth 4] [--memory BYTES]

The caching allocator is capped from ``GPUMGR_GPU_MEMORY`` first (see ``grant.py``), so a batch too
large for the grant ends in PyTorch's own ``OutOfMemoryError`` (exit 3) rather than a kill. Nothing is
downloaded: the data are random tensors made on the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import grant

#: The exit status when the grant is too small for the model and batch asked for.
EXIT_OUT_OF_MEMORY = 3


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=256, help="samples a step")
    parser.add_argument("--width", type=int, default=4096, help="hidden units of each layer")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    parser.add_argument("--memory", type=int, help="bytes the allocator may use (default: GPUMGR_GPU_MEMORY); "
                        "a burstable container may pass its limit here")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch  # after the arguments, so --help works without PyTorch

    if not torch.cuda.is_available():
        print("no CUDA device is visible", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    fraction = grant.cap_allocator(torch, 0, args.memory)
    print(f"allocator capped at {fraction:.4f} of the GPU" if fraction else "no grant found: allocator not capped",
          flush=True)
    torch.manual_seed(args.seed)
    layers: list[torch.nn.Module] = []
    for i in range(args.depth):
        layers += [torch.nn.Linear(args.width if i else 1024, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.monotonic()
    try:
        for step in range(1, args.steps + 1):
            inputs = torch.randn(args.batch, 1024, device=device)
            labels = torch.randint(0, 10, (args.batch,), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 50 == 0 or step == args.steps:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
    except torch.OutOfMemoryError as exc:
        print(f"out of memory inside the grant: {exc}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved(device)
    print(f"done: {args.steps} steps in {time.monotonic() - started:.1f} s, allocator peak {peak} bytes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

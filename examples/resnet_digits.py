"""A small ResNet (BatchNorm, residual blocks) on the handwritten digits shipped with the worker.

``examples/plain/resnet_digits.py`` trains it in one process with plain torch;
``examples/resnet_digits.py`` is the same script data-parallel over N ranks with commlab
(``diff -u examples/plain/resnet_digits.py examples/resnet_digits.py``): N ranks with batch B
see the samples the plain script sees with batch N x B, and BatchNorm's running statistics are
made equal across ranks by the exchanger (``buffers=broadcast``, its default). SGD with momentum
and weight decay, the learning rate cut tenfold twice (StepLR); the data are the 1,797 8x8
digits in ``workers/data``, upsampled to 16x16, with a fixed held-out sixth.

    python examples/plain/resnet_digits.py --steps 150
    commlab run --workers 2 --exchanger 'ring://' examples/resnet_digits.py --steps 150
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import commlab
from workers.data import load_digits


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input (projected by a strided 1x1 conv when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


def resnet(width: int = 16, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        BasicBlock(width, width), BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 4 * width, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, classes))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    out = model(x)
    model.train()
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ex = commlab.connect()  # the regime named by $COMMLAB_EXCHANGER; rank and peers from the launcher
    rank, world = ex.rank, ex.world_size
    data = load_digits(16, args.seed)  # global step t's batch, cut into one slice per rank
    torch.manual_seed(args.seed)
    model = resnet(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    ex.setup(model, optimizer)  # collective: every rank starts from rank 0's parameters and buffers
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, args.steps // 3), gamma=0.1)
    t0, loss = time.perf_counter(), torch.tensor(float("nan"))
    for step in range(args.steps):
        t_step = time.perf_counter()
        x, y = data.batch(step, rank, world, args.batch_size)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        now = time.perf_counter()  # what the step cost; the exchange adds its bytes and exposed wait
        commlab.report(step, loss=loss.item(), time_s=now - t0, step_s=now - t_step, exchange=ex.last_report)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.3g}  "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)
    test_loss, test_acc = evaluate(model, data.test_x, data.test_y)
    if rank == 0:
        print(f"test loss {test_loss:.4f}, test accuracy {test_acc:.3f}", flush=True)
        commlab.report(args.steps - 1, loss=loss.item(), test_loss=test_loss, test_acc=test_acc,
                       exchange=ex.last_report)
    ex.close()


if __name__ == "__main__":
    main()

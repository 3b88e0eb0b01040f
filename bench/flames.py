"""Flame graphs from py-spy's collapsed stacks (`py-spy record --format raw`), drawn with matplotlib:
each frame a box as wide as its share of the samples, its callers below it, so that the widest towers
are where the process spends its CPU. `python -m bench.profile --flames DIR` writes one per process.

    python -m bench.flames OUT_DIR stacks/*.txt
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MIN_SHARE = 0.004  # frames under 0.4 % of the samples are not drawn (nor their callees)
MAX_DEPTH = 48


@dataclass
class Node:
    name: str
    samples: int = 0
    children: dict[str, Node] = field(default_factory=dict)

    def child(self, name: str) -> Node:
        node = self.children.get(name)
        if node is None:
            node = self.children[name] = Node(name)
        return node


def short(frame: str, parts: int = 1) -> str:
    """`function (path/to/file.py:123)` -> `function (file.py)` (`parts` = 2: `function (to/file.py)`);
    native frames as they are."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(where.split('/')[-parts:])})" if where else name


# gRPC's poller thread runs Cython under threading's `Thread.run`: py-spy sees no frame of its own above
# it and counts it busy while it waits in epoll (py-spy gave it 10-44 % of a service's samples, perf
# and /proc 3-19 % of its CPU). Such samples are left out; bench.profile reads the thread's CPU from
# /proc instead.
POLLER = ("Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run")


def stacks(collapsed: Path) -> Iterator[tuple[list[str], int]]:
    """The stacks of a collapsed-stacks file with their sample counts, outermost frame first: process
    and thread frames left out, and the bare stacks of gRPC's poller thread (POLLER)."""
    for line in collapsed.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [part for part in stack.split(";") if part and not part.startswith(("process ", "thread "))]
        if frames and tuple(frame.partition(" (")[0] for frame in frames) != POLLER:
            yield frames, int(count)


def tree(collapsed: Path) -> Node:
    """The call tree of a collapsed-stacks file (`stacks`)."""
    root = Node("all")
    for frames, n in stacks(collapsed):
        root.samples += n
        node = root
        for part in frames:
            node = node.child(short(part))
            node.samples += n
    return root


def _colour(name: str) -> tuple[float, float, float]:
    """A warm colour, the same for the same function in every graph."""
    h = zlib.crc32(name.encode()) / 2**32
    return (0.85 + 0.15 * h, 0.35 + 0.45 * (1 - h), 0.1 + 0.2 * h)


def draw(root: Node, out: Path, title: str) -> Path | None:
    """The flame graph of `root` as a PNG at `out`; None when there are no samples."""
    if root.samples == 0:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    boxes: list[tuple[float, int, float, str]] = []  # (x, depth, width, name), x and width in [0, 1]

    def walk(node: Node, x: float, depth: int) -> None:
        for child in sorted(node.children.values(), key=lambda c: -c.samples):
            width = child.samples / root.samples
            if width >= MIN_SHARE and depth < MAX_DEPTH:
                boxes.append((x, depth, width, child.name))
                walk(child, x, depth + 1)
            x += width

    walk(root, 0.0, 0)
    depth = max((d for _, d, _, _ in boxes), default=0) + 1
    fig, ax = plt.subplots(figsize=(16, max(3.0, 0.22 * depth + 1.0)))
    for x, d, width, name in boxes:
        ax.add_patch(plt.Rectangle((x, d), width, 0.95, facecolor=_colour(name), edgecolor="white", lw=0.3))
        chars = int(width * 230)  # what fits at this figure width and font size
        if chars >= 4:
            label = name if len(name) <= chars else name[: chars - 1] + "…"
            ax.text(x + 0.002, d + 0.45, label, fontsize=6, va="center", clip_on=True)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, depth)
    ax.set_yticks([])
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0], ["0", "25 %", "50 %", "75 %", "100 % of samples"])
    ax.set_title(f"{title}: {root.samples} samples (frames under {MIN_SHARE:.1%} left out)", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    for name in argv[1:]:
        path = Path(name)
        written = draw(tree(path), out_dir / f"flame-{path.stem}.png", path.stem)
        print(written or f"{path}: no samples")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

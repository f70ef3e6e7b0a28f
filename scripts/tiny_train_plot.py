"""An SVG plot of a training log (``scripts/train_tiny.py``): no plotting library needed."""

from __future__ import annotations

from pathlib import Path

W, H, PAD = 640, 360, 50


def _smooth(values: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def write_loss_svg(log: dict, path: Path) -> None:
    """Training loss (trunk and MTP, moving average of 25 steps) and held-out loss per step."""
    steps = [s[0] for s in log["steps"]]
    series = [
        ("training loss", "#1f77b4", steps, _smooth([s[1] for s in log["steps"]], 25)),
        ("MTP training loss (token t+2)", "#ff7f0e", steps, _smooth([s[2] for s in log["steps"]], 25)),
        ("held-out loss", "#2ca02c", [e["step"] for e in log["eval"]], [e["loss"] for e in log["eval"]]),
    ]
    xmax = max(steps)
    ymax = max(max(v) for *_, v in series)
    ymax = float(int(ymax) + 1)

    def xy(x: float, y: float) -> str:
        return f"{PAD + (W - 2 * PAD) * x / xmax:.1f},{H - PAD - (H - 2 * PAD) * y / ymax:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<polyline points="{xy(0, ymax)} {xy(0, 0)} {xy(xmax, 0)}" fill="none" stroke="black"/>',
        f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">step</text>',
        f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">'
        "cross-entropy (nats/token)</text>",
    ]
    for y in range(0, int(ymax) + 1):
        x0, y0 = xy(0, y).split(",")
        parts.append(f'<text x="{float(x0) - 6}" y="{float(y0) + 4}" text-anchor="end">{y}</text>')
    for x in range(0, xmax + 1, max(1, xmax // 5)):
        x0, y0 = xy(x, 0).split(",")
        parts.append(f'<text x="{x0}" y="{float(y0) + 16}" text-anchor="middle">{x}</text>')
    for i, (name, color, xs, ys) in enumerate(series):
        pts = " ".join(xy(x, y) for x, y in zip(xs, ys, strict=True))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        ly = PAD + 16 * i
        parts.append(
            f'<line x1="{W - 260}" y1="{ly}" x2="{W - 240}" y2="{ly}" stroke="{color}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{W - 235}" y="{ly + 4}">{name}</text>')
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")

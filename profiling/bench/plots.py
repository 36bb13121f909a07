"""PNG plots of a peer comparison (`python -m profiling.bench peer --plot [DIR]`): one
figure per part (sampler, tail) and vocabulary, ours against vLLM by batch size.

Left: the median milliseconds of each case, ours solid, vLLM dashed, both axes
logarithmic. Right: vLLM / ours per case (above 1: ours is faster), the dotted
line at 1. The title names the machine, the threads and the commit. Needs
matplotlib (`pip install -e '.[plot]'`), imported only here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_peer(rows: Sequence[Mapping[str, object]], meta: Mapping[str, object], folder: Path) -> list[Path]:
    """One PNG per (part, vocabulary) of the peer bench's results (`--json`'s rows); the
    paths written, `peer-<part>-v<vocab>.png` in `folder`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for part in sorted({str(r["part"]) for r in rows}):
        for vocab in sorted({int(r["vocab"]) for r in rows if r["part"] == part}):
            mine = [r for r in rows if r["part"] == part and r["vocab"] == vocab]
            cases = list(dict.fromkeys(str(r["case"]) for r in mine))
            fig, (times, ratios) = plt.subplots(1, 2, figsize=(11, 4.2))
            for k, case in enumerate(cases):
                points = sorted((int(r["batch"]), float(r["ours_us"]) / 1e3, float(r["vllm_us"]) / 1e3)
                                for r in mine if r["case"] == case)
                batches = [b for b, _, _ in points]
                color = f"C{k}"
                times.plot(batches, [o for _, o, _ in points], "o-", color=color, label=f"{case}: ours")
                times.plot(batches, [v for _, _, v in points], "s--", color=color, label=f"{case}: vLLM")
                ratios.plot(batches, [v / o for _, o, v in points], "o-", color=color, label=case)
            for axis in (times, ratios):
                axis.set_xscale("log", base=2)
                axis.set_xlabel("batch size B (requests)")
                axis.grid(True, which="both", alpha=0.3)
            times.set_yscale("log")
            times.set_ylabel("median ms per call")
            times.legend(fontsize=7, ncol=2)
            ratios.axhline(1.0, color="black", linestyle=":", linewidth=1)
            ratios.set_ylabel("vLLM / ours (> 1: ours faster)")
            ratios.legend(fontsize=7)
            hidden = mine[0]["hidden"]
            fig.suptitle(f"{part}: ours vs vLLM {meta.get('vllm', '?')}, V={vocab} H={hidden}, fp32; "
                         f"{meta.get('cpu', '?')}, {meta.get('threads', '?')} threads, commit {meta.get('commit', '?')}",
                         fontsize=9)
            fig.tight_layout()
            path = folder / f"peer-{part}-v{vocab}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written

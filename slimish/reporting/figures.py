"""One matplotlib figure per aspect of a run, from its metrics.jsonl records (one per step). A figure whose metrics
the run did not record is left out (an older run, a run without evaluation)."""

from __future__ import annotations

from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")  # files only: no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

STEP_PARTS = [("rollout", "time_rollout_s"), ("train", "time_train_s"), ("sync", None), ("verify", "time_verify_s")]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _legend(ax, other) -> None:
    """One legend for a plot with two y axes."""
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = other.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, loc="best", fontsize="small")


def _has(records: list[dict], *keys: str) -> bool:
    return any(key in r for r in records for key in keys)


def _second_axis(records, ax, key: str, *, label: str, ylabel: str, color: str) -> None:
    """`key` on a right-hand y axis, and one legend for both axes."""
    other = ax.twinx()
    steps, values = _series(records, key)
    other.plot(steps, values, marker=".", color=color, label=label)
    other.set_ylabel(ylabel)
    _legend(ax, other)


def _two_axes(records, ax, left: tuple[str, str, str, str], right: tuple[str, str, str, str]) -> None:
    """Two metrics of different units: each (key, label, y-axis label, colour), `left` on the left y axis."""
    key, label, ylabel, color = left
    steps, values = _series(records, key)
    ax.plot(steps, values, marker="o", color=color, label=label)
    ax.set_ylabel(ylabel)
    key, label, ylabel, color = right
    _second_axis(records, ax, key, label=label, ylabel=ylabel, color=color)


def reward_and_length(records, ax):
    _two_axes(records, ax, ("reward_mean", "reward (mean)", "reward", "tab:blue"),
              ("response_len_mean", "response length (mean tokens)", "tokens", "tab:orange"))


def timeline(records, ax):
    """Stacked per-step seconds: rollout, train, sync (without verification), verification."""
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    for name, key in STEP_PARTS:
        if key is None:  # the sync's own time, its verification apart
            values = [r.get("time_sync_s", 0.0) - r.get("time_verify_s", 0.0) for r in records]
        else:
            values = [r.get(key, 0.0) for r in records]
        ax.bar(steps, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds")
    ax.legend()


def throughput(records, ax):
    steps, values = _series(records, "tokens_per_s")
    ax.plot(steps, values, marker="o")
    ax.set_ylabel("generated tokens / s of the step")


def off_policy(records, ax):
    steps, staleness = _series(records, "staleness_max")
    ax.step(steps, staleness, where="mid", label="staleness (max versions behind)")
    ax.set_ylabel("versions")
    _second_axis(records, ax, "off_policy_token_frac", label="off-policy token fraction", ylabel="fraction",
                 color="tab:red")


def sync_throughput(records, ax):
    points = [(r["step"], r["sync_mib"] / r["time_sync_s"]) for r in records
              if r.get("sync_mib") and r.get("time_sync_s")]
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    ax.set_ylabel("MiB / s (whole sync)")


def engines(records, ax):
    for key in ("engine_deaths", "engine_hangs", "engine_restarts"):
        steps, values = _series(records, key)
        ax.plot(steps, values, marker="o", label=key.replace("_", " "))
    ax.set_ylabel("per step")
    ax.legend()


def learning_rate(records, ax):
    _two_axes(records, ax, ("lr", "learning rate (the step's last optimizer step)", "learning rate", "tab:green"),
              ("grad_norm", "grad norm (before clipping)", "grad norm", "tab:gray"))


def evaluation(records, ax):
    for key in sorted({k for r in records for k in r if k.startswith("eval/")}):
        steps, values = _series(records, key)
        ax.plot(steps, values, marker="o", label=key[len("eval/"):])
    ax.set_ylabel("value")
    ax.legend()


# (file stem, title, the metrics it needs (any of them), how to draw it)
FIGURES: list[tuple[str, str, tuple[str, ...], Callable]] = [
    ("reward", "Reward and response length", ("reward_mean",), reward_and_length),
    ("timeline", "Seconds per step: rollout, train, sync, verification", ("time_rollout_s",), timeline),
    ("throughput", "Generation throughput", ("tokens_per_s",), throughput),
    ("off_policy", "Staleness and off-policy tokens", ("staleness_max", "off_policy_token_frac"), off_policy),
    ("sync", "Weight-sync throughput", ("sync_mib",), sync_throughput),
    ("engines", "Engine deaths, hangs and restarts", ("engine_deaths",), engines),
    ("lr", "Learning rate and gradient norm", ("lr",), learning_rate),
    ("eval", "Evaluation", (), evaluation),
]


def draw(records: list[dict]) -> list[tuple[str, str, plt.Figure]]:
    """(stem, title, figure) for every figure the records can fill."""
    out = []
    for stem, title, needs, fn in FIGURES:
        present = _has(records, *needs) if needs else any(k.startswith("eval/") for r in records for k in r)
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
        fn(records, ax)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        fig.tight_layout()
        out.append((stem, title, fig))
    return out

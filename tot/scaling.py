"""The scaling curve (`tot.bench bench.scaling=true`): accuracy against decoding time and against
generated tokens as a search's budget N grows, per search and decoder, on the same problems (STAND's
Figure 1 for this project), with each cell's acceptance length and speed over `ar`.

N is each search's own budget (`scaled(n)` of its settings): thoughts per state for `bfs`, trajectories
for `dvts`, solutions for `best_of_n`, iterations for `mcts`. Every cell is one `bench`, so every
decoder's trees are checked against `hf`'s where an `hf` entry runs, as the bench checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from decoding import ConfigError
from tot.runs.config import RunConfig
from tot.runs.output import pyplot, save_figure
from tot.search import SEARCHES


def search_cells(cfg: RunConfig, searches: dict[str, dict[str, Any] | None] | None) -> dict[str, object]:
    """Each swept search's settings at the run's budget: the run's own for its search, else the
    search's defaults with the options given in `bench.searches` (name -> options)."""
    if not searches:
        return {cfg.search: cfg.search_settings}
    cells = {}
    for name, options in searches.items():
        if name not in SEARCHES:
            raise ConfigError(f"bench.searches has {name!r}, which is not one of {', '.join(SEARCHES)}")
        if name == cfg.search and not options:
            cells[name] = cfg.search_settings
        else:
            cells[name] = SEARCHES[name].settings(options or {}, f"bench.searches.{name}")
    return cells


def scaling(
    cfg: RunConfig,
    run_cell: Callable[[RunConfig], dict[str, Any]],
    budgets: list[int],
    temperatures: list[float],
    searches: dict[str, dict[str, Any] | None] | None = None,
    after_cell: Callable[[list[dict[str, Any]]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One bench per (temperature, search, N), run by `run_cell` (tot.bench.bench on the loaded
    models and decoders): the rows of the curve and the lossless check's mismatches, each naming its
    cell. `after_cell` gets the rows so far after each cell (the command writes them: a long sweep
    stopped midway keeps its finished cells)."""
    rows, mismatches = [], []
    for t in temperatures:
        for search, settings in search_cells(cfg, searches).items():
            for n in budgets:
                cell = replace(
                    cfg,
                    search=search,
                    gen=replace(cfg.gen, temperature=t, eval_temperature=t),
                    search_settings=settings.scaled(n),  # type: ignore[attr-defined]
                )
                result = run_cell(cell)
                mismatches += [f"{search} N={n} temperature {t}: {m}" for m in result["mismatches"]]
                solved = len(result["problems"])
                for r in result["decoders"].values():
                    rows.append(
                        {
                            "temperature": t,
                            "search": search,
                            "budget": n,
                            "decoder": r["decoder"],
                            "accuracy": r["problems_correct"] / solved,
                            "wall_s": r["time_s"],  # scaling cells run in turns: the wall clock
                            "tokens": r["tokens"],
                            "acceptance_length": r["acceptance_length"],
                            "tokens_per_s": r["tokens_per_s"],
                            "speedup_vs_ar": r.get("speedup_vs_ar"),
                        }
                    )
                if after_cell is not None:
                    after_cell(rows)
    return rows, mismatches


def scaling_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| temperature | search | N | decoder | accuracy | wall (s) | tokens | acceptance length | tokens/s | vs ar |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        tau = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        vs_ar = "-" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x"
        lines.append(
            f"| {r['temperature']} | {r['search']} | {r['budget']} | `{r['decoder']}` | {r['accuracy']:.2f} "
            f"| {r['wall_s']:.1f} | {r['tokens']} | {tau} | {r['tokens_per_s']:.1f} | {vs_ar} |"
        )
    return "\n".join(lines)


def plot_scaling(rows: list[dict[str, Any]], path: Path) -> bool:
    """Accuracy against wall time and against tokens, one line per (search, decoder) per temperature,
    each point labelled with its N; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lines: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        lines.setdefault((r["search"], r["decoder"], r["temperature"]), []).append(r)
    several_t = len({r["temperature"] for r in rows}) > 1
    labelled = set()  # each (search, temperature)'s points are named once, on its first decoder's line
    for (search, decoder, t), points in lines.items():
        label = f"{search} / {decoder}" + (f" / t={t}" if several_t else "")
        named = (search, t) not in labelled
        labelled.add((search, t))
        for ax, x in zip(axes, ("wall_s", "tokens")):
            ax.plot([p[x] for p in points], [p["accuracy"] for p in points], marker="o", label=label)
            for p in points if named else []:
                where = (p[x], p["accuracy"])
                ax.annotate(f"N={p['budget']}", where, fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].set_xlabel("wall time of the run (s)")
    axes[1].set_xlabel("generated tokens")
    for ax in axes:
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("accuracy against decoding cost as the search budget N grows")
    fig.tight_layout()
    save_figure(fig, path)
    return True

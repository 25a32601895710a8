"""The per-row error plot against layout degree (echo.report.plots.error_by_layout, called by
echo.validate.published.plot_error_by_layout and run_validate)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
import pytest

from echo.io import write_parquet
from echo.report import plots
from echo.validate.published import plot_error_by_layout, published_rows, run_validate

PNG = b"\x89PNG\r\n\x1a\n"
# workload name -> parallel section of its file (cp and ep left out where they default to 1)
LAYOUTS = {
    "w-dense": {"tp": 8, "pp": 4, "dp": 2},
    "w-cp": {"tp": 2, "pp": 1, "dp": 4, "cp": 4},
    "w-moe": {"tp": 1, "pp": 8, "dp": 16, "ep": 8},
}


def _workloads(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, parallel in LAYOUTS.items():
        # only the parallel section is read; the rest keeps the file looking like a workload
        (folder / f"{name}.yaml").write_text(
            "model: {arch: gpt, layers: 8, hidden: 64, heads: 4, vocab: 128, seq_len: 32}\n"
            f"parallel: {parallel}\ntraining: {{global_batch: 64, micro_batch: 1}}\n".replace("'", ""))
    return folder


def _table(split: bool) -> pa.Table:
    cols = {"table": ["mcore-h100", "mbridge-h100", "mbridge-h100"], "row": ["7B", "a", "b"],
            "workload": list(LAYOUTS), "error": [0.05, -0.12, 0.30]}
    if split:
        cols["split"] = ["validation", "validation", "fit"]
    return pa.table(cols)


@pytest.mark.parametrize("split", [False, True])
def test_every_row_sits_at_its_degrees(tmp_path: Path, split: bool) -> None:
    path = tmp_path / "published_by_layout.png"
    points = plot_error_by_layout(_table(split), _workloads(tmp_path / "workloads"), path)
    assert path.read_bytes().startswith(PNG)
    got = {p["workload"]: (p["tp"], p["pp"], p["cp"], p["ep"]) for p in points}
    assert got == {"w-dense": (8, 4, 1, 1), "w-cp": (2, 1, 4, 1), "w-moe": (1, 8, 1, 8)}  # cp, ep default 1
    assert [p["error"] for p in points] == [0.05, -0.12, 0.30]
    assert [p["split"] for p in points] == (["validation", "validation", "fit"] if split else [None] * 3)


def test_the_figure_draws_each_point_at_degree_and_error_percent(tmp_path: Path) -> None:
    points = plot_error_by_layout(_table(True), _workloads(tmp_path / "workloads"), tmp_path / "p.png")
    fig = plots.error_by_layout(points)
    panels = [ax for ax in fig.axes if ax.collections]
    assert [ax.get_xscale() for ax in panels] == ["log"] * 4
    for ax, dim in zip(panels, plots.LAYOUT_DIMS, strict=True):
        assert dim.upper() in ax.get_xlabel()
        # one scatter per (table, fit or validation): here three, of one row each
        drawn = {}
        for c in ax.collections:
            (x, y), = np.asarray(c.get_offsets()).tolist()
            face = np.asarray(c.get_facecolors())
            drawn[(x, round(y, 9))] = face.size == 0 or face[0][3] == 0  # hollow
        want = {(float(p[dim]), round(100 * p["error"], 9)): p["split"] == "fit" for p in points}
        assert drawn == want  # every row at its degree and error (%); only the fit row hollow
        assert any(list(line.get_ydata()) == [0.0, 0.0] for line in ax.get_lines()), "the zero line"
    plt.close(fig)


def test_no_rows_still_writes_a_figure(tmp_path: Path) -> None:
    empty = pa.table({"table": pa.array([], pa.string()), "row": pa.array([], pa.string()),
                      "workload": pa.array([], pa.string()), "error": pa.array([], pa.float64())})
    path = tmp_path / "empty.png"
    assert plot_error_by_layout(empty, tmp_path, path) == []
    assert path.read_bytes().startswith(PNG)


def test_run_validate_writes_the_layout_plot_next_to_the_published_one(tmp_path: Path, reference: Path) -> None:
    rows = published_rows(reference)[:2]
    summaries = {}
    for r, f in zip(rows, (1.1, 0.9), strict=True):
        summaries[r.name] = tmp_path / f"{r.name}.parquet"
        write_parquet(pa.table({"step_time_s": [r.measured_step_s * f]}), summaries[r.name])
    plot = tmp_path / "validate" / "published.png"
    table = run_validate(rows, summaries, tmp_path / "validate" / "published.parquet", plot)
    assert table.num_rows == 2
    assert plot.read_bytes().startswith(PNG)
    assert (tmp_path / "validate" / "published_by_layout.png").read_bytes().startswith(PNG)


def _ranking_table(predicted: list[float]) -> pa.Table:
    """One model on one GPU under three layouts (the first measured in two releases) and a model
    measured under one layout only."""
    return pa.table({
        "table": ["mbridge"] * 5, "model": ["m"] * 4 + ["other"], "hardware": ["h100"] * 5,
        "precision": ["current"] * 5, "workload": ["a", "a", "b", "c", "z"],
        "measured_tflops_per_gpu": [300.0, 320.0, 400.0, 200.0, 100.0],
        "predicted_tflops_per_gpu": [predicted[0], predicted[0], predicted[1], predicted[2], 90.0]})


def test_ranking_fidelity_orders_each_models_layouts() -> None:
    from echo.validate.report import layout_rankings, rankings_markdown

    same, = layout_rankings(_ranking_table([310.0, 390.0, 150.0]))  # measured order b > a > c
    assert (same["model"], same["layouts"], same["concordant"]) == ("m", 3, 1.0)
    assert same["spearman"] == pytest.approx(1.0)
    assert same["measured_order"] == same["predicted_order"] == ["b", "a", "c"]
    flipped, = layout_rankings(_ranking_table([390.0, 310.0, 150.0]))  # a and b swapped
    assert flipped["concordant"] == pytest.approx(2 / 3) and flipped["spearman"] == pytest.approx(0.5)
    assert "| mbridge | m | h100 | current | 3 | 67% | +0.50 |" in rankings_markdown(_ranking_table([390.0, 310.0, 150.0]))

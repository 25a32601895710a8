"""A plan as the text ``python -m echo plan`` prints."""

from __future__ import annotations

from echo.plan.planner import Plan


def _money(x: float | None) -> str:
    return "unknown (no price for this hardware: --usd-per-gpu-hour)" if x is None else f"${x:,.0f}"


def plan_text(p: Plan) -> str:
    """The plan, one figure a line, then where each figure came from."""
    per_day = p.interruptions_per_day
    causes = ", ".join(f"{k} {v:.2f}" for k, v in per_day.items() if k != "total")
    interval = "optimal (Daly 2006)" if p.interval_is_optimal else "given"
    lines = [
        f"{p.workload} on {p.gpus:,} x {p.hardware} ({p.topology}), site {p.site}",
        f"  step (simulated)            {p.step_time_s:.3f} s, {p.tokens_per_step:,} tokens; "
        f"{p.expected_step_s:.3f} s expected with the GPUs' speed spread",
        f"  interruptions               {per_day['total']:.2f} a day ({causes}); one every {p.mtti_h:.2f} h",
        f"  checkpoint                  {p.checkpoint_gb:,.0f} GB ({p.checkpoint_parameters / 1e9:,.1f}B parameters), "
        f"save {p.checkpoint_save_s:.1f} s, load {p.checkpoint_load_s:.1f} s; restart {p.restart_s:.0f} s",
        f"  checkpoint interval         every {p.checkpoint_interval_steps:,} steps "
        f"({p.checkpoint_interval_s / 60:.1f} min, {interval})",
        f"  effective training time     {p.effective_training_time:.1%}",
        f"  tokens                      {p.tokens:.3g}",
        f"  time to train               {p.time_to_train_days:.1f} days ({p.ideal_days:.1f} uninterrupted), "
        f"{p.interruptions:,.0f} interruptions",
    ]
    if p.days is not None:
        lines.append(f"  interruptions in {p.days:g} days    {p.interruptions_in_days:,.0f}")
    lines += [
        f"  GPU-hours                   {p.gpu_hours:,.0f}",
        f"  cost                        {_money(p.cost_usd)}"
        + ("" if p.usd_per_gpu_hour is None else f" at ${p.usd_per_gpu_hour:.2f} a GPU-hour"),
        "  energy                      " + ("unknown (the hardware file has no power section)" if p.energy_mwh is None
                                         else f"{p.energy_mwh:,.0f} MWh (GPUs busy {p.gpu_busy:.0%} of a step)"),
        "provenance:",
        *(f"  {k}: {v}" for k, v in p.provenance.items()),
    ]
    return "\n".join(lines)
